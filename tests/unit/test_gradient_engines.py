"""Every gradient engine implements megatron/parallel/engines.py's `GradientEngine`, so that the optimizer, the
checkpoints and the training step need not tell them apart."""

import inspect

import pytest
import torch
from torch import nn

from megatron.parallel.data_parallel import GradientBuffers
from megatron.parallel.engines import GradientEngine
from megatron.parallel.fsdp.flat_shards import FlatGradShards
from megatron.parallel.fsdp.fsdp2 import Fsdp2Grads

METHODS = [name for name, _ in inspect.getmembers(GradientEngine, inspect.isfunction) if not name.startswith("_")]
ATTRIBUTES = list(GradientEngine.__annotations__)


@pytest.mark.parametrize("engine", [GradientBuffers, FlatGradShards, Fsdp2Grads])
def test_each_engine_has_the_protocols_methods(engine):
    assert METHODS and all(callable(getattr(engine, name, None)) for name in METHODS), engine
    for name in METHODS:  # called as the protocol calls them: no argument it lacks, none more required
        ours, theirs = inspect.signature(getattr(engine, name)), inspect.signature(getattr(GradientEngine, name))
        required = [p for p in ours.parameters.values() if p.default is inspect.Parameter.empty]
        assert len(required) <= len(theirs.parameters) <= len(ours.parameters), (engine, name)


def test_the_buffers_hold_the_protocols_attributes():
    engine = GradientBuffers(nn.Linear(4, 4), None)
    assert ATTRIBUTES and all(hasattr(engine, name) for name in ATTRIBUTES)
    assert not engine.sharded_state and not engine.shards_released()
    assert engine.grad_piece(engine.params[0], 0, 4).data_ptr() == engine.params[0].main_grad.data_ptr()
    assert torch.equal(engine.reduced_grad(engine.params[1]), torch.zeros(4))
