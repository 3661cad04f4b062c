"""Induced FP8 failures on a tiny Llama (local layers, delayed scaling, CPU) through the hooks of
scripts/probes/fp8_failures.py: each injection produces its failure, the monitor flags it, and the guard acts where
the study (docs/fp8.md, "Induced failures") measured it does, with the layer it moves kept in bf16 on resume."""

from __future__ import annotations

import pytest
import torch

from megatron.config import parse_args
from megatron.training import Trainer
from tests.assets.scripts import load_probe
from tests.dist_utils import run_distributed

probe = load_probe("fp8_failures")
# 20 steps instead of the study's 30 (a shorter cosine schedule): the timelines asserted hold at both lengths, at
# the study's first seed
SHORT = "--train-iters 20"
ITERS = "--train-iters 14"


@pytest.fixture(scope="module")
def data() -> str:
    return probe.data_flags()


@pytest.fixture(scope="module")
def reference(data: str):
    return probe.train(f"{probe.FP8} {data}", None, "ref fp8", extra=SHORT)


def _departure(run, reference) -> int | None:
    return probe.departure(run.losses, reference.losses)


@pytest.mark.slow
def test_the_uninjected_run_is_never_flagged(reference):
    assert probe.first(reference.flags) is None and probe.first(reference.guard) is None


@pytest.mark.slow
def test_rescaled_outliers_change_no_bit_in_fp32_and_are_flagged_at_once_in_fp8(data, reference):
    """K and 1/K are powers of two: in fp32 the rescaled model trains bit for bit as with K = 1 (the same linear
    path; the plain linear sums its weight gradient in another kernel, to 1e-6); FP8 sees the channels' range K
    apart, and the monitor flags linear_fc2's input on the first injected step, in each injected layer."""
    injection = probe.Injection("rescaled-outliers", 10, 8, 4.0, more_layers=(1,))
    unit = probe.Injection("rescaled-outliers", 10, 8, 1.0, more_layers=(1,))
    assert probe.train(data, injection, "hp", extra=ITERS).losses == probe.train(data, unit, "hp", extra=ITERS).losses
    fp8 = probe.train(f"{probe.FP8} --no-fp8-first-layer-bf16 {data}", injection, "fp8", extra=ITERS)
    assert fp8.series["amax"][14] > 100 * reference.series["amax"][14]  # layer 2's, K = 4^5 there
    assert probe.first(fp8.flags) == 10
    for layer in (0, 1):
        assert any(flag.startswith(f"layers.{layer}.mlp.linear_fc2 input") for flag in fp8.flags[10])
    with pytest.raises(ValueError, match="more_layers is for the outlier kinds"):
        probe.Injection("lr-spike", more_layers=(1,))


@pytest.mark.slow
def test_outlier_channels_are_flagged_at_once_and_the_guard_moves_the_layer_before_the_loss_departs(
    data, reference, tmp_path
):
    injection = probe.Injection("outliers", 10, 6, 2.0)
    kept = probe.train(f"{probe.FP8} {data}", injection, "fp8", extra=SHORT)
    fc2 = kept.series["amax"]
    assert fc2[15] > 300 * fc2[9]  # linear_fc2's input amax grew by orders of magnitude
    # the first injected step saturates linear_fc2's input (its delayed scale is the step before's)
    assert probe.first(kept.flags) == 10
    assert any("linear_fc2 input saturated" in flag for flag in kept.flags[10])

    run = probe.train(f"{probe.FP8} --fp8-auto-bf16 {data}", injection, "fp8", extra=f"{SHORT} --save {tmp_path}")
    assert probe.first(run.guard) == 12 and run.bf16_layers == [2]  # --fp8-guard-intervals 3: steps 10, 11, 12
    departed = _departure(run, reference)
    assert departed is None or departed > 12

    # the moved layer stays in bf16 across the checkpoint
    resumed = Trainer(parse_args(f"{probe.TINY} {probe.FP8} {data} --train-iters 21 --load {tmp_path}".split()))
    assert resumed.fp8_monitor.guard.bf16_layers == [2]
    assert [s.enabled for s in resumed.fp8.states.values()] == [False] * 4


@pytest.mark.slow
def test_watching_every_fifth_step_the_guard_still_acts_on_consecutive_steps(data):
    """Outliers from step 10 are flagged there; the monitor then watches 11 and 12 (the guard's streak), the guard
    moves the layer on 12, as when watching every step, and the watch goes back to every 5th step."""
    every_fifth = probe.FP8.replace("--fp8-stats-interval 1", "--fp8-stats-interval 5")
    run = probe.train(
        f"{every_fifth} --fp8-auto-bf16 {data}", probe.Injection("outliers", 10, 6, 2.0), "fp8", extra=SHORT
    )
    assert sorted(run.flags) == [5, 10, 11, 12, 15, 20]
    assert probe.first(run.flags) == 10 and probe.first(run.guard) == 12 and run.bf16_layers == [2]


@pytest.mark.slow
def test_a_learning_rate_spike_is_flagged_on_the_step_its_update_reaches(data, reference):
    injection = probe.Injection("lr-spike", 10, 3, 30.0)
    run = probe.train(f"{probe.FP8} --fp8-auto-bf16 {data}", injection, "fp8", extra=SHORT)
    # step 10's forward precedes its update: step 11 is the first to see it, in the monitor and in the loss alike
    assert probe.first(run.flags) == 11 == _departure(run, reference)
    assert sorted(i for i, flags in run.flags.items() if flags) == [11, 12]  # two watched steps over, then none
    assert probe.first(run.guard) is None and run.bf16_layers == []  # --fp8-guard-intervals 3 lets it pass

    two = probe.train(f"{probe.FP8} --fp8-auto-bf16 --fp8-guard-intervals 2 {data}", injection, "fp8", extra=SHORT)
    assert probe.first(two.guard) == 12 and two.bf16_layers == [2]

    # no FP8 statistic precedes step 11: the spiked update of step 10 stands out (its size relative to the weight),
    # but the layer's weights, the only FP8 tensors it changes before step 11's forward, saturate under the threshold
    assert run.updates[10] > 5 * max(reference.updates.values())
    assert max(run.series["weight saturated"].values()) < probe.SATURATION


@pytest.mark.slow
def test_one_watched_step_far_over_the_saturation_threshold_also_happens_without_a_failure(data):
    # why the guard keeps its streak for a tensor however far over: --smooth-swiglu's first scales (after step 1)
    # saturate linear_fc2's input on step 2, far over, and the delayed scale has caught up by step 3
    run = probe.train(f"{probe.FP8} --smooth-swiglu {data}", None, "smooth-swiglu", extra="--train-iters 3")
    assert run.series["max saturated"][2] > probe.FAR_OVER * probe.SATURATION
    assert not run.flags[1] and not run.flags[3] and probe.first(run.guard) is None


def test_timelines_over_seeds_read_as_ranges():
    assert probe.span([11, 11, 11]) == "11" and probe.span([None, None]) == "-"
    assert probe.span([12, None, 10]) == "10..12, - in 1 of 3"
    assert probe.span([0.5, -1.25], "{:+.2f}%") == "-1.25%..+0.50%"


def _wrong_amax_group(rank: int, world_size: int, data: str) -> None:
    torch.set_num_threads(1)
    extra = "--train-iters 14"
    reference = probe.train(f"{probe.FP8} {data}", None, "ref fp8", world_size, extra)
    assert probe.first(reference.flags) is None  # replicas of a sound reduction agree exactly
    injection = probe.Injection("amax-group", 10, 21, 0.0)
    run = probe.train(f"{probe.FP8} --fp8-auto-bf16 {data}", injection, "fp8", world_size, extra)
    flagged = probe.first(run.flags)
    assert flagged == 11 and all("scales disagree across ranks" in f for f in run.flags[flagged]), run.flags
    assert all(" layers.1." in f or f.startswith("layers.1.") for f in run.flags[flagged])
    assert probe.first(run.guard) == 13 and run.bf16_layers == [2]
    assert _departure(run, reference) is None  # at this size the disagreement costs no loss


@pytest.mark.slow
def test_an_amax_reduced_over_the_wrong_group_is_flagged_as_disagreeing_scales(data):
    run_distributed(_wrong_amax_group, world_size=2, args=(data,))
