"""--init-model-with-meta-device with Transformer Engine's layers under FSDP (optim_grads_params) on 2 GPUs (NCCL):
the comparison of tests/distributed/test_fsdp_meta.py with --transformer-impl transformer_engine, in bf16, FP8
delayed, and FP8 delayed with --fp8-param-gather (TE weights all-gathered as E4M3 bytes); and under
--use-megatron-fsdp's optim_grads (the flat-bucket engine, every weight whole on every rank: the model gets its storage
and values before the buckets see it) in bf16 and FP8 delayed (TE's FP8 weights are a one-line error there).

The TE modules are built with device="meta" (TE then defers its initialization and allocates nothing; the parallel
attributes TE would set when initializing are set by `te_linear.mark_te_params`), FSDP gives each rank its shards,
and each part's values come from a twin built on the GPU one part at a time with TE's own init (the CPU draws of
`te_linear.sharded_normal_init`). Checked against the eager build of the same run: every weight shard and parameter
attribute bit for bit, the model's parameters without storage until FSDP allocated the shards, no part larger than a
layer built at once, and the losses of 4 steps (the first identical, the rest within 1e-5 relative: TE's attention
is kept to its deterministic backends)."""

import os

from tests.dist_utils import run_distributed
from tests.distributed.test_fsdp_meta import PARAMS, compare_meta_to_eager, record_deferred_builds
from tests.distributed.test_parallel_layouts import BASE, FP8
from tests.gpu.marks import TE_ON_TWO_GPUS

STEPS = 4
FLAGS = f"{BASE} --transformer-impl transformer_engine --bf16 --train-iters {STEPS} --eval-iters 0 {PARAMS}"

pytestmark = TE_ON_TWO_GPUS


def _body(rank, world_size):
    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"  # read when TE builds its attention modules
    builds = record_deferred_builds()
    for extra in ("", FP8, f"{FP8} --fp8-param-gather"):
        flags = f"{FLAGS} {extra}"
        got, want = compare_meta_to_eager(flags, world_size, builds)
        assert len(got) == STEPS and got[0] == want[0], (extra, got, want)
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want)), (extra, got, want)


def test_te_meta_device_init_gives_the_eager_weights_and_losses():
    run_distributed(_body, world_size=2, backend="nccl")


def _whole_body(rank, world_size):
    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"
    builds = record_deferred_builds()
    zero2 = FLAGS.replace(PARAMS, "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads")
    for extra in ("", FP8):
        got, want = compare_meta_to_eager(f"{zero2} {extra}", world_size, builds)
        assert len(got) == STEPS and got[0] == want[0], (extra, got, want)
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want)), (extra, got, want)


def test_te_meta_device_init_under_the_flat_bucket_engine():
    run_distributed(_whole_body, world_size=2, backend="nccl")
