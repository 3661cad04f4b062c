"""scripts/pstats_diff.py: two host profiles compared function by function."""

import cProfile
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "pstats_diff.py"
spec = importlib.util.spec_from_file_location("pstats_diff", SCRIPT)
pstats_diff = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pstats_diff)


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def extra_work() -> None:
    busy(0.01)


def _profile(path: Path, calls: int) -> Path:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(2):  # steps
        for _ in range(calls):
            extra_work()
        busy(0.005)
    profiler.disable()
    profiler.dump_stats(path)
    return path


def test_the_function_one_side_runs_more_leads_with_its_calls_per_step(tmp_path):
    first = pstats_diff.functions(_profile(tmp_path / "a.pstats", calls=3))
    second = pstats_diff.functions(_profile(tmp_path / "b.pstats", calls=1))
    lines = pstats_diff.diff_lines(first, second, steps=2, top=3)
    assert lines[0].startswith("own time per step: ")
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| function")]
    deltas = [float(row.split("|")[2]) for row in rows]
    assert deltas[:3] == sorted(deltas[:3], reverse=True) and deltas[0] > 0, rows  # most more first
    extra = next(row for row in rows if row.startswith("| test_pstats_diff.py") and " extra_work " in row)
    assert extra.endswith("| 3, 1 |"), extra


def test_a_missing_profile_is_a_one_line_error(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "a"), str(tmp_path / "b")], capture_output=True)
    assert run.returncode == 2 and b"no such profile" in run.stderr.splitlines()[-1]
