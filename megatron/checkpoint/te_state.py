"""Transformer Engine's FP8 state in checkpoints, unpickled without running foreign code.

TE keeps delayed scaling's scales and amax histories in each module's `_extra_state`: a uint8 tensor holding a
pickle of {"recipe": DelayedScaling(...), "scale_fwd": tensor, "amax_history_fwd": tensor, ..., and plain values}.
TE 2.20 and later refuse to unpickle it unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1, since a pickle can run any
code. Before a load, `verify_te_pickles` unpickles every such entry with the project's restricted unpickler
(safe_load.py), allowing what TE's FP8 state is made of: TE's recipe classes besides plain data (tensors, ordered
dicts; tensor storages through `torch.load(weights_only=True)`). An entry holding anything else stops the load with
one line naming it; when all pass, `te_pickles_allowed` lets TE unpickle them for the duration of the load.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from .safe_load import DataUnpickler, RefusedGlobal, unpickle_data

TE_UNSAFE_PICKLE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
_TE_RECIPE = "transformer_engine.common.recipe"


class _Fp8StateUnpickler(DataUnpickler):
    """Plain data and TE's recipe classes (the real ones, imported: TE unpickles them itself after the check); no
    stand-ins, as TE's own unpickling would then resolve whatever they stood for."""

    allowed = {
        (_TE_RECIPE, n): None
        for n in ("DelayedScaling", "Format", "_FormatHelper", "MMParams", "QParams", "_OverrideLinearPrecision")
    }


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
            unpickle_data(value.detach().cpu().numpy().tobytes(), _Fp8StateUnpickler)
        except RefusedGlobal as exc:
            raise UnsafeTePickle(f"{key} holds {exc}") from exc
        except Exception as exc:  # bytes that are no pickle at all
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
