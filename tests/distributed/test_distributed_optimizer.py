"""--use-distributed-optimizer (optimizer sharded over the data-parallel ranks): the same losses and gradients as
the single-process model under DP=2 (one bucket; and many small buckets with parameters cut by the shard
boundaries, reduced during the backward and all-gathered during the next forward, --overlap-param-gather),
TP=2 + SP x DP=2 and PP=2 x DP=2 (tied embeddings, whose two stage copies are sharded differently), at the fp32
tolerances of test_parallel_layouts.py; with FP8 (delayed) the same as the unsharded optimizer in the same layout
(loss rel 1e-5, gradients 1e-4 of each tensor's largest element: only the gradient norm's summation order
differs). FP8 is compared with the unsharded layout rather than with one process because data parallelism itself
changes FP8 gradients at the first steps: each rank's loss is averaged over fewer micro-batches, so its output
gradients are twice as large, and with the initial scale of 1 they round differently in e5m2's subnormal range
(plain DP=2 is off by 0.11 of a tensor's largest element at step 1). Save and resume reproduces the uninterrupted
run; --ckpt-format torch checkpoints of another optimizer layout fail with a message naming the fix."""

from pathlib import Path

import pytest
import torch

from megatron.checkpoint import CheckpointError
from megatron.config import ConfigError
from megatron.training import Trainer
from tests.dist_utils import run_distributed
from tests.distributed.test_parallel_layouts import BASE, _assemble, _check, _compare, _layouts_body, _parse
from tests.distributed.test_parallel_layouts import FP8 as FP8_FLAGS

DISTOPT = "--use-distributed-optimizer"
BUCKETS = "--overlap-grad-reduce --ddp-bucket-size 3000"
TP2_DP2 = "--tensor-model-parallel-size 2 --sequence-parallel --overlap-grad-reduce"
OVERLAP = f"{DISTOPT} --overlap-param-gather"  # the next forward waits for each bucket's all-gather (hooks)
LAYOUTS_2 = {"dp2_distopt": DISTOPT, "dp2_distopt_buckets": f"{OVERLAP} {BUCKETS}", "dp2_buckets": BUCKETS}
LAYOUTS_4 = {
    "tp2_dp2_distopt": f"{OVERLAP} {TP2_DP2}",
    "tp2_dp2": TP2_DP2,
    # Uneven stages and a wider vocabulary (WIDE_VOCAB), so the tied embedding's first-stage copy spans both
    # data-parallel shards while its last-stage copy lies in one: their gradients must be summed before the
    # reduce-scatter, or the two copies' averaged parts do not line up.
    "pp2_dp2_distopt": f"{DISTOPT} --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 1",
}
WIDE_VOCAB = "--vocab-size 511"
FP8_TOLS = (1e-5, 1e-4)


def _check_fp8_against_unsharded(tmp_path, sharded: str, unsharded: str) -> None:
    got, want = (
        [torch.load(p, weights_only=False) for p in sorted(tmp_path.glob(f"{n}_fp8.rank*.pt"))]
        for n in (sharded, unsharded)
    )
    _compare(_assemble(got), _assemble(want), *FP8_TOLS, label=f"{sharded}_fp8")


def test_two_rank_distributed_optimizer_matches_single_process(tmp_path):
    fp8, resume = {"dp2_distopt_buckets", "dp2_buckets"}, {"dp2_distopt_buckets"}
    run_distributed(_layouts_body, world_size=2, args=(str(tmp_path), LAYOUTS_2, fp8, resume))
    _check(tmp_path, LAYOUTS_2, set(), 2)
    _check_fp8_against_unsharded(tmp_path, "dp2_distopt_buckets", "dp2_buckets")


def test_four_rank_distributed_optimizer_matches_single_process(tmp_path):
    fp8 = {"tp2_dp2_distopt", "tp2_dp2"}
    args = (str(tmp_path), LAYOUTS_4, fp8, {"pp2_dp2_distopt"}, (), WIDE_VOCAB)
    run_distributed(_layouts_body, world_size=4, args=args)
    _check(tmp_path, LAYOUTS_4, set(), 4, impl=WIDE_VOCAB)
    _check_fp8_against_unsharded(tmp_path, "tp2_dp2_distopt", "tp2_dp2")


# The torch format's per-rank optimizer files fit only their own layout (torch_dist reshards: test_dist_checkpoint.py)
FLAGS = f"{BASE} --train-iters 2 --bf16 --ddp-bucket-size 3000 --ckpt-format torch"


def _checkpoint_body(rank, world_size, out_dir):
    plain, sharded = Path(out_dir, "plain"), Path(out_dir, "sharded")
    trainer = Trainer(_parse(f"{FLAGS} {DISTOPT} --save {sharded}", world_size))
    # Each rank keeps the fp32 main copy and Adam moments of about half of the parameters (shards are padded).
    total = sum(p.numel() for p in trainer.optimizer.params)
    held = sum(m.numel() for m in trainer.optimizer.main_params)
    assert total / 2 - 3 * 128 <= held <= total / 2 + 3 * 128, (held, total)
    trainer.train()
    Trainer(_parse(f"{FLAGS} --save {plain}", world_size)).train()
    with pytest.raises(CheckpointError, match="its optimizer state is sharded .* add --use-distributed-optimizer"):
        Trainer(_parse(f"{FLAGS} --load {sharded} --train-iters 3", world_size))
    with pytest.raises(CheckpointError, match="holds no distributed-optimizer shard .* --no-load-optim"):
        Trainer(_parse(f"{FLAGS} {DISTOPT} --load {plain} --train-iters 3", world_size))
    # Weights move between the two: the optimizer starts afresh from them.
    resumed = Trainer(_parse(f"{FLAGS} --load {sharded} --no-load-optim --train-iters 3", world_size))
    assert resumed.state.iteration == 2


def test_distributed_optimizer_checkpoints_refuse_another_layout(tmp_path):
    run_distributed(_checkpoint_body, world_size=2, args=(str(tmp_path),))
    with pytest.raises(CheckpointError, match="saved with data-parallel size 2, this run has 1; relaunch"):
        Trainer(_parse(f"{FLAGS} {DISTOPT} --load {tmp_path / 'sharded'} --train-iters 3", 1))
    with torch.no_grad():  # the single-process run may still start from the weights
        Trainer(_parse(f"{FLAGS} {DISTOPT} --load {tmp_path / 'sharded'} --no-load-optim --train-iters 3", 1))


def test_overlap_param_gather_needs_the_distributed_optimizer():
    with pytest.raises(ConfigError, match="--overlap-param-gather overlaps the distributed optimizer's"):
        _parse(f"{BASE} --overlap-param-gather", 1)
    assert _parse(f"{BASE} {OVERLAP}", 1).parallel.overlap_param_gather


def _fp8_skip_body(rank, world_size):
    trainer = Trainer(_parse(f"{BASE} --pipeline-model-parallel-size 2 {FP8_FLAGS} --train-iters 2", world_size))
    if rank == 0:  # this stage alone sees an inf/NaN FP8 amax in the first step
        inner, steps = trainer.fp8.step, []

        def fp8_step() -> bool:
            finite = inner()
            steps.append(finite)
            return finite and len(steps) > 1

        trainer.fp8.step = fp8_step
    before = [p.detach().clone() for p in trainer.optimizer.params]
    batches = iter(trainer.loader(trainer.datasets.train, 0))
    _, norm, stepped = trainer.train_step(batches, 1e-3)
    assert not stepped and norm == float("inf"), (norm, stepped)  # both stages skip; neither waits for the other
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.optimizer.params))
    _, norm, stepped = trainer.train_step(batches, 1e-3)
    assert stepped and 0 < norm < float("inf")


def test_a_stage_with_non_finite_fp8_amaxes_skips_the_step_on_every_stage():
    run_distributed(_fp8_skip_body, world_size=2)


def _versions_body(rank, world_size):
    # one bucket (the default 40M elements hold the whole test model): each rank steps on half of it, so some
    # parameters have no piece here and reach this rank only through the all-gather
    trainer = Trainer(_parse(f"{BASE} {DISTOPT} --train-iters 3 --eval-iters 0", world_size))
    named = dict(trainer.model.named_parameters())
    before = {name: p._version for name, p in named.items()}
    trainer.train()
    buffers = trainer.grad_buffers
    assert len(buffers.buckets) == 1
    unowned = [name for name, p in named.items() if buffers.owned_range(p) is None]
    assert unowned, "every parameter has a piece on this rank: the test shows nothing"
    # each step rewrote every parameter (through the all-gather where this rank owns no piece of it): what
    # Transformer Engine's layers read to cast their FP8 weights again (TETransformerLayer._first_microbatch)
    stale = [name for name, p in named.items() if p._version - before[name] < 3]
    assert not stale, (rank, stale)


def test_every_parameter_is_marked_rewritten_by_each_step():
    run_distributed(_versions_body, world_size=2)
