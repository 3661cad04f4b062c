"""Delayed scaling: the amax history, both compute algorithms, the margin, and inf/NaN steps."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.fp8 import Fp8Format, Recipe, Role
from megatron.fp8.scaling import AmaxState

FP8_MAX = {Role.INPUT: 448.0, Role.WEIGHT: 448.0, Role.GRAD: 57344.0}  # hybrid


def make_state(algo: str, history: int, margin: int = 0, linears: int = 2) -> AmaxState:
    recipe = Recipe("delayed", Fp8Format("hybrid"), amax_history_len=history, amax_compute_algo=algo, margin=margin)
    return AmaxState(recipe, linears, torch.device("cpu"))


def see(state: AmaxState, step_amaxes: list[list[float]]) -> None:
    """Record several micro-batches' amaxes for linear 0 (one list of three per micro-batch)."""
    for micro_batch in step_amaxes:
        for role, value in zip(Role, micro_batch):
            state.record(0, role, torch.tensor(value))


@pytest.mark.parametrize("algo", ["most_recent", "max"])
def test_history_and_scale_follow_the_formula(algo):
    state = make_state(algo, history=3, margin=1)
    steps = [
        [[2.0, 0.5, 1e-3], [4.0, 0.25, 2e-3]],  # two micro-batches: the step's amax is their max
        [[1.0, 0.5, 4e-3]],
        [[0.5, 0.5, 1e-4]],
        [[0.25, 0.5, 1e-4]],  # the first step's amax (4.0) has now left the 3-long history
    ]
    history: list[list[float]] = []
    assert torch.equal(state.scale, torch.ones(2, 3))  # Transformer Engine's initial scale
    for step in steps:
        see(state, step)
        assert state.step()
        history.insert(0, [float(torch.tensor(max(mb[r] for mb in step))) for r in range(3)])  # stored in fp32
        history = history[:3]
        for role in Role:
            used = history[0][role.value] if algo == "most_recent" else max(h[role.value] for h in history)
            want = float(torch.tensor(FP8_MAX[role] / used / 2.0).float())
            assert float(state.scale[0, role.value]) == want
        assert torch.equal(state.scale[1], torch.ones(3))  # linear 1 saw nothing: zero amax keeps its scale
        assert state.history[: len(history), 0].tolist() == history


def test_non_finite_amax_leaves_history_and_scale_untouched():
    state = make_state("max", history=2)
    see(state, [[1.0, 1.0, 1.0]])
    assert state.step()
    history, scale = state.history.clone(), state.scale.clone()
    for bad in (math.inf, math.nan):
        see(state, [[3.0, bad, 1.0]])
        assert state.step() is False
        assert torch.equal(state.history, history) and torch.equal(state.scale, scale)
    see(state, [[2.0, 2.0, 2.0]])  # the next finite step proceeds from the untouched state
    assert state.step() and float(state.scale[0, 0]) == 448.0 / 2.0


def test_state_dict_round_trip_and_shape_check():
    state = make_state("max", history=4)
    see(state, [[1.5, 3.0, 0.5]])
    state.step()
    other = make_state("max", history=4)
    other.load_state_dict(state.state_dict())
    assert torch.equal(other.history, state.history) and torch.equal(other.scale, state.scale)
    with pytest.raises(ValueError, match="--fp8-amax-history-len"):
        make_state("max", history=2).load_state_dict(state.state_dict())


def test_current_scaling_recipes_keep_no_state_but_still_check_amaxes():
    state = AmaxState(Recipe("tensorwise", Fp8Format("e4m3")), 1, torch.device("cpu"))
    state.record(0, Role.GRAD, torch.tensor(math.nan))
    assert state.step() is False and state.state_dict() == {}
    state.record(0, Role.GRAD, torch.tensor(1.0))
    assert state.step() is True
