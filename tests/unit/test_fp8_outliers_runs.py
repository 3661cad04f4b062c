"""scripts/probes/fp8_outliers_gpu.py --runs: a study trains the runs named, and refuses names it has not or a
subset without the bf16 run its tables measure against."""

from __future__ import annotations

import pytest

from tests.assets.scripts import load_probe, load_script

load_script("parity_runs")  # puts scripts/ on sys.path, as PYTHONPATH=.:scripts does
probe = load_probe("fp8_outliers_gpu")


def parse(*flags: str):
    return probe.build_parser().parse_args(
        ["--kind", "rescaled-outliers", "--engine", "local", "--growths", "3", *flags]
    )


def test_all_runs_by_default():
    args = parse()
    assert probe.selected(args) == list(probe.run_flags(args))
    assert {"bf16", "delayed x3", "smooth x3", "auto-bf16 x3", "auto-bf16, intervals 1 x3"} <= set(probe.selected(args))


def test_the_recovery_runs_differ_in_the_guard_intervals_only():
    flags = probe.run_flags(parse())
    default, single = flags["auto-bf16 x3"], flags["auto-bf16, intervals 1 x3"]
    assert single == (f"{default[0]} --fp8-guard-intervals 1", 3)
    assert "--fp8-auto-bf16" in default[0] and "--fp8-guard-intervals" not in default[0]


def test_runs_trains_the_named_subset_in_order():
    assert probe.selected(parse("--runs", "bf16", "smooth x3")) == ["bf16", "smooth x3"]


@pytest.mark.parametrize("runs", [["bf16", "smooth x9"], ["delayed x3"]])
def test_runs_refuses_unknown_names_and_a_subset_without_bf16(runs):
    with pytest.raises(SystemExit, match="give bf16 and some of"):
        probe.selected(parse("--runs", *runs))


def test_marks_name_the_first_flag_departure_and_each_guard():
    result = probe.failures.Result
    bf16 = result("bf16", losses={i: 3.0 for i in range(1, 21)})
    grown = {i: 3.0 if i < 8 else 3.1 for i in range(1, 21)}  # 3.3% above from step 8
    delayed = result("delayed x3", losses=grown, flags={5: [], 10: ["layers.2.mlp.linear_fc2 input underflow"]})
    auto = result("auto-bf16 x3", losses=grown, guard={10: [], 12: ["layers.2 to bf16"]})
    single = result("auto-bf16, intervals 1 x3", losses=grown, guard={10: ["layers.2 to bf16"]})
    results = {r.name: r for r in (bf16, delayed, auto, single)}
    watched, found = probe.marks(parse(), results)
    assert watched is delayed
    assert found == {"flagged": 10, "departs 1%": 8, "guard": 12, "guard, intervals 1": 10}


def test_replot_needs_plot(tmp_path):
    with pytest.raises(SystemExit, match="give --plot PNG"):
        probe.main(["--kind", "rescaled-outliers", "--engine", "local", "--out", str(tmp_path), "--replot"])
