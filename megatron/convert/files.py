"""File handling shared by the converters: an output folder that appears only when complete, and reading pickled
checkpoints (this project's, and Megatron-LM's without its code installed) as data only."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megatron.checkpoint.safe_load import load_foreign, load_own

from .state import ConvertError


def partial_dir(target: Path) -> Path:
    """Where a conversion into `target` writes until it is complete: a hidden sibling (same file system, so the
    final rename is atomic)."""
    return target.parent / f".{target.name}.partial"


@contextlib.contextmanager
def atomic_output_dir(target: str | os.PathLike, log=print) -> Iterator[Path]:
    """Yield a temporary folder next to `target`; when the block completes it is flushed and renamed to `target`,
    when it fails it is removed. An existing non-empty `target` is refused (the tool never overwrites), and the
    remains of an interrupted earlier conversion into `target` are cleared first."""
    target = Path(target).absolute()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConvertError(f"{target} already exists and is not empty: remove it or choose another --save-dir")
    tmp = partial_dir(target)
    if tmp.exists():
        log(f"> removing {tmp}, left by an interrupted conversion")
        shutil.rmtree(tmp)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    try:
        yield tmp
        for file in tmp.rglob("*"):
            if file.is_file():
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
        if target.exists():
            target.rmdir()
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_torch_file(path: Path, foreign: bool = False) -> dict[str, Any]:
    """torch.load on the CPU, memory-mapped (tensors are read when used), never running code from the file
    (megatron/checkpoint/safe_load.py): this project's files weights only; `foreign` ones (Megatron-LM's) through
    the restricted unpickler, with stand-ins for its classes, which need not be installed here."""
    if not path.exists():
        raise ConvertError(f"{path} is missing: the checkpoint is incomplete (half-written or copied in part)")
    state = load_foreign(path, str(path), ConvertError) if foreign else load_own(path, str(path), ConvertError, True)
    if not isinstance(state, dict):
        raise ConvertError(f"{path} holds a {type(state).__name__}, not a checkpoint's dict: restore the file")
    return state
