"""Rank, world size and rendezvous address from the launcher: torchrun's variables, or Slurm's under `srun`.

torchrun (and `srun torchrun`) sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for each worker; they
win whenever they are present. When `srun` starts one process per GPU itself, only Slurm's variables are there:
SLURM_PROCID (global rank), SLURM_STEP_NUM_TASKS (processes in this step) and SLURM_LOCALID (rank on this node).

SLURM_STEP_NUM_TASKS rather than SLURM_NTASKS: the batch script itself sees SLURM_NTASKS (the allocation's task
count) and SLURM_PROCID=0 but is not one of the step's processes; a plain `python pretrain_gpt.py` there must stay a
single process, not wait forever for peers that were never started. Only `srun` sets the STEP_ variables.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass

from megatron.errors import UserError


@dataclass(frozen=True)
class SlurmTask:
    """This process's place in an `srun` step of one process per task."""

    rank: int
    world_size: int
    local_rank: int


def slurm_task(env: Mapping[str, str] = os.environ) -> SlurmTask | None:
    """This process's rank and world under `srun`, or None when torchrun's variables are set or `srun` did not start
    it."""
    if "RANK" in env or "WORLD_SIZE" in env:
        return None
    names = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID")
    if not all(name in env for name in names):
        return None
    rank, world, local = (int(env[name]) for name in names)
    return SlurmTask(rank=rank, world_size=world, local_rank=local)


def world_size(env: Mapping[str, str] = os.environ) -> int:
    """The number of processes the launcher started: WORLD_SIZE, else the `srun` step's task count, else 1."""
    if "WORLD_SIZE" in env:
        return int(env["WORLD_SIZE"])
    task = slurm_task(env)
    return task.world_size if task else 1


def rank(env: Mapping[str, str] = os.environ) -> int:
    """This process's global rank as the launcher set it, before any process group exists: RANK, else the `srun`
    task's rank, else 0."""
    if "RANK" in env:
        return int(env["RANK"])
    task = slurm_task(env)
    return task.rank if task else 0


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list ("gpu[01-04]" -> "gpu01"), expanded by `scontrol show hostnames`."""
    if shutil.which("scontrol") is None:
        raise UserError(
            f"srun launch: MASTER_ADDR is not set and scontrol is not on PATH to expand SLURM_STEP_NODELIST "
            f"({nodelist}); export MASTER_ADDR=<first node's hostname> before srun"
        )
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()[0]


def default_port(job_id: str) -> int:
    """A rendezvous port every task of a job agrees on and that differs between jobs sharing a node."""
    return 20000 + int(job_id) % 20000


def adopt_slurm_env(
    env: MutableMapping[str, str] = os.environ, resolve_host: Callable[[str], str] = first_host
) -> SlurmTask | None:
    """Under `srun` without torchrun, set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    from Slurm's variables so that torch.distributed's env:// rendezvous and everything reading LOCAL_RANK work
    unchanged. MASTER_ADDR and MASTER_PORT are kept when the job script exported them. Returns the task, or None
    (env untouched) when torchrun's variables are present or this is no `srun` step."""
    task = slurm_task(env)
    if task is None:
        return None
    env["RANK"] = str(task.rank)
    env["WORLD_SIZE"] = str(task.world_size)
    env["LOCAL_RANK"] = str(task.local_rank)
    if "SLURM_STEP_TASKS_PER_NODE" in env and "SLURM_NODEID" in env:
        # "4(x2),3": per-node counts in node order; LOCAL_WORLD_SIZE is this node's.
        counts: list[int] = []
        for part in env["SLURM_STEP_TASKS_PER_NODE"].split(","):
            n, _, times = part.partition("(x")
            counts += [int(n)] * (int(times.rstrip(")")) if times else 1)
        node = int(env["SLURM_NODEID"])
        if node < len(counts):
            env["LOCAL_WORLD_SIZE"] = str(counts[node])
    if task.world_size > 1:
        if "MASTER_ADDR" not in env:
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
            if not nodelist:
                raise UserError("srun launch: MASTER_ADDR is not set and Slurm gave no node list; export MASTER_ADDR")
            env["MASTER_ADDR"] = resolve_host(nodelist)
        if "MASTER_PORT" not in env:
            env["MASTER_PORT"] = str(default_port(env.get("SLURM_JOB_ID", "0")))
    return task
