"""Activation recomputation (--recompute-granularity, --recompute-method, --recompute-num-layers,
--recompute-modules): keep fewer activations in the forward pass and run parts of the forward again in backward.

    full       the decoder keeps only the inputs of the recomputed layers (`run_layers`): `uniform` groups all layers
               of this stage into runs of N, `block` recomputes the stage's first N layers one by one
    selective  each layer recomputes the parts --recompute-modules names: core_attn and mlp through `checkpoint`,
               layernorm through `NormRecompute` (the norm output is freed after its linear ran, rebuilt in backward)

`checkpoint` is reentrant, as Megatron-LM's: the first forward runs without autograd and keeps the inputs; backward
restores the random-number state of that forward (CPU and the inputs' CUDA device), runs the function again with
autograd, back-propagates through it and hands on the inputs' gradients. Dropout therefore draws the same masks
twice, and the random stream after the checkpoint is the one a run without recomputation sees, so losses and
gradients are bitwise those of no recomputation.

FP8. Local engine: delayed scaling's scales change only in `Fp8Manager.step()`, so the recomputed forward casts with
the scales of the first; it records the same amaxes again, into a running max that they leave unchanged, and the
monitor counts each tensor at its first cast only: histories and statistics are those of no recomputation.
Transformer Engine: its layers are checkpointed with TE's own `checkpoint` (`te_fp8.te_checkpoint`, which the TE
layers hand to `checkpoint` and `run_layers` as their `runner`), which stashes each module's FP8 scales and amax
history in the first forward and runs the recomputation on them without registering the module's amaxes again.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron.config import ModelConfig
from megatron.errors import UserError


@dataclass(frozen=True)
class RecomputePlan:
    """What a model recomputes, from the --recompute-* flags (after `ModelConfig.finalize`)."""

    granularity: str | None = None
    method: str | None = None
    num_layers: int | None = None
    modules: frozenset[str] = frozenset()

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> RecomputePlan:
        modules = frozenset(cfg.recompute_modules or ()) if cfg.recompute_granularity == "selective" else frozenset()
        return cls(cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers, modules)

    def selective(self, module: str) -> bool:
        return module in self.modules

    def chunks(self, num_layers: int) -> list[tuple[int, int, bool]]:
        """(start, end, recomputed) runs over this stage's `num_layers` layers under full granularity."""
        if self.granularity != "full":
            return [(0, num_layers, False)] if num_layers else []
        assert self.num_layers is not None
        if self.method == "uniform":
            n = self.num_layers
            return [(i, min(i + n, num_layers), True) for i in range(0, num_layers, n)]
        return [(i, i + 1, i < self.num_layers) for i in range(num_layers)]

    def recomputed_layers(self, num_layers: int) -> int:
        """How many of this stage's `num_layers` layers full recomputation covers."""
        return sum(end - start for start, end, recomputed in self.chunks(num_layers) if recomputed)

    def describe(self, num_layers: int) -> list[str]:
        """Startup log lines (none without recomputation)."""
        if self.granularity is None:
            return []
        if self.granularity == "full":
            if self.method == "uniform":
                what = f"full, uniform: all {num_layers} layers of this stage in groups of {self.num_layers}"
            else:
                what = (
                    f"full, block: the first {self.recomputed_layers(num_layers)} of this stage's {num_layers} layers"
                )
        else:
            what = f"selective: {', '.join(sorted(self.modules))} in every layer"
        return [
            f"activation recomputation: {what}; TFLOP/s and MFU count model FLOPs (the recomputed forward is not"
            " counted)"
        ]


_phase = {"first_forward": 0, "recompute": 0}


def in_checkpointed_forward() -> bool:
    """True inside the first forward of a checkpointed function (autograd off, yet a training forward)."""
    return _phase["first_forward"] > 0


def in_recompute() -> bool:
    """True while a checkpointed function runs again in the backward pass."""
    return _phase["recompute"] > 0


@contextlib.contextmanager
def _entered(phase: str) -> Iterator[None]:
    _phase[phase] += 1
    try:
        yield
    finally:
        _phase[phase] -= 1


def _cuda_devices(tensors: Sequence[Any]) -> list[torch.device]:
    return sorted({t.device for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda}, key=str)


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, function: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        ctx.function = function
        ctx.devices = _cuda_devices(args)
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = [torch.cuda.get_rng_state(d) for d in ctx.devices]
        with torch.no_grad(), _entered("first_forward"):
            out = function(*args)
        ctx.constants = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(a if isinstance(a, torch.Tensor) else None for a in args))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs = [
            c if t is None else t.detach().requires_grad_(t.requires_grad)
            for t, c in zip(ctx.saved_tensors, ctx.constants)
        ]
        # The random state of the first forward for the recomputation, then back to backward's own.
        with torch.random.fork_rng(devices=ctx.devices):
            torch.set_rng_state(ctx.cpu_rng)
            for device, state in zip(ctx.devices, ctx.cuda_rng):
                torch.cuda.set_rng_state(state, device)
            with torch.enable_grad(), _entered("recompute"):
                out = ctx.function(*inputs)
        if out.requires_grad:
            torch.autograd.backward(out, grad)
        return (None, *(t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None for t in inputs))


Runner = Callable[..., torch.Tensor]
"""A reentrant checkpoint implementation: runner(function, *args) -> function(*args), recomputed in backward."""


def checkpoint(function: Callable[..., torch.Tensor], *args: Any, runner: Runner | None = None) -> torch.Tensor:
    """function(*args) -> one tensor, keeping only `args` for backward and running function again there.

    `runner`: the checkpoint to run it with instead of this module's, for a function containing Transformer Engine
    modules (`te_fp8.te_checkpoint`: TE's checkpoint, which handles their FP8 state). Runs the function plainly where
    there is nothing to keep (autograd off, or no input requiring a gradient, through which alone a reentrant
    checkpoint is reached in backward)."""
    if not torch.is_grad_enabled() or not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return function(*args)
    if runner is not None:
        with _entered("first_forward"):
            return runner(function, *args)
    return _Checkpoint.apply(function, *args)


def splits_units(plan: RecomputePlan, units: Sequence[int], num_layers: int) -> bool:
    """Whether a run that `plan` recomputes starts or ends inside one of `units` (layers per FSDP unit, in order)."""
    bounds = set(itertools.accumulate(units, initial=0))
    return any(done and not {start, end} <= bounds for start, end, done in plan.chunks(num_layers))


def check_units_whole(model: nn.Module) -> None:
    """A one-line error where the model's full recomputation would recompute part of an FSDP unit of several layers:
    FSDP2 (torch 2.11) gathers and frees a unit of several modules as a whole, at the first module's forward and
    after the first gradient reaches a module's input, so the next recomputed layer of the unit would run on freed
    weights."""
    units, num_layers = model.layer_units, len(model.decoder.layers)
    if max(units, default=1) > 1 and splits_units(model.recompute, units, num_layers):
        raise UserError(
            f"full recomputation ({model.recompute.method}, --recompute-num-layers {model.recompute.num_layers})"
            f" splits FSDP units of {max(units)} layers (--suggested-communication-unit-size): use --recompute-method"
            f" uniform --recompute-num-layers {max(units)} (or a multiple), or a smaller unit size"
        )


@contextlib.contextmanager
def every_layer_recomputed(model: nn.Module) -> Iterator[None]:
    """Run `model` (a GPTModel) inside with full recomputation, uniform, one layer at a time (one FSDP unit at a
    time where a unit holds several layers: see `check_units_whole`), and no selective recomputation, whatever its
    own --recompute-* flags; restore them on exit.

    For a pass before the first step that must fit wherever the step fits (delayed scaling's calibration, which runs
    the FP8 layers in high precision: twice FP8's bytes for every GEMM input kept): it keeps each layer's input and,
    in backward, one layer's (unit's) activations. Selective recomputation is switched off because inside a
    recomputed layer it saves nothing at the peak and would only nest a second checkpoint in the first. The
    recomputed forward runs on the random state of the first (see `checkpoint`), so it computes the same tensors bit
    for bit."""
    # FSDP's units have equal numbers of layers but the last: uniform runs of that number are the units
    every_layer = RecomputePlan("full", "uniform", max(model.layer_units, default=1))  # no selective modules
    plan = model.recompute
    model.recompute = every_layer
    for layer in model.decoder.layers:  # each layer set its switches from the model's plan when it was built
        layer.set_recompute(every_layer)
    try:
        yield
    finally:
        model.recompute = plan
        for layer in model.decoder.layers:
            layer.set_recompute(plan)


def run_layers(
    layers: Sequence[nn.Module],
    x: torch.Tensor,
    rotary: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    plan: RecomputePlan,
    runner: Runner | None = None,
) -> torch.Tensor:
    """x through `layers` (this stage's transformer layers), with full recomputation as `plan` says (`runner`: see
    `checkpoint`)."""
    for start, end, recomputed in plan.chunks(len(layers)):
        run = _layer_run(layers[start:end])
        x = checkpoint(run, x, rotary, attention_mask, runner=runner) if recomputed else run(x, rotary, attention_mask)
    return x


def _layer_run(layers: Sequence[nn.Module]) -> Callable[..., torch.Tensor]:
    def run(x: torch.Tensor, rotary: torch.Tensor | None, attention_mask: torch.Tensor | None) -> torch.Tensor:
        for layer in layers:
            x = layer(x, rotary, attention_mask)
        return x

    return run


class _DiscardableNorm(torch.autograd.Function):
    """The norm's output, computed without autograd; `NormRecompute` frees its storage once the linear has used
    it and refills it (and builds the norm's graph) just before the linear's backward."""

    @staticmethod
    def forward(ctx: Any, norm: Callable[[torch.Tensor], torch.Tensor], owner: NormRecompute, x: torch.Tensor):
        ctx.owner = owner  # which keeps x: the input is all that is kept of the norm
        return norm(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, torch.Tensor | None]:
        owner: NormRecompute = ctx.owner
        if owner.recomputed is None:  # the linear's output took no gradient of its own (the hook did not run)
            owner.recompute()
        x, out = owner.inputs, owner.recomputed
        owner.inputs = owner.recomputed = None
        torch.autograd.backward(out, grad)
        return None, None, x.grad


class NormRecompute:
    """--recompute-modules layernorm for a norm fused into a linear (LayerNormLinear): the linear keeps a reference
    to the norm output for its weight gradient; its storage is released right after the linear's forward and
    recomputed from the norm's input when the gradient of the linear's output arrives (Megatron-LM's
    output-discarding checkpoint). One instance per forward call."""

    def __init__(self, norm: Callable[[torch.Tensor], torch.Tensor]):
        self.norm = norm
        self.inputs: torch.Tensor | None = None
        self.recomputed: torch.Tensor | None = None
        self.output: torch.Tensor | None = None
        self._x: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.output = _DiscardableNorm.apply(self.norm, self, x)
        self._x = x
        return self.output

    def discard(self, consumer_output: torch.Tensor) -> None:
        """Free the norm output now (the linear has run) and rebuild it when consumer_output's gradient comes."""
        out = self.output
        assert out is not None
        if not consumer_output.requires_grad:
            return
        out.untyped_storage().resize_(0)
        consumer_output.register_hook(lambda grad: self.recompute())

    def recompute(self) -> None:
        """Refill the norm output's storage (the linear's backward reads it) and keep the norm's graph."""
        out = self.output
        assert out is not None and self._x is not None
        x = self._x.detach().requires_grad_(self._x.requires_grad)
        with torch.enable_grad(), _entered("recompute"):
            recomputed = self.norm(x)
        storage = out.untyped_storage()
        storage.resize_(recomputed.untyped_storage().size())
        storage.copy_(recomputed.untyped_storage())
        self.inputs, self.recomputed, self.output, self._x = x, recomputed, None, None
