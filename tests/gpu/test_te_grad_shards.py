"""Transformer Engine layers under --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads (the flat-bucket
ZeRO-2 engine, megatron/parallel/fsdp/flat_shards.py) on 2 GPUs (NCCL) train as under the distributed optimizer: the CPU
comparison of tests/distributed/test_grad_shards.py with TE's fused wgrad GEMMs, which read `weight.main_grad` at the
start of each linear's backward, after the engine has allocated the bucket and pointed `main_grad` at it. Six steps
of four micro-batches, small buckets: bf16 within 2e-3, FP8 delayed (also with every layer recomputed, TE's
checkpoint, with --fp8-param-gather, and O2's FP8 reduce-scatters) within 1e-2 (tests/gpu/test_te_fsdp.py's
tolerances). Between steps no bucket holds storage and the gradient state is half the buckets' elements. New buckets
are filled with NaN: TE's wgrad GEMMs must write them (`overwrite_main_grad`), not accumulate into them, or the
losses turn NaN."""

from megatron.parallel.fsdp.flat_shards import FlatGradShards
from tests.dist_utils import run_distributed
from tests.distributed.test_fsdp import _close, _run
from tests.distributed.test_grad_shards import DISTOPT, O2, RECOMPUTE, ZERO2, _held_between_steps
from tests.distributed.test_parallel_layouts import BASE, FP8
from tests.gpu.marks import TE_ON_TWO_GPUS

STEPS = 6
TE = "--transformer-impl transformer_engine --bf16"
FLAGS = f"{BASE} {TE} --train-iters {STEPS} --eval-iters 0 --global-batch-size 16 --ddp-bucket-size 3000"

pytestmark = TE_ON_TWO_GPUS


def _body(rank, world_size):
    FlatGradShards.fill_new_buckets = float("nan")
    cases = (("bf16", "", 2e-3), ("FP8", FP8, 1e-2), ("FP8 recomputed", f"{FP8} {RECOMPUTE}", 1e-2))
    # O2 reduce-scatters in FP8 (fp8_reduce.py): its handle is waited for on the engine's reduce stream
    more = (("FP8 --fp8-param-gather", f"{FP8} --fp8-param-gather", 1e-2), ("FP8 O2", f"{FP8} {O2}", 1e-2))
    for label, recipe, rel in (*cases, *more):
        want, _ = _run(f"{FLAGS} {recipe} {DISTOPT}", world_size)
        got, trainer = _run(f"{FLAGS} {recipe} {ZERO2}", world_size)
        _close(got, want, rel, f"TE {label}", steps=STEPS)
        _held_between_steps(trainer)


def test_te_grad_shards_match_the_distributed_optimizer():
    run_distributed(_body, world_size=2, backend="nccl")
