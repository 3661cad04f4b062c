"""Gradient accumulation fusion on the local path (Megatron-LM's `--gradient-accumulation-fusion`, on by default).

A linear whose weight has an fp32 gradient buffer (`weight.main_grad`, megatron/parallel/data_parallel.py) computes
its weight gradient dY^T X straight into that buffer: one `addmm_` when the weight is fp32 (no gradient tensor
in between), or the GEMM's product added into the fp32 buffer for bf16/fp16 weights. Autograd then gets a
placeholder (`wgrad_placeholder`) and `weight.grad_added_to_main_grad` tells the buffers' hook not to add it (the
contract Transformer Engine's fused wgrad accumulation follows). A weight marked `overwrite_main_grad` (Transformer
Engine's attribute, set by megatron/parallel/fsdp/flat_shards.py, whose buffers live for one micro-batch and are not
zeroed) gets the product written into `main_grad` instead: no read of the old contents.
`--no-gradient-accumulation-fusion` uses plain F.linear: the gradient lands in `.grad` and the hook adds it.
The untied output layer (model/output_layer.py) fuses its weight gradient the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _LinearAccumulatingWgrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_input = grad.matmul(weight)
        g2d, x2d = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        main_grad = weight.main_grad
        write_wgrad(main_grad, g2d, x2d, overwrite=getattr(weight, "overwrite_main_grad", False))
        weight.grad_added_to_main_grad = True
        grad_bias = g2d.sum(0) if ctx.has_bias else None
        return grad_input, wgrad_placeholder(weight, main_grad), grad_bias


def write_wgrad(target: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, overwrite: bool) -> None:
    """target += dy^T x (or = with `overwrite`): straight from the GEMM where the dtypes agree, else through a product
    in the inputs' dtype (a bf16 GEMM into an fp32 buffer)."""
    if target.dtype == dy.dtype:
        if overwrite:
            torch.mm(dy.t(), x, out=target)
        else:
            target.addmm_(dy.t(), x)
    elif overwrite:
        target.copy_(dy.t().mm(x))
    else:
        target.add_(dy.t().mm(x))


def wgrad_placeholder(weight: torch.Tensor, main_grad: torch.Tensor) -> torch.Tensor:
    """What autograd gets as the weight's gradient (the buffers' hook drops it). Autograd keeps a gradient laid out
    as the weight is, and copies any other, a zero-stride one too, into a new tensor of the weight's size: a
    transient copy of the layer's whole gradient. So where the dtypes agree it is `main_grad` itself (a view:
    nothing allocated); else the zero-stride tensor, copied."""
    if main_grad.dtype == weight.dtype:
        return main_grad.view_as(weight)
    return torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)


def fuses_wgrad(weight: torch.Tensor, enabled: bool) -> bool:
    """Whether a linear's weight gradient goes straight into its buffer: fusion on, training with autograd, and a
    plain weight with a `main_grad` buffer (FP8 weights accumulate through their own path)."""
    return enabled and torch.is_grad_enabled() and weight.requires_grad and hasattr(weight, "main_grad")


def linear_accumulating_wgrad(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear whose weight gradient is accumulated into `weight.main_grad` (see the module docstring)."""
    return _LinearAccumulatingWgrad.apply(x, weight, bias)
