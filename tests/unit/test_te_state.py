"""megatron/model/te_state.py on a CPU: stand-ins for Transformer Engine 2.20's modules, placed in `sys.modules` under
TE's names, keep a process group where TE keeps it (quantization.py's FP8GlobalStateManager.quantization_state
.autocast_arguments, dot_product_attention.py's _attention_backends["attention_params"].fp8_meta, distributed.py's
lru-cached get_distributed_world_size). Without `release_te_state` as an exit part `Shutdown.close` names the
groups and TE's structures holding them; with it the groups go. A run that never loaded TE imports nothing."""

from __future__ import annotations

import functools
import importlib.abc
import sys
import types
import weakref
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch.distributed as dist

from megatron.model.te_state import ATTENTION, DISTRIBUTED, QUANTIZATION, release_te_state
from megatron.training.shutdown import Shutdown


@dataclass(slots=True)
class FP8GlobalState:  # TE 2.20.2 quantization.py:389 (the fields that matter here)
    fp8_distributed_group: Any = None
    global_amax_buffer: dict[str, list] = field(default_factory=dict)
    autocast_arguments: dict[Any, tuple[Any, Any]] = field(default_factory=dict)


class FP8GlobalStateManager:  # quantization.py:415
    quantization_state = FP8GlobalState()

    @classmethod
    def reset(cls) -> None:
        cls.quantization_state = FP8GlobalState()

    @classmethod
    def autocast_enter(cls, recipe: Any, group: Any) -> None:  # quantization.py:730, what te.autocast keeps
        cls.quantization_state.autocast_arguments[f"recipe={recipe},group={id(group)}"] = (recipe, group)


@dataclass(eq=True)
class AttentionParams:  # attention/dot_product_attention/utils.py:201
    fp8_meta: dict[str, Any] | None = None


@functools.lru_cache
def get_distributed_world_size(group: Any = None) -> int:  # distributed.py:166
    return dist.get_world_size(group)


@pytest.fixture
def te_stand_ins(monkeypatch):
    quantization = types.ModuleType(QUANTIZATION)
    quantization.FP8GlobalStateManager = FP8GlobalStateManager
    attention = types.ModuleType(ATTENTION)
    attention._attention_backends = {"attention_params": None, "backend_selection_requires_update": False}
    attention._thd_policy_backend_cache = []
    distributed = types.ModuleType(DISTRIBUTED)
    distributed.get_distributed_world_size = get_distributed_world_size
    for module in (quantization, attention, distributed):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    FP8GlobalStateManager.reset()
    get_distributed_world_size.cache_clear()
    yield attention
    FP8GlobalStateManager.reset()
    get_distributed_world_size.cache_clear()


def _run_that_leaves_groups_in_te(attention: types.ModuleType, release: bool) -> tuple[list[str], list[weakref.ref]]:
    """A run's groups as a TE run leaves them: the amax group in the FP8 state and the attention backends' cache,
    the tensor-parallel group in the world-size cache. Returns the shutdown's log and the groups' weak references."""
    lines: list[str] = []
    shutdown = Shutdown(log=lines.append)
    shutdown.own_process_groups({"world": dist.group.WORLD}, timeout_minutes=1)
    amax, tp = dist.new_group([0]), dist.new_group([0])
    shutdown.watch({"amax_group": amax, "tp_group": tp})
    if release:
        shutdown.add_at_exit("Transformer Engine's global state", release_te_state)
    FP8GlobalStateManager.autocast_enter("DelayedScaling()", amax)
    attention._attention_backends["attention_params"] = AttentionParams({"fp8_group": amax})
    get_distributed_world_size(tp)
    watched = [weakref.ref(amax), weakref.ref(tp)]
    del amax, tp
    shutdown.close()
    return lines, watched


def test_without_the_exit_part_the_warning_names_the_groups_and_te_s_structures(te_stand_ins, one_rank_world):
    lines, watched = _run_that_leaves_groups_in_te(te_stand_ins, release=False)
    assert all(ref() is not None for ref in watched)
    assert len(lines) == 1, lines
    assert "2 process group(s) still referenced after their release" in lines[0]
    amax, tp = lines[0].split(" at exit: ")[1].split("; ")
    assert amax.startswith("amax_group (ranks 0) held by ")
    assert "FP8GlobalState.autocast_arguments" in amax or "AttentionParams.fp8_meta" in amax, amax
    assert tp.startswith("tp_group (ranks 0) held by ")
    assert "get_distributed_world_size" in tp or "lru_cache" in tp, tp


def test_the_exit_part_releases_what_te_keeps(te_stand_ins, one_rank_world):
    lines, watched = _run_that_leaves_groups_in_te(te_stand_ins, release=True)
    assert lines == []
    assert all(ref() is None for ref in watched)
    assert FP8GlobalStateManager.quantization_state.autocast_arguments == {}
    assert te_stand_ins._attention_backends == {"attention_params": None, "backend_selection_requires_update": True}
    assert get_distributed_world_size.cache_info().currsize == 0


class _NoTransformerEngine(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        if name.split(".")[0] == "transformer_engine":
            raise AssertionError(f"imported {name}")
        return None


def test_without_te_loaded_nothing_is_imported_or_released(monkeypatch):
    for name in [n for n in sys.modules if n.split(".")[0] == "transformer_engine"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_NoTransformerEngine(), *sys.meta_path])
    assert release_te_state() == []
    assert not any(n.split(".")[0] == "transformer_engine" for n in sys.modules)
