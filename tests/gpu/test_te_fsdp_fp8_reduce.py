"""FSDP's FP8 gradient reduce-scatter (--fp8-grad-reduce, megatron/parallel/fsdp/fp8_reduce_scatter.py) with Transformer
Engine's layers on 2 GPUs (NCCL): the encode and decode run as fp8_reduce_kernels' Triton kernels on FSDP2's
reduce-scatter stream, the bytes travel in one NCCL all-to-all. Over 20 steps at lr 1e-3 the losses stay within 2e-3
(bf16) and 1e-2 (FP8 delayed; tests/gpu/test_te_fsdp.py's tolerances) of the distributed optimizer's with
--fp8-grad-reduce, under optim_grads_params and optim_grads; every reduce-scatter moves at most 0.55x the bytes of
FSDP2's bf16 reduce-scatter of the same unit, nothing saturates, and O2 (with the precision-aware states and bf16
gradient shards) stays within 1e-2 of the distributed optimizer's O2. The CPU version:
tests/distributed/test_fsdp_fp8_reduce.py."""

from tests.dist_utils import run_distributed
from tests.distributed.test_fsdp_fp8_reduce import check_against_distributed_optimizer
from tests.distributed.test_parallel_layouts import BASE, FP8
from tests.gpu.marks import TE_ON_TWO_GPUS

STEPS = 20
FLAGS = f"{BASE} --transformer-impl transformer_engine --bf16 --train-iters {STEPS} --eval-iters 0 --lr 1e-3"

pytestmark = TE_ON_TWO_GPUS


def _body(rank, world_size):
    check_against_distributed_optimizer(FLAGS, world_size, {"": 2e-3, FP8: 1e-2, "O2": 1e-2})


def test_te_fsdp_fp8_grad_reduce_matches_distributed_optimizer():
    run_distributed(_body, world_size=2, backend="nccl")
