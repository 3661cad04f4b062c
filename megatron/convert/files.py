"""File handling shared by the converters: an output folder that appears only when complete, and reading pickled
checkpoints written by other programs (Megatron-LM) without their code installed."""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

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


class _Missing:
    """Stands in for a class of a package that is not installed here (Megatron-LM's enums in its saved args):
    keeps whatever the pickle restores, so the fields this tool reads (plain ones) are still there."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)

    def __reduce_ex__(self, protocol):  # pragma: no cover - never pickled again
        return (_Missing, ())


def _missing_class(module: str, name: str) -> type:
    return type(name, (_Missing,), {"__module__": module, "__new__": lambda cls, *a, **k: object.__new__(cls)})


class _TolerantUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            if module.split(".")[0] in ("megatron", "transformer_engine", "apex", "modelopt"):
                return _missing_class(module, name)
            raise


_pickle = types.ModuleType("tolerant_pickle")
_pickle.__dict__.update({k: getattr(pickle, k) for k in dir(pickle) if not k.startswith("__")})
_pickle.Unpickler = _TolerantUnpickler  # type: ignore[attr-defined]


def load_torch_file(path: Path, foreign: bool = False) -> dict[str, Any]:
    """torch.load on the CPU, memory-mapped (tensors are read when used). `foreign`: classes of Megatron-LM (and its
    dependencies) that are not installed here are replaced by stand-ins instead of failing."""
    if not path.exists():
        raise ConvertError(f"{path} is missing: the checkpoint is incomplete (half-written or copied in part)")
    kwargs: dict[str, Any] = {"map_location": "cpu", "weights_only": False}
    if foreign and "megatron.core" not in sys.modules:
        kwargs["pickle_module"] = _pickle
    try:
        try:
            return torch.load(path, mmap=True, **kwargs)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            return torch.load(path, **kwargs)  # the legacy (non-zip) format cannot be mapped
    except Exception as exc:  # a truncated or foreign file
        raise ConvertError(f"cannot read {path} (truncated or not a PyTorch checkpoint): {exc}") from None
