"""Every crash point of a save (tests/e2e/crash_points.py): killed before each file-system call of a first save, a
next save with a retention delete, and a re-save, in the torch format, torch_dist, and torch_dist with --async-save,
the folder loads the checkpoint `latest` names and takes a later save; the flushes a power loss needs are in order."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_save_killed_at_any_call_loses_no_checkpoint(tmp_path):
    driver = ROOT / "tests" / "e2e" / "crash_points.py"
    cmd = [sys.executable, str(driver), "--workdir", str(tmp_path), "--jobs", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["failures"] == [], "\n".join(result["failures"][:20])
    assert len(result["ops"]) == 9, result["ops"]  # 3 scenarios x (torch, torch_dist, torch_dist --async-save)
    assert min(result["ops"].values()) >= 15, result["ops"]  # the calls were recorded: each save makes 20 or more
