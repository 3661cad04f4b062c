"""Atomic, Megatron-layout checkpoints."""

from .checkpointer import Checkpointer, folder_format
from .checkpointing import (
    CheckpointError,
    check_model_state,
    latest_iteration,
    load_checkpoint,
    load_rank_file,
    model_parallel_name,
    publish_checkpoint,
    rng_state,
    save_checkpoint,
    select_checkpoint,
    set_rng_state,
)
from .dist import DistCheckpointer
from .integrity import checkpoint_is_finite
from .torch_format import TorchCheckpointer

__all__ = [
    "Checkpointer",
    "CheckpointError",
    "DistCheckpointer",
    "check_model_state",
    "checkpoint_is_finite",
    "folder_format",
    "latest_iteration",
    "load_checkpoint",
    "load_rank_file",
    "model_parallel_name",
    "publish_checkpoint",
    "rng_state",
    "save_checkpoint",
    "select_checkpoint",
    "set_rng_state",
    "TorchCheckpointer",
]
