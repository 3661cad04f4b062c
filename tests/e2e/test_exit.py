"""Every way out of a DP=2 FP8 CPU run ends in an orderly exit: the last step (the soak's twelve variants),
--exit-interval, a SIGTERM to every rank (Slurm's preemption), a diverged run. Each rank exits with its code (0, or 3
for the divergence), no rank aborts with "terminate called without an active exception", and no communication thread
is left running once pretrain_gpt.py's main returns (megatron/training/shutdown.py says why that matters). The soak
repeats the finished launch 20 times over the variants most prone to abort (scripts/probes/exit_soak.sh)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from megatron.checkpoint import latest_iteration
from tests.assets.data_helpers import ROOT

FLAGS = (
    "--mock-data --vocab-size 128 --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32"
    " --micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --lr-warmup-iters 2 --log-interval 1 --eval-iters 1"
    " --eval-interval 1000 --seed 1234 --position-embedding-type rope --normalization RMSNorm --swiglu"
    " --disable-bias-linear --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2"
    " --transformer-impl local --use-distributed-optimizer --fp8-format hybrid"
)
PROBE = str(ROOT / "tests" / "assets" / "exit_probe.py")
# gloo_tcp_loop, pt_gloo_runloop, pt_tcpstore_uv (rank 0's store), NCCL's
COMMUNICATION_THREADS = re.compile(r"gloo|nccl|tcpstore", re.IGNORECASE)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)


def _check_orderly(out: str, ranks: int = 2) -> None:
    assert "terminate called" not in out, out
    # A list holds no "]" (thread names), so a line that still ran into the next rank's stays two matches.
    threads = re.findall(r"threads after main, rank (\d+): (\[[^\]]*\])", out)
    assert sorted(int(rank) for rank, _ in threads) == list(range(ranks)), out
    for rank, names in threads:
        assert not COMMUNICATION_THREADS.search(names), f"rank {rank} still runs {names}"


def _torchrun(args: str, timeout: int = 300) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(_free_port()), PROBE, *args.split()]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout, cwd=ROOT)
    return proc.returncode, proc.stdout + proc.stderr


def _launch_ranks(args: str, tmp_path) -> list[tuple[subprocess.Popen, object]]:
    """Two ranks started as srun starts them (no torchrun): each its own process, signalled on its own."""
    port = str(_free_port())
    ranks = []
    for rank in range(2):
        log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115 - closed by _finish
        env = _env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        cmd = [sys.executable, "-u", PROBE, *args.split()]
        ranks.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT), log))
    return ranks


def _finish(ranks, tmp_path, timeout: int = 300) -> tuple[list[int], str]:
    codes = [proc.wait(timeout=timeout) for proc, _ in ranks]
    for _, log in ranks:
        log.close()
    return codes, "".join((tmp_path / f"rank{rank}.log").read_text() for rank in range(len(ranks)))


def test_exit_interval_exits_zero(tmp_path):
    args = f"{FLAGS} --fp8-recipe tensorwise --fp8-param-gather --train-iters 20 --exit-interval 3"
    code, out = _torchrun(f"{args} --save {tmp_path} --ckpt-format torch")
    assert code == 0, out
    assert "> exiting at iteration 3 (--exit-interval 3)" in out
    _check_orderly(out)


def test_sigterm_to_every_rank_saves_and_exits_zero(tmp_path):
    save = tmp_path / "ckpt"
    args = f"{FLAGS} --fp8-recipe delayed --train-iters 3000 --exit-signal-handler --save {save} --save-interval 100000"
    ranks = _launch_ranks(f"{args} --async-save", tmp_path)
    deadline = time.monotonic() + 240
    while not re.search(r"iteration\s+3/", (tmp_path / "rank0.log").read_text()):
        assert time.monotonic() < deadline and all(proc.poll() is None for proc, _ in ranks)
        time.sleep(0.2)
    for proc, _ in ranks:
        proc.send_signal(signal.SIGTERM)
    codes, out = _finish(ranks, tmp_path)
    assert codes == [0, 0], out
    stopped = re.search(r"exiting program at iteration (\d+) after receiving SIGTERM", out)
    assert stopped, out
    assert latest_iteration(str(save)) == int(stopped.group(1))  # the --async-save write finished and published
    _check_orderly(out)


def test_a_diverged_run_exits_three_on_every_rank(tmp_path):
    args = f"{FLAGS} --fp8-recipe delayed --lr 1e4 --train-iters 60 --max-consecutive-skipped-iterations 1"
    ranks = _launch_ranks(args, tmp_path)
    codes, out = _finish(ranks, tmp_path)
    assert codes == [3, 3], out
    assert "the run diverged" in out
    _check_orderly(out)


@pytest.mark.slow
def test_twelve_finished_launches_all_exit_zero_with_no_communication_thread_left(tmp_path):
    """scripts/probes/exit_soak.sh: each of its 12 variants (recipe x --fp8-param-gather x checkpoint format, delayed
    with a torch_dist --async-save among them) once, two at a time (20 launches took 109 s of the suite's 15 minutes;
    longer soaks: run the script with a larger N), through the probe: every rank of every launch lists its threads."""
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "probes" / "exit_soak.sh"), "12", str(tmp_path)],
        capture_output=True,
        text=True,
        env=_env(SOAK_PYTHON=sys.executable, SOAK_JOBS="2", SOAK_SCRIPT=PROBE),
        timeout=1200,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "exit soak: 0 of 12 launches failed" in proc.stdout
    for i in range(12):
        _check_orderly((tmp_path / f"run{i}.log").read_text())
