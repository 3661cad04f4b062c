"""Checkpoint conversion (tools/checkpoint/convert.py): this project's checkpoints under any layout, Hugging Face
Llama / GPT-2 and Megatron-LM checkpoints (read, and written by `mcore`), all through one whole-model form
(`FullModel`)."""

from .files import atomic_output_dir
from .hf import read_hf, write_hf
from .mcore import write_mcore
from .mlm import read_mlm
from .ours import read_ours, write_torch
from .state import ConvertError, FullModel

__all__ = [
    "ConvertError",
    "FullModel",
    "atomic_output_dir",
    "read_hf",
    "read_mlm",
    "read_ours",
    "write_hf",
    "write_mcore",
    "write_torch",
]
