"""Transformer Engine's FP8 state in checkpoints, unpickled without running foreign code.

TE keeps delayed scaling's scales and amax histories in each module's `_extra_state`: a uint8 tensor holding a
pickle of {"recipe": DelayedScaling(...), "scale_fwd": tensor, "amax_history_fwd": tensor, ..., and plain values}.
TE 2.20 and later refuse to unpickle it unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1, since a pickle can run any
code. Before a load, `verify_te_pickles` unpickles every such entry with an unpickler that knows only what TE's FP8
state is made of (TE's recipe classes, tensors, ordered dicts; tensor storages through `torch.load(weights_only=
True)`). An entry holding anything else stops the load with one line naming it; when all pass, `te_pickles_allowed`
lets TE unpickle them for the duration of the load.
"""

from __future__ import annotations

import contextlib
import enum
import io
import os
import pickle
from collections.abc import Iterator
from typing import Any

import torch

TE_UNSAFE_PICKLE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
_TE_RECIPE = "transformer_engine.common.recipe"
_ALLOWED = {
    ("torch._utils", "_rebuild_tensor_v2"),
    ("collections", "OrderedDict"),
    *((_TE_RECIPE, name) for name in ("DelayedScaling", "Format", "_FormatHelper", "MMParams", "QParams")),
}


def _storage_from_bytes(data: bytes) -> Any:
    """The tensor storages inside the pickle are `torch.save` bytes; read them as weights only."""
    return torch.load(io.BytesIO(data), weights_only=True)


def _enum_member(cls: Any, name: str) -> Any:
    """Stands in for `getattr`, which some Python versions pickle enum members with: an allowed enum's member only
    (a general getattr would reach any function's globals)."""
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
        raise pickle.UnpicklingError(f"getattr on {cls!r}")
    return cls[name]


class _Fp8StateUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _storage_from_bytes
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name}")
        return super().find_class(module, name)


class UnsafeTePickle(ValueError):
    """A checkpoint's `_extra_state` pickle holds something other than Transformer Engine's FP8 state."""


def verify_te_pickles(state: dict[str, Any]) -> list[str]:
    """The `_extra_state` entries of `state` that hold a pickle (TE's delayed-scaling state), each unpickled with the
    restricted unpickler. Raises UnsafeTePickle naming the entry and the first thing it is not allowed to hold."""
    pickled = []
    for key, value in state.items():
        if not (key.endswith("_extra_state") and isinstance(value, torch.Tensor) and value.numel()):
            continue  # empty (stateless recipes, bf16 layers) or not TE's byte tensor: TE handles it
        try:
            _Fp8StateUnpickler(io.BytesIO(value.detach().cpu().numpy().tobytes())).load()
        except Exception as exc:  # a foreign global, or bytes that are no pickle at all
            raise UnsafeTePickle(f"{key} holds {type(exc).__name__}: {exc}") from exc
        pickled.append(key)
    return pickled


@contextlib.contextmanager
def te_pickles_allowed(allow: bool) -> Iterator[None]:
    """TE's opt-in to unpickling its extra state, set around a load whose pickles `verify_te_pickles` passed (and
    restored afterwards: it is process-wide)."""
    before = os.environ.get(TE_UNSAFE_PICKLE_ENV)
    if allow:
        os.environ[TE_UNSAFE_PICKLE_ENV] = "1"
    try:
        yield
    finally:
        if allow:
            if before is None:
                del os.environ[TE_UNSAFE_PICKLE_ENV]
            else:
                os.environ[TE_UNSAFE_PICKLE_ENV] = before
