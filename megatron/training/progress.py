"""The progress line and its TensorBoard scalars: the steps since the last line (their seconds, losses and samples)
summed up at every --log-interval-th step, with throughput, MFU and the optional statistics; and the validation
report."""

from __future__ import annotations

import math

import torch

from megatron.config import Config
from megatron.optim.loss_scaler import LossScaler
from megatron.parallel import ParallelDims
from megatron.parallel.engines import GradientEngine

from .flops import num_floating_point_operations, peak_tflops
from .logger import TensorBoardWriter, print_rank_0, training_log_line, validation_log_lines
from .runtime import Runtime
from .stats import Stats
from .train_state import TrainState


class Progress:
    """Collects the steps of a log interval and prints the interval's line (rank 0) at its end."""

    def __init__(
        self,
        cfg: Config,
        dims: ParallelDims,
        device: torch.device,
        vocab_size: int,
        train_iters: int,
        *,
        loss_scaler: LossScaler,
        grad_buffers: GradientEngine,
        stats: Stats,
        runtime: Runtime,
        tensorboard: TensorBoardWriter,
    ):
        self.cfg, self.dims, self.device, self.train_iters = cfg, dims, device, train_iters
        self.loss_scaler, self.grad_buffers, self.stats = loss_scaler, grad_buffers, stats
        self.runtime, self.tensorboard = runtime, tensorboard
        self.flops_per_sample = num_floating_point_operations(cfg.model, 1, vocab_size)
        self.peak = peak_tflops(device)
        self._start_interval()

    def _start_interval(self) -> None:
        self.seconds, self.losses, self.iters, self.samples = 0.0, [], 0, 0

    def add_step(self, seconds: float, loss: float, samples: int) -> None:
        self.seconds += seconds
        self.losses.append(loss)
        self.iters += 1
        self.samples += samples

    def log_if_due(self, state: TrainState, batch_size: int, lr: float, norm: float) -> None:
        """At the interval's end (and at the last iteration): the line of its last step (global batch size
        `batch_size`), with rates over the interval's samples (not iterations x --global-batch-size under a
        batch-size ramp)."""
        if state.iteration % self.cfg.logging.log_interval and state.iteration != self.train_iters:
            return
        self._log(state, batch_size, lr, norm)
        self._start_interval()

    def _log(self, state: TrainState, batch_size: int, lr: float, norm: float) -> None:
        cfg, seconds, samples = self.cfg, self.seconds, self.samples
        finite = [x for x in self.losses if math.isfinite(x)]
        loss = sum(finite) / len(finite) if finite else float("nan")
        seconds_per_iter = seconds / self.iters
        tflops = self.flops_per_sample * samples / seconds / self.dims.world_size / 1e12
        tokens_per_s = samples * cfg.model.seq_length / seconds
        mfu = tflops / self.peak if self.peak else None
        extra_fields, extra_scalars = self.stats.report()  # --log-params-norm, --log-num-zeros-in-grad, memory
        print_rank_0(
            training_log_line(
                state.iteration,
                self.train_iters,
                state.consumed_samples,
                1000 * seconds_per_iter,
                tflops,
                tokens_per_s,
                mfu,
                lr,
                batch_size,
                loss,
                norm,
                state.skipped_iters,
                state.nan_iters,
                self.loss_scaler.scale,
                extra_fields,
            )
        )
        scalars = {
            "lm loss": loss,
            "learning-rate": lr,
            "grad-norm": norm,
            "iteration-time": seconds_per_iter,
            "throughput/tflops-per-gpu": tflops,
            "throughput/tokens-per-s": tokens_per_s,
            "skipped-iterations": state.skipped_iters,
            "loss-scale": self.loss_scaler.scale,
        }
        if mfu is not None:
            scalars["throughput/mfu"] = mfu
        if cfg.logging.log_throughput and cfg.logging.log_timers_to_tensorboard:
            scalars["throughput"] = tflops
        scalars.update(extra_scalars)
        if self.grad_buffers.fp8_stats is not None:  # --fp8-grad-reduce: what FP8 lost (printed by rank 0)
            line, values = self.grad_buffers.fp8_stats.report()
            print_rank_0(line)
            scalars.update(values)
        if self.device.type == "cuda":
            scalars["memory/max-allocated-gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.tensorboard.scalars(scalars, state.iteration)
        self.runtime.report_timers(state.iteration, len(self.losses), self.tensorboard)

    def log_validation(self, iteration: int, loss: float, split: str, final: bool = False) -> None:
        print_rank_0(validation_log_lines(iteration, loss, split, final))
        scalars = {f"lm loss {split}": loss}
        if self.cfg.logging.log_validation_ppl_to_tensorboard:
            scalars[f"lm loss {split} ppl"] = math.exp(min(20.0, loss))
        self.tensorboard.scalars(scalars, iteration)
