"""The constructors that safe_load.py's unpicklers let a pickle call, each checking its arguments before it builds
anything: a pickle chooses the arguments, so `bytearray(3_000_000_000)` from 36 bytes, `set(range(10**12))`, or a
numpy dtype flagged as holding objects (whose raw bytes numpy then reads as pointers: a crash, or worse) must be
refused where they are asked for.

numpy objects are rebuilt from checked parts only: a dtype is one of the plain numeric ones (`DtypeSpec`, real only
once checked), an array is a `CheckedArray` (an ndarray whose `__setstate__` takes plain dtypes and raw bytes of
exactly the size its shape needs), a scalar is a plain dtype's. No object array, no structured or flagged dtype
ever exists. Real files hold only these: numpy's RNG state (a uint32 array), numpy scalars in Megatron-LM's args.
"""

from __future__ import annotations

import codecs
import collections
import math
from typing import Any

import numpy as np
import torch

from megatron.untrusted import MAX_ELEMENTS, LimitExceeded

_numpy_core = getattr(np, "_core", None) or np.core  # numpy 2 renamed numpy.core to numpy._core
_PLAIN_KINDS = "biufc"  # bool, signed and unsigned ints, floats, complex: raw bytes are their values
_MAX_DIMS = 64  # torch's and numpy's own limit on dimensions


class RefusedData(ValueError):
    """A constructor's arguments are not plain data (an object dtype, a flagged dtype, sizes that disagree)."""


def _plain_dtype(code: Any) -> np.dtype:
    if not isinstance(code, str) or len(code) > 8:
        raise RefusedData(f"a numpy dtype named {code!r:.40}, which is not a plain numeric type")
    try:
        dtype = np.dtype(code)
    except TypeError:
        raise RefusedData(f"a numpy dtype named {code!r}, which numpy does not know") from None
    if dtype.kind not in _PLAIN_KINDS or dtype.fields is not None or dtype.subdtype is not None or dtype.flags:
        raise RefusedData(f"a numpy dtype {code!r}, which is not a plain numeric type (object and structured "
                          "dtypes are never loaded)")  # fmt: skip
    return dtype


class DtypeSpec:
    """What `numpy.dtype(code, align, copy)` and its state make in a pickle: a plain dtype's code and byte order,
    checked; `dtype()` is the real (fresh) numpy dtype. The pickle's state may set nothing but the byte order."""

    def __init__(self, code: Any, align: Any = False, copy: Any = True) -> None:
        self._dtype = _plain_dtype(code)

    def __setstate__(self, state: Any) -> None:
        plain = (None, None, None, -1, -1, 0)  # subarray, names, fields, itemsize, alignment, flags of a plain dtype
        if not (isinstance(state, tuple) and len(state) in (8, 9) and state[0] in (3, 4)) or state[2:8] != plain:
            raise RefusedData(f"a numpy dtype {self._dtype.str} with the state {state!r:.80}, which is not a plain "
                              "dtype's (only its byte order may be set)")  # fmt: skip
        if state[1] not in ("<", ">", "|", "="):
            raise RefusedData(f"a numpy dtype with the byte order {state[1]!r:.20}")
        self._dtype = self._dtype.newbyteorder(state[1]) if state[1] != "|" else self._dtype

    def dtype(self) -> np.dtype:
        return np.dtype(self._dtype.str)

    def __repr__(self) -> str:
        return f"DtypeSpec({self._dtype.str!r})"


def _real_dtype(spec: Any) -> np.dtype:
    if not isinstance(spec, DtypeSpec):
        raise RefusedData(f"a numpy object whose dtype is a {type(spec).__name__}, not a numpy dtype")
    return spec.dtype()


class CheckedArray(np.ndarray):
    """An ndarray rebuilt from a pickle: `__setstate__` checks the version, shape, dtype and the raw bytes' length
    before numpy sees them. Pickled again, it is a plain ndarray."""

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) == 5 and state[0] == 1):
            raise RefusedData(f"a numpy array with the state {state!r:.80}, which is not numpy's (version 1)")
        _, shape, spec, fortran, data = state
        dtype = _real_dtype(spec)
        shape = _checked_shape(shape)
        if not isinstance(data, bytes) or not isinstance(fortran, bool):
            raise RefusedData("a numpy array whose data is not raw bytes (object arrays are never loaded)")
        if len(data) != math.prod(shape) * dtype.itemsize:
            raise RefusedData(f"a numpy array of shape {shape} {dtype} with {len(data)} bytes of data")
        np.ndarray.__setstate__(self, (1, shape, dtype, fortran, data))

    def __reduce__(self) -> Any:
        return np.asarray(self).__reduce__()


def _checked_shape(shape: Any) -> tuple[int, ...]:
    if not (isinstance(shape, tuple) and len(shape) <= _MAX_DIMS and all(type(d) is int and d >= 0 for d in shape)):
        raise RefusedData(f"a shape {shape!r:.80}, which is not a tuple of at most {_MAX_DIMS} sizes")
    return shape


def reconstruct(cls: Any, shape: Any, code: Any) -> CheckedArray:
    """numpy's `_reconstruct(ndarray, (0,), b'b')`, with which every pickled array begins: an empty CheckedArray,
    filled by its `__setstate__`."""
    if cls is not np.ndarray:
        raise RefusedData(f"numpy's _reconstruct of {getattr(cls, '__name__', type(cls).__name__)}, not ndarray")
    return np.ndarray.__new__(CheckedArray, (0,), np.uint8)


def scalar(spec: Any, data: Any) -> Any:
    """numpy's `scalar(dtype, raw bytes)`: a plain dtype's value from exactly its bytes."""
    dtype = _real_dtype(spec)
    if not isinstance(data, bytes) or len(data) != dtype.itemsize:
        raise RefusedData(f"a numpy {dtype} scalar from {type(data).__name__} {data!r:.40}")
    return np.frombuffer(data, dtype=dtype)[0]


def _count(n: int, what: str) -> int:
    if n > MAX_ELEMENTS:
        raise LimitExceeded(f"{what} of {n:,} elements, over the limit of {MAX_ELEMENTS:,}")
    return n


def _sequence(args: tuple, what: str) -> tuple:
    """A constructor's one iterable argument, when it is a container the pickle itself holds (so its size is the
    file's); a range or any lazy iterable could stand for billions of elements."""
    if len(args) > 1 or (args and not isinstance(args[0], (list, tuple, set, frozenset, dict, str, bytes))):
        raise RefusedData(f"{what} of {type(args[0]).__name__ if args else '?'}, not of a list the file holds")
    return args


def make_set(*args: Any) -> set:
    return set(*_sequence(args, "a set"))


def make_frozenset(*args: Any) -> frozenset:
    return frozenset(*_sequence(args, "a frozenset"))


def make_ordered_dict(*args: Any) -> collections.OrderedDict:
    return collections.OrderedDict(*_sequence(args, "an OrderedDict"))


def make_bytearray(*args: Any) -> bytearray:
    """`bytearray(bytes)` or, as protocol 2 pickles it, `bytearray(str, 'latin-1')`; never `bytearray(n)`."""
    if not args or (len(args) == 1 and isinstance(args[0], (bytes, bytearray))):
        return bytearray(*args)
    if len(args) == 2 and isinstance(args[0], str) and args[1] in ("latin-1", "latin1"):
        return bytearray(args[0], "latin-1")
    raise RefusedData(f"a bytearray of {type(args[0]).__name__} {args[0]!r:.40}, not of bytes the file holds")


def make_range(*args: Any) -> range:
    value = range(*args)
    _count(len(value), "a range")
    return value


def make_size(*args: Any) -> torch.Size:
    """torch.Size of a list or tuple of at most 64 ints (what torch pickles)."""
    if len(args) > 1 or (args and not isinstance(args[0], (list, tuple))) or (args and len(args[0]) > _MAX_DIMS):
        raise RefusedData(f"a torch.Size of {args!r:.60}, not of at most {_MAX_DIMS} sizes")
    return torch.Size(*args)


def encode(obj: Any, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    """`_codecs.encode(str, 'latin1')`, with which protocol 2 pickles bytes; no other codec (some compress)."""
    if not isinstance(obj, str) or encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise RefusedData(f"_codecs.encode with the codec {encoding!r:.20}")
    return codecs.encode(obj, encoding, errors)


NUMPY: dict[tuple[str, str], Any] = {
    **{(m, n): o for m in ("numpy.core.multiarray", "numpy._core.multiarray")
       for n, o in (("_reconstruct", reconstruct), ("scalar", scalar))},
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): DtypeSpec,
}  # fmt: skip
"""numpy's globals as the pickle names them, mapped to their checked stand-ins."""

TORCH_NAMED: list[Any] = [
    *[(f, f"{m}.{n}") for m in ("numpy.core.multiarray", "numpy._core.multiarray")
      for n, f in (("_reconstruct", reconstruct), ("scalar", scalar))],
    (np.ndarray, "numpy.ndarray"),
    (DtypeSpec, "numpy.dtype"),
    CheckedArray,  # torch's weights-only unpickler calls __setstate__ only of the allowed classes' instances
]  # fmt: skip
"""The same for torch's weights-only unpickler (`torch.serialization.safe_globals`)."""
