"""The computation of a step: a micro-batch's loss, the pipeline schedules, one optimizer step over a global batch, and
evaluation's forward passes. The training loop (trainer.py) decides when; this module does the arithmetic, in the
order the collectives and the host-device syncs need."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron.config import Config
from megatron.model import GPTModel, Stage
from megatron.model.smooth_swiglu import smoothed_linears, update_smoothing
from megatron.optim import MixedPrecisionAdamW
from megatron.optim.loss_scaler import LossScaler
from megatron.optim.schedule import LearningRates
from megatron.parallel import (
    ParallelDims,
    grad_norm,
    reduce_sequence_parallel_grads,
    reduce_tied_embedding_grads,
)
from megatron.parallel.context_parallel import ContextParallel
from megatron.parallel.engines import GradientEngine
from megatron.parallel.interleaved import run_interleaved
from megatron.parallel.pipeline import forward_backward_1f1b, forward_only
from megatron.parallel.tensor_parallel import TensorParallel

from .data_loading import to_device
from .loss import StepLoss, masked_mean
from .runtime import Runtime
from .stats import Stats

Batches = Iterator[dict[str, torch.Tensor]]


class Steps:
    """Forward and backward passes of this rank's stage of `model` (every rank calls the same methods in turn)."""

    def __init__(
        self,
        cfg: Config,
        dims: ParallelDims,
        device: torch.device,
        model: GPTModel,
        stage: Stage,
        tp: TensorParallel,
        cp: ContextParallel,
        *,
        optimizer: MixedPrecisionAdamW,
        grad_buffers: GradientEngine,
        loss_scaler: LossScaler,
        fp8: Any,
        stats: Stats,
        runtime: Runtime,
    ):
        self.cfg, self.dims, self.device = cfg, dims, device
        self.model, self.stage, self.tp, self.cp = model, stage, tp, cp
        self.optimizer, self.grad_buffers, self.loss_scaler = optimizer, grad_buffers, loss_scaler
        self.fp8, self.stats, self.runtime = fp8, stats, runtime
        self.dtype = cfg.precision.params_dtype
        self.smoothed = smoothed_linears(model)  # --smooth-swiglu's linears, found once: not walked every step

    def loss(
        self,
        batch: dict[str, torch.Tensor],
        hidden: torch.Tensor | None = None,
        step: StepLoss | None = None,
        chunk: int | None = None,
    ) -> torch.Tensor:
        """The micro-batch's mean loss over its unmasked tokens, or in training (`step`) what its backward runs on
        (on a pipeline stage before the last: its output; `chunk`: one model chunk of the interleaved schedule)."""
        # Position ids are 0..s-1 unless --reset-position-ids; None spares the model a host-device sync per micro-batch.
        position_ids = batch.get("position_ids") if self.cfg.data.reset_position_ids else None
        out = self.model(
            batch["tokens"],
            position_ids,
            batch.get("attention_mask"),
            labels=batch["labels"],
            hidden=hidden,
            chunk=chunk,
        )
        if not self.stage.computes_loss(chunk):
            if step is not None and chunk in (None, self.stage.num_chunks - 1):  # once per micro-batch
                step.count(batch["loss_mask"])
            return out
        mask = batch["loss_mask"]
        if step is not None:
            return step.add(out, mask)
        return masked_mean(out, mask, self.cp.group)

    def batch_loss(self, batches: Batches) -> torch.Tensor:
        """The next micro-batch's loss (`loss` of it on the device)."""
        return self.loss(to_device(next(batches), self.device, self.cp))

    def pipeline(self, batches: Batches, num_micro: int, train: bool, step: StepLoss | None = None) -> torch.Tensor:
        """Mean loss over the micro-batches, through the pipeline stages; every stage returns it (training: `step`
        records the loss, and the return value is meaningless)."""

        def stage_forward(batch, hidden, chunk=None):
            out = self.loss(to_device(batch, self.device, self.cp), hidden, step, chunk)
            if step is not None:
                return self.loss_scaler.scale_loss(out) if self.stage.computes_loss(chunk) else out
            return out / num_micro if self.stage.computes_loss(chunk) else out

        s, h = self.cfg.model.seq_length // self.cp.size, self.cfg.model.hidden_size
        shape = (s // self.dims.tp if self.tp.sequence_parallel else s, self.cfg.training.micro_batch_size, h)
        where = (self.dims, shape, self.dtype, self.device)
        if self.stage.num_chunks > 1:
            vpp = self.stage.num_chunks
            group = self.cfg.parallel.microbatch_group_size_per_virtual_pipeline_stage
            losses = run_interleaved(stage_forward, batches, num_micro, vpp, *where, not train, group)
        else:
            schedule = forward_backward_1f1b if train else forward_only
            losses = schedule(stage_forward, batches, num_micro, *where)
        if step is not None:
            return torch.zeros((), device=self.device)
        total = torch.stack(losses).sum().float() if losses else torch.zeros((), device=self.device)
        dist.all_reduce(total, group=self.dims.pp_group)  # the loss lives on the last stage
        return total

    def train_step(self, batches: Batches, lr: float | LearningRates, num_micro: int) -> tuple[float, float, bool]:
        """One optimizer step at `lr` over `num_micro` micro-batches; returns (loss, grad norm, whether it was
        applied)."""
        self.model.train()
        step = StepLoss(self.cfg.training.calculate_per_token_loss, num_micro, self.device, self.cp.group)
        timers = self.runtime.timers
        timers("forward-backward", 1).start()
        if self.dims.pp > 1:
            self.pipeline(batches, num_micro, train=True, step=step)
        else:
            for micro in range(num_micro):
                self.grad_buffers.is_last_micro_batch = micro == num_micro - 1
                timers("forward-compute", 2).start()
                loss = self.loss(to_device(next(batches), self.device, self.cp), step=step)
                timers("forward-compute", 2).stop()
                timers("backward-compute", 2).start()
                self.loss_scaler.scale_loss(loss).backward()
                timers("backward-compute", 2).stop()
        timers("forward-backward", 1).stop()
        self.runtime.empty_cache(1)
        fp8_finite = self.fp8.step() if self.fp8 is not None else True
        params, sharded = self.optimizer.params, self.grad_buffers.sharded_state
        timers("all-grads-sync", 1).start()
        reduce_tied_embedding_grads(params, self.dims)
        self.grad_buffers.finish()
        reduce_sequence_parallel_grads(params, self.dims, self.grad_buffers.reduced_grad)
        timers("all-grads-sync", 1).stop()
        self.loss_scaler.unscale_(self.optimizer.grads(), step.grad_factor(self.dims.dp_cp_group))
        self.stats.count_zeros()
        timers("optimizer", 1).start()
        # An inf/NaN FP8 amax skips the step through an infinite gradient norm, which the norm's reduction carries
        # to every stage and replica: skipping the call here would leave the other pipeline stages waiting in it.
        norm, stepped = self.optimizer.step(
            lr,
            lambda: grad_norm(self.optimizer.norm_grads(), self.dims, sharded, self.device, skip=not fp8_finite),
        )
        timers("optimizer", 1).stop()
        if self.smoothed:  # the next step's Smooth-SwiGLU scales, from this step's amaxes
            update_smoothing(self.smoothed, self.dims.dp_cp_group, self.cfg.model.smooth_swiglu_migration)
        self.runtime.empty_cache(2)
        self.grad_buffers.zero()
        # The host waits for the GPU only here, with the whole step queued (the loss first; norm and the skip
        # decision are ready by then). fp16: inf/NaN gradients give an infinite norm on every rank and skip the step.
        loss = step.value(self.dims.pp_group, self.dims.dp_cp_group)
        self.loss_scaler.update(found_inf=not bool(stepped))
        return loss, float(norm), bool(stepped)

    @torch.no_grad()
    def evaluation_loss(self, batches: Batches, num_micro: int) -> float:
        """Mean loss of `num_micro` micro-batches, averaged over the data-parallel ranks (model in eval mode)."""
        self.model.eval()
        if self.dims.pp > 1:
            mean = self.pipeline(batches, num_micro, train=False)  # each micro-batch's loss / num_micro, summed
        else:
            mean = torch.zeros((), device=self.device)
            for _ in range(num_micro):
                mean += self.batch_loss(batches).float()
            mean = mean / num_micro
        if self.dims.dp_cp_group is not None:  # the mean over the data-parallel (x context-parallel) ranks
            dist.all_reduce(mean, group=self.dims.dp_cp_group)
            mean /= self.dims.dp_cp
        return float(mean)
