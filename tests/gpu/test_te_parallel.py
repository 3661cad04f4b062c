"""Transformer Engine under tensor (+sequence), pipeline and data parallelism on 2 or 4 GPUs (NCCL) trains the
single-GPU TE model: the CPU layout tests (tests/distributed/test_parallel_layouts.py) rerun with
--transformer-impl transformer_engine.

Tolerances: fp32 runs differ from one GPU by summation order and by TE picking other GEMM kernels for the shard
shapes (losses rel 1e-4, gradients 1e-2 of each tensor's largest element); FP8 runs (delayed, hybrid) are bf16 runs
with FP8 GEMMs, amaxes max-reduced over tensor x data ranks (losses rel 1e-2, gradients 1e-1). Save and resume under
TE tensor parallelism reproduces the uninterrupted run's losses to rel 1e-5 (GPU reductions need not be bitwise
repeatable).
"""

import pytest
import torch

from megatron.fp8.te_recipe import te_import_error
from tests.dist_utils import run_distributed
from tests.distributed.test_parallel_layouts import LAYOUTS_2, LAYOUTS_4, _check, _layouts_body

TE = "--transformer-impl transformer_engine"
TOLS = ((1e-4, 1e-2), (1e-2, 1e-1))


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(te_import_error() is not None, reason=f"needs Transformer Engine ({te_import_error()})"),
]


# Tensor + sequence parallelism and the pipeline (DP is plain data parallelism around the same TE layers, covered on
# the CPU); each also with FP8, and a save/resume under TE tensor parallelism.
LAYOUTS_GPU = {name: LAYOUTS_2[name] for name in ("tp2_sp", "pp2")}


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs (device kind nvidia-h200-x2)")
def test_te_two_gpu_layouts_match_one_gpu(tmp_path):
    fp8, resume = set(LAYOUTS_GPU), {"tp2_sp"}
    args = (str(tmp_path), LAYOUTS_GPU, fp8, resume, (), TE, 1e-5)
    run_distributed(_layouts_body, world_size=2, args=args, backend="nccl")
    _check(tmp_path, LAYOUTS_GPU, fp8, 2, impl=TE, tols=TOLS)


@pytest.mark.skipif(_gpus() < 4, reason="needs 4 GPUs (device kind nvidia-h200-x4)")
def test_te_four_gpu_layouts_match_one_gpu(tmp_path):
    fp8 = set(LAYOUTS_4)
    run_distributed(_layouts_body, world_size=4, args=(str(tmp_path), LAYOUTS_4, fp8, set(), (), TE), backend="nccl")
    _check(tmp_path, LAYOUTS_4, fp8, 4, impl=TE, tols=TOLS)
