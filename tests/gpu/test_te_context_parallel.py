"""Transformer Engine's context-parallel attention (DotProductAttention given the cp group, cp_global_ranks, a CUDA
stream and --cp-comm-type) on 2 GPUs trains the one-GPU TE model, for each exchange TE offers here (p2p, all_gather,
a2a), and CP=2 x TP=2 + SP on 4 GPUs.

TE's context-parallel kernels (flash / fused attention) take bf16 or fp16 only, so these runs are bf16 (the CPU tests,
tests/distributed/test_context_parallel.py, check the fp32 arithmetic exactly). Tolerances: bf16 sums in another
order (TE's per-chunk softmax merge under CP) move the losses by about 1e-3 relative; gradients after two Adam
steps by a few percent of each tensor's largest element. A wrong chunk order, positions or missing reduction is off
by the whole value. Never run yet on a GPU (written against TE 2.20's API).
"""

import pytest
import torch

from megatron.config.te_rules import te_import_error
from tests.dist_utils import run_distributed
from tests.distributed.test_context_parallel import _body
from tests.distributed.test_parallel_layouts import _check

TE = "--transformer-impl transformer_engine --bf16"
TOLS = ((1e-2, 1e-1), (2e-2, 5e-1))


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(te_import_error() is not None, reason=f"needs Transformer Engine ({te_import_error()})"),
]

LAYOUTS_2 = {
    "cp2_p2p": f"{TE} --context-parallel-size 2 --cp-comm-type p2p",
    "cp2_all_gather": f"{TE} --context-parallel-size 2 --cp-comm-type all_gather",
    "cp2_a2a": f"{TE} --context-parallel-size 2 --cp-comm-type a2a",
    "cp2_per_layer": f"{TE} --context-parallel-size 2 --cp-comm-type p2p all_gather a2a p2p",
}


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs (device kind nvidia-h200-x2)")
def test_te_context_parallel_matches_one_gpu(tmp_path):
    resume = {"cp2_p2p": ("torch",)}
    run_distributed(_body, world_size=2, args=(str(tmp_path), LAYOUTS_2, {"cp2_p2p"}, resume), backend="nccl")
    _check(tmp_path, LAYOUTS_2, {"cp2_p2p"}, 2, impl=TE, tols=TOLS)


@pytest.mark.skipif(_gpus() < 4, reason="needs 4 GPUs (device kind nvidia-h200-x4)")
def test_te_context_parallel_with_tensor_parallel_matches_one_gpu(tmp_path):
    layouts = {"cp2_tp2": f"{TE} --context-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel"}
    run_distributed(_body, world_size=4, args=(str(tmp_path), layouts, set(), {}), backend="nccl")
    _check(tmp_path, layouts, set(), 4, impl=TE, tols=TOLS)
