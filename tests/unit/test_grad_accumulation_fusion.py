"""--no-gradient-accumulation-fusion: weight gradients through `.grad` instead of straight into the fp32 buffers;
both give the same gradients (megatron/model/grad_accumulation.py). A weight marked `overwrite_main_grad`
(megatron/parallel/fsdp/flat_shards.py's unzeroed buckets) gets the product written over whatever `main_grad` held: the
same bits as accumulating into zeros, also for FP8 weights (megatron/fp8/params.py)."""

import pytest
import torch

from megatron.config import parse_args
from megatron.fp8.params import accumulate_weight_grad
from megatron.model.layers import Linear
from megatron.model.output_layer import OutputLinear
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
    # the placeholder autograd kept is the buffer itself (same dtype) or a zero-filled copy: nothing to add
    assert linear.weight.grad_added_to_main_grad
    assert linear.weight.grad.data_ptr() == linear.weight.main_grad.data_ptr() or not linear.weight.grad.any()
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


@pytest.mark.parametrize("overwrite", [False, True])
def test_the_output_layer_writes_its_weight_gradient_into_its_buffer_and_makes_no_other(overwrite):
    """The untied output layer's gradient (1 GB on Llama-3's vocabulary) is never a tensor of its own beside the
    buffer: the product lands in `main_grad`, and autograd keeps `main_grad` itself as the placeholder."""
    torch.manual_seed(0)
    layer = OutputLinear(16, 40, bias=False, dtype=torch.bfloat16)
    x = torch.randn(6, 2, 16, dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(6, 2, 40, dtype=torch.bfloat16)
    plain = grad_out.reshape(-1, 40).t() @ x.detach().reshape(-1, 16)
    layer.weight.main_grad = torch.full((40, 16), float("nan") if overwrite else 0.0, dtype=torch.bfloat16)
    layer.weight.overwrite_main_grad = overwrite
    layer(x).backward(grad_out)
    assert layer.weight.grad.data_ptr() == layer.weight.main_grad.data_ptr() and layer.weight.grad_added_to_main_grad
    torch.testing.assert_close(layer.weight.main_grad, plain)
    torch.testing.assert_close(x.grad, grad_out @ layer.weight.detach())
    del layer.weight.main_grad  # no buffer (FSDP2's shards, evaluation): nn.Linear's own gradient
    layer.weight.grad = None
    layer(x).backward(grad_out)
    torch.testing.assert_close(layer.weight.grad, plain)


@pytest.mark.parametrize("tied", ["", "--untie-embeddings-and-output-weights"])
def test_the_flag_gives_the_same_gradients_through_dot_grad(tied):
    assert parse_args(f"{TINY} --no-gradient-accumulation-fusion".split()).model.gradient_accumulation_fusion is False
    fused, plain = grads_of_one_step(tied), grads_of_one_step(f"{tied} --no-gradient-accumulation-fusion")
    assert len(fused) == len(plain)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
