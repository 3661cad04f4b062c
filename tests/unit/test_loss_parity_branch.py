"""The loss-parity harness's shared trunks (--branch-at) without training: the plan (a trunk per seed first, every
run of the seed loading it), which trunks still need training, the order the runs start in, and the report
leaving the trunks out of the paired table."""

import argparse
import shlex
import sys
import threading
from pathlib import Path

import pytest

from tests.assets.scripts import load_script

parity = load_script("loss_parity")
report = sys.modules["parity_report"]
runs_module = sys.modules["parity_runs"]

MODEL = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --micro-batch-size 4 --global-batch-size 8"
ARGS = ["--model", f"{MODEL} --train-iters 6", "--mock-data", "--vocab-size", "64"]


def dry_run(capsys, *argv: str) -> dict[str, list[str]]:
    assert parity.main([*ARGS, *argv, "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    return {line.split(": ", 1)[0]: shlex.split(line.split(": ", 1)[1]) for line in lines}


def flag(flags: list[str], name: str) -> str:
    return flags[len(flags) - 1 - flags[::-1].index(name) + 1]


def test_trunks_come_first_and_every_run_of_a_seed_loads_its_own(capsys, tmp_path):
    plan = dry_run(capsys, "--configs", "local-delayed", "--seeds", "2", "--noise-floor", "--branch-at", "3",
                   "--trunks", str(tmp_path))  # fmt: skip
    scratch = dry_run(capsys, "--configs", "local-delayed", "--seeds", "2", "--noise-floor")
    assert list(plan) == ["local-bf16+trunk", "local-bf16@seed2+trunk", *scratch]  # the same runs, trunks first
    trunk = plan["local-bf16+trunk"]
    assert [flag(trunk, f) for f in ("--exit-interval", "--save-interval", "--seed")] == ["3", "3", "1234"]
    assert flag(trunk, "--save") == flag(trunk, "--load") == str(tmp_path / "local-bf16_trunk")  # a cut trunk resumes
    assert "--fp8-format" not in trunk and flag(plan["local-bf16@seed2+trunk"], "--seed") == "1235"
    for name, flags in plan.items():
        if not name.endswith("+trunk"):
            seed = "_seed2" if "@seed2" in name else ""
            assert flag(flags, "--load") == str(tmp_path / f"local-bf16{seed}_trunk") and "--save" not in flags
            assert flag(flags, "--seed") == ("1235" if seed else "1234")
    assert flag(plan["local-bf16+noise"], "--micro-batch-size") == "2"  # the noise floor's split, from the trunk


def test_branch_errors(capsys):
    for argv, message in [
        (["--branch-at", "-1"], "--branch-at -1: give a step >= 1, or 0"),
        (["--branch-at", "6"], "branch before the last step (--train-iters 6)"),
    ]:
        with pytest.raises(SystemExit):
            parity.main([*ARGS, "--configs", "local-delayed", *argv, "--dry-run"])
        assert message in capsys.readouterr().err


def test_the_presets_branch_half_way_unless_told(capsys, tmp_path):
    corpus = tmp_path / "parity"
    corpus.mkdir()
    (corpus / "parity_text_document.bin").write_bytes(b"")  # the plan only checks that the corpus is there
    flags = ["--preset", "llama-150m", "--data-dir", str(tmp_path), "--configs", "te-delayed", "--dry-run"]
    assert parity.main(flags) == 0
    plan = capsys.readouterr().out.splitlines()
    assert plan[0].startswith("te-bf16+trunk: ") and "--exit-interval 300" in plan[0]
    assert parity.main([*flags, "--branch-at", "0"]) == 0
    assert [line.split(":")[0] for line in capsys.readouterr().out.splitlines()] == ["te-bf16", "te-delayed"]


def test_a_saved_trunk_or_one_no_run_needs_is_not_trained(tmp_path):
    args = argparse.Namespace(branch_at=3)
    saved, fresh = tmp_path / "saved", tmp_path / "fresh"
    saved.mkdir()
    (saved / parity.TRACKER).write_text("3\n")
    plan = [("a+trunk", ["--save", str(saved)]), ("b+trunk", ["--save", str(fresh)])]
    plan += [("c+trunk", ["--save", str(fresh)]), ("x", []), ("y", [])]
    needs = {"x": "a+trunk", "y": "b+trunk", "z": "c+trunk"}  # z finished already: not in the plan
    assert [name for name, _ in parity.needed_trunks(plan, needs, args)] == ["b+trunk", "x", "y"]
    (saved / parity.TRACKER).write_text("2\n")  # a checkpoint of another step is not this trunk
    assert not parity.trunk_saved(["--save", str(saved)], 3)


def fake_runs(monkeypatch, fail: set[str]):
    """parity_runs.run_one replaced: records the order runs start in, and fails the runs named in `fail`."""
    started: list[str] = []
    lock = threading.Lock()

    def run_one(name, flags, setup, timeout, log_dir, env_line, launch):
        with lock:
            started.append(name)
        error = "boom" if name in fail else None
        return {"name": name, "error": error, "returncode": 1 if error else 0, "partial": False,
                "train": [[3, 1.0]], "valid": [[3, 1.0]], "parts": [], "wall_s": 0.0}  # fmt: skip

    monkeypatch.setattr(runs_module, "run_one", run_one)
    return started


@pytest.mark.parametrize("parallel", [1, 3])
def test_a_branch_starts_after_its_trunk_and_not_after_a_failed_one(monkeypatch, tmp_path, parallel):
    started = fake_runs(monkeypatch, fail={"t2"})
    args = argparse.Namespace(log_dir=tmp_path, deadline=None, results=tmp_path / "r.json", checkpoints=None,
                              timeout=60, parallel=parallel)  # fmt: skip
    plan = [("t1", []), ("t2", []), ("a", []), ("b", []), ("c", [])]
    needs = {"a": "t1", "b": "t2", "c": "t1"}
    results = {"runs": {}}
    failed, left = runs_module.train_all(plan, {}, args, results, "cpu", needs, {"t1": lambda: True})
    assert sorted(failed) == ["b", "t2"] and left == []
    assert "b" not in started and started.index("a") > started.index("t1") and started.index("c") > started.index("t1")
    assert sorted(results["runs"]) == ["a", "c", "t1", "t2"]  # a branch not trained leaves no record


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_run_out_of_gpu_memory_beside_others_is_trained_again_one_run_fewer_at_a_time(
    monkeypatch, tmp_path, parallel
):
    """b runs out of memory on its first try: beside another run, its worker ends and a's takes b when a ends; alone
    (--parallel 1) it fails as any run does."""
    started: list[str] = []
    requeued = threading.Event()

    def log(line, **kwargs):  # train_all's lines; b's requeue is the one a waits for
        if "out of GPU memory" in line:
            requeued.set()

    def run_one(name, flags, setup, timeout, log_dir, env_line, launch):
        started.append(name)
        if name == "a" and parallel > 1:
            requeued.wait(timeout=10)  # a ends only after b's failure is handled (or the retry never came)
        error = "torch.OutOfMemoryError: CUDA out of memory." if started.count(name) == 1 and name == "b" else None
        return {"name": name, "error": error, "returncode": 1 if error else 0, "partial": False,
                "train": [[3, 1.0]], "valid": [[3, 1.0]], "parts": [], "wall_s": 0.0}  # fmt: skip

    monkeypatch.setattr(runs_module, "run_one", run_one)
    monkeypatch.setattr(runs_module, "print", log, raising=False)
    args = argparse.Namespace(log_dir=tmp_path, deadline=None, results=tmp_path / "r.json", checkpoints=None,
                              timeout=60, parallel=parallel)  # fmt: skip
    results = {"runs": {}}
    failed, left = runs_module.train_all([("a", []), ("b", [])], {}, args, results, "cpu")
    if parallel == 1:
        assert failed == ["b"] and started == ["a", "b"]
    else:
        assert failed == [] and left == [] and started.count("b") == 2 and results["runs"]["b"]["error"] is None


def test_an_unsaved_trunk_counts_as_unfinished(monkeypatch, tmp_path):
    fake_runs(monkeypatch, fail=set())
    args = argparse.Namespace(log_dir=tmp_path, deadline=None, results=tmp_path / "r.json", checkpoints=None,
                              timeout=60, parallel=1)  # fmt: skip
    results = {"runs": {}}
    failed, left = runs_module.train_all([("t", []), ("a", [])], {}, args, results, "cpu", {"a": "t"},
                                         {"t": lambda: False})  # fmt: skip
    assert results["runs"]["t"]["partial"] and left == ["t"] and failed == ["a"]  # "a" is not left waiting
    assert "a" not in results["runs"]


def test_the_report_leaves_the_trunks_out_of_the_pairs():
    def run(valid):
        return {"error": None, "valid": valid, "train": valid, "seed": 1234}

    runs = {"te-bf16+trunk": run([[3, 5.0]]), "te-bf16": run([[6, 4.0]]), "te-delayed": run([[6, 4.04]])}
    assert [(c.base, round(c.final.mean, 6)) for c in report.compare(runs)] == [("te-delayed", 1.0)]
    assert Path(parity.DEFAULT_TRUNKS).name == "trunks"
