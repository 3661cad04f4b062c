"""A checkpoint is data, never code: every pickle this project reads goes through this module.

A pickle can name any importable callable and call it while loading (`__reduce__`), so a checkpoint handed over by
someone else could run a command. Three ways in, one allowlist:

- This project's own files (model_optim_rng.pt, the distributed optimizer's rank files, DCP bytes entries) load with
  `torch.load(weights_only=True)`: tensors and plain containers, plus `OWN_GLOBALS` (numpy's RNG-state array, which
  checkpoints written before this module hold, rebuilt from checked parts by plain_data.py; new ones store it as a
  list).
- Files of other programs (Megatron-LM's model_optim_rng.pt / common.pt, Hugging Face's pytorch_model.bin) and
  DCP's `.metadata` index go through `DataUnpickler`: tensors, plain containers, a fixed list of data classes
  (`PLAIN`), and, for classes of Megatron-LM and its dependencies, stand-ins that only keep the data the pickle
  gives them (no code of theirs is imported or run). Every other global is refused.
- Transformer Engine's `_extra_state` pickles are checked with `DataUnpickler` allowing TE's recipe classes, before
  TE is let to unpickle them itself (te_state.py).

Whatever a pickle may call checks its arguments before it allocates (plain_data.py: no numpy object array or
flagged dtype ever exists), and what a pickle unpickles to is bounded in depth and in what its shared references
expand to (megatron/untrusted.py). A refusal is one line naming the file and the class or the limit.
`--trust-checkpoint` (pretrain_gpt.py, tools/checkpoint/convert.py) or MEGATRON_TRUST_CHECKPOINT=1 loads files the
user trusts the old way (any class; docs/checkpoints.md).
"""

from __future__ import annotations

import _compat_pickle
import argparse
import contextlib
import enum
import io
import os
import pathlib
import pickle
import re
import signal
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch._utils
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException

from megatron.errors import UserError
from megatron.untrusted import LimitExceeded, check_expansion, check_size

from . import plain_data

TRUST_ENV = "MEGATRON_TRUST_CHECKPOINT"
TRUST_FLAG = "--trust-checkpoint"
_HOW_TO_TRUST = f"if you trust the file, rerun with {TRUST_FLAG} (or {TRUST_ENV}=1)"

# Packages whose classes appear in Megatron-LM's checkpoints (its args, enums, dataclasses, rerun-state objects):
# rebuilt as stand-ins, never imported. This project's own package has the same name: its classes are never
# pickled (its own files hold plain data), so a `megatron.*` name in a pickle is always treated as foreign data.
FOREIGN_PACKAGES = ("megatron", "transformer_engine", "apex", "modelopt", "nvidia_resiliency_ext")

OWN_GLOBALS: list[Any] = [
    *plain_data.TORCH_NAMED,  # numpy's RNG-state array, rebuilt from checked parts
    io.BytesIO,  # Transformer Engine 1.x's `_extra_state`
]


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle names a global outside the allowlist; the message is `module.name`."""


def trusted() -> bool:
    """Whether the user opted in to loading checkpoints the old way (any class, code included)."""
    return os.environ.get(TRUST_ENV, "") == "1"


def trust_checkpoints(trust: bool) -> None:
    """--trust-checkpoint given: this process loads checkpoints the old way from now on (MEGATRON_TRUST_CHECKPOINT=1;
    every rank of a torchrun job parses its own flags, so all see it)."""
    if trust:
        os.environ[TRUST_ENV] = "1"


def first_line(exc: BaseException) -> str:
    """The first line of an error's message; of DCP's per-rank failure report, the first failure's."""
    failures = getattr(exc, "failures", None) or getattr(exc, "_failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = getattr(inner, "exc", inner)
        if isinstance(inner, tuple):  # (exception, traceback) in some torch versions
            inner = next((x for x in inner if isinstance(x, BaseException)), None)
        if isinstance(inner, BaseException):
            return first_line(inner)
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _refused(what: str, name: str) -> str:
    return f"{what} is not loaded: it holds {name}, which is not plain data (a checkpoint is data, never code); " + (
        _HOW_TO_TRUST
    )


_TORCH_REFUSAL = re.compile(r"GLOBAL ([\w.]+)|but got <class '([\w.]+)'>")
_TORCH_BOILERPLATE = ("Weights only load failed", "In PyTorch 2.6", "Please file an issue", "Check the documentation")


def _torch_reason(exc: BaseException) -> str:
    """The line of torch's weights-only error that says what is wrong (its others are advice)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    useful = [ln for ln in lines if not ln.startswith(_TORCH_BOILERPLATE)]
    return (useful or lines or [type(exc).__name__])[0].removeprefix("WeightsUnpickler error: ")


def _canonical(name: str) -> str:
    """torch's name for a refused global as `module.name` of today (it drops `builtins.`, keeps Python 2 names)."""
    module, _, attr = name.rpartition(".")
    module, attr = _compat_pickle.NAME_MAPPING.get((module, attr), (module, attr))
    return f"{_compat_pickle.IMPORT_MAPPING.get(module, module) or 'builtins'}.{attr}"


def load_own(source: Any, what: str, error: type[Exception] = UserError, mmap: bool = False) -> Any:
    """`torch.load` of a file (or buffer) this project wrote, weights only. Raises `error` (one line naming `what`)
    when it holds anything else, goes past a limit (megatron/untrusted.py) or cannot be read."""
    try:
        if trusted():
            return torch.load(source, map_location="cpu", weights_only=False)
        with torch.serialization.safe_globals(OWN_GLOBALS):
            loaded = torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
        check_expansion(loaded, "it")
        return loaded
    except (plain_data.RefusedData, LimitExceeded) as exc:
        raise error(_not_plain(what, exc)) from None
    except pickle.UnpicklingError as exc:
        found = _TORCH_REFUSAL.search(str(exc))
        if found:
            raise error(_refused(what, _canonical(found.group(1) or found.group(2)))) from None
        raise error(f"cannot read {what} (truncated, or not a PyTorch file): {_torch_reason(exc)}") from None
    except Exception as exc:  # a truncated zip, bytes that are no pickle, a missing storage record
        raise error(f"cannot read {what} (truncated, or not a PyTorch file): {_torch_reason(exc)}") from None


def _not_plain(what: str, exc: Exception) -> str:
    """The refusal of a pickle whose data is not plain (plain_data.py) or too large (megatron/untrusted.py)."""
    text = first_line(exc)
    return f"{what} is not loaded: {text if text.startswith('it ') else 'it holds ' + text}"


class StandIn:
    """An object of a class that is not loaded (Megatron-LM's Namespace enums, dataclasses, rerun state): it keeps
    the arguments and attributes the pickle gives it, so plain fields stay readable, and runs nothing."""

    def __new__(cls, *args: Any, **kwargs: Any) -> StandIn:
        obj = object.__new__(cls)
        obj.__dict__["args"] = args
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots) of a class with __slots__
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update({str(k): v for k, v in state.items()})

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(f"{type(self).__module__}.{type(self).__name__} is a stand-in and is not pickled again")


_STAND_INS: dict[tuple[str, str], type] = {}


def stand_in(module: str, name: str) -> type:
    """The stand-in class for `module.name` (one per name, so enum members compare equal)."""
    key = (module, name)
    if key not in _STAND_INS:
        _STAND_INS[key] = type(name, (StandIn,), {"__module__": module, "__qualname__": name})
    return _STAND_INS[key]


def _storage_from_bytes(data: bytes) -> Any:
    """Tensor storages inside a pickle made by plain `pickle.dumps` are `torch.save` bytes: read as weights only."""
    return torch.load(io.BytesIO(data), weights_only=True)


def _member(owner: Any, name: str) -> Any:
    """Stands in for `getattr`, with which some Python versions pickle enum members: an allowed enum's member, or
    a stand-in's (a general getattr would reach any function's globals)."""
    if isinstance(owner, type) and issubclass(owner, enum.Enum) and isinstance(name, str) and name in owner.__members__:
        return owner[name]
    if isinstance(owner, type) and issubclass(owner, StandIn) and isinstance(name, str):
        return owner(name)
    raise RefusedGlobal(f"builtins.getattr on {getattr(owner, '__name__', type(owner).__name__)}")


def _named(*objects: Any) -> dict[tuple[str, str], Any]:
    return {(o.__module__, o.__name__): o for o in objects}


PLAIN: dict[tuple[str, str], Any] = {
    **_named(argparse.Namespace, slice, complex),
    ("builtins", "set"): plain_data.make_set,  # these check their arguments before they allocate (plain_data.py)
    ("builtins", "frozenset"): plain_data.make_frozenset,
    ("builtins", "bytearray"): plain_data.make_bytearray,
    ("builtins", "range"): plain_data.make_range,
    ("collections", "OrderedDict"): plain_data.make_ordered_dict,
    ("torch", "Size"): plain_data.make_size,
    ("_codecs", "encode"): plain_data.encode,
    **_named(torch._utils._rebuild_tensor_v2, torch._utils._rebuild_parameter),
    **{("torch._utils", n): getattr(torch._utils, n) for n in ("_rebuild_parameter_with_state",)},
    ("_io", "BytesIO"): io.BytesIO,
    ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
    ("builtins", "getattr"): _member,
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,  # DCP's .metadata keeps its folder's path
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    **plain_data.NUMPY,  # never an object array nor an object-flagged dtype
    ("signal", "Signals"): signal.Signals,  # an enum: Megatron-LM's args.exit_signal (SIGTERM)
}  # fmt: skip
"""Globals any pickle may name: constructors of plain data that run no code of the pickle's choosing."""

DCP_INDEX: dict[tuple[str, str], Any] = {
    ("torch.distributed.checkpoint.metadata", n): getattr(dcp_metadata, n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo}
"""DCP's index classes (dataclasses and an enum): what a `.metadata` file is made of."""


def _torch_constant(name: str) -> Any:
    """torch.float32, torch.strided, torch.contiguous_format, ...: constants, not callables."""
    value = getattr(torch, name, None)
    return value if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)) else None


class DataUnpickler(pickle.Unpickler):
    """Rebuilds plain data only (`PLAIN` and the class's `allowed`); with `stand_ins`, classes of Megatron-LM and
    its dependencies become `StandIn`s. Anything else raises RefusedGlobal naming it, unless the user trusts the
    file (`trusted()`: then any class resolves, and stand-ins replace only what is not installed)."""

    allowed: dict[tuple[str, str], Any] = {}
    stand_ins = False

    def load(self) -> Any:
        loaded = super().load()
        check_expansion(loaded, "it")  # before anyone walks or prints it
        return loaded

    def find_class(self, module: str, name: str) -> Any:
        # Python 2 names, which protocol-2 pickles (torch.save's) carry for some modules: mapped as pickle's own
        # find_class maps them, so the allowlist and the refusals speak of today's names
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        key = (module, name)
        if key in PLAIN:
            return PLAIN[key]
        if key in self.allowed:
            return self.allowed[key] if self.allowed[key] is not None else super().find_class(module, name)
        if module == "torch" and _torch_constant(name) is not None:
            return _torch_constant(name)
        foreign = self.stand_ins and module.split(".")[0] in FOREIGN_PACKAGES
        if trusted():
            try:
                return super().find_class(module, name)
            except (ImportError, AttributeError):
                if not foreign:
                    raise
        if foreign:
            return stand_in(module, name)
        raise RefusedGlobal(f"{module}.{name}")


class ForeignUnpickler(DataUnpickler):
    """Megatron-LM's and Hugging Face's files: plain data, with stand-ins for Megatron-LM's classes."""

    stand_ins = True


class DcpIndexUnpickler(ForeignUnpickler):
    """DCP's `.metadata` (ours or Megatron-LM's, whose planner data may hold its own classes)."""

    allowed = DCP_INDEX


def _pickle_module(unpickler: type[pickle.Unpickler]) -> types.ModuleType:
    """A stand-in for the `pickle` module that torch.load unpickles with (`pickle_module=`)."""
    module = types.ModuleType(f"restricted_pickle_{unpickler.__name__}")
    module.__dict__.update({k: getattr(pickle, k) for k in dir(pickle) if not k.startswith("__")})
    module.Unpickler = unpickler  # type: ignore[attr-defined]
    module.load = lambda file, **kw: unpickler(file, **kw).load()  # type: ignore[attr-defined]
    module.loads = lambda data, **kw: unpickler(io.BytesIO(data), **kw).load()  # type: ignore[attr-defined]
    return module


_FOREIGN_PICKLE = _pickle_module(ForeignUnpickler)


def load_foreign(path: os.PathLike | str | io.BytesIO, what: str, error: type[Exception] = UserError) -> Any:
    """`torch.load` (memory-mapped where the format allows) of another program's file (or a buffer: a DCP bytes
    entry of Megatron-LM's) through `ForeignUnpickler`. Raises `error` (one line naming `what`) on a refused class
    or an unreadable file."""
    kwargs: dict[str, Any] = {"map_location": "cpu", "weights_only": False, "pickle_module": _FOREIGN_PICKLE}
    try:
        if isinstance(path, io.BytesIO):
            return torch.load(path, **kwargs)
        try:
            return torch.load(path, mmap=True, **kwargs)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            return torch.load(path, **kwargs)  # the legacy (non-zip) format cannot be mapped
    except RefusedGlobal as exc:
        raise error(_refused(what, str(exc))) from None
    except (plain_data.RefusedData, LimitExceeded) as exc:
        raise error(_not_plain(what, exc)) from None
    except Exception as exc:  # a truncated or foreign file
        raise error(f"cannot read {what} (truncated, or not a PyTorch file): {first_line(exc)}") from None


def unpickle_data(data: bytes, unpickler: type[pickle.Unpickler] = ForeignUnpickler) -> Any:
    """Unpickle `data` with a restricted unpickler; raises RefusedGlobal or the unpickler's own error."""
    return unpickler(io.BytesIO(data)).load()


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader, reading the `.metadata` index (a pickle, which DCP unpickles unrestricted) with
    `DcpIndexUnpickler`. Errors stay DCP's (callers turn them into one line naming the folder)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            check_size(path, MAX_INDEX_BYTES)
            with self.fs.create_stream(path, "rb") as file:
                metadata = DcpIndexUnpickler(file).load()
        except RefusedGlobal as exc:
            raise RefusedGlobal(_refused(str(path), str(exc))) from None
        except (plain_data.RefusedData, LimitExceeded) as exc:
            raise ValueError(_not_plain(str(path), exc)) from None
        entries = getattr(metadata, "state_dict_metadata", None)
        if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(entries, dict):
            raise ValueError(f"{path} holds a {type(metadata).__name__}, not DCP's index")
        if not all(isinstance(k, str) and _is_entry(v) for k, v in entries.items()):
            raise ValueError(f"{path} is damaged: its entries are not DCP's tensor and bytes records")
        storage = getattr(metadata, "storage_data", None)
        if not (isinstance(storage, dict) and all(_is_storage(k, v) for k, v in storage.items())):
            raise ValueError(f"{path} is damaged: its storage records are not DCP's (file, offset, length)")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


MAX_INDEX_BYTES = 1 << 32
"""4 GiB: DCP's `.metadata` lists a record per tensor chunk; a 1T-parameter model's index on thousands of ranks is
a few hundred MB."""


def _is_size(value: Any, dims: int | None = None) -> bool:
    return (
        isinstance(value, torch.Size)
        and (dims is None or len(value) == dims)
        and all(type(d) is int and d >= 0 for d in value)
    )


def _is_entry(entry: Any) -> bool:
    """A tensor record (sizes, dtype and chunks that agree) or a bytes record: what DCP's planner then reads
    without checking."""
    if type(entry) is dcp_metadata.BytesStorageMetadata:
        return True
    if type(entry) is not dcp_metadata.TensorStorageMetadata or not _is_size(entry.size):
        return False
    props, chunks = entry.properties, entry.chunks
    return (
        type(props) is dcp_metadata.TensorProperties
        and isinstance(props.dtype, torch.dtype)
        and isinstance(chunks, list)
        and all(
            type(c) is dcp_metadata.ChunkStorageMetadata
            and _is_size(c.offsets, len(entry.size))
            and _is_size(c.sizes, len(entry.size))
            for c in chunks
        )
    )


def _is_storage(index: Any, info: Any) -> bool:
    return (
        type(index) is dcp_metadata.MetadataIndex
        and isinstance(index.fqn, str)
        and type(info) is dcp_filesystem._StorageInfo
        and isinstance(info.relative_path, str)
        and all(type(n) is int and n >= 0 for n in (info.offset, info.length))
    )


def load_bytes_entry(value: io.BytesIO, fqn: str, folder: Any) -> Any:
    """A DCP bytes entry (`torch.save` of an object) of a checkpoint folder, weights only."""
    return load_own(value, f"entry {fqn} of {folder}")


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner for a flat state dict, reading bytes entries weights only (DCP's own unpickles
    them unrestricted); `foreign`: another program's (Megatron-LM's), through `ForeignUnpickler`."""

    def __init__(self, folder: Any, foreign: bool = False):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.folder, self.foreign = folder, foreign

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        if self.foreign:
            self.state_dict[fqn] = load_foreign(value, f"entry {fqn} of {self.folder}")
        else:
            self.state_dict[fqn] = load_bytes_entry(value, fqn, self.folder)


@contextlib.contextmanager
def malformed(source: str, error: type[Exception] = UserError) -> Iterator[None]:
    """Errors raised while using what a file holds (a key it lacks, a value of another type, a size no memory
    holds) become one line naming `source`: the file is malformed. The project's own one-line errors pass."""
    try:
        yield
    except (UserError, torch.OutOfMemoryError, torch.distributed.DistError):  # ours, or no fault of the file
        raise
    except (RefusedGlobal, CheckpointException) as exc:  # DCP's failure report derives from BaseException
        raise error(f"{source}: {first_line(exc)}") from None
    except (LookupError, TypeError, AttributeError, ValueError, RuntimeError, ArithmeticError, MemoryError) as exc:
        raise error(
            f"{source} is malformed ({type(exc).__name__}: {first_line(exc)[:200]}): restore it, or check that it is"
            " what the flags say it is"
        ) from None
    except OSError as exc:
        raise error(f"{source} cannot be read: {first_line(exc)}") from None
