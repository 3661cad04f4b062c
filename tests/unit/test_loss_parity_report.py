"""The loss-parity harness without training: run names and plans, flags, log parsing, paired gaps and their
intervals, the verdicts and exit status, the report."""

import math
import sys

import pytest

from megatron.training.logger import training_log_line, validation_log_lines
from tests.assets.scripts import load_script

parity = load_script("loss_parity")
report = sys.modules["parity_report"]


def record(valid, seed=1234, error=None, skipped=0, flags="--train-iters 300"):
    """A results-JSON run as the harness writes it."""
    return {
        "seed": seed,
        "error": error,
        "returncode": 0 if error is None else 1,
        "valid": valid,
        "train": [[it, loss + 0.1] for it, loss in valid],
        "skipped_iterations": skipped,
        "setup": {"preset": "llama-150m", "flags": flags},
    }


def test_t_quantiles_and_intervals():
    assert report.t95(1) == 12.706 and report.t95(2) == 4.303 and report.t95(30) == 2.042
    assert report.t95(31) == pytest.approx(2.040, abs=1e-3) and report.t95(1000) == pytest.approx(1.962, abs=1e-3)
    iv = report.Interval([0.1, 0.3, 0.2])
    assert iv.mean == pytest.approx(0.2) and iv.sd == pytest.approx(0.1)
    assert iv.half_width == pytest.approx(4.303 * 0.1 / math.sqrt(3))
    assert report.Interval([0.1, 0.3, 0.2]).verdict(0.5) == "pass"  # 0.2 + 0.248 <= 0.5
    assert report.Interval([0.1, 0.3, 0.2]).verdict(0.4) == "unresolved"
    assert report.Interval([1.0, 1.1, 1.2]).verdict(0.5) == "fail"
    assert report.Interval([0.1]).verdict(0.5) == "unresolved" and report.Interval([0.1]).half_width is None
    assert report.Interval([0.1, math.nan]).verdict(0.5) == "fail"  # a diverged seed


def test_run_names_and_plans():
    run = report.parse_run_name("te-delayed@seed3+h16")
    assert (run.config, run.seed_index, run.tag, run.base) == ("te-delayed", 3, "h16", "te-delayed+h16")
    assert run.reference_base() == "te-bf16" and run.reference_base("te-delayed-fp8params") == "te-delayed-fp8params"
    assert report.run_name("te-bf16+noise", 2) == "te-bf16@seed2+noise" and report.run_name("te-bf16", 1) == "te-bf16"
    for bad in ["te-bf17", "te-bf16@seed1", "te-bf16@2", "te-bf16+"]:
        with pytest.raises(ValueError):
            report.parse_run_name(bad)
    plan = parity.plan_runs(["te-delayed", "te-blockwise", "te-tensorwise@seed5"], 2, None, True)
    assert plan == [
        "te-bf16",
        "te-bf16+noise",
        "te-delayed",
        "te-blockwise",
        "te-bf16@seed2",
        "te-bf16@seed2+noise",
        "te-delayed@seed2",
        "te-blockwise@seed2",
        "te-tensorwise@seed5",
    ]  # seed by seed, so that a cut-off leaves whole pairs
    assert parity.plan_runs(["local-delayed"], 1, "local-tensorwise", False) == ["local-tensorwise", "local-delayed"]


def test_flags_noise_floor_and_skipping_finished_runs():
    common = ["--micro-batch-size", "16", "--global-batch-size", "32"]
    assert parity.noise_flags(common, 1) == ["--micro-batch-size", "8"]
    assert parity.noise_flags(["--micro-batch-size", "3", "--global-batch-size", "12"], 2) == [
        "--micro-batch-size",
        "6",
    ]
    with pytest.raises(ValueError, match="allows neither half nor twice the size"):
        parity.noise_flags(["--micro-batch-size", "3", "--global-batch-size", "9"], 1)
    per_run = {"te-delayed+h16": ["--fp8-amax-history-len", "16"]}
    flags = parity.run_flags("te-delayed@seed2+h16", common, 1234, ["--fp8-stats-interval", "5"], per_run)
    assert flags[:4] == common and "--fp8-recipe" in flags and flags[-2:] == ["--fp8-amax-history-len", "16"]
    assert flags[flags.index("--seed") + 1] == "1235" and "--fp8-stats-interval" in flags  # by CONFIG+TAG
    bf16 = parity.run_flags("te-bf16", common, 1234, ["--fp8-stats-interval", "5"], per_run)
    assert "--fp8-stats-interval" not in bf16  # bf16 refuses FP8 flags
    done = {"error": None, "returncode": 0, "command": ["/elsewhere/python", "/elsewhere/pretrain_gpt.py", *flags]}
    assert parity.finished_with(done, flags) and not parity.finished_with(done, bf16)
    assert not parity.finished_with({**done, "error": "timed out"}, flags) and not parity.finished_with(None, flags)
    # environment assignments among a run's flags: first in its flags, an `env` prefix in its command
    per_run["te-delayed+bwd16"] = ["NVTE_FP8_DPA_BWD=0", "--fp8-margin", "1"]
    env_flags = parity.run_flags("te-delayed+bwd16", common, 1234, [], per_run)
    assert env_flags[0] == "NVTE_FP8_DPA_BWD=0" and env_flags[-2:] == ["--fp8-margin", "1"]
    assert parity.flag_values(env_flags)["--seed"] == "1234"
    cmd = parity.command(env_flags)
    assert cmd[:2] == ["env", "NVTE_FP8_DPA_BWD=0"] and "NVTE_FP8_DPA_BWD=0" not in cmd[2:]
    assert parity.finished_with({**done, "command": cmd}, env_flags)
    assert not parity.finished_with({**done, "command": cmd}, env_flags[1:])
    assert not parity.finished_with({**done, "command": parity.command(env_flags[1:])}, env_flags)
    later = parity.run_flags("te-delayed+late", common, 1234, [], {"te-delayed+late": ["--x", "A=1"]})
    assert later[-2:] == ["--x", "A=1"] and parity.command(later)[0] != "env"  # only a leading word sets one
    assert parity.set_flag(["--a", "1", "--b", "2"], "--a", "3") == ["--a", "3", "--b", "2"]
    assert parity.flag_values(["--a", "1", "--bf16", "--data-path", "0.3", "x", "--a", "2"]) == {
        "--a": "2",
        "--bf16": "",
        "--data-path": "0.3 x",
    }


def test_parse_losses_reads_the_logger_formats():
    def line(iteration, loss, skipped=0):
        return training_log_line(iteration, 4, 8 * iteration, 10.0, 1.0, 100.0, None, 1e-3, 8, loss, 1.0, skipped, 0)

    log = "\n".join(
        [
            line(2, 9.5),
            validation_log_lines(2, 9.25),
            line(4, float("nan"), skipped=1),
            validation_log_lines(4, 8.75),
            validation_log_lines(4, 8.75, final=True),  # after training: the same evaluation, not a second point
            validation_log_lines(4, 8.5, "test"),  # the test split is not validation
        ]
    )
    losses = report.parse_losses(log)
    assert losses["train"][0] == [2, 9.5] and math.isnan(losses["train"][1][1])
    assert losses["valid"] == [[2, 9.25], [4, 8.75]]
    assert (losses["skipped_iterations"], losses["nan_iterations"]) == (1, 0)


def runs_of_three_seeds():
    ref = {1: [3.0, 2.0], 2: [3.2, 2.2], 3: [3.1, 2.1]}
    runs = {}
    for seed, (a, b) in ref.items():
        suffix = "" if seed == 1 else f"@seed{seed}"
        runs[f"te-bf16{suffix}"] = record([[100, a], [200, b]], seed=1233 + seed)
        gap = {1: 0.010, 2: 0.011, 3: 0.012}[seed]  # +1.0%, +1.1%, +1.2% at the end; +0 at iteration 100
        runs[f"te-delayed{suffix}"] = record([[100, a], [200, b * (1 + gap)]], seed=1233 + seed, skipped=1)
        noise = {1: 0.0005, 2: -0.0005, 3: 0.0}[seed]
        name = "te-bf16+noise" if seed == 1 else f"te-bf16@seed{seed}+noise"
        runs[name] = record([[100, a], [200, b * (1 + noise)]], seed=1233 + seed)
    runs["te-blockwise"] = record([[100, 3.0], [200, 2.0]])
    runs["te-blockwise@seed2"] = record([], error="Float8BlockScaling needs | a newer GPU")
    return runs


def test_comparisons_pair_each_seed_with_its_partner():
    comparisons = {c.base: c for c in report.compare(runs_of_three_seeds())}
    assert sorted(comparisons) == ["te-bf16+noise", "te-blockwise", "te-delayed"]
    delayed = comparisons["te-delayed"]
    assert delayed.final.gaps == pytest.approx([1.0, 1.1, 1.2]) and delayed.seed_indices == [1, 2, 3]
    assert delayed.by_iteration[100].gaps == [0.0, 0.0, 0.0] and delayed.largest()[0] == 200
    assert delayed.skipped == 3 and delayed.final.verdict(0.5) == "fail" and not delayed.noise_floor
    noise = comparisons["te-bf16+noise"]
    assert noise.noise_floor and noise.final.mean == pytest.approx(0.0, abs=1e-12)
    blockwise = comparisons["te-blockwise"]
    assert blockwise.final.n == 1 and blockwise.missing == ["te-blockwise@seed2"]
    table = report.format_comparisons(list(comparisons.values()), 0.5)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table.splitlines()[2:]}
    assert rows["te-delayed"][:4] == ["te-bf16", "3", "+1.100%", "+0.852% .. +1.348%"]
    assert rows["te-delayed"][6:] == ["fail", "3"]
    assert rows["te-bf16+noise"][6].startswith("(noise floor: ±") and rows["te-blockwise"][1] == "1 (1 missing)"
    relaxed = report.format_comparisons(list(comparisons.values()), 5.0)
    assert "| pass |" in relaxed and relaxed.count("unresolved") == 1  # blockwise: one seed


def test_report_exit_status_and_the_plot(tmp_path, monkeypatch):
    runs = runs_of_three_seeds()
    table, comparisons = report.write_report({"runs": runs}, tmp_path / "r.md", tmp_path / "r.png")
    text = (tmp_path / "r.md").read_text()
    assert table in text and "| te-blockwise@seed2 | 1234 | failed: Float8BlockScaling needs / a newer GPU |" in text
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "(r.png)" in text
    assert parity.exit_status(comparisons, 0.5, False) == 1  # te-delayed fails
    passing = [c for c in comparisons if c.base != "te-delayed"]
    assert parity.exit_status(passing, 0.5, False) == 2  # te-blockwise has one seed: unresolved
    assert parity.exit_status([c for c in passing if c.base != "te-blockwise"], 0.5, False) == 0
    assert parity.exit_status([], 0.5, True) == 1  # a run failed
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    report.write_report({"runs": runs}, tmp_path / "s.md", tmp_path / "s.png")
    assert "No plot: the PNG needs matplotlib" in (tmp_path / "s.md").read_text()


def test_cli_errors_and_dry_runs(capsys):
    model = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --micro-batch-size 4 --global-batch-size 8"
    assert parity.main(["--model", model, "--configs", "local-delayed", "--mock-data", "--vocab-size", "64",
                        "--seeds", "2", "--noise-floor", "--dry-run"]) == 0  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == [
        "local-bf16",
        "local-bf16+noise",
        "local-delayed",
        "local-bf16@seed2",
        "local-bf16@seed2+noise",
        "local-delayed@seed2",
    ]
    assert all("--full-validation" in line and "--num-layers 2" in line for line in out)
    assert out[1].endswith("--micro-batch-size 2") and "--seed 1235" in out[3]
    assert parity.main(["--configs", "local-bf16", "--nproc-per-node", "2", "--mock-data", "--dry-run"]) == 0
    assert "-m torch.distributed.run --standalone --nproc-per-node=2 " in capsys.readouterr().out
    for argv, message in [
        (["--seeds", "0"], "--seeds 0: give 1 or more"),
        (["--configs", "te-bf17"], "expected CONFIG[@seedN][+TAG]"),
        (["--configs", "local-delayed", "--config-flags", "local-x+y=--lr 1"], "names runs not planned"),
        (["--preset", "llama-150m", "--data-dir", "/nonexistent"], "no parity corpus; build it with"),
    ]:
        with pytest.raises(SystemExit):
            parity.main([*argv, "--dry-run"])
        assert message in capsys.readouterr().err


def test_a_run_resumed_over_two_commands_keeps_both_parts():
    part = {"error": None, "partial": True, "train": [[1, 9.0], [2, 8.0]], "valid": [[2, 8.5]]}
    part["parts"] = [{"iterations": [1, 2], "wall_s": 10.0}]
    rest = {"error": None, "partial": False, "train": [[3, 7.0]], "valid": [[2, 8.5], [3, 7.5]]}
    rest["parts"] = [{"iterations": [3, 3], "wall_s": 5.0}]
    merged = parity.merge_parts(part, rest)
    assert merged["train"] == [[1, 9.0], [2, 8.0], [3, 7.0]] and merged["valid"] == [[2, 8.5], [3, 7.5]]
    assert [p["iterations"] for p in merged["parts"]] == [[1, 2], [3, 3]] and merged["wall_s"] == 15.0
    assert parity.merge_parts(None, rest) is rest and parity.merge_parts({**part, "partial": False}, rest) is rest
    assert report.compare({"te-bf16": record([[2, 3.0]]), "te-delayed": {**record([[2, 3.0]]), "partial": True}})[
        0
    ].missing == ["te-delayed"]  # an unfinished run is no sample
