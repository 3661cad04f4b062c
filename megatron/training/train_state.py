"""The run's counters (`TrainState`), and the part of them a checkpoint carries: restored at start from --load,
written at each save point with the model and optimizer."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from megatron.checkpoint import Checkpointer, checkpoint_is_finite
from megatron.config import Config
from megatron.config.optimizer import resolve_schedule
from megatron.convert.mlm_load import load_megatron_lm
from megatron.convert.mlm_resume import is_megatron_lm
from megatron.errors import MissingCheckpointError
from megatron.optim import MixedPrecisionAdamW
from megatron.parallel.engines import GradientEngine

from .logger import print_rank_0

SAVED = ("consumed_samples", "consumed_valid_samples", "skipped_iters", "nan_iters")
"""The counters a checkpoint's train state holds besides the iteration (which the checkpointer writes itself)."""


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    consumed_valid_samples: int = 0
    """Validation samples read so far: each evaluation reads the next eval_iters x global batch (Megatron-LM's
    consumed_valid_samples, carried by checkpoints)."""
    skipped_iters: int = 0
    nan_iters: int = 0
    losses: dict[int, float] = field(default_factory=dict)
    """lm loss of every iteration this process ran (global average), by iteration number."""
    valid_losses: dict[int, float] = field(default_factory=dict)

    def record_step(self, loss: float, batch_size: int, stepped: bool, nan: bool) -> None:
        """The counters after step `self.iteration` (already counted): its samples, whether it was skipped or a nan
        iteration, its loss."""
        self.consumed_samples += batch_size
        self.skipped_iters += not stepped
        self.nan_iters += nan
        self.losses[self.iteration] = loss


def restore_train_state(
    state: TrainState, checkpointer: Checkpointer, cfg: Config, optimizer: MixedPrecisionAdamW
) -> bool:
    """Load --load's newest checkpoint: the model, and the rest unless the flags say otherwise; the counters go
    into `state` (not with --finetune, which takes the weights only and starts counting afresh). Returns whether a
    checkpoint was loaded: a folder without one starts the run from scratch, as in Megatron-LM, or with
    --exit-on-missing-checkpoint raises MissingCheckpointError."""
    ckpt_cfg = cfg.checkpoint
    if not ckpt_cfg.load:
        return False
    if is_megatron_lm(ckpt_cfg.load):  # resumed through the converters' readers (docs/checkpoints.md)
        loaded = load_megatron_lm(checkpointer, ckpt_cfg.load)
    else:
        loaded = checkpointer.load(ckpt_cfg.load)
    if loaded is None:
        if ckpt_cfg.exit_on_missing_checkpoint:
            raise MissingCheckpointError(
                f"--exit-on-missing-checkpoint: no checkpoint in --load {ckpt_cfg.load} (no"
                " latest_checkpointed_iteration.txt naming a complete iteration); check the path, or drop the flag"
                " to start from scratch"
            )
        print_rank_0(
            f"> no checkpoint found in {ckpt_cfg.load}: starting from scratch (--exit-on-missing-checkpoint stops"
            " instead)"
        )
        return False
    if ckpt_cfg.finetune:
        optimizer.reload_model_params()
        return True
    state.iteration = loaded["iteration"]
    state.consumed_samples = loaded["consumed_samples"]
    valid = loaded.get("consumed_valid_samples", 0)
    state.consumed_valid_samples = valid or resumed_valid_samples(cfg, state.iteration)
    state.skipped_iters = loaded.get("skipped_iters", 0)
    state.nan_iters = loaded.get("nan_iters", 0)
    if not ckpt_cfg.no_load_optim:  # the schedule is part of the optimizer state (Megatron-LM: its scheduler's)
        restore_schedule(cfg, loaded)
    return True


def resumed_valid_samples(cfg: Config, iteration: int) -> int:
    """The validation position of a checkpoint that holds none (or 0) at `iteration`, as Megatron-LM takes it
    (training.py, build_train_valid_test_data_loaders): one evaluation of eval_iters x global batch per
    --eval-interval steps done (with --train-samples, none)."""
    train = cfg.training
    if train.train_samples is not None:
        return 0
    return iteration // train.eval_interval * train.eval_iters * train.global_batch_size


def restore_schedule(cfg: Config, loaded: dict) -> None:
    """The learning-rate schedule of a resumed run: the checkpoint's with --use-checkpoint-opt_param-scheduler,
    else the flags' (with --override-opt_param-scheduler silently; without it the settings that differ are logged).
    A checkpoint without a schedule leaves the flags'; a Megatron-LM one gives its args' (and scheduler's) schedule."""
    saved = loaded.get("config")
    saved = saved.get("optimizer") if isinstance(saved, dict) else None
    ckpt_cfg = cfg.checkpoint
    if not isinstance(saved, dict):
        if ckpt_cfg.use_checkpoint_opt_param_scheduler:
            print_rank_0("> --use-checkpoint-opt_param-scheduler: the checkpoint holds no schedule; the flags' is used")
        return
    cfg.optimizer, differ = resolve_schedule(cfg.optimizer, saved, ckpt_cfg.use_checkpoint_opt_param_scheduler)
    if not differ:
        return
    listed = ", ".join(
        f"--{name.replace('_', '-')} {ours} (checkpoint: {theirs})" for name, (ours, theirs) in differ.items()
    )
    if ckpt_cfg.use_checkpoint_opt_param_scheduler:
        print_rank_0(f"> --use-checkpoint-opt_param-scheduler: the checkpoint's schedule is used, not {listed}")
    elif ckpt_cfg.override_opt_param_scheduler:
        print_rank_0(f"> --override-opt_param-scheduler: the flags' schedule is used: {listed}")
    else:
        print_rank_0(
            f"> WARNING: the learning-rate schedule differs from the checkpoint's: {listed}; the flags' is used (add"
            " --override-opt_param-scheduler to say so, or --use-checkpoint-opt_param-scheduler to keep the"
            " checkpoint's; Megatron-LM stops without one of them)"
        )


class Checkpoints:
    """--load and --save of the run: `checkpointer` reads and writes the parts (model, optimizer, loss scaler, FP8
    state) in --ckpt-format, and `state`'s counters go beside them; bound once, so that the loop only says when."""

    def __init__(
        self,
        state: TrainState,
        checkpointer: Checkpointer | None,
        cfg: Config,
        model: nn.Module,
        optimizer: MixedPrecisionAdamW,
        grad_buffers: GradientEngine,
    ):
        self.state, self.checkpointer, self.cfg = state, checkpointer, cfg
        self.model, self.optimizer, self.grad_buffers = model, optimizer, grad_buffers

    def restore(self) -> bool:
        """`restore_train_state` from --load: whether a checkpoint was loaded."""
        return restore_train_state(self.state, self.checkpointer, self.cfg, self.optimizer)

    def save(self) -> None:
        """Save iteration `state.iteration` into --save (the checkpointer logs Megatron-LM's line), unless the weights
        or optimizer state are not finite."""
        state = self.state
        self.grad_buffers.wait_for_params()  # overlapped all-gathers of the last update
        if not checkpoint_is_finite(self.model, self.optimizer):  # never write (nor point `latest` at) a NaN state
            print_rank_0(
                f"> WARNING: not saving the checkpoint of iteration {state.iteration}: weights or"
                " optimizer state are not finite; `latest` still names the previous one"
            )
            return
        train_state = {k: getattr(state, k) for k in SAVED} | {"config": self.cfg.to_dict()}
        self.checkpointer.save(self.cfg.checkpoint.save, state.iteration, train_state)
