"""Rank and world from Slurm's variables when `srun` starts one process per task (megatron/parallel/launch.py)."""

from __future__ import annotations

import pytest

from megatron.errors import UserError
from megatron.parallel import launch

# What `srun --ntasks 4 --ntasks-per-node 2` gives the task with global rank 3 (second node, second task).
SRUN_TASK = {
    "SLURM_PROCID": "3",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_NTASKS": "4",
    "SLURM_JOB_ID": "123456",
}


def hosts(nodelist: str) -> str:
    assert nodelist == "gpu[07-08]"
    return "gpu07"


def test_srun_task_takes_rank_world_local_rank_and_rendezvous_from_slurm() -> None:
    env = dict(SRUN_TASK)
    assert launch.world_size(env) == 4
    task = launch.adopt_slurm_env(env, resolve_host=hosts)
    assert task == launch.SlurmTask(rank=3, world_size=4, local_rank=1)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("3", "4", "1", "2")
    assert env["MASTER_ADDR"] == "gpu07"
    assert env["MASTER_PORT"] == str(launch.default_port("123456"))
    assert 1024 < int(env["MASTER_PORT"]) < 65536


def test_exported_master_addr_and_port_are_kept() -> None:
    env = dict(SRUN_TASK, MASTER_ADDR="10.0.0.1", MASTER_PORT="29501")
    launch.adopt_slurm_env(env, resolve_host=lambda _: pytest.fail("must not resolve"))
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "29501")


def test_torchrun_variables_win_over_slurm() -> None:
    # `srun torchrun`: every worker also inherits SLURM_PROCID of its node's one srun task.
    env = dict(SRUN_TASK, RANK="5", WORLD_SIZE="16", LOCAL_RANK="5")
    before = dict(env)
    assert launch.world_size(env) == 16
    assert launch.adopt_slurm_env(env, resolve_host=hosts) is None
    assert env == before


def test_batch_script_itself_is_a_single_process() -> None:
    # The batch step has SLURM_NTASKS and SLURM_PROCID=0 but no SLURM_STEP_NUM_TASKS: python run there is alone.
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "7"}
    assert launch.world_size(env) == 1
    assert launch.adopt_slurm_env(env) is None
    assert "RANK" not in env
    assert launch.world_size({}) == 1


def test_single_task_step_needs_no_rendezvous() -> None:
    env = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_LOCALID": "0"}
    launch.adopt_slurm_env(env, resolve_host=lambda _: pytest.fail("must not resolve"))
    assert env["WORLD_SIZE"] == "1" and "MASTER_ADDR" not in env


def test_missing_node_list_is_one_line_error() -> None:
    env = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0"}
    with pytest.raises(UserError, match="MASTER_ADDR"):
        launch.adopt_slurm_env(env)


def test_first_host_expands_with_scontrol(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch.shutil, "which", lambda _: None)
    with pytest.raises(UserError, match="scontrol is not on PATH"):
        launch.first_host("gpu[07-08]")
