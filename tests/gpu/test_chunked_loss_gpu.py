"""The chunked loss (--cross-entropy-fusion-impl chunked, megatron/model/output_layer.py) on a GPU, beside Transformer
Engine's fused cross-entropy, the default loss of TE's layers: the same per-token losses and gradients in bf16, and
a lower peak by about the logits it does not keep; and the untied output layer's weight gradient written into a bf16
buffer with no copy of its own.

On one CUDA GPU with TE: `python3 -m pytest -q -x tests/gpu/test_chunked_loss_gpu.py`.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.config.te_rules import te_import_error
from megatron.model.output_layer import OutputLinear, linear_cross_entropy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(te_import_error() is not None, reason=f"needs Transformer Engine ({te_import_error()})"),
]

# the 8B's sequence and (nearly) its vocabulary: 2 GiB of bf16 logits in 16 slices of CHUNK_ELEMENTS. With 4 slices
# (4096 tokens, 64k vocabulary: 512 MiB of logits) one slice's fp32 work outweighed what was saved: 720 MiB above the
# inputs against TE's 648 (two H100s)
TOKENS, HIDDEN, VOCAB = 8192, 1024, 131072


def _run(loss_fn):
    torch.manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (0.02 * torch.randn(VOCAB, HIDDEN, device="cuda")).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, VOCAB, (TOKENS,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = loss_fn(x, weight, labels)
    loss.sum().backward()
    torch.cuda.synchronize()
    return loss.detach(), x.grad, weight.grad, torch.cuda.max_memory_allocated() - base


def _te(x, weight, labels):
    from megatron.model.te_layers import te_cross_entropy

    logits = F.linear(x, weight).unsqueeze(1)  # [s, b=1, V]
    return te_cross_entropy(logits, labels.unsqueeze(0)).squeeze(0)


def test_same_losses_and_gradients_and_no_logits_at_the_peak():
    loss, dx, dw, peak = _run(linear_cross_entropy)
    ref, ref_dx, ref_dw, ref_peak = _run(_te)
    torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dx, ref_dx, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(dw, ref_dw, rtol=2e-2, atol=2e-3)
    logits = TOKENS * VOCAB * 2
    print(f"peak above the inputs: chunked {peak / 2**20:.0f} MiB, TE {ref_peak / 2**20:.0f} MiB")
    assert peak < ref_peak - logits / 2, (peak, ref_peak)


def test_the_output_layer_writes_into_a_bf16_buffer_without_a_copy():
    layer = OutputLinear(HIDDEN, VOCAB, bias=False, device="cuda", dtype=torch.bfloat16)
    layer.weight.main_grad = torch.empty_like(layer.weight)
    layer.weight.overwrite_main_grad = True
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = layer(x)
    grad = torch.ones_like(out)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out.backward(grad)
    torch.cuda.synchronize()
    # the input gradient (8 MiB) and GEMM workspace, not a second 128 MiB weight gradient
    assert torch.cuda.max_memory_allocated() - base < layer.weight.numel() * 2 / 2
    assert layer.weight.grad.data_ptr() == layer.weight.main_grad.data_ptr()
    torch.testing.assert_close(layer.weight.main_grad, grad.t() @ x.detach())
