"""Transformer Engine's delayed scaling calibrated in a pass with every layer recomputed (megatron/training/warmup.py,
`every_layer_recomputed`; one GPU): TE's calibrated amax histories and scales are bit for bit those of the pass
without recomputation, and so are the losses after it (--deterministic-mode), for a model without recomputation of
its own, with full and with selective recomputation, and with FP8 weights (--fp8-param-gather); the pass's memory
peak above what was allocated before it is lower. The CPU twin: tests/distributed/test_calibration_recompute.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

import megatron.training.warmup as warmup
from megatron.config import parse_args
from megatron.config.te_rules import te_import_error
from megatron.training import Trainer
from tests.gpu.test_fp8_monitor_gpu import LLAMA, te_scales

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(te_import_error() is not None, reason=f"needs Transformer Engine ({te_import_error()})"),
]

# four layers at sequence 512: enough activations that keeping one layer's instead of all shows in the peak
MODEL = LLAMA.replace("--num-layers 2", "--num-layers 4").replace("--seq-length 64", "--seq-length 512")
FLAGS = (
    f"{MODEL} --transformer-impl transformer_engine --fp8-format hybrid --fp8-recipe delayed --bf16 --train-iters 3"
    " --deterministic-mode"
)
OWN = {
    "none": "",
    "full": "--recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
    "selective": "--recompute-granularity selective --recompute-modules core_attn mlp",
    "fp8_params": "--fp8-param-gather",
}


def _run(flags: str, recompute_pass: bool) -> tuple[tuple[torch.Tensor, torch.Tensor], dict, int]:
    """(TE's calibrated (history[0], scale)), the losses, and the pass's peak allocation above what was allocated
    before it. `recompute_pass=False`: the pass without recomputation of its own (as before)."""
    calibrate, recomputed = warmup.calibrate_delayed_scaling, warmup.every_layer_recomputed
    peak: list[int] = []

    def measured(*args):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        line = calibrate(*args)
        torch.cuda.synchronize()
        peak.append(torch.cuda.max_memory_allocated() - before)
        return line

    warmup.calibrate_delayed_scaling = measured
    if not recompute_pass:
        warmup.every_layer_recomputed = lambda model: contextlib.nullcontext()
    try:
        trainer = Trainer(parse_args(flags.split(), device_type="cuda"))
    finally:
        warmup.calibrate_delayed_scaling, warmup.every_layer_recomputed = calibrate, recomputed
    assert len(peak) == 1, "no calibration pass ran"
    scales = te_scales(trainer)
    return scales, trainer.train().losses, peak[0]


@pytest.mark.parametrize("own", OWN)
def test_te_calibration_with_recomputation_matches_without(own):
    flags = f"{FLAGS} {OWN[own]}"
    _run(flags, recompute_pass=True)  # warm-up: TE's and cuBLAS's workspaces exist before the measured passes
    (want_history, want_scale), want, old_peak = _run(flags, recompute_pass=False)
    (history, scale), losses, new_peak = _run(flags, recompute_pass=True)
    assert (want_scale > 1).any()  # calibrated
    assert torch.equal(history, want_history) and torch.equal(scale, want_scale), (own, history, want_history)
    assert losses == want, (own, losses, want)
    assert new_peak < old_peak, (own, new_peak, old_peak)
