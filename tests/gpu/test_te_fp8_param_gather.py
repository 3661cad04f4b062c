"""Transformer Engine's FP8 weights with the distributed optimizer on 2 GPUs (NCCL): each rank casts its shard of
the fp32 masters with TE's `quantize_master_weights` and the all-gather moves the FP8 bytes; step by step the FP8
weights (bytes and scales) and the losses equal those of the unsharded optimizer with FP8 weights (DP=2; delayed,
tensorwise and blockwise). The CPU twin, with the local engine's FP8 weights: tests/distributed/
test_fp8_param_gather.py."""

import pytest
import torch

from megatron.config.te_rules import te_import_error
from tests.dist_utils import run_distributed
from tests.distributed.test_fp8_param_gather import _same_as_unsharded_body

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(te_import_error() is not None, reason=f"needs Transformer Engine ({te_import_error()})"),
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs (nvidia-h200-x2)"
    ),
]


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise"])
def test_te_dp2_fp8_weights_match_the_unsharded_optimizer_bitwise(recipe):
    layout = "--transformer-impl transformer_engine --bf16"
    run_distributed(_same_as_unsharded_body, world_size=2, args=(layout, (recipe,)), backend="nccl")
