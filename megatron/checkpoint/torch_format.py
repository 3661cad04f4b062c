"""`--ckpt-format torch`: the training state of every rank in Megatron-LM's legacy per-rank files
(checkpointing.py has the layout and the atomic writes). The counterpart of `DistCheckpointer`, with the same
methods, so the trainer holds one checkpointer and does not know the format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from megatron.config.pipeline_split import layer_ranges
from megatron.model.smooth_swiglu import SCALES_KEY, STARTED_LINE

from .checkpointing import (
    CheckpointError,
    _log,
    check_model_state,
    load_checkpoint,
    load_model_state,
    load_rank_file,
    model_parallel_name,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from .integrity import retention
from .model_shape import differing_flags
from .safe_load import malformed


class TorchCheckpointer:
    """Saves and loads one rank's state in the torch format; loads only under the layout that saved it (a different
    data-parallel size is fine unless the optimizer is sharded)."""

    def __init__(self, cfg: Any, dims: Any, model: nn.Module, optimizer: Any, loss_scaler: Any, fp8: Any, monitor: Any):
        self.cfg, self.dims, self.model, self.optimizer = cfg, dims, model, optimizer
        self.loss_scaler, self.fp8, self.monitor = loss_scaler, fp8, monitor
        self.shard = model_parallel_name(dims.tp_rank, dims.pp_rank, dims.pp)
        self.layout = {"tp": dims.tp, "pp": dims.pp, "dp": dims.dp, "cp": dims.cp}
        # With --use-distributed-optimizer each data-parallel (x context-parallel) rank saves its optimizer shard
        self.optimizer_file = f"optim_dp_rank_{dims.dp_cp_rank:03d}.pt" if optimizer.buffers is not None else None

    def save(self, root: str, iteration: int, train_state: dict[str, Any]) -> Path:
        optimizer_state = self.optimizer.state_dict()
        sharded = self.optimizer_file is not None
        state: dict[str, Any] = {
            "model": self.model.state_dict(),
            "optimizer": None if sharded else optimizer_state,
            "scheduler": {"num_steps": iteration},
            "rng": rng_state(),
            **train_state,
            "loss_scaler": self.loss_scaler.state_dict(),
            "fp8": self.fp8.state_dict() if self.fp8 is not None else None,
            "fp8_guard": self.monitor.state_dict() if self.monitor is not None else None,
            "layout": self.layout,
            # which global layers this rank's stage-local ones are (a virtual pipeline or an uneven split places
            # other layers on a stage of the same size: checked on load, and read by tools/checkpoint/convert.py)
            "layer_numbers": list(self.model.stage.layer_numbers),
        }
        rank_files = {self.optimizer_file: {"optimizer": optimizer_state, "dp": self.dims.dp_cp}} if sharded else {}
        return save_checkpoint(
            root,
            iteration,
            state,
            writer=self.dims.is_checkpoint_writer,
            shard=self.shard,
            layout=self.layout,
            rank_files=rank_files,
            retain=retention(self.cfg.checkpoint),
        )

    def load(self, root: str, iteration: int | None = None) -> dict[str, Any] | None:
        """Load the newest checkpoint under `root` (`iteration`: one already selected) into the model (and unless
        --finetune / --no-load-optim / --no-load-rng, the FP8 state, optimizer, loss scaler and RNG); returns its
        state, or None when there is none."""
        state = load_checkpoint(root, self.shard, self.layout, iteration=iteration)
        if state is None:
            return None
        with malformed(f"checkpoint {root} (iteration {state.get('iteration')}, {self.shard})", CheckpointError):
            return self._apply(root, state)

    def _apply(self, root: str, state: dict[str, Any]) -> dict[str, Any]:
        ckpt = self.cfg.checkpoint
        saved, ours = state.get("layer_numbers"), list(self.model.stage.layer_numbers)
        if saved is not None and saved != ours:
            raise CheckpointError(
                f"checkpoint {root} holds layers {layer_ranges(saved)} on pipeline stage {self.dims.pp_rank}, this"
                f" run places layers {layer_ranges(ours)} there (another virtual pipeline or uneven split): relaunch"
                " with the layout flags that saved it, or use --ckpt-format torch_dist, whose checkpoints load under"
                " any layout"
            )
        ours_state = self.model.state_dict()
        started = [k for k in ours_state if k.endswith(SCALES_KEY) and k not in state["model"]]
        if started:  # saved without --smooth-swiglu: the scales keep their 1
            state["model"].update({k: ours_state[k] for k in started})
            _log(f"> checkpoint {root} {STARTED_LINE}")
        check_model_state(state["model"], ours_state, root, differing_flags(state.get("config"), self.cfg))
        load_model_state(self.model, state["model"], root)
        if ckpt.finetune:
            return state
        if "converted_from" in state and not (ckpt.no_load_optim and ckpt.no_load_rng):
            raise CheckpointError(
                f"checkpoint {root} holds weights only (converted from {state['converted_from']}): add"
                " --finetune, or --no-load-optim --no-load-rng to continue from its iteration"
            )
        if self.fp8 is not None and state.get("fp8") is not None:  # first: FP8 weights are cast with its scales
            self.fp8.load_state_dict(state["fp8"])
        if ckpt.no_load_optim:
            self.optimizer.reload_model_params()
        else:
            self._load_optimizer(root, state)
            self.loss_scaler.load_state_dict(state.get("loss_scaler") or {})
        if not ckpt.no_load_rng:
            set_rng_state(state["rng"], f"checkpoint {root}")
        if self.monitor is not None and state.get("fp8_guard") is not None:
            self.monitor.load_state_dict(state["fp8_guard"])
        return state

    def _load_optimizer(self, root: str, state: dict[str, Any]) -> None:
        fix = "relaunch with the saved run's settings, or add --no-load-optim to start the optimizer afresh"
        if self.optimizer_file is not None:
            saved = load_rank_file(root, self.shard, self.optimizer_file, state["iteration"])
            if saved["dp"] != self.dims.dp_cp:
                raise CheckpointError(
                    f"checkpoint {root}: its distributed-optimizer state was saved with data-parallel size"
                    f" {saved['dp']}, this run has {self.dims.dp_cp}; {fix}"
                )
            optimizer_state = saved["optimizer"]
        else:
            optimizer_state = state["optimizer"]
            if optimizer_state is None:
                raise CheckpointError(
                    f"checkpoint {root}: its optimizer state is sharded (saved with --use-distributed-optimizer);"
                    f" add --use-distributed-optimizer with the same data-parallel size, or {fix}"
                )
        try:
            note = self.optimizer.load_state_dict(optimizer_state)
        except ValueError as exc:
            raise CheckpointError(f"checkpoint {root}: {exc}; {fix}") from exc
        if note:
            _log(f"> {note} (checkpoint {root})")

    def poll(self) -> None:
        """Nothing in the background: saves are synchronous."""

    def finalize(self) -> None:
        """Nothing in the background: saves are synchronous."""
