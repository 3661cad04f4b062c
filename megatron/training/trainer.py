"""The training loop: build everything from a Config, train to --train-iters, evaluate, checkpoint, log, and stop.

Order of construction (each step needs the previous): process groups -> seeds -> tokenizer and padded vocabulary ->
model -> FP8 state attached to its linears -> optimizer -> checkpoint loaded -> datasets positioned at the
checkpoint's consumed samples. The trainer calls the parts in that order and runs the loop; each part lives in a
module named for it: build.py (model, FP8, gradient buffers, optimizer), train_state.py (the counters, loaded and
saved with checkpoints), data_loading.py (batches), steps.py (a step's and evaluation's passes), evaluation.py
(which samples an evaluation reads, its loss and line), warmup.py
(calibration and CUDA graphs before the first step), startup.py (the start-of-run lines), startup_times.py (where
the start-up's seconds go), progress.py (the progress and validation lines), runtime.py (gc, exit conditions,
timers, profiler), guards.py (divergence, spikes, lost ranks), shutdown.py (what was started, stopped in order on
every exit path).
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from megatron.checkpoint import Checkpointer
from megatron.checkpoint.save_folder import check_save_folder
from megatron.config import Config
from megatron.config.batch_schedule import BatchSchedule, train_iterations
from megatron.data import build_datasets, build_tokenizer, padded_vocab_size
from megatron.fp8.calibration import holds_delayed_scales
from megatron.model.te_state import release_te_state
from megatron.optim.loss_scaler import build_loss_scaler
from megatron.optim.schedule import LearningRates, LRSchedule
from megatron.parallel import ParallelDims, init_distributed

from .build import (
    build_fp8,
    build_grad_buffers,
    build_model,
    build_optimizer,
    point_fp8_weights_at_their_casts,
    set_seed,
)
from .data_loading import Loaders, close_loader
from .determinism import apply_deterministic_mode
from .evaluation import Evaluation
from .guards import RunGuards, guard_collectives
from .logger import TensorBoardWriter, print_rank_0
from .memory import print_peak_memory
from .progress import Progress
from .runtime import Runtime
from .shutdown import Shutdown, forget_frames
from .startup import outputs_line, print_arguments, print_layout, print_model, write_config
from .startup_times import CHECKPOINT_LOADED, DATA_ITERATORS, MODEL_AND_OPTIMIZER, StartupTimes
from .stats import Stats
from .steps import Batches, Steps
from .train_state import Checkpoints, TrainState
from .warmup import calibrate_fp8, capture_cuda_graphs


class Trainer:
    """`Trainer(cfg).train()` trains and returns the TrainState. `shutdown` collects what the trainer starts (a
    caller that owns the process, like `pretrain`, passes its own and closes it once the trainer is dropped)."""

    def __init__(self, cfg: Config, shutdown: Shutdown | None = None):
        self.cfg = cfg
        self.shutdown = shutdown or Shutdown()
        if cfg.checkpoint.save:  # read-only, full, or not a folder: said now, not at the first save
            check_save_folder(cfg.checkpoint.save)
        if cfg.training.deterministic_mode:  # before any communicator, cuBLAS handle or TE module exists
            apply_deterministic_mode()
        started = dist.is_initialized()
        self.device = init_distributed(cfg)
        if not started and dist.is_initialized():  # this run started torch.distributed: its end destroys the groups
            self.shutdown.own_process_groups({"world": dist.group.WORLD}, cfg.parallel.distributed_timeout_minutes)
        self.dims = ParallelDims.build(cfg)
        self.startup = StartupTimes(cfg.logging.timing_log_option, self.device)  # where the start-up's seconds go
        self.shutdown.watch({k: v for k, v in vars(self.dims).items() if isinstance(v, dist.ProcessGroup)})
        with self.shutdown.on_error():  # a part that fails to start stops those started before it
            self._build()

    def _build(self) -> None:
        cfg, dims = self.cfg, self.dims
        set_seed(cfg.training.seed)
        self.tokenizer = build_tokenizer(cfg.data)
        self.vocab_size = padded_vocab_size(
            self.tokenizer.vocab_size, cfg.data.make_vocab_size_divisible_by, cfg.parallel.tensor_model_parallel_size
        )
        self.dtype = cfg.precision.params_dtype
        self.startup.initialized()
        with self.startup.setup(MODEL_AND_OPTIMIZER, "after model, optimizer, and learning rate scheduler are built"):
            self._build_model_and_optimizer()
        with self.startup.setup(DATA_ITERATORS, "after dataloaders are built"):
            with self.startup.phase("datasets"):
                self.datasets = build_datasets(cfg, self.tokenizer, self.vocab_size)
        # this rank's micro-batches of a split from a sample on (the loop's, evaluation's, and tests')
        self.loader = Loaders(cfg.training.micro_batch_size, cfg.data.num_workers, dims, self.device)
        self.tensorboard = TensorBoardWriter(cfg.logging.tensorboard_dir)
        self.shutdown.add("the TensorBoard writer", self.tensorboard.close)
        self.runtime = Runtime(cfg, dims.rank, self.device)  # gc, empty cache, exit budget, timers, profiler
        self.shutdown.add("the profiler, --manual-gc and the exit signal handler", self.runtime.end_training)
        self.guards = RunGuards(cfg, self.loss_scaler, self.tensorboard)  # divergence stop, loss spikes
        self.stats = Stats(cfg.logging, dims, self.optimizer, self.grad_buffers.sharded_state, self.device)
        self.steps = Steps(
            cfg,
            dims,
            self.device,
            self.model,
            self.stage,
            self.tp,
            self.cp,
            optimizer=self.optimizer,
            grad_buffers=self.grad_buffers,
            loss_scaler=self.loss_scaler,
            fp8=self.fp8,
            stats=self.stats,
            runtime=self.runtime,
        )
        self.progress = Progress(
            cfg,
            dims,
            self.device,
            self.vocab_size,
            self.train_iters,
            loss_scaler=self.loss_scaler,
            grad_buffers=self.grad_buffers,
            stats=self.stats,
            runtime=self.runtime,
            tensorboard=self.tensorboard,
        )
        parts = self.state, self.loader, self.steps, self.runtime, self.progress
        self.evaluation = Evaluation(cfg.training, cfg.num_micro_batches, *parts)
        print_arguments(cfg)
        print_layout(cfg, dims, self.device, self.stage, self.batch_schedule, self.train_iters)
        fp8_lines = self.fp8.describe() if self.fp8 is not None else []
        self.memory_estimate_gib = print_model(
            cfg, dims, self.tokenizer.vocab_size, self.vocab_size, self.model, fp8_lines
        )
        write_config(cfg, dims, self.tensorboard)
        if cfg.precision.calibration_pass and self._needs_calibration():
            with self.startup.phase("delayed scaling's calibration pass"):
                batches = iter(self.loader(self.datasets.train, self.state.consumed_samples))
                calibrate_fp8(self.steps, batches, self.fp8_monitor)
        if cfg.training.cuda_graph_impl == "transformer_engine":
            with self.startup.phase("CUDA graphs captured"):
                capture_cuda_graphs(self.steps)
        self.startup.done()

    def _needs_calibration(self) -> bool:
        """A fresh run, or one whose checkpoint holds no delayed-scaling scales (saved in bf16, with another recipe,
        or converted); a checkpoint of a delayed-scaling run holds them, and resuming keeps them."""
        if self.state.iteration == 0:
            return True
        monitor = self.fp8_monitor
        assert monitor is not None  # every delayed-scaling run builds one (its taps serve the calibration)
        if holds_delayed_scales(self.steps.fp8, monitor.taps, self.device):
            return False
        print_rank_0(
            f"> fp8: checkpoint at iteration {self.state.iteration} holds no delayed-scaling scales: calibrating"
            " them as at a first step"
        )
        return True

    def _build_model_and_optimizer(self) -> None:
        """Megatron-LM's model-and-optimizer-setup: the model, its FP8 state, the gradient buffers, the optimizer,
        the learning rate and batch size schedules, and --load's checkpoint; each a phase of the start-up's table."""
        cfg, dims, phase = self.cfg, self.dims, self.startup.phase
        self.tp, self.cp, self.stage, self.model, deferred = build_model(
            cfg, dims, self.device, self.vocab_size, self.startup
        )
        if cfg.model.transformer_impl == "transformer_engine":  # TE's globals keep our groups (te_state.py)
            self.shutdown.add_at_exit("Transformer Engine's global state", release_te_state)
        with phase("FP8 state"):
            self.fp8, self.fp8_monitor = build_fp8(cfg, self.model, dims, self.device)
        sharding = "FSDP sharding" + (" and the meta-device model's values" if deferred else "")
        with phase(sharding if cfg.sharding.fsdp2 else "gradient buffers"):
            self.grad_buffers = build_grad_buffers(cfg, dims, self.model, self.device, deferred)
        self.shutdown.add_at_exit("the gradient buffers' hooks", self.grad_buffers.remove_hooks)
        with phase("optimizer"):
            self.optimizer = build_optimizer(cfg, dims, self.model, self.device, self.grad_buffers)
            point_fp8_weights_at_their_casts(cfg, self.model, self.optimizer, self.fp8_monitor)
        self.loss_scaler = build_loss_scaler(cfg.precision)
        self.state = TrainState()
        self.checkpointer = None  # saves in --ckpt-format, loads the format on disk, logs the seconds
        if cfg.checkpoint.save or cfg.checkpoint.load:
            parts = self.model, self.optimizer, self.loss_scaler, self.fp8, self.fp8_monitor
            self.checkpointer = Checkpointer(cfg, dims, *parts)
        parts = self.state, self.checkpointer, cfg, self.model, self.optimizer, self.grad_buffers
        self.checkpoints = Checkpoints(*parts)
        if cfg.checkpoint.load:
            with phase(CHECKPOINT_LOADED):
                if not self.checkpoints.restore():
                    self.startup.relabel(CHECKPOINT_LOADED, "checkpoint looked for (none in --load)")
        # Each step's batch size and learning rate follow the consumed samples (a resumed run: the checkpoint's)
        self.batch_schedule, self.train_iters = BatchSchedule.from_config(cfg), train_iterations(cfg)
        self.batch_schedule.check_from(self.state.consumed_samples, self.train_iters - self.state.iteration)
        self.lr_schedule = LRSchedule.from_config(cfg.optimizer, cfg.training.global_batch_size)

    # ------------------------------------------------------------------ the parts, for the loop and for tests

    def train_step(
        self, batches: Batches, lr: float | LearningRates, num_micro: int | None = None
    ) -> tuple[float, float, bool]:
        """One optimizer step at `lr` over `num_micro` micro-batches (default: those of --global-batch-size);
        returns (loss, grad norm, whether it was applied)."""
        return self.steps.train_step(batches, lr, num_micro or self.cfg.num_micro_batches)

    # ------------------------------------------------------------------ the loop

    def train(self) -> TrainState:
        """Train to --train-iters (or an exit condition), evaluate, save; then stop what the trainer started."""
        cfg, state = self.cfg, self.state
        self.startup.training()
        batches = iter(self.loader(self.datasets.train, state.consumed_samples))
        if self.checkpointer is not None:  # never end with a background write unfinished or invisible
            self.shutdown.add("--async-save's pending write", self.checkpointer.finalize, needs_peers=True)
        self.shutdown.add("the data loader", lambda: close_loader(batches))
        with self.shutdown.stopping():
            stopped_early, saved_at = self._steps(batches)
            # Megatron-LM's order: the last save, then the final evaluation of the validation and test splits. An
            # iteration is evaluated once: where the loop's last iteration is a multiple of --eval-interval, its
            # evaluation was the final one (Megatron-LM evaluates it twice, on other batches, with two values).
            if cfg.checkpoint.save and saved_at != state.iteration:
                self.checkpoints.save()
            if cfg.training.eval_iters > 0 and not stopped_early:
                if state.iteration not in state.valid_losses:
                    state.valid_losses[state.iteration] = self.evaluation.run(self.datasets.valid, final=True)
                self.evaluation.run(self.datasets.test, "test", final=True)
        return state

    def _steps(self, batches: Batches) -> tuple[bool, int | None]:
        """Steps until --train-iters, --exit-interval, the time limit or the exit signal. Returns whether the run
        stopped early (time limit or signal: no final evaluation) and the iteration last saved."""
        cfg, state, train_cfg = self.cfg, self.state, self.cfg.training
        saved_at = None
        self.runtime.start_training()
        self.startup.before_first_step()
        while state.iteration < self.train_iters:
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
            self.startup.after_step(elapsed)
            state.iteration += 1
            self.runtime.after_step(state.iteration)
            state.record_step(loss, gbs, stepped, self.guards.after_step(state.iteration, loss, norm, stepped))
            if self.checkpointer is not None:
                self.checkpointer.poll()  # a finished --async-save write becomes visible
            if watched is not None:
                self.fp8_monitor.report(watched, state.iteration, print_rank_0, self.tensorboard.scalars)
            self.progress.add_step(elapsed, loss, gbs)
            self.progress.log_if_due(state, gbs, lrs.default, norm)
            exiting = bool(train_cfg.exit_interval) and state.iteration % train_cfg.exit_interval == 0
            if state.iteration % train_cfg.eval_interval == 0:  # at the loop's last iteration: the final evaluation
                last = exiting or state.iteration == self.train_iters
                state.valid_losses[state.iteration] = self.evaluation.run(self.datasets.valid, final=last)
            save_interval = cfg.checkpoint.save_interval
            if cfg.checkpoint.save and save_interval and state.iteration % save_interval == 0:
                self.checkpoints.save()
                saved_at = state.iteration
            if exiting:
                print_rank_0(f"> exiting at iteration {state.iteration} (--exit-interval {train_cfg.exit_interval})")
                return False, saved_at
            if self.runtime.exit_requested(state.iteration):  # time limit or signal
                return True, saved_at
        return False, saved_at


def pretrain(cfg: Config) -> TrainState:
    """Build and train; the entry point of pretrain_gpt.py. A collective that fails because another rank died
    raises LostRankError (one line) instead of its backend's traceback. Every way out, an error's included, ends in
    `Shutdown.close`: what the run started is stopped and its process groups destroyed before the interpreter
    exits (see shutdown.py for why)."""
    shutdown = Shutdown()
    try:
        state = guard_collectives(lambda: _train(cfg, shutdown), cfg.parallel.distributed_timeout_minutes)
    except BaseException as exc:
        forget_frames(exc)  # its traceback's frames hold the trainer, and through it the process groups
        shutdown.close(ok=False)
        raise
    shutdown.close()
    return state


def _train(cfg: Config, shutdown: Shutdown) -> TrainState:
    trainer = Trainer(cfg, shutdown)
    state = trainer.train()
    print_peak_memory(trainer.device, trainer.memory_estimate_gib)
    print_rank_0(outputs_line(cfg))
    print_rank_0(json.dumps({"final_iteration": state.iteration, "final_lm_loss": state.losses.get(state.iteration)}))
    return state
