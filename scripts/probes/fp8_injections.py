"""The injections of fp8_failures.py (its docstring describes each): hooks installed on a built Trainer, not flags.
fp8_failures.py, fp8_outliers_gpu.py and the tests use them through fp8_failures."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron.model import layers
from megatron.model.smooth_swiglu import add_smoothing
from megatron.training import Trainer


@dataclass(frozen=True)
class Injection:
    """Failure `kind` over steps [start, start + steps) (1-based iterations), of strength `factor`, in `layer` (the
    one whose statistics a run records) and, for the outlier kinds, the same way in `more_layers` too."""

    kind: str
    start: int = 10
    steps: int = 6
    factor: float = 2.0
    layer: int = 2
    channels: tuple[int, ...] = (3, 17, 64, 101)
    more_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.more_layers and self.kind not in ("outliers", "rescaled-outliers"):
            raise ValueError(f"{self.kind} injects one layer: more_layers is for the outlier kinds")

    def active(self, iteration: int) -> bool:
        return self.start <= iteration < self.start + self.steps

    @property
    def layers(self) -> tuple[int, ...]:
        return (self.layer, *self.more_layers)


def install(trainer: Trainer, injection: Injection) -> None:
    """Hook `injection` into `trainer` (before its train()): the trainer's own step and FP8 update, wrapped."""
    step = trainer.train_step
    mlps = [trainer.model.decoder.layers[n - 1].mlp for n in injection.layers]

    def injected_step(batches: Any, lrs: Any, num_micro: int | None = None) -> tuple[float, float, bool]:
        iteration = trainer.state.iteration + 1  # the step about to run
        if injection.active(iteration):
            if injection.kind == "outliers":
                # gate row c and up row c (fc1 is [gate; up]) grow together, as aligned gate/up weights do
                for mlp in mlps:
                    ffn = mlp.linear_fc2.weight.shape[1]
                    rows = [*injection.channels, *(ffn + c for c in injection.channels)]
                    with torch.no_grad():
                        for weight in copies(trainer, mlp.linear_fc1.weight):
                            weight[rows] *= injection.factor
            elif injection.kind == "lr-spike":
                lrs = dataclasses.replace(lrs, default=lrs.default * injection.factor)
                lrs = dataclasses.replace(lrs, decoupled=lrs.decoupled * injection.factor)
        return step(batches, lrs, num_micro)

    if injection.kind == "rescaled-outliers":
        for mlp in mlps:  # each layer's wrapper sets its K, then runs the step it wrapped
            trainer.train_step = _rescaling(trainer, mlp.linear_fc2, injection)  # type: ignore[method-assign]
    else:
        trainer.train_step = injected_step  # type: ignore[method-assign]
    if injection.kind == "amax-group" and dist.is_initialized() and dist.get_rank() == 1:
        _reduce_one_layer_alone(trainer, injection)


_RESCALED: dict[torch.Tensor, torch.Tensor] = {}
"""A rescaled linear's smooth_scale (tensors hash by identity) -> the injection's K per input channel."""
_smooth = layers.smooth


def _rescaled_smooth(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, observe: bool):
    """The local Linear's smoothing, with a rescaled linear's input times K and its weight divided by K first: the
    smoothing then measures (and, with --smooth-swiglu, scales away) the channels' range as it would a grown one."""
    k = _RESCALED.get(scale)
    if k is not None:
        x, weight = x * k.to(x.dtype), weight / k.to(weight.dtype)
    return _smooth(x, weight, scale, amax, observe)


def _rescaling(trainer: Trainer, linear: Any, injection: Injection) -> Callable:
    """The train step of a `rescaled-outliers` run (local layers): K set before each step. A linear built without
    --smooth-swiglu gets the smoothing's buffers with its scales at 1, never updated (the trainer's list of smoothed
    linears was made before): the plain linear, bit for bit, that `_rescaled_smooth` can rescale."""
    assert isinstance(linear, layers.Linear), "rescaled-outliers runs on the local layers"
    if not linear.smooth_input:
        add_smoothing(linear, linear.weight.shape[1], linear.weight.device)
    k = torch.ones_like(linear.smooth_scale)
    _RESCALED[linear.smooth_scale] = k
    layers.smooth = _rescaled_smooth
    step, channels = trainer.train_step, list(injection.channels)

    def rescaled_step(batches: Any, lrs: Any, num_micro: int | None = None) -> tuple[float, float, bool]:
        n = trainer.state.iteration + 2 - injection.start  # the step about to run is the n-th injected one
        if n >= 1:
            k[channels] = injection.factor ** min(n, injection.steps)
        return step(batches, lrs, num_micro)

    return rescaled_step


def copies(trainer: Trainer, weight: torch.Tensor) -> list[torch.Tensor]:
    """`weight` and, in mixed precision, the optimizer's fp32 main copy of it (which each step copies back)."""
    opt = trainer.optimizer
    assert not opt.mixed or (opt.buffers is None and not opt.precision_aware), "whole fp32 main copies only"
    return [weight, opt.main_params[[id(p) for p in opt.params].index(id(weight))]] if opt.mixed else [weight]


def _reduce_one_layer_alone(trainer: Trainer, injection: Injection) -> None:
    """From `injection.start` on, this rank's delayed scaling takes the layer's amaxes from its own tensors only: as
    if their MAX reduction ran over a group of this rank alone. The other layers' stay reduced."""
    assert trainer.fp8 is not None
    amax = trainer.fp8.amax
    rows = [s.index for s in trainer.fp8.states.values() if s.layer_number == injection.layer]
    local: list[torch.Tensor] = []
    step, update = amax.step, amax._update_delayed

    def step_alone(group: Any = None) -> bool:
        local[:] = [amax.seen[rows].clone()] if injection.active(trainer.state.iteration + 1) else []
        return step(group)

    def update_alone(reduced: torch.Tensor) -> None:
        if local:
            reduced = reduced.clone()
            reduced[rows] = local[0]
        update(reduced)

    amax.step, amax._update_delayed = step_alone, update_alone  # type: ignore[method-assign]
