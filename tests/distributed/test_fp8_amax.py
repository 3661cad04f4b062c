"""Amax reduction of the FP8 manager on 2 gloo ranks: one spawn, several checks."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron.fp8 import Fp8Format, Recipe, Role
from megatron.fp8.scaling import AmaxState
from tests.dist_utils import run_distributed


def _body(rank: int, world_size: int) -> None:
    recipe = Recipe("delayed", Fp8Format("e4m3"), amax_history_len=2, amax_compute_algo="max")
    state = AmaxState(recipe, 2, torch.device("cpu"))

    # Each rank sees different amaxes; after the step both hold the elementwise max and the same scales.
    mine = (
        torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.25, 8.0]]) * (rank + 1)
        if rank == 0
        else torch.tensor([[4.0, 1.0, 1.0], [0.125, 0.5, 1.0]])
    )
    for index in range(2):
        for role in Role:
            state.record(index, role, mine[index, role.value])
    world = dist.group.WORLD
    assert state.step(world) is True
    expected = torch.tensor([[4.0, 2.0, 3.0], [0.5, 0.5, 8.0]])
    assert torch.equal(state.history[0], expected), state.history[0]
    assert torch.equal(state.scale, (448.0 / expected.double()).float())  # fp32 division, correctly rounded
    gathered = [torch.empty_like(state.scale) for _ in range(world_size)]
    dist.all_gather(gathered, state.scale)
    assert torch.equal(gathered[0], gathered[1])

    # A NaN on rank 1 only (a gloo MAX could drop it): both ranks report the step non-finite, change nothing.
    before = state.history.clone(), state.scale.clone()
    state.record(0, Role.GRAD, torch.tensor(math.nan if rank == 1 else 1.0))
    assert state.step(world) is False
    assert torch.equal(state.history, before[0]) and torch.equal(state.scale, before[1])

    # An inf on rank 0 only, in a different cell: same answer on both ranks.
    state.record(1, Role.INPUT, torch.tensor(math.inf if rank == 0 else 1.0))
    assert state.step(world) is False

    # The amax group argument is honoured (a group of both ranks here).
    group = dist.new_group([0, 1])
    state.record(0, Role.INPUT, torch.tensor(16.0 if rank == 1 else 1.0))
    assert state.step(group) is True
    assert float(state.history[0, 0, 0]) == 16.0 and float(state.history[1, 0, 0]) == 4.0
    assert float(state.scale[0, 0]) == 448.0 / 16.0  # algo max over [16, 4]

    # No group: this process alone (another pipeline stage's amaxes belong to other layers).
    state.record(0, Role.INPUT, torch.tensor(32.0 if rank == 1 else 2.0))
    assert state.step(None) is True
    assert float(state.history[0, 0, 0]) == (32.0 if rank == 1 else 2.0)


def test_amax_reduction_on_two_ranks():
    run_distributed(_body, world_size=2)
