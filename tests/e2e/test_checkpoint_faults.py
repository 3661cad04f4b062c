"""Fault injection (tests/e2e/checkpoint_faults.py): kill -9 at random points of training and saving, damaged files
and a full disk; every restart resumes from the last good checkpoint and reproduces the uninterrupted run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_faults_never_lose_a_checkpoint_or_fail_silently(tmp_path):
    driver = ROOT / "tests" / "e2e" / "checkpoint_faults.py"
    # Two trials at a time: each run trains on one thread, and the driver waits (two cores)
    cmd = [sys.executable, str(driver), "--trials", "20", "--seed", "19", "--workdir", str(tmp_path), "--jobs", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    print(out.stdout[-3000:], out.stderr[-3000:])
    assert out.returncode == 0, out.stderr[-2000:]
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    assert counts["silent failures"] == 0, out.stdout
    assert counts["iterations lost"] == 0, out.stdout
    assert counts["faults injected"] >= 20, counts  # kills that landed before the run ended, plus 6 damages
    assert counts["runs recovered"] == counts["faults injected"], counts
