"""Context parallelism trains the single-process model: CP=2 on 2 gloo ranks, CP=2 x TP=2 (sequence parallel) and
CP=2 x DP=2 (distributed optimizer) on 4, same losses and gradients within fp32 tolerance (the tolerances and the
gradient assembly of test_parallel_layouts.py, with the context-parallel ranks counted as data-parallel replicas:
after the dp x cp reduction they hold the same gradients); checkpoints saved under CP resume exactly."""

from pathlib import Path

import torch
import torch.distributed as dist

from megatron.config import parse_args
from megatron.parallel import ParallelDims
from megatron.training import Trainer
from tests.dist_utils import run_distributed
from tests.distributed.test_parallel_layouts import BASE, FP8, GPT2, _check, _parse, _record

# With full loss masks and equal micro-batches the per-token mean is the mean of micro-batch means: same reference.
LAYOUTS_2 = {
    "cp2": "--context-parallel-size 2",
    "cp2_per_token": "--context-parallel-size 2 --calculate-per-token-loss",
}
LAYOUTS_4 = {
    "cp2_tp2": "--context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel",
    "cp2_dp2": "--context-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 3000",
    "cp2_pp2": "--context-parallel-size 2 --pipeline-model-parallel-size 2",
}


def _int_flag(flags: str, name: str) -> int:
    words = flags.split()
    return int(words[words.index(name) + 1]) if name in words else 1


def _coords(flags: str, rank: int, world_size: int) -> tuple[int, int, int]:
    """(tp rank, pp rank, rank in the dp x cp group) of `rank` under Megatron's tp-cp-dp-pp order."""
    tp, cp = _int_flag(flags, "--tensor-model-parallel-size"), _int_flag(flags, "--context-parallel-size")
    pp = _int_flag(flags, "--pipeline-model-parallel-size")
    dp = world_size // (tp * cp * pp)
    tp_rank, cp_rank, dp_rank = rank % tp, (rank // tp) % cp, (rank // (tp * cp)) % dp
    return tp_rank, rank // (tp * cp * dp), dp_rank * cp + cp_rank


def _resume(flags: str, world_size: int, ckpt: str) -> None:
    full = Trainer(_parse(f"{flags} --train-iters 4", world_size)).train()
    Trainer(_parse(f"{flags} --train-iters 4 --exit-interval 2 --save {ckpt}", world_size)).train()
    resumed = Trainer(_parse(f"{flags} --train-iters 4 --load {ckpt}", world_size)).train()
    assert [resumed.losses[i] for i in (3, 4)] == [full.losses[i] for i in (3, 4)]


def _check_rank_layout(rank: int) -> None:
    """Megatron's tp-cp-dp-pp order on 4 ranks: the groups each rank sees."""
    ranks = lambda group: None if group is None else dist.get_process_group_ranks(group)  # noqa: E731
    tp2 = ParallelDims.create(4, rank, tp=2, pp=1, cp=2)
    assert (tp2.tp_rank, tp2.cp_rank, tp2.dp, tp2.dp_cp_rank) == (rank % 2, rank // 2, 1, rank // 2)
    assert ranks(tp2.cp_group) == list(tp2.cp_ranks) == [rank % 2, rank % 2 + 2]
    assert ranks(tp2.dp_cp_group) == ranks(tp2.cp_group) and tp2.dp_group is None
    assert ranks(tp2.amax_group) == [0, 1, 2, 3] and ranks(tp2.mp_group) == ranks(tp2.tp_group)
    dp2 = ParallelDims.create(4, rank, tp=1, pp=1, cp=2)
    assert ranks(dp2.cp_group) == [rank - rank % 2, rank - rank % 2 + 1] and ranks(dp2.dp_group) == [
        rank % 2,
        rank % 2 + 2,
    ]
    assert ranks(dp2.dp_cp_group) == [0, 1, 2, 3] and dp2.dp_cp == 4 and dp2.dp_cp_rank == rank
    assert dp2.is_checkpoint_writer == (rank == 0)
    pp2 = ParallelDims.create(4, rank, tp=1, pp=2, cp=2)
    assert pp2.pp_ranks == (rank % 2, rank % 2 + 2) and ranks(pp2.dp_cp_group) == ranks(pp2.cp_group)


def _body(rank, world_size, out_dir, layouts, fp8_layouts, resume_layouts):
    if world_size == 4:
        _check_rank_layout(rank)
    for name, extra in layouts.items():
        for tag, flags in (("", f"{BASE} {extra}"), ("_fp8", f"{BASE} {extra}{FP8}")):
            if tag and name not in fp8_layouts:
                continue
            record = _record(flags, world_size)
            record["coords"] = _coords(flags, rank, world_size)
            torch.save(record, Path(out_dir, f"{name}{tag}.rank{rank}.pt"))
        for fmt in resume_layouts.get(name, ()):
            _resume(f"{GPT2} {extra} --ckpt-format {fmt}", world_size, str(Path(out_dir, f"ckpt_{name}_{fmt}")))


def test_cp2_matches_single_process_and_resumes(tmp_path):
    resume = {"cp2": ("torch", "torch_dist")}
    run_distributed(_body, world_size=2, args=(str(tmp_path), LAYOUTS_2, {"cp2"}, resume))
    _check(tmp_path, LAYOUTS_2, {"cp2"}, 2)


def test_cp2_with_tp2_and_with_dp2_match_single_process(tmp_path):
    resume = {"cp2_dp2": ("torch",)}
    run_distributed(_body, world_size=4, args=(str(tmp_path), LAYOUTS_4, set(), resume))
    _check(tmp_path, LAYOUTS_4, set(), 4)


def test_context_parallel_flags_parse():
    cfg = parse_args(f"{BASE} --context-parallel-size 2 --cp-comm-type p2p a2a all_gather a2a".split(), world_size=4)
    assert cfg.parallel.context_parallel_size == 2 and cfg.data_parallel_size == 2
    assert cfg.parallel.cp_comm_type == ["p2p", "a2a", "all_gather", "a2a"]
