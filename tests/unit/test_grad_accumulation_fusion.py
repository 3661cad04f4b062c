"""--no-gradient-accumulation-fusion: weight gradients through `.grad` instead of straight into the fp32 buffers;
both give the same gradients (megatron/model/grad_accumulation.py). A weight marked `overwrite_main_grad`
(megatron/parallel/grad_shards.py's unzeroed buckets) gets the product written over whatever `main_grad` held: the
same bits as accumulating into zeros, also for FP8 weights (megatron/fp8/params.py)."""

import pytest
import torch

from megatron.config import parse_args
from megatron.fp8.params import accumulate_weight_grad
from megatron.model.layers import Linear
from megatron.training import Trainer
from tests.e2e.test_training import TINY


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_accumulates_its_weight_gradient_into_main_grad(dtype):
    torch.manual_seed(0)
    linear = Linear(16, 8, bias=True, init_std=0.02, dtype=dtype)
    linear.weight.main_grad = torch.full((8, 16), 0.5)
    x = torch.randn(3, 4, 16, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(3, 4, 8, dtype=dtype)
    linear(x).backward(grad_out)
    expected = grad_out.reshape(-1, 8).float().t() @ x.detach().reshape(-1, 16).float()
    torch.testing.assert_close(
        linear.weight.main_grad,
        0.5 + expected,
        rtol=2e-2 if dtype != torch.float32 else 1e-5,
        atol=1e-2 if dtype != torch.float32 else 1e-5,
    )
    assert linear.weight.grad_added_to_main_grad and not linear.weight.grad.any()
    torch.testing.assert_close(x.grad, grad_out @ linear.weight.detach())
    torch.testing.assert_close(linear.bias.grad, grad_out.reshape(-1, 8).sum(0))

    linear.gradient_accumulation_fusion = False  # --no-gradient-accumulation-fusion: a plain .grad
    linear.weight.grad, before = None, linear.weight.main_grad.clone()
    linear(x).backward(grad_out)
    assert torch.equal(linear.weight.main_grad, before)
    torch.testing.assert_close(linear.weight.grad.float(), expected, rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize(
    "dtype,grad_dtype", [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.bfloat16, torch.float32)]
)
def test_a_weight_marked_overwrite_main_grad_gets_the_product_written(dtype, grad_dtype):
    torch.manual_seed(0)
    linear = Linear(16, 8, bias=False, init_std=0.02, dtype=dtype)
    x = torch.randn(3, 4, 16, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(3, 4, 8, dtype=dtype)
    linear.weight.main_grad = torch.zeros(8, 16, dtype=grad_dtype)
    linear(x).backward(grad_out)
    accumulated = linear.weight.main_grad.clone()
    linear.weight.main_grad = torch.full((8, 16), float("nan"), dtype=grad_dtype)  # an unzeroed buffer
    linear.weight.overwrite_main_grad = True
    linear(x).backward(grad_out)
    assert torch.equal(linear.weight.main_grad, accumulated) and linear.weight.grad_added_to_main_grad


def test_an_fp8_weight_marked_overwrite_main_grad_gets_its_gradient_written():
    weight, dw = torch.zeros(4, 4), torch.randn(4, 4)
    weight.main_grad = torch.ones(4, 4)
    accumulate_weight_grad(weight, dw)
    assert torch.equal(weight.main_grad, 1 + dw)
    weight.main_grad, weight.overwrite_main_grad = torch.full((4, 4), float("nan")), True
    accumulate_weight_grad(weight, dw)
    assert torch.equal(weight.main_grad, dw) and weight.grad_added_to_main_grad


def grads_of_one_step(flags: str) -> list[torch.Tensor]:
    cfg = parse_args(f"{TINY} --hidden-dropout 0 --attention-dropout 0 {flags}".split())
    trainer = Trainer(cfg)
    captured, step = [], trainer.optimizer.step

    def capture(lr, norm_fn):
        captured.extend(g.clone() for g in trainer.optimizer.grads())
        return step(lr, norm_fn)

    trainer.optimizer.step = capture
    trainer.train_step(iter(trainer.loader(trainer.datasets.train, 0)), lr=1e-3)
    return captured


def test_the_flag_gives_the_same_gradients_through_dot_grad():
    assert parse_args(f"{TINY} --no-gradient-accumulation-fusion".split()).model.gradient_accumulation_fusion is False
    fused, plain = grads_of_one_step(""), grads_of_one_step("--no-gradient-accumulation-fusion")
    assert len(fused) == len(plain)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
