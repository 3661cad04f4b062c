"""The training loop: build everything from a Config, train to --train-iters, evaluate, checkpoint, log.

Order of construction (each step needs the previous): process groups -> seeds -> tokenizer and padded vocabulary ->
model (built in fp32 on the CPU from the seed, so every device and layout starts from the same weights, then moved
and cast) -> FP8 state attached to its linears -> optimizer -> checkpoint loaded -> datasets positioned at the
checkpoint's consumed samples.
"""

from __future__ import annotations

import json
import math
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from megatron.checkpoint import Checkpointer, checkpoint_is_finite
from megatron.config import Config
from megatron.config.batch_schedule import BatchSchedule, train_iterations
from megatron.config.pipeline_split import layout_line
from megatron.data import PretrainingSampler, build_datasets, build_tokenizer, padded_vocab_size
from megatron.fp8.calibration import calibrate_delayed_scaling
from megatron.fp8.monitor import build_fp8_monitor
from megatron.model import GPTModel, Stage, count_parameters
from megatron.model.layers import is_fp8_param
from megatron.model.meta_init import DeferredInit
from megatron.optim import MixedPrecisionAdamW
from megatron.optim.loss_scaler import build_loss_scaler
from megatron.optim.schedule import LearningRates, LRSchedule
from megatron.parallel import (
    GradientBuffers,
    ParallelDims,
    grad_norm,
    init_distributed,
    reduce_sequence_parallel_grads,
    reduce_tied_embedding_grads,
)
from megatron.parallel.context_parallel import NO_CP, ContextParallel, attach_context_parallel, split_batch
from megatron.parallel.fsdp import build_fsdp
from megatron.parallel.interleaved import run_interleaved
from megatron.parallel.pipeline import forward_backward_1f1b, forward_only, schedule_line
from megatron.parallel.tensor_parallel import TensorParallel

from .determinism import apply_deterministic_mode
from .flops import num_floating_point_operations, peak_tflops
from .guards import RunGuards, guard_collectives
from .logger import TensorBoardWriter, print_rank_0, training_log_line, validation_log_lines
from .loss import StepLoss, masked_mean
from .memory import estimate_bytes, memory_estimate_lines
from .runtime import Runtime
from .stats import Stats


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    skipped_iters: int = 0
    nan_iters: int = 0
    losses: dict[int, float] = field(default_factory=dict)
    """lm loss of every iteration this process ran (global average), by iteration number."""
    valid_losses: dict[int, float] = field(default_factory=dict)


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _to_device(
    batch: dict[str, torch.Tensor], device: torch.device, cp: ContextParallel = NO_CP
) -> dict[str, torch.Tensor]:
    """On the device, this context-parallel rank's chunks of the sequence (after the copy: the pinned batch moves
    whole, asynchronously)."""
    return split_batch({k: v.to(device, non_blocking=True) for k, v in batch.items()}, cp)


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        if cfg.training.deterministic_mode:  # before any communicator, cuBLAS handle or TE module exists
            apply_deterministic_mode()
        self.device = init_distributed(cfg)
        self.dims = ParallelDims.build(cfg)
        set_seed(cfg.training.seed)
        self.tokenizer = build_tokenizer(cfg.data)
        self.vocab_size = padded_vocab_size(
            self.tokenizer.vocab_size, cfg.data.make_vocab_size_divisible_by, cfg.parallel.tensor_model_parallel_size
        )
        self.dtype = cfg.precision.params_dtype
        dims, par = self.dims, cfg.parallel
        self.tp = TensorParallel(dims.tp_group, dims.tp, dims.tp_rank, par.sequence_parallel, par.tp_comm_overlap)
        self.cp = ContextParallel.from_dims(dims, par.cp_comm_type)
        if par.tp_comm_overlap:  # TE's userbuffers must exist before the TE modules that use them are built
            from megatron.model.te_comm_overlap import initialize_userbuffers

            initialize_userbuffers(cfg, dims.tp)
        chunks = cfg.stage_chunks(dims.pp_rank)
        self.stage = Stage.of_chunks(chunks, pre_process=dims.is_first_stage, post_process=dims.is_last_stage)
        build = partial(
            GPTModel, cfg.model, self.vocab_size, precision=cfg.precision, amax_group=dims.amax_group, tp=self.tp
        )
        # --init-model-with-meta-device: built without storage, given its values once sharded (model/meta_init.py)
        deferred = DeferredInit(build, self.stage, self.dtype) if par.init_model_with_meta_device else None
        self.model = deferred.model if deferred else build(stage=self.stage).to(self.device, self.dtype)
        attach_context_parallel(self.model, self.cp)
        self.fp8 = None
        if cfg.precision.fp8 and cfg.model.transformer_impl == "local":  # TE runs its FP8 inside the model
            from megatron.fp8 import attach_fp8

            self.fp8 = attach_fp8(self.model, cfg, self.dims.amax_group)
        self.fp8_monitor = build_fp8_monitor(cfg, self.model, self.fp8, self.dims, self.device)
        # Under the pipeline schedule the last micro-batch's backward is not the last backward of the step on every
        # stage, so the buckets are reduced after the schedule there.
        overlap = par.overlap_grad_reduce and dims.pp == 1
        sharded = cfg.optimizer.use_distributed_optimizer
        if par.fsdp:  # weights, gradients and optimizer states sharded (megatron/parallel/fsdp.py)
            self.grad_buffers = build_fsdp(self.model, cfg, dims.dp_cp_group, self.device, deferred)
        else:
            self.grad_buffers = GradientBuffers(
                self.model,
                dims.dp_cp_group,
                overlap,
                par.ddp_bucket_size,
                sharded,
                par.overlap_param_gather,
                grad_dtype=torch.bfloat16 if par.grad_reduce_in_bf16 else torch.float32,
                fp8_reduce=par.fp8_grad_reduce,
            )
        if self.grad_buffers.overlap_param_gather:
            self.grad_buffers.wait_for_params_in_forward(self.model, list(self.model.decoder.layers))
        # FP8 weights' amaxes, when their main copies are cast: TE scales each tensor-parallel shard by itself, the
        # local engine the whole tensor (as in one process)
        fp8_group = dims.amax_group if cfg.model.transformer_impl == "local" else dims.dp_cp_group
        self.optimizer = MixedPrecisionAdamW(
            self.model, cfg.optimizer, self.device.type == "cuda", self.grad_buffers, fp8_group
        )
        self.loss_scaler = build_loss_scaler(cfg.precision)
        self.state = TrainState()
        self.checkpointer = None  # saves in --ckpt-format, loads the format on disk, logs the seconds
        if cfg.checkpoint.save or cfg.checkpoint.load:
            parts = self.model, self.optimizer, self.loss_scaler, self.fp8, self.fp8_monitor
            self.checkpointer = Checkpointer(cfg, dims, *parts)
        self._load()
        # Each step's batch size and learning rate follow the consumed samples (a resumed run: the checkpoint's)
        self.batch_schedule, self.train_iters = BatchSchedule.from_config(cfg), train_iterations(cfg)
        self.batch_schedule.check_from(self.state.consumed_samples, self.train_iters - self.state.iteration)
        self.lr_schedule = LRSchedule.from_config(cfg.optimizer, cfg.training.global_batch_size)
        self.datasets = build_datasets(cfg, self.tokenizer, self.vocab_size)
        self.tensorboard = TensorBoardWriter(cfg.logging.tensorboard_dir)
        self.runtime = Runtime(cfg, dims.rank, self.device)  # gc, empty cache, exit budget, timers, profiler
        self.guards = RunGuards(cfg, self.loss_scaler, self.tensorboard)  # divergence stop, loss spikes
        self.stats = Stats(cfg.logging, dims, self.optimizer, self.grad_buffers.sharded, self.device)
        self.flops_per_sample = num_floating_point_operations(cfg.model, 1, self.vocab_size)
        self.peak = peak_tflops(self.device)
        self._log_startup()
        self._calibrate_fp8()
        if cfg.training.cuda_graph_impl == "transformer_engine":
            self._capture_cuda_graphs()

    # ------------------------------------------------------------------ setup

    def _log_startup(self) -> None:
        cfg = self.cfg
        print_rank_0("------------------------ arguments ------------------------")
        for values in cfg.to_dict().values():
            if isinstance(values, dict):
                for key, value in sorted(values.items()):
                    print_rank_0(f"  {key} {'.' * max(1, 40 - len(key))} {value}")
        print_rank_0("-------------------- end of arguments ---------------------")
        for note in cfg.notes:
            print_rank_0(f"note: {note}")
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        print_rank_0(
            f"> device: {self.device} ({name}), world size {self.dims.world_size}, data-parallel size {self.dims.dp},"
            + (f" context-parallel size {self.dims.cp}," if self.dims.cp > 1 else "")
            + f" {cfg.num_micro_batches} micro-batches of {cfg.training.micro_batch_size} per step"
        )
        if self.dims.pp > 1:
            print_rank_0(f"> {schedule_line(self.dims.pp, self.stage.num_chunks, cfg.num_micro_batches)}")
        if cfg.pipeline_layout is not None:
            print_rank_0(f"> {layout_line(cfg.pipeline_layout, self.dims.pp, cfg.model.num_layers)}")
        if not self.batch_schedule.is_constant:
            phases = ", ".join(f"{batch} from sample {start}" for start, batch in self.batch_schedule.phases)
            print_rank_0(f"> global batch size schedule: {phases}; {self.train_iters} iterations")
        print_rank_0(
            f"> padded vocab (size: {self.tokenizer.vocab_size}) with"
            f" {self.vocab_size - self.tokenizer.vocab_size} dummy tokens (new size: {self.vocab_size})"
        )
        params = count_parameters(self.model)
        if self.dims.tp * self.dims.pp > 1:
            print_rank_0(f"> number of parameters on (tensor, pipeline) model parallel rank (0, 0): {params:,}")
        else:
            print_rank_0(f"> number of parameters: {params:,}")
        fp8_params = sum(p.numel() for p in self.model.parameters() if is_fp8_param(p))
        pp_rank = self.dims.pp_rank
        estimate = estimate_bytes(cfg, params, self.vocab_size, self.dtype, pp_rank=pp_rank, fp8_params=fp8_params)
        self.memory_estimate_gib = estimate["total"] / 2**30  # printed again beside the measured peak at the end
        for line in memory_estimate_lines(cfg, estimate, params, self.dtype, fp8_params=fp8_params):
            print_rank_0(f"> {line}")
        if self.fp8 is not None:
            for line in self.fp8.describe():
                print_rank_0(f"> fp8: {line}")
        for line in self.model.describe():
            print_rank_0(f"> {line}")
        out_dir = cfg.logging.log_dir or cfg.checkpoint.save or cfg.logging.tensorboard_dir
        if out_dir and self.dims.is_first_rank:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / "config.json").write_text(cfg.to_json() + "\n")
        self.tensorboard.text("config", "```\n" + cfg.to_json() + "\n```")

    def _calibrate_fp8(self) -> None:
        """Delayed scaling's first scales from a high-precision pass over the first micro-batch (a fresh run only:
        a checkpoint holds the scales); its gradients are thrown away and the random streams left as they were."""
        prec = self.cfg.precision
        if not (prec.fp8 and prec.fp8_recipe == "delayed" and prec.fp8_calibration) or self.state.iteration > 0:
            return
        batches = iter(self._loader(self.datasets.train, self.state.consumed_samples))

        def run() -> None:
            if self.dims.pp > 1:
                self._pipeline(batches, 1, train=True)
            else:
                self._loss(_to_device(next(batches), self.device, self.cp)).backward()

        assert self.fp8_monitor is not None
        self.model.train()
        devices = [self.device] if self.device.type == "cuda" else []
        with self.grad_buffers.paused(), torch.random.fork_rng(devices=devices):
            line = calibrate_delayed_scaling(
                self.model, self.fp8, self.fp8_monitor.taps, prec, run, self.dims, self.cfg.parallel.tp_comm_overlap
            )
        self.optimizer.recast_fp8_params()  # FP8 weights were cast before the calibrated weight scales existed
        print_rank_0(f"> fp8: {line}")

    def _capture_cuda_graphs(self) -> None:
        """After the checkpoint is loaded (the graphs read the weights and FP8 state in place, wherever they came
        from) and before the first step; the capture's warm-up gradients are thrown away."""
        from megatron.model.cuda_graphs import capture_te_layer_graphs

        self.model.train()
        with self.grad_buffers.paused():
            seconds = capture_te_layer_graphs(self.model, self.cfg.training.micro_batch_size, self.dtype)
        layers = len(self.stage.layer_numbers)
        print_rank_0(f"> captured CUDA graphs of {layers} transformer layers (forward and backward) in {seconds:.1f} s")

    def _load(self) -> None:
        ckpt_cfg = self.cfg.checkpoint
        if not ckpt_cfg.load:
            return
        state = self.checkpointer.load(ckpt_cfg.load)  # the model, and the rest unless the flags say otherwise
        if state is None:
            print_rank_0(f"> no checkpoint found in {ckpt_cfg.load}: starting from scratch")
            return
        if ckpt_cfg.finetune:
            self.optimizer.reload_model_params()
            return
        self.state.iteration = state["iteration"]
        self.state.consumed_samples = state["consumed_samples"]
        self.state.skipped_iters = state.get("skipped_iters", 0)
        self.state.nan_iters = state.get("nan_iters", 0)

    def save(self) -> None:
        self.grad_buffers.wait_for_params()  # overlapped all-gathers of the last update
        if not checkpoint_is_finite(self.model, self.optimizer):  # never write (nor point `latest` at) a NaN state
            print_rank_0(
                f"> WARNING: not saving the checkpoint of iteration {self.state.iteration}: weights or"
                " optimizer state are not finite; `latest` still names the previous one"
            )
            return
        keys = ("consumed_samples", "skipped_iters", "nan_iters")
        train_state = {k: getattr(self.state, k) for k in keys} | {"config": self.cfg.to_dict()}
        self.checkpointer.save(self.cfg.checkpoint.save, self.state.iteration, train_state)  # logs Megatron's line

    def _loader(self, dataset: Dataset, consumed_samples: int) -> DataLoader:
        sampler = PretrainingSampler(
            len(dataset), consumed_samples, self.cfg.training.micro_batch_size, self.dims.dp_rank, self.dims.dp
        )
        return DataLoader(
            dataset,
            batch_sampler=sampler,
            num_workers=self.cfg.data.num_workers,
            pin_memory=self.device.type == "cuda",
            # A private generator: creating a loader must not draw from the global RNG (that would shift dropout
            # between a resumed run and an uninterrupted one).
            generator=torch.Generator(),
        )

    # ------------------------------------------------------------------ steps

    def _loss(
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

    def _pipeline(self, batches, num_micro: int, train: bool, step: StepLoss | None = None) -> torch.Tensor:
        """Mean loss over the micro-batches, through the pipeline stages; every stage returns it (training: `step`
        records the loss, and the return value is meaningless)."""

        def stage_forward(batch, hidden, chunk=None):
            out = self._loss(_to_device(batch, self.device, self.cp), hidden, step, chunk)
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

    def _average_over_dp(self, value: torch.Tensor) -> float:
        if self.dims.dp_cp_group is not None:
            value = value.clone()
            dist.all_reduce(value, group=self.dims.dp_cp_group)
            value /= self.dims.dp_cp
        return float(value)

    def train_step(self, batches, lr: float | LearningRates, num_micro: int | None = None) -> tuple[float, float, bool]:
        """One optimizer step at `lr` over `num_micro` micro-batches (default: those of --global-batch-size);
        returns (loss, grad norm, whether it was applied)."""
        self.model.train()
        num_micro = num_micro or self.cfg.num_micro_batches
        step = StepLoss(self.cfg.training.calculate_per_token_loss, num_micro, self.device, self.cp.group)
        timers = self.runtime.timers
        timers("forward-backward", 1).start()
        if self.dims.pp > 1:
            self._pipeline(batches, num_micro, train=True, step=step)
        else:
            for micro in range(num_micro):
                self.grad_buffers.is_last_micro_batch = micro == num_micro - 1
                timers("forward-compute", 2).start()
                loss = self._loss(_to_device(next(batches), self.device, self.cp), step=step)
                timers("forward-compute", 2).stop()
                timers("backward-compute", 2).start()
                self.loss_scaler.scale_loss(loss).backward()
                timers("backward-compute", 2).stop()
        timers("forward-backward", 1).stop()
        self.runtime.empty_cache(1)
        fp8_finite = self.fp8.step() if self.fp8 is not None else True
        params, sharded = self.optimizer.params, self.grad_buffers.sharded
        timers("all-grads-sync", 1).start()
        reduce_tied_embedding_grads(params, self.dims)
        self.grad_buffers.finish()
        reduce_sequence_parallel_grads(params, self.dims)
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
        self.runtime.empty_cache(2)
        self.grad_buffers.zero()
        # The host waits for the GPU only here, with the whole step queued (the loss first; norm and the skip
        # decision are ready by then). fp16: inf/NaN gradients give an infinite norm on every rank and skip the step.
        loss = step.value(self.dims.pp_group, self.dims.dp_cp_group)
        self.loss_scaler.update(found_inf=not bool(stepped))
        return loss, float(norm), bool(stepped)

    @torch.no_grad()
    def evaluate(self, dataset: Dataset | None, split: str = "validation") -> float | None:
        if dataset is None or self.cfg.training.eval_iters == 0:
            return None
        self.runtime.before_evaluation()
        self.model.eval()
        batches = iter(self._loader(dataset, 0))
        steps = self.cfg.training.eval_iters * self.cfg.num_micro_batches
        if self.dims.pp > 1:
            loss = self._average_over_dp(self._pipeline(batches, steps, train=False))
        else:
            total = torch.zeros((), device=self.device)
            for _ in range(steps):
                total += self._loss(_to_device(next(batches), self.device, self.cp)).float()
            loss = self._average_over_dp(total / steps)
        self.runtime.after_evaluation()
        print_rank_0(validation_log_lines(self.state.iteration, loss, split))
        scalars = {f"lm loss {split}": loss}
        if self.cfg.logging.log_validation_ppl_to_tensorboard:
            scalars[f"lm loss {split} ppl"] = math.exp(min(20.0, loss))
        self.tensorboard.scalars(scalars, self.state.iteration)
        return loss

    def train(self) -> TrainState:
        cfg, state = self.cfg, self.state
        train_cfg, train_iters = cfg.training, self.train_iters
        batches = iter(self._loader(self.datasets.train, state.consumed_samples))
        interval_time, interval_losses, interval_iters, interval_samples = 0.0, [], 0, 0
        saved_at, stopped_early = None, False
        self.runtime.start_training()
        while state.iteration < train_iters:
            self.runtime.before_step(state.iteration)
            lrs = self.lr_schedule.at(state.consumed_samples)
            gbs = self.batch_schedule.global_batch_size(state.consumed_samples)
            num_micro = self.batch_schedule.num_micro_batches(state.consumed_samples)
            start = time.perf_counter()
            with self.fp8_monitor.watch(state.iteration + 1) if self.fp8_monitor else nullcontext() as watched:
                loss, norm, stepped = self.train_step(batches, lrs, num_micro)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            elapsed = time.perf_counter() - start
            state.iteration += 1
            self.runtime.after_step(state.iteration)
            state.consumed_samples += gbs
            state.skipped_iters += not stepped
            state.nan_iters += self.guards.after_step(state.iteration, loss, norm, stepped)
            state.losses[state.iteration] = loss
            if self.checkpointer is not None:
                self.checkpointer.poll()  # a finished --async-save write becomes visible
            if watched is not None:
                self.fp8_monitor.report(watched, state.iteration, print_rank_0, self.tensorboard.scalars)
            interval_time += elapsed
            interval_losses.append(loss)
            interval_iters += 1
            interval_samples += gbs
            if state.iteration % cfg.logging.log_interval == 0 or state.iteration == train_iters:
                interval = (interval_time, interval_iters, interval_samples, gbs)
                self._log_interval(*interval, interval_losses, lrs.default, norm)
                interval_time, interval_losses, interval_iters, interval_samples = 0.0, [], 0, 0
            if state.iteration % train_cfg.eval_interval == 0 and state.iteration < train_iters:
                state.valid_losses[state.iteration] = self.evaluate(self.datasets.valid)
            save_interval = cfg.checkpoint.save_interval
            if cfg.checkpoint.save and save_interval and state.iteration % save_interval == 0:
                self.save()
                saved_at = state.iteration
            if train_cfg.exit_interval and state.iteration % train_cfg.exit_interval == 0:
                print_rank_0(f"> exiting at iteration {state.iteration} (--exit-interval {train_cfg.exit_interval})")
                break
            if self.runtime.exit_requested(state.iteration):  # time limit or signal: no final evaluation
                stopped_early = True
                break
        if train_cfg.eval_iters > 0 and not stopped_early:
            state.valid_losses[state.iteration] = self.evaluate(self.datasets.valid)
            self.evaluate(self.datasets.test, "test")
        if cfg.checkpoint.save and saved_at != state.iteration:
            self.save()
        if self.checkpointer is not None:
            self.checkpointer.finalize()  # never end with a background write unfinished or invisible
        self.runtime.end_training()
        self.tensorboard.close()
        return state

    def _log_interval(
        self, seconds: float, iters: int, samples: int, batch_size: int, losses: list[float], lr: float, norm: float
    ) -> None:
        """The line of the interval's last step (its global batch size `batch_size`), with rates over the
        interval's `samples` (not iterations x --global-batch-size under a batch-size ramp)."""
        cfg, state = self.cfg, self.state
        finite = [x for x in losses if math.isfinite(x)]
        loss = sum(finite) / len(finite) if finite else float("nan")
        seconds_per_iter = seconds / iters
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
        self.runtime.report_timers(state.iteration, len(losses), self.tensorboard)


def pretrain(cfg: Config) -> TrainState:
    """Build and train; the entry point of pretrain_gpt.py. A collective that fails because another rank died
    raises LostRankError (one line) instead of its backend's traceback."""
    return guard_collectives(lambda: _pretrain(cfg), cfg.parallel.distributed_timeout_minutes)


def _pretrain(cfg: Config) -> TrainState:
    trainer = Trainer(cfg)
    state = trainer.train()
    if trainer.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(trainer.device) / 2**30
        # Peak and estimate of the busiest rank (pipeline stages and vocabulary shards differ), in one reduction.
        both = torch.tensor([peak, trainer.memory_estimate_gib], device=trainer.device)
        if dist.is_initialized():
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
        peak, estimate = both.tolist()
        where = "the most on any rank; " if dist.is_initialized() else ""
        print_rank_0(f"> peak memory allocated: {peak:.2f} GiB ({where}estimate at start: {estimate:.2f} GiB)")
    print_rank_0(json.dumps({"final_iteration": state.iteration, "final_lm_loss": state.losses.get(state.iteration)}))
    return state
