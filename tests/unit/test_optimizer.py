"""MixedPrecisionAdamW: the fused path (clipping and non-finite skipping on the device, no host read of the norm)
against the unfused one (host decisions), on the CPU, where torch runs both."""

import pytest
import torch

from megatron.config import parse_args
from megatron.model import GPTModel
from megatron.optim import MixedPrecisionAdamW
from megatron.parallel import GradientBuffers

FLAGS = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 64 --mock-data"


def one_step(fused: bool, clip: float, grad_scale: float = 1.0, poison: bool = False):
    cfg = parse_args(f"{FLAGS} --clip-grad {clip}".split())
    torch.manual_seed(0)
    model = GPTModel(cfg.model, 64)
    GradientBuffers(model, None)
    optimizer = MixedPrecisionAdamW(model, cfg.optimizer, fused=fused)
    tokens = torch.randint(0, 64, (2, 16))
    (model(tokens, labels=tokens).mean() * grad_scale).backward()
    if poison:
        optimizer.params[0].main_grad[0] = float("inf")
    norm, stepped = optimizer.step(
        1e-2, lambda: torch.linalg.vector_norm(torch.cat([g.flatten() for g in optimizer.grads()]))
    )
    return norm, stepped, [p.detach().clone() for p in optimizer.params], optimizer


@pytest.mark.parametrize(
    "clip, grad_scale",
    [(1.0, 1.0), (0.01, 1.0), (0.0, 1.0), (1.0, 1e3)],
    ids=["no-clip-hit", "clipped", "clip-off", "large-grads"],
)
def test_fused_step_clips_like_the_unfused_one(clip, grad_scale):
    fused_norm, fused_stepped, fused_params, _ = one_step(True, clip, grad_scale)
    norm, stepped, params, _ = one_step(False, clip, grad_scale)
    assert isinstance(fused_norm, torch.Tensor) and isinstance(fused_stepped, torch.Tensor)
    assert bool(fused_stepped) and bool(stepped) and torch.allclose(fused_norm, norm)
    for a, b in zip(fused_params, params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_non_finite_norm_skips_the_step(fused):
    cfg = parse_args(FLAGS.split())
    torch.manual_seed(0)
    before = [p.detach().clone() for p in GPTModel(cfg.model, 64).parameters()]
    norm, stepped, params, optimizer = one_step(fused, 1.0, poison=True)
    assert not torch.isfinite(norm) and not bool(stepped)
    for a, b in zip(params, before):
        assert torch.equal(a, b)
    # The skipped step does not count: Adam's bias correction restarts from the same step number.
    assert all(float(state["step"]) == 0 for state in optimizer.optimizer.state.values())
