"""Atomic, Megatron-layout checkpoints."""

from .checkpointing import (
    CheckpointError,
    check_model_state,
    latest_iteration,
    load_checkpoint,
    load_rank_file,
    model_parallel_name,
    rng_state,
    save_checkpoint,
    set_rng_state,
)

__all__ = [
    "CheckpointError",
    "check_model_state",
    "latest_iteration",
    "load_checkpoint",
    "load_rank_file",
    "model_parallel_name",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]
