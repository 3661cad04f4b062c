"""Passes before the first step whose gradients are thrown away: delayed scaling's calibration (its first scales from
a high-precision pass) and the capture of Transformer Engine layers' CUDA graphs. Both run after the checkpoint is
loaded and leave the gradient buffers and the random streams as they were."""

from __future__ import annotations

import torch

from megatron.fp8.calibration import calibrate_delayed_scaling
from megatron.fp8.monitor import Fp8Monitor
from megatron.model.recompute import every_layer_recomputed

from .logger import print_rank_0
from .steps import Batches, Steps

CALIBRATION_OOM = (
    "delayed scaling's calibration pass (the first micro-batch's forward and backward in high precision, every layer"
    " recomputed) ran out of GPU memory before the first step: start without it (--no-fp8-calibration), lower"
    " --micro-batch-size or use --fp8-recipe tensorwise"
)


def calibrate_fp8(steps: Steps, batches: Batches, monitor: Fp8Monitor | None) -> None:
    """Delayed scaling's first scales from a high-precision pass over the first micro-batch of `batches`."""
    cfg, dims = steps.cfg, steps.dims

    def run() -> None:
        if dims.pp > 1:
            steps.pipeline(batches, 1, train=True)
        else:
            steps.batch_loss(batches).backward()

    assert monitor is not None
    steps.model.train()
    devices = [steps.device] if steps.device.type == "cuda" else []
    # Every layer recomputed in the pass (its layers run in high precision, keeping twice FP8's bytes per GEMM
    # input): one extra forward, once per run, so that the pass needs less memory than the step it precedes
    with steps.grad_buffers.paused(), torch.random.fork_rng(devices=devices), every_layer_recomputed(steps.model):
        overlap = cfg.parallel.tp_comm_overlap
        try:
            line = calibrate_delayed_scaling(steps.model, steps.fp8, monitor.taps, cfg.precision, run, dims, overlap)
        except torch.OutOfMemoryError as error:  # a run whose step itself barely fits
            raise RuntimeError(CALIBRATION_OOM) from error
        steps.optimizer.restore_freed_shards()  # before the gradients' reset marks the shards written
    steps.optimizer.recast_fp8_params()  # FP8 weights were cast before the calibrated weight scales existed
    print_rank_0(f"> fp8: {line}")


def capture_cuda_graphs(steps: Steps) -> None:
    """After the checkpoint is loaded (the graphs read the weights and FP8 state in place, wherever they came
    from) and before the first step; the capture's warm-up gradients are thrown away."""
    from megatron.model.cuda_graphs import capture_te_layer_graphs

    steps.model.train()
    with steps.grad_buffers.paused():
        seconds = capture_te_layer_graphs(steps.model, steps.cfg.training.micro_batch_size, steps.dtype)
    layers = len(steps.stage.layer_numbers)
    print_rank_0(f"> captured CUDA graphs of {layers} transformer layers (forward and backward) in {seconds:.1f} s")
