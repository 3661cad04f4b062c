"""A real one-node Slurm (scripts/slurm_local_cluster.sh) runs the project's own examples/pretrain_gpt.sbatch.

1. torchrun launch, two gloo processes, a tiny CPU model: the job completes from a fresh directory (its log goes to
   the submit directory, no GPU request) and logs finite losses for every iteration.
2. srun launch (rank and world from SLURM_*): `scancel --batch --signal=USR1` mid-run, as Slurm's
   `--signal=B:USR1@120` does before a time limit. The script forwards the signal, training saves and exits 0, the
   script requeues the job, and the requeued job resumes from the saved iteration: losses before and after the
   interruption are identical to run 1's, iteration by iteration.

Skipped (with the reason) when Slurm cannot be set up: not root, not Linux, or slurm-wlm/munge missing and apt-get
unable to install them. Part 2 needs --exit-signal-handler; without it in the CLI it skips naming the flag.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatron.config.cli import all_flags

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SETUP = REPO / "scripts" / "slurm_local_cluster.sh"
SBATCH_SCRIPT = REPO / "examples" / "pretrain_gpt.sbatch"
ITERS = 300
TINY = (
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 256 --num-layers 1 --hidden-size 32"
    " --num-attention-heads 2 --seq-length 32 --max-position-embeddings 32 --micro-batch-size 2"
    f" --global-batch-size 4 --train-iters {ITERS} --lr 1e-3 --log-interval 1 --save-interval 100000"
    " --eval-iters 0 --hidden-dropout 0 --attention-dropout 0"
).split()
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*\| lm loss: (\S+) \|")


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    if not sys.platform.startswith("linux"):
        pytest.skip("Slurm runs on Linux only")
    if os.geteuid() != 0:
        pytest.skip("starting slurmctld/slurmd needs root (CI runs as root; as a user: sudo " + str(SETUP) + " start)")
    state = tmp_path_factory.mktemp("slurm-local")
    env = dict(os.environ, SLURM_LOCAL_DIR=str(state), SLURM_CONF=str(state / "slurm.conf"))
    # A cluster the user already runs from this script on the default ports would collide: use other ports.
    env.update(SLURM_LOCAL_CTLD_PORT="16817", SLURM_LOCAL_SLURMD_PORT="16818")
    started = subprocess.run(["bash", str(SETUP), "start"], env=env, capture_output=True, text=True, timeout=600)
    if started.returncode != 0:
        lines = (started.stderr or started.stdout).strip().splitlines()
        pytest.skip(f"no local Slurm: {lines[-1] if lines else 'slurm_local_cluster.sh start failed'}")
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", NPROC_PER_NODE="2", OMP_NUM_THREADS="1")
    try:
        yield env
    finally:
        subprocess.run(["bash", str(SETUP), "stop"], env=env, capture_output=True, timeout=60)


def submit(env: dict[str, str], workdir: Path, **overrides: str) -> str:
    workdir.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(
        ["sbatch", "--parsable", "--chdir", str(workdir), str(SBATCH_SCRIPT), *TINY],
        env=dict(env, **overrides),
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().split(";")[0]


def job_field(env: dict[str, str], job: str, name: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True).stdout
    found = re.search(rf"\b{name}=(\S+)", out)
    return found.group(1) if found else ""


def wait_done(env: dict[str, str], job: str, timeout: float = 240) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_field(env, job, "JobState")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"):
            return state
        time.sleep(0.5)
    subprocess.run(["scancel", job], env=env)
    raise AssertionError(f"job {job} did not finish within {timeout} s (state {job_field(env, job, 'JobState')})")


def log_of(workdir: Path, job: str) -> str:
    path = workdir / f"pretrain-gpt-{job}.out"
    return path.read_text() if path.exists() else ""


def losses(text: str) -> dict[int, str]:
    return {int(it): loss for it, loss in LOSS.findall(text)}


@pytest.fixture(scope="module")
def reference(slurm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    workdir = tmp_path_factory.mktemp("reference")
    job = submit(slurm_env, workdir, LAUNCHER="torchrun", SIGNAL_FLAGS=signal_flags())
    state = wait_done(slurm_env, job)
    log = log_of(workdir, job)
    assert state == "COMPLETED", f"job {job} ended {state}:\n{log[-3000:]}"
    assert "world size 2" in log, log[-3000:]
    return losses(log)


def signal_flags() -> str:
    # Before --exit-signal-handler exists the reference run must not pass it (the script's default does).
    return "--exit-signal-handler --exit-signal SIGUSR1" if "--exit-signal-handler" in all_flags() else ""


def test_sbatch_script_trains_with_two_gloo_processes(reference: dict[int, str]) -> None:
    assert sorted(reference) == list(range(1, ITERS + 1))
    assert all(math.isfinite(float(loss)) for loss in reference.values())


def test_preempted_job_saves_requeues_and_resumes_with_identical_losses(
    slurm_env: dict[str, str], reference: dict[int, str], tmp_path: Path
) -> None:
    for flag in ("--exit-signal-handler", "--exit-signal"):
        if flag not in all_flags():
            pytest.skip(f"pretrain_gpt.py has no {flag} yet: the sbatch script's preemption path needs it")
    job = submit(slurm_env, tmp_path, LAUNCHER="srun")
    # Signal once training is under way (its handler is installed), well before the last iteration.
    deadline = time.monotonic() + 120
    while not losses(log_of(tmp_path, job)) and time.monotonic() < deadline:
        assert job_field(slurm_env, job, "JobState") in ("PENDING", "RUNNING"), log_of(tmp_path, job)
        time.sleep(0.2)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm_env, check=True)
    state = wait_done(slurm_env, job)
    log = log_of(tmp_path, job)
    assert state == "COMPLETED", f"job {job} ended {state}:\n{log[-3000:]}"
    assert job_field(slurm_env, job, "Restarts") == "1", log[-3000:]

    first, marker, second = log.partition("requeueing job")
    assert marker, f"the script did not requeue after the signal:\n{log[-3000:]}"
    saved = [int(it) for it in re.findall(r"successfully saved checkpoint at iteration\s+(\d+)", first)]
    assert saved and saved[-1] < ITERS, f"no checkpoint saved before the requeue:\n{first[-3000:]}"
    interrupted_at = saved[-1]
    assert f"loaded checkpoint from checkpoints/pretrain-gpt at iteration {interrupted_at}" in second, second[-3000:]
    before, after = losses(first), losses(second)
    assert max(before) == interrupted_at, "training went on past the checkpoint the signal saved"
    assert min(after) == interrupted_at + 1 and max(after) == ITERS
    combined = {**before, **after}
    differ = [(it, combined.get(it), ref) for it, ref in reference.items() if combined.get(it) != ref]
    assert not differ, f"(iteration, resumed run's loss, uninterrupted run's loss): {differ[:5]}"
