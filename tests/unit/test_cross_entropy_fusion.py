"""--cross-entropy-loss-fusion --cross-entropy-fusion-impl native: same loss and gradients as the plain loss, and
the model uses it under the flag (megatron/model/cross_entropy.py)."""

import pytest
import torch

from megatron.config import ConfigError, parse_args
from megatron.model import GPTModel
from megatron.model.cross_entropy import fused_cross_entropy
from megatron.parallel.tensor_parallel import vocab_parallel_cross_entropy
from tests.e2e.test_training import TINY


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_matches_plain_loss_and_gradient(dtype):
    torch.manual_seed(0)
    logits = (3 * torch.randn(4, 7, 50)).to(dtype)
    labels = torch.randint(0, 50, (4, 7))
    grad_out = torch.rand(4, 7)
    results = []
    for fn in (vocab_parallel_cross_entropy, fused_cross_entropy):
        x = logits.clone().requires_grad_()
        loss = fn(x, labels, None)
        loss.backward(grad_out)
        results.append((loss, x.grad))
    (plain, plain_grad), (fused, fused_grad) = results
    assert fused.dtype == torch.float32 and fused_grad.dtype == dtype
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 4e-3}
    torch.testing.assert_close(fused_grad, plain_grad.to(dtype), **tol)


def model_loss_and_grads(flags: str, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """TINY's per-token loss on `tokens` under `flags`, after its backward, and every parameter's gradient."""
    cfg = parse_args(f"{TINY} {flags}".split())
    torch.manual_seed(0)
    model = GPTModel(cfg.model, 128)
    loss = model(tokens, labels=tokens)
    loss.mean().backward()
    return loss, [p.grad for p in model.parameters()]


def test_model_uses_it_under_the_flag():
    tokens = torch.randint(0, 128, (2, 32))
    (plain, plain_grads), (fused, fused_grads) = (
        model_loss_and_grads(f, tokens) for f in ("", "--cross-entropy-loss-fusion")
    )
    assert "Fused" in fused.grad_fn.name() and "Fused" not in plain.grad_fn.name()
    torch.testing.assert_close(plain, fused)
    for ours, theirs in zip(fused_grads, plain_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


def test_te_impl_needs_a_gpu():
    with pytest.raises(ConfigError, match="--cross-entropy-fusion-impl"):
        parse_args(f"{TINY} --cross-entropy-loss-fusion --cross-entropy-fusion-impl te".split())


def test_te_impl_refuses_fp16_logits():
    flags = f"{TINY} --fp16 --cross-entropy-loss-fusion --cross-entropy-fusion-impl te".split()
    with pytest.raises(ConfigError, match="bf16 or fp32 logits.*--cross-entropy-fusion-impl native"):
        parse_args(flags, device_type="cuda")
