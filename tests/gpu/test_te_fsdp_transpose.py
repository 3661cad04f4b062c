"""The parameter FSDP2 makes from a TE weight's first FP8 all-gather (megatron/parallel/fsdp/te_fp8_gather.py) on one
GPU: FSDP2 builds it with `torch.as_strided` and `nn.Parameter` (a detach) from the Float8Tensor that
`fsdp_post_all_gather` returns, and TE 2.20's copies (`make_like`) keep the transpose buffer but not its invalid
mark. A unit kept gathered from its forward into its backward (the last layer unit under optim_grads_params, all under
optim_grads) then ran its first dgrad on the buffer as allocated: on two H100s FSDP's step 1 looked skipped (its weights
unchanged at step 2, then moved by Adam's first step at step 2's learning rate: tests/gpu/test_te_fsdp_guard.py)."""

import pytest
import torch
from torch import nn

from megatron.config.te_rules import te_import_error
from megatron.parallel.fsdp.te_fp8_gather import _needs_transpose, wrap_te_fp8_weight

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(te_import_error() is not None, reason=f"needs Transformer Engine ({te_import_error()})"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]


def test_the_parameter_fsdp_makes_at_the_first_gather_reads_a_true_transpose():
    if not _needs_transpose():
        pytest.skip("this GPU's FP8 GEMMs read no transpose (Blackwell)")
    rows, cols = 64, 32  # not square: TE's as_strided of a valid transpose would scramble it
    shard = wrap_te_fp8_weight(torch.randn(rows, cols, device="cuda")).data
    shard._scale.set(shard._tensor.abs().amax())
    padded = shard._scale.fill(shard._tensor, 0, rows)  # one rank: the whole weight, as gathered
    metadata = (shard._scale.scale_inv, (rows, cols))
    weight, inner = shard.fsdp_post_all_gather((padded,), metadata, torch.bfloat16)
    assert len(inner) == 2  # the bytes and the transpose buffer, which FSDP frees and allocates with the unit
    inner[1].fill_(0x7F)  # the buffer as allocated holds anything (0x7F: E4M3 NaN)
    # what FSDP2's init_unsharded_param makes of it (torch 2.11): the parameter its unit's modules then hold
    param = nn.Parameter(torch.as_strided(weight, (rows, cols), (cols, 1), storage_offset=0))
    assert param._transpose is None or param._transpose_invalid, "the buffer as allocated, taken for the transpose"
    # TE's backward (kept gathered since the forward: no later gather) asks for the transpose and reads it
    param.update_usage(columnwise_usage=True)
    assert torch.equal(param._transpose, padded.t())
    # a later gather refills the parameter: its transpose goes into FSDP's buffer, rebuilt when TE asks for it
    assert shard.fsdp_post_all_gather((padded,), metadata, torch.bfloat16, out=param) is None
    assert param._transpose is inner[1] and param._transpose_invalid
    param.update_usage(columnwise_usage=True)
    assert param._transpose.data_ptr() == inner[1].data_ptr() and torch.equal(inner[1], padded.t())
