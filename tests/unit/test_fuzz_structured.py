"""Every hostile file is refused in one line, part three (parts one and two: test_fuzz_inputs.py, test_fuzz_foreign.py):
inputs that are well-formed JSON, pickles, .npy and .idx headers but hostile by structure (depth, size, type
confusion, shared references, object dtypes), for every kind of file training and conversion read
(tests/unit/fuzz_structures.py). One worker process runs them all under a memory and a per-case time cap
(tests/unit/fuzz_worker.py): no case may kill it, exhaust the cap, run over time or end in a traceback."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.unit.fuzz_worker import COUNTS

ROOT = Path(__file__).resolve().parents[2]
SEED = 20261201


def test_structure_aware_fuzzing_finds_no_crash_and_no_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("MEGATRON_TRUST_CHECKPOINT", None)  # the hostile files must meet the loaders a user meets
    run = subprocess.run([sys.executable, "-m", "tests.unit.fuzz_worker", str(tmp_path), str(SEED)],
                         capture_output=True, text=True, timeout=1200, cwd=ROOT, env=env)  # fmt: skip
    lines = run.stdout.splitlines()
    started = [line.split(" ", 1)[1] for line in lines if line.startswith("start ")]
    finished = [m.groups() for m in map(re.compile(r"(loaded|refused|FAIL) (.+)#\d+ ").match, lines) if m]
    reproduce = f"(alone: python -m tests.unit.fuzz_worker DIR {SEED} '<case id>')"
    if run.returncode != 0:
        last = started[-1] if len(started) > len(finished) else "none (it died between cases)"
        raise AssertionError(
            f"the worker ended with {run.returncode} (a negative code is a signal) in case {last} {reproduce}:\n"
            + run.stderr[-3000:]
        )
    failures = [line for line in lines if line.startswith("FAIL ")]
    assert not failures, f"{len(failures)} cases failed {reproduce}:\n" + "\n".join(failures[:40])
    outcomes = collections.Counter((kind, outcome) for outcome, kind in finished)
    print(f"\nstructure-aware cases: {len(finished)}")
    for kind in COUNTS:
        print(f"  {kind}: {outcomes[kind, 'refused']} refused, {outcomes[kind, 'loaded']} loaded")
    assert len(finished) == sum(COUNTS.values()) >= 5000
    for kind in COUNTS:  # the hostile inputs reach the checks: most are refused (the index cache rebuilds instead,
        # a preprocess line is reported and skipped)
        if not kind.startswith("index cache") and kind != "preprocess line":
            assert outcomes[kind, "refused"] >= COUNTS[kind] // 4, (kind, outcomes[kind, "refused"])
    for kind in ("DCP .metadata", "foreign pickle (Megatron-LM, HF .bin)", "own pickle (weights only)"):
        assert outcomes[kind, "loaded"] > 0, f"no {kind} case loaded: the fixture itself is refused"
