"""Megatron-LM's checkpoint and scheduler flags: each flag's meaning, without a training run (the runs are
in tests/e2e/test_megatron_ckpt_flags.py)."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from megatron.checkpoint import CheckpointError, save_checkpoint, select_checkpoint
from megatron.checkpoint.dist_planner import ChunkLoadPlanner, ChunkSavePlanner
from megatron.checkpoint.integrity import Retention
from megatron.config import ConfigError, parse_args
from megatron.config.optimizer import resolve_schedule

BASE = "--mock-data --vocab-size 128 --train-iters 10"


def _cfg(flags: str = ""):
    return parse_args(f"{BASE} {flags}".split())


def test_defaults_and_flags_parse():
    ckpt = _cfg().checkpoint
    assert ckpt.ckpt_fully_parallel_save and ckpt.async_strategy == "mcore" and not ckpt.verify_integrity
    flags = (
        "--use-checkpoint-opt_param-scheduler --dist-ckpt-optim-fully-reshardable --ckpt-fully-parallel-load"
        " --no-ckpt-fully-parallel-save --ckpt-assume-constant-structure --verify-integrity --async-strategy nvrx"
        " --save x --save-interval 5 --save-retain-interval 10"
    )
    ckpt = _cfg(flags).checkpoint
    assert ckpt.use_checkpoint_opt_param_scheduler and not ckpt.ckpt_fully_parallel_save
    assert ckpt.save_retain_interval == 10 and ckpt.verify_integrity and ckpt.ckpt_fully_parallel_load
    assert _cfg("--ckpt-fully-parallel-save --override-opt_param-scheduler").checkpoint.ckpt_fully_parallel_save


@pytest.mark.parametrize(
    "flags, match",
    [
        ("--use-checkpoint-opt_param-scheduler --override-opt_param-scheduler", "contradict each other"),
        ("--async-save --async-strategy nvrx --save x", "--async-strategy nvrx .*choices: mcore"),
        ("--async-strategy fast", "invalid choice: 'fast'"),
        ("--save x --save-interval 4 --save-retain-interval 6", "multiple of --save-interval 4"),
        ("--save-retain-interval 4", "needs --save DIR"),
        ("--save x --save-retain-interval 0", "must be >= 1"),
    ],
)
def test_values_that_cannot_work_are_one_line(flags, match):
    with pytest.raises(ConfigError, match=match) as err:
        _cfg(flags)
    assert "\n" not in str(err.value)


def test_the_schedule_comes_from_the_flags_or_the_checkpoint():
    flags = _cfg("--lr 2e-3 --lr-decay-style linear").optimizer
    saved = dict(vars(_cfg("--lr 1e-3").optimizer))
    kept, differ = resolve_schedule(flags, saved, use_checkpoint=False)
    assert kept is flags and differ == {"lr": (2e-3, 1e-3), "lr_decay_style": ("linear", "cosine")}
    taken, _ = resolve_schedule(flags, saved, use_checkpoint=True)
    assert (taken.lr, taken.lr_decay_style, taken.weight_decay) == (1e-3, "cosine", flags.weight_decay)
    saved_longer = dict(saved, lr=2e-3, lr_decay_style="linear", lr_decay_iters=20)  # --lr-decay-iters counts
    assert resolve_schedule(flags, saved_longer, True)[0].lr_decay_iters == 20
    with pytest.raises(ConfigError, match="the checkpoint's lr is"):
        resolve_schedule(flags, dict(saved, lr=[1]), True)


def _save(root, iteration, retain=None):
    save_checkpoint(str(root), iteration, {"x": torch.full((8,), float(iteration))}, writer=True, retain=retain)


def _kept(root):
    return sorted(int(p.name[5:]) for p in root.glob("iter_*"))


def test_save_retain_interval_keeps_its_multiples_and_the_latest(tmp_path):
    for iteration in range(2, 14, 2):
        _save(tmp_path / "a", iteration, Retention(interval=4))
    assert _kept(tmp_path / "a") == [4, 8, 12]
    _save(tmp_path / "a", 14, Retention(interval=4))
    assert _kept(tmp_path / "a") == [4, 8, 12, 14]
    for iteration in range(1, 11):  # with --save-retain-last 2 as well: kept by either rule
        _save(tmp_path / "b", iteration, Retention(last=2, interval=4))
    assert _kept(tmp_path / "b") == [4, 8, 9, 10]


def test_verify_integrity_refuses_instead_of_falling_back(tmp_path):
    _save(tmp_path, 2)
    _save(tmp_path, 4)
    path = tmp_path / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    assert select_checkpoint(str(tmp_path)) == 2  # without the flag: the newest older one that verifies
    with pytest.raises(CheckpointError, match=r"--verify-integrity: .*iteration 4 .*CRC-32") as err:
        select_checkpoint(str(tmp_path), strict=True)
    assert "\n" not in str(err.value)
    (tmp_path / "iter_0000002" / "metadata.json").write_text('{"layout": {"tp": 1, "pp": 1, "dp": 1}}')
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    assert select_checkpoint(str(tmp_path)) == 2  # no checksums: loaded unverified, with a note
    with pytest.raises(CheckpointError, match="--verify-integrity: .*iteration 2 .*has no checksums"):
        select_checkpoint(str(tmp_path), strict=True)


def _writes(fully_parallel: bool) -> list[list[str]]:
    """The entries each of two ranks writes when both hold the same two replicated tensors (data-parallel
    replicas) and one shard of their own."""
    plans = []
    planners = []
    for rank in range(2):
        state = {"a": torch.ones(100), "b": torch.ones(100), f"own{rank}": torch.ones(10)}
        where = {"a": ("a", (100,), (0,)), "b": ("b", (100,), (0,)), f"own{rank}": ("own", (20,), (rank * 10,))}
        planner = ChunkSavePlanner(where, fully_parallel)
        planner.set_up_planner(state, None, rank == 0)
        plans.append(planner.create_local_plan())
        planners.append(planner)
    global_plans, _ = planners[0].create_global_plan(plans)
    return [sorted(item.index.fqn for item in plan.items) for plan in global_plans]


def test_fully_parallel_save_spreads_the_replicas_over_the_ranks():
    assert _writes(fully_parallel=True) == [["a", "own"], ["b", "own"]]  # Megatron-LM's default
    assert _writes(fully_parallel=False) == [["a", "b", "own"], ["own"]]  # --no-ckpt-fully-parallel-save


def test_every_rank_reads_only_its_own_chunks(tmp_path):
    """--ckpt-fully-parallel-load's behaviour, always: a rank asks storage only for what overlaps its chunk."""
    full = torch.arange(32.0).reshape(8, 4)
    state = {"w#0": full[:4].clone(), "w#1": full[4:].clone()}
    where = {"w#0": ("w", (8, 4), (0, 0)), "w#1": ("w", (8, 4), (4, 0))}
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path), planner=ChunkSavePlanner(where), no_dist=True)
    mine = {"w#1": torch.zeros(4, 4)}  # rank 1 of a two-way split: rows 4..7
    planner = ChunkLoadPlanner({"w#1": ("w", (8, 4), (4, 0))})
    reader = FileSystemReader(tmp_path)
    planner.set_up_planner(mine, reader.read_metadata(), True)
    reads = planner.create_local_plan().items
    assert [tuple(r.storage_index.offset) for r in reads] == [(4, 0)]  # the chunk at row 4, not row 0's
    dcp.load(mine, storage_reader=FileSystemReader(tmp_path), planner=planner, no_dist=True)
    assert torch.equal(mine["w#1"], full[4:])


def test_help_text_documents_each_flag():
    from megatron.config import build_parser

    text = build_parser().format_help()
    for flag in ("--use-checkpoint-opt_param-scheduler", "--override-opt_param-scheduler", "--verify-integrity"):
        assert flag in text
    assert "already the behaviour" in text and "mcore" in text
