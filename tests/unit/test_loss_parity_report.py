"""scripts/loss_parity.py without training: run names and flags, log parsing, gaps, the table, the report."""

import importlib.util
import math
import os
import sys
import time
from pathlib import Path

import pytest

from megatron.training.logger import training_log_line, validation_log_lines

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "loss_parity.py"
spec = importlib.util.spec_from_file_location("loss_parity", SCRIPT)
parity = importlib.util.module_from_spec(spec)
sys.modules.setdefault("loss_parity", parity)  # dataclasses look their module up there
spec.loader.exec_module(parity)


def record(valid, train=None, error=None, seed=1234, skipped=0, setup=None):
    """A results-JSON run as the harness writes it."""
    return {
        "seed": seed,
        "error": error,
        "valid": valid,
        "train": train if train is not None else [[it, loss + 0.1] for it, loss in valid],
        "skipped_iterations": skipped,
        "setup": setup or {"preset": "llama-150m", "flags": "--train-iters 300 --eval-interval 100"},
    }


def test_run_names_seeds_and_flag_order():
    run = parity.parse_run_name("te-delayed@seed3+h16")
    assert (run.config, run.seed_index, run.tag, run.reference) == ("te-delayed", 3, "h16", "te-bf16")
    assert parity.parse_run_name("local-bf16@seed2").is_seed_of("local-bf16")
    assert not parity.parse_run_name("local-bf16@seed2+x").is_seed_of("local-bf16")  # a variant: no noise floor
    assert parity.parse_run_name("te-delayed@seed2+x").is_seed_of("te-delayed+x")
    for bad in ["te-bf17", "te-bf16@seed1", "te-bf16@2", "te-bf16+"]:
        with pytest.raises(ValueError):
            parity.parse_run_name(bad)
    common = ["--train-iters", "10"]
    per_run = {"te-delayed+h16": ["--fp8-amax-history-len", "16"]}
    fp8_only = ["--fp8-stats-interval", "5"]
    flags = parity.run_flags(parity.parse_run_name("te-delayed+h16"), common, 1234, fp8_only, per_run)
    assert flags[:2] == common and "--fp8-recipe" in flags and flags[-2:] == ["--fp8-amax-history-len", "16"]
    assert flags[flags.index("--seed") + 1] == "1234" and "--fp8-stats-interval" in flags
    bf16 = parity.run_flags(parity.parse_run_name("te-bf16@seed2"), common, 1234, fp8_only, per_run)
    assert bf16[bf16.index("--seed") + 1] == "1235" and "--fp8-stats-interval" not in bf16  # bf16 refuses FP8 flags
    assert parity.set_flag(["--a", "1", "--b", "2"], "--a", "3") == ["--a", "3", "--b", "2"]
    assert parity.set_flag(["--a", "1"], "--c", "3") == ["--a", "1", "--c", "3"]
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
            "> building model",
            line(2, 9.5),
            validation_log_lines(2, 9.25),
            line(4, float("nan"), skipped=1),
            validation_log_lines(4, 8.75),
            validation_log_lines(4, 8.5, "test"),  # the test split is not validation
        ]
    )
    losses = parity.parse_losses(log)
    assert losses["train"][0] == [2, 9.5] and losses["train"][1][0] == 4 and math.isnan(losses["train"][1][1])
    assert losses["valid"] == [[2, 9.25], [4, 8.75]]
    assert (losses["skipped_iterations"], losses["nan_iterations"]) == (1, 0)


def test_gap_largest_gap_and_smoothing():
    assert parity.gap_pct(3.03, 3.0) == pytest.approx(1.0)
    assert parity.gap_pct(2.97, 3.0) == pytest.approx(-1.0)
    ref = [[100, 3.0], [200, 3.0], [300, 2.9]]
    # +1% at 100, -3% at 200 (the largest, sign kept), 0 at 300; iteration 400 has no reference and is ignored
    run = [[100, 3.03], [200, 2.91], [300, 2.9], [400, 1.0]]
    gap, iteration = parity.largest_gap(run, ref)
    assert (round(gap, 6), iteration) == (-3.0, 200)
    gap, iteration = parity.largest_gap([[100, 3.03], [200, float("nan")]], ref)  # a diverged evaluation is largest
    assert math.isnan(gap) and iteration == 200
    assert parity.largest_gap([[50, 3.0]], ref) is None
    points = [[10, 4.0], [20, 2.0], [30, float("nan")], [40, 6.0]]
    assert parity.smooth(points, 20) == [[10, 4.0], [20, 3.0], [30, 2.0], [40, 6.0]]


def test_table_gaps_spread_and_failures():
    runs = {
        "local-mxfp8": record([[100, 3.2], [200, 3.018]]),  # +0.6% against local-bf16
        "te-delayed": record([[100, 3.03], [200, 3.003]]),  # +0.1% final, +1% at iteration 100
        "te-bf16": record([[100, 3.0], [200, 3.0]]),
        "te-bf16@seed2": record([[100, 3.01], [200, 3.006]], seed=1235),  # the noise floor: 0.2%
        "te-tensorwise": record([[100, 3.0], [200, 2.988]], skipped=2),  # -0.4%: within 0.5%, outside the spread
        "te-blockwise": record([], train=[], error="Float8BlockScaling needs | a newer GPU"),
        "local-bf16": record([[100, 3.1], [200, 3.0]]),
    }
    rows = parity.summarize(runs)
    assert [r.name for r in rows] == [
        "te-bf16",
        "te-bf16@seed2",
        "te-delayed",
        "te-tensorwise",
        "te-blockwise",
        "local-bf16",
        "local-mxfp8",
    ]
    by_name = {r.name: r for r in rows}
    assert by_name["te-delayed"].gap == pytest.approx(0.1)
    assert by_name["te-delayed"].largest == (pytest.approx(1.0), 100)
    assert by_name["te-delayed"].spread == pytest.approx(0.2)
    assert by_name["local-mxfp8"].reference == "local-bf16" and by_name["local-mxfp8"].gap == pytest.approx(0.6)
    assert by_name["local-mxfp8"].spread == pytest.approx(0.2)  # no local seed run: te's noise floor
    lines = parity.format_table(rows).splitlines()
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in lines[2:]}
    assert len(cells) == len(runs)
    assert cells["te-bf16"][:4] == ["1234", "3.0000", "3.1000", "reference"]
    assert cells["te-bf16@seed2"][3:7] == ["+0.20%", "+0.33% (100)", "yes", "(noise floor)"]
    assert cells["te-delayed"][3:7] == ["+0.10%", "+1.00% (100)", "yes", "yes (±0.20%)"]
    assert cells["te-tensorwise"][3:] == ["-0.40%", "-0.40% (200)", "yes", "**no** (±0.20%)", "2"]
    assert cells["local-mxfp8"][3:6] == ["+0.60%", "+3.23% (100)", "**no**"]
    assert cells["te-blockwise"][1] == "failed: Float8BlockScaling needs / a newer GPU"  # no '|' breaking the row
    assert all(c == "" for c in cells["te-blockwise"][2:])
    tight = parity.format_table(rows, tolerance=0.05).splitlines()
    assert "within 0.05%" in tight[0] and "| **no** |" in next(x for x in tight if "| te-delayed |" in x)


def test_table_without_reference_or_second_seed():
    rows = parity.summarize({"local-delayed": record([[10, 5.0]]), "te-bf16": record([[10, 5.0]])})
    cells = {r.name: r for r in rows}
    assert cells["local-delayed"].gap is None and cells["local-delayed"].reference is None  # no local-bf16 run
    assert cells["te-bf16"].role == "reference" and cells["te-bf16"].spread is None
    no_seed = parity.summarize({"te-bf16": record([[10, 5.0]]), "te-delayed": record([[10, 5.05]])})
    assert "no second seed" in parity.format_table(no_seed)


def test_setup_notes_name_the_differing_flags():
    same = {"preset": "tiny", "flags": "--train-iters 30 --lr 3e-3"}
    runs = {
        "local-bf16": record([[30, 7.0]], setup=same),
        "local-delayed": record([[30, 7.0]], setup=same),
        "local-mxfp8": record([[20, 7.0]], setup={"preset": "tiny", "flags": "--train-iters 20 --lr 3e-3"}),
    }
    notes = parity.setup_notes(runs)
    assert len(notes) == 1 and notes[0].startswith("local-mxfp8 differs from local-bf16")
    assert "--train-iters 20 vs 30" in notes[0] and "--lr" not in notes[0]
    runs["local-mxfp8"] = record([[30, 7.0]], setup={**same, "nproc_per_node": 2})
    assert parity.setup_notes(runs) == ["local-mxfp8 differs from local-bf16: 2 vs 1 processes"]


def test_a_named_reference_replaces_bf16(tmp_path):
    runs = {
        "te-bf16": record([[10, 4.0]]),
        "te-delayed-fp8params": record([[10, 5.0]]),
        "te-delayed-fp8params-o2": record([[10, 5.02]]),
    }
    table = parity.write_report({"runs": runs}, tmp_path / "r.md", None, reference="te-delayed-fp8params")
    assert "| gap to te-delayed-fp8params |" in table
    assert "| te-delayed-fp8params-o2 | 1234 | 5.0200 |" in table and "| +0.40% |" in table
    assert "| te-bf16 | 1234 | 4.0000 |" in table and "-20.00%" in table
    assert "Gap to te-delayed-fp8params: 100 x" in (tmp_path / "r.md").read_text()


def test_nproc_per_node_launches_through_torchrun(capsys):
    assert parity.main(["--configs", "local-bf16", "--nproc-per-node", "2", "--mock-data", "--dry-run"]) == 0
    assert "-m torch.distributed.run --standalone --nproc-per-node=2 " in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parity.main(["--configs", "local-bf16", "--nproc-per-node", "0", "--dry-run"])
    assert "--nproc-per-node 0: give 1 or more processes" in capsys.readouterr().err


def test_report_without_matplotlib_still_writes_the_table(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    results = {"runs": {"local-bf16": record([[10, 5.0]]), "local-delayed": record([[10, 5.01]])}}
    table = parity.write_report(results, tmp_path / "docs" / "parity.md", tmp_path / "docs" / "parity.png")
    text = (tmp_path / "docs" / "parity.md").read_text()
    assert table in text and "| local-delayed | 1234 | 5.0100 |" in table and "+0.20%" in table
    assert "the PNG needs matplotlib" in text and not (tmp_path / "docs" / "parity.png").exists()


def test_results_merge_across_invocations(tmp_path):
    path = tmp_path / "runs" / "results.json"
    assert parity.load_results(path) == {"runs": {}}
    first = parity.load_results(path)
    first["runs"]["te-bf16"] = record([[10, 5.0]])
    parity.save_results(first, path)
    second = parity.load_results(path)
    second["runs"]["te-delayed"] = record([[10, float("nan")]])  # a diverged run survives the round trip
    parity.save_results(second, path)
    merged = parity.load_results(path)["runs"]
    assert list(merged) == ["te-bf16", "te-delayed"] and math.isnan(merged["te-delayed"]["valid"][0][1])
    assert [p.name for p in path.parent.iterdir()] == ["results.json"]  # no temporary file left behind


def test_execute_streams_lines_and_stops_a_run_at_its_timeout():
    seen = []
    start = time.monotonic()
    code_line = "import time; print('started', flush=True); time.sleep(60)"
    text, code = parity.benchmark.execute([sys.executable, "-c", code_line], 2, dict(os.environ), seen.append)
    assert code == -1 and "started" in text and "timed out after 2 s" in text
    assert seen == ["started\n"] and time.monotonic() - start < 30
    text, code = parity.benchmark.execute([sys.executable, "-c", "import sys; sys.exit(3)"], 30, dict(os.environ))
    assert (text, code) == ("", 3)


def test_runs_at_other_seeds_pair_with_the_reference_at_their_seed(tmp_path):
    runs = {
        "te-delayed-fp8params": record([[10, 5.0]]),
        "te-delayed-fp8params@seed2": record([[10, 4.0]], seed=1235),  # other batches: -20%, the noise floor
        "te-delayed-fp8params-o2": record([[10, 5.05]]),  # +1%
        "te-delayed-fp8params-o2@seed2": record([[10, 3.98]], seed=1235),  # -0.5% against seed 2, not -20.4%
        "te-delayed-fp8params-o2@seed3": record([[10, 5.1]], seed=1236),  # no reference at seed 3: the first seed's
        "te-delayed-fp8params-o1": record([[10, 5.01]]),  # one seed: no mean
    }
    rows = {r.name: r for r in parity.summarize(runs, "te-delayed-fp8params")}
    assert rows["te-delayed-fp8params@seed2"].role == "seed" and rows["te-delayed-fp8params@seed2"].gap == -20
    assert rows["te-delayed-fp8params@seed2"].reference == "te-delayed-fp8params"
    paired = rows["te-delayed-fp8params-o2@seed2"]
    assert paired.reference == "te-delayed-fp8params@seed2" and paired.gap == pytest.approx(-0.5)
    assert rows["te-delayed-fp8params-o2@seed3"].reference == "te-delayed-fp8params"
    assert rows["te-delayed-fp8params-o2@seed3"].spread == pytest.approx(20)  # the reference's own seeds
    # the mean over seeds takes only the paired runs: +1 and -0.5
    assert parity.paired_gaps(list(rows.values())) == {
        "te-delayed-fp8params-o2": [pytest.approx(1.0), pytest.approx(-0.5)],
        "te-delayed-fp8params-o1": [pytest.approx(0.2)],
    }
    table = parity.format_seed_table(list(rows.values()))
    assert table.splitlines()[2] == "| te-delayed-fp8params-o2 | 2 | +0.25% | 1.06% | 0.75% | -0.50% .. +1.00% | yes |"
    assert len(table.splitlines()) == 3  # o1 has one seed: no row
    report = parity.write_report({"runs": runs}, tmp_path / "r.md", None, reference="te-delayed-fp8params")
    assert table in (tmp_path / "r.md").read_text() and "| te-delayed-fp8params-o2@seed2 |" in report
    # bf16 as the reference pairs the same way
    bf16 = parity.summarize(
        {
            "te-bf16": record([[10, 5.0]]),
            "te-bf16@seed2": record([[10, 4.0]], seed=1235),
            "te-delayed@seed2": record([[10, 4.04]], seed=1235),
        }
    )
    assert bf16[-1].reference == "te-bf16@seed2" and bf16[-1].gap == pytest.approx(1.0)
    assert parity.format_seed_table(bf16) == ""
