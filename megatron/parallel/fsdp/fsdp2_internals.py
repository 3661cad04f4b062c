"""The one module that touches PyTorch FSDP2's private state (torch 2.11 to 2.13); every other module asks it.

FSDP2's public surface (`fully_shard`, `FSDPModule`'s methods, a tensor subclass's `fsdp_pre_all_gather` and
`fsdp_post_all_gather`) covers sharding and FP8 all-gather bytes. What the FP8 all-gather of sharded weights needs
beyond it lives on FSDP2's private records:

* a unit's parameter group (`FSDPParamGroup`, one per unit) and its parameter records (`FSDPParam`): the sharded
  local tensor (the project's FP8 shard wrapper), the module holding the parameter, the padded shard storage;
* the group's training state and its resharding after the forward, which tell a gather for the backward from one for
  the forward (rowwise and mxfp8 gather a different cast for each);
* a record's gathered outputs, forgotten when a weight's gather dtype changes (FSDP2 refills them in place otherwise);
* the root's lazy initialization, run early (`share_padded_storage`);
* the `ReduceScatter` protocol of a custom reduce-scatter (FP8 gradient reduction).

`missing_internals(unit)` lists every private attribute read here that an FSDP unit lacks
(tests/distributed/test_fsdp2_internals.py fails naming them when torch changes them).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # a torch without FSDP2's custom collectives: `fp8_reduce_scatter.py` says which one is needed
    ReduceScatter = None

# What is read, by the private object that holds it
STATE_ATTRIBUTES = ("_fsdp_param_group", "_lazy_init")
GROUP_ATTRIBUTES = ("fsdp_params", "_training_state", "_reshard_after_forward", "is_unsharded")
PARAM_ATTRIBUTES = ("_sharded_local_tensor", "_module_info", "_sharded_param_data", "_unsharded_inner_tensors")


def param_group(unit: FSDPModule) -> Any | None:
    """The unit's `FSDPParamGroup` (None for a unit that holds no parameters of its own)."""
    return unit._get_fsdp_state()._fsdp_param_group


def units(model: nn.Module) -> Iterator[FSDPModule]:
    """Each FSDP unit of `model` once (a unit of several modules shares one state), with its parameter group."""
    seen = set()
    for module in model.modules():
        if isinstance(module, FSDPModule) and id(state := module._get_fsdp_state()) not in seen:
            seen.add(id(state))
            yield module


def unit_params(unit: FSDPModule) -> list[Any]:
    """The unit's parameter records (`FSDPParam`), in its group's order."""
    group = param_group(unit)
    return list(group.fsdp_params) if group is not None else []


def sharded_local_tensor(param: Any) -> torch.Tensor:
    """The local shard FSDP2 holds for a parameter record: the tensor (subclass) its all-gather hooks are called on."""
    return param._sharded_local_tensor


def module_of(param: Any) -> nn.Module:
    """The module whose attribute the parameter is."""
    return param._module_info.module


def padded_shard(param: Any) -> torch.Tensor:
    """The storage FSDP2 keeps the local shard in, padded to ceil(rows / ranks) rows."""
    return param._sharded_param_data


def set_padded_shard(param: Any, data: torch.Tensor) -> None:
    param._sharded_param_data = data


def gathered_outputs(param: Any) -> list[torch.Tensor]:
    """The all-gather outputs FSDP2 allocated for the parameter (none before its first gather)."""
    return list(getattr(param, "all_gather_outputs", []))


def unsharded_param(param: Any) -> torch.Tensor | None:
    """The gathered parameter FSDP2 built at the first all-gather (None before)."""
    return getattr(param, "_unsharded_param", None)


def forget_gathered(param: Any) -> None:
    """Drop the gathered outputs and the unsharded parameter, so that the next all-gather allocates and builds anew
    (`fsdp_post_all_gather` called without `out=`)."""
    param.all_gather_outputs, param._unsharded_inner_tensors = [], []
    if hasattr(param, "_unsharded_param"):
        del param._unsharded_param


def lazy_init(root: FSDPModule) -> None:
    """FSDP2's root initialization, which its first forward would run (idempotent)."""
    root._get_fsdp_state()._lazy_init()


def training_phase(group: Any) -> str | None:
    """The group's training state by name (IDLE, FORWARD, PRE_BACKWARD, ...; None where torch has none)."""
    return getattr(getattr(group, "_training_state", None), "name", None)


def reshards_after_forward(group: Any) -> bool | None:
    """Whether the group frees its gathered weights after the forward (None where torch records it otherwise)."""
    value = getattr(group, "_reshard_after_forward", None)
    return value if isinstance(value, bool) else None


def is_unsharded(group: Any) -> bool:
    """Whether the group's weights are gathered now."""
    return group.is_unsharded


def missing_internals(unit: FSDPModule) -> list[str]:
    """The private attributes read here that `unit` (an FSDP unit holding parameters, after its root's lazy
    initialization) lacks, each as `Owner.attribute`; empty on the torch versions this module is written for."""
    missing = [f"FSDPModule.{name}" for name in ("_get_fsdp_state",) if not hasattr(unit, name)]
    if missing:
        return missing
    state = unit._get_fsdp_state()
    missing += [f"FSDPState.{name}" for name in STATE_ATTRIBUTES if not hasattr(state, name)]
    group = getattr(state, "_fsdp_param_group", None)
    if group is None:
        return missing + ["FSDPState._fsdp_param_group (None on a unit holding parameters)"]
    missing += [f"FSDPParamGroup.{name}" for name in GROUP_ATTRIBUTES if not hasattr(group, name)]
    if training_phase(group) is None:
        missing.append("FSDPParamGroup._training_state.name")
    if reshards_after_forward(group) is None:
        missing.append("FSDPParamGroup._reshard_after_forward (a bool)")
    for param in getattr(group, "fsdp_params", [])[:1]:
        missing += [f"FSDPParam.{name}" for name in PARAM_ATTRIBUTES if not hasattr(param, name)]
        if not hasattr(getattr(param, "_module_info", None), "module"):
            missing.append("FSDPParam._module_info.module")
    if ReduceScatter is None:
        missing.append("torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter")
    return missing
