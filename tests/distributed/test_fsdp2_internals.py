"""FSDP2's private state that megatron/parallel/fsdp/fsdp2_internals.py reads, on the installed torch: a torch that
renames or drops any of it fails here, naming each attribute, before a training run reaches it."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from megatron.parallel.fsdp import fsdp2_internals as internals
from tests.dist_utils import run_distributed


def _body(rank, world_size):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    internals.lazy_init(model)
    unit = model[0]
    assert not internals.missing_internals(unit), (
        f"torch {torch.__version__} changed FSDP2's private state that fsdp2_internals.py reads:"
        f" {', '.join(internals.missing_internals(unit))}"
    )
    # the records read what they claim: the unit's own weights, their modules and shards
    params = internals.unit_params(unit)
    assert [internals.module_of(p) for p in params] == [unit, unit]
    assert [internals.sharded_local_tensor(p).shape for p in params] == [(4, 8), (4,)]
    assert internals.padded_shard(params[0]).numel() == 32
    assert len(list(internals.units(model))) == 2
    group = internals.param_group(unit)
    assert internals.training_phase(group) == "IDLE" and internals.reshards_after_forward(group) is True
    model(torch.ones(2, 8)).sum().backward()
    assert not internals.is_unsharded(group) and internals.gathered_outputs(params[0])
    internals.forget_gathered(params[0])
    assert not internals.gathered_outputs(params[0]) and internals.unsharded_param(params[0]) is None


def test_fsdp2_private_state_the_project_reads_exists():
    run_distributed(_body, world_size=2)


def test_a_missing_attribute_is_named():
    class Group:  # a parameter group of a torch that renamed `_training_state`
        fsdp_params, _reshard_after_forward, is_unsharded = [], True, False

    class State:
        _fsdp_param_group, _lazy_init = Group(), None

    class Unit:
        def _get_fsdp_state(self):
            return State()

    missing = internals.missing_internals(Unit())
    assert "FSDPParamGroup._training_state" in missing and "FSDPParamGroup._training_state.name" in missing
