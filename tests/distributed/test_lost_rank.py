"""A rank killed with SIGKILL mid-run: the surviving rank, blocked in a collective with it, exits promptly with a
non-zero status and one line naming the likely cause (no hang, no backend traceback)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

from tests.assets.data_helpers import ROOT

TINY = (
    "--mock-data --vocab-size 128 --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32"
    " --micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --eval-iters 1 --eval-interval 100000 --log-interval 1"
    " --train-iters 3000"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_survivor_of_a_killed_rank_exits_with_one_line():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", WORLD_SIZE="2")
    env["MASTER_PORT"] = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-u", str(ROOT / "pretrain_gpt.py"), *TINY.split()],
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        survivor, victim = procs
        assert survivor.stdout is not None
        for line in survivor.stdout:  # rank 0 prints the progress lines
            if re.search(r"iteration\s+3/", line):
                break
        victim.send_signal(signal.SIGKILL)
        start = time.monotonic()
        out, err = survivor.communicate(timeout=60)
        seconds = time.monotonic() - start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert survivor.returncode == 4, (out[-2000:], err[-2000:])
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith("pretrain_gpt.py: error: rank 0: a collective failed, most likely because another rank")
    assert seconds < 60
