"""Delayed scaling's calibration pass runs with every layer recomputed (megatron/training/warmup.py,
`every_layer_recomputed`), whatever the run's own --recompute-* flags, so that it needs no more memory than the step
(local layers, FP8 emulated on the CPU):

* the calibrated amax histories and scales are bit for bit those of the pass without recomputation (the recomputed
  forward records the same amaxes again into a running max, the gradients' once), and the losses of the steps
  after it too: for a model without recomputation of its own, with full (uniform, block) and with selective
  recomputation, dropout on; in one process and under FSDP at DP=2 (gloo, FP8 all-gathers, the shards freed by
  the pass's forward and written back);
* the pass ran as full, uniform, one layer (one FSDP unit of two layers where units hold two), and the run's own
  settings are back afterwards; a run's own recomputation of part of a unit is refused in one line;
* the pass keeps fewer bytes for backward at once (the peak of the tensors saved for backward, measured through
  saved-tensor hooks) than without recomputation."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import pytest
import torch

import megatron.training.warmup as warmup
from megatron.errors import UserError
from megatron.model.recompute import RecomputePlan
from megatron.training import Trainer
from tests.dist_utils import run_distributed
from tests.distributed.test_fsdp import PA, UNITS
from tests.distributed.test_parallel_layouts import BASE, FP8, _parse

STEPS = 3
DELAYED = f"{BASE} {FP8} --train-iters {STEPS} --eval-iters 0 --bf16"
DROPOUT = DELAYED.replace("--hidden-dropout 0 --attention-dropout 0", "--hidden-dropout 0.1 --attention-dropout 0.1")
OWN = {
    "none": "",
    "uniform2": "--recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
    "block1": "--recompute-granularity full --recompute-method block --recompute-num-layers 1",
    "selective": "--recompute-granularity selective --recompute-modules core_attn mlp layernorm",
}
FSDP = "--use-torch-fsdp2 --data-parallel-sharding-strategy"


class _Held:
    """A tensor saved for backward; its finalizer counts it as freed."""

    def __init__(self, t: torch.Tensor):
        self.t = t


@contextlib.contextmanager
def _peak_saved_bytes() -> Iterator[list[int]]:
    """[peak]: the most bytes of tensors saved for backward alive at once inside (filled in as it runs)."""
    live, peak = [0], [0]

    def freed(nbytes: int) -> None:
        live[0] -= nbytes

    def pack(t: torch.Tensor) -> _Held:
        held = _Held(t)
        live[0] += t.nbytes
        peak[0] = max(peak[0], live[0])
        weakref.finalize(held, freed, t.nbytes)
        return held

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held.t):
        yield peak


# The attributes through which the layers and linears apply --recompute-modules (core_attn, mlp, layernorm): read
# here directly, not through the layers' `set_recompute`, so that the test sees what the forward sees
SELECTIVE_SWITCHES = ("recompute_core_attn", "recompute_mlp", "recompute_norm")


def _calibrated(flags: str, world_size: int = 1, recompute_pass: bool = True) -> tuple[Trainer, dict]:
    """The trainer after its calibration pass, and what the pass saw: the model's recompute plan and selective
    switches during the pass, and the peak bytes it saved for backward. `recompute_pass=False`: the pass as it ran
    before, without recomputation of its own."""
    calibrate, recomputed = warmup.calibrate_delayed_scaling, warmup.every_layer_recomputed
    seen: dict = {}

    def observed(model, manager, taps, precision, run, *args):
        seen["plan"] = model.recompute
        seen["switched_on"] = [
            name for module in model.modules() for name in SELECTIVE_SWITCHES if getattr(module, name, False)
        ]

        def measured() -> None:
            with _peak_saved_bytes() as peak:
                run()
            seen["saved"] = peak[0]

        return calibrate(model, manager, taps, precision, measured, *args)

    warmup.calibrate_delayed_scaling = observed
    if not recompute_pass:
        warmup.every_layer_recomputed = lambda model: contextlib.nullcontext()
    try:
        trainer = Trainer(_parse(flags, world_size))
    finally:
        warmup.calibrate_delayed_scaling, warmup.every_layer_recomputed = calibrate, recomputed
    assert "plan" in seen, "no calibration pass ran"
    return trainer, seen


def _scales(trainer: Trainer) -> tuple[torch.Tensor, torch.Tensor]:
    amax = trainer.fp8.amax
    return amax.history.clone(), amax.scale.clone()


def _run(flags: str, world_size: int, recompute_pass: bool) -> tuple[Trainer, dict, tuple, dict]:
    """Trainer, what its pass saw, its calibrated (histories, scales) and its losses (each run built and trained
    before the next is built: dropout draws from the process's random streams, which the trainer seeds)."""
    trainer, seen = _calibrated(flags, world_size, recompute_pass)
    scales = _scales(trainer)
    return trainer, seen, scales, trainer.train().losses


def _compare(flags: str, world_size: int = 1, together: int = 1) -> None:
    """The pass with and without its recomputation: the same scales and losses, bit for bit; the run's own
    recomputation back after the pass; fewer bytes kept for backward. `together`: layers the pass recomputes at a
    time (an FSDP unit's)."""
    _, old, (want_history, want_scale), want = _run(flags, world_size, recompute_pass=False)
    after, new, (history, scale), losses = _run(flags, world_size, recompute_pass=True)
    own = RecomputePlan.from_config(after.cfg.model)
    passed = RecomputePlan("full", "uniform", together)
    assert old["plan"] == own and new["plan"] == passed, (old["plan"], new["plan"])
    assert not new["switched_on"], new["switched_on"]  # no selective recomputation nested inside the layers'
    assert after.model.recompute == own
    switched_on = [
        name for module in after.model.modules() for name in SELECTIVE_SWITCHES if getattr(module, name, False)
    ]
    assert sorted(switched_on) == sorted(old["switched_on"]), (switched_on, old["switched_on"])
    assert new["saved"] < old["saved"], (flags, new["saved"], old["saved"])
    assert (want_scale != 1).any()  # calibrated
    assert torch.equal(history, want_history) and torch.equal(scale, want_scale), (flags, scale, want_scale)
    assert len(losses) == STEPS and losses == want, (flags, losses, want)


def test_calibration_with_recomputation_matches_without_in_one_process():
    for own in OWN.values():
        _compare(f"{DROPOUT} {own}")


def _fsdp_body(rank: int, world_size: int) -> None:
    for own in ("none", "uniform2"):
        for strategy in ("optim_grads", "optim_grads_params"):
            _compare(f"{DELAYED} {PA} --fp8-param-gather {FSDP} {strategy} {OWN[own]}", world_size)
    # units of two layers: the pass recomputes a unit at a time (FSDP2 frees a unit as a whole); a run's own
    # recomputation of single layers is refused in one line
    _compare(f"{DELAYED} {PA} {FSDP} optim_grads {UNITS}", world_size, together=2)
    with pytest.raises(UserError, match="splits FSDP units of 2 layers"):
        Trainer(_parse(f"{DELAYED} {FSDP} optim_grads {UNITS} {OWN['block1']}", world_size))
    torch.distributed.barrier()


def test_calibration_with_recomputation_matches_without_under_fsdp():
    run_distributed(_fsdp_body, world_size=2)
