"""The output layer: the untied layer's module (`OutputLinear`), and its GEMM and the cross-entropy in one, a slice of
the vocabulary at a time (`linear_cross_entropy`: --cross-entropy-loss-fusion --cross-entropy-fusion-impl chunked).

`OutputLinear` writes its weight gradient straight into `weight.main_grad` where a gradient buffer provides one, as
the local linears do (Megatron-LM's output layer fuses it alike). The output layer's is the model's largest single
gradient (V/tp x h: 1 GB in bf16 on Llama-3's 128k vocabulary), computed while every activation is still held, so
the separate gradient tensor autograd would make, beside the buffer it is then copied into, sits at the memory peak.
Without a buffer (FSDP2's DTensor shards, fusion off, evaluation) it is the plain `nn.Linear`.

The other losses keep the logits, [tokens, V/tp], from the forward to the backward (Transformer Engine's and the
native fused one in the training dtype, 2.1 GB for a sequence of 8192 on Llama-3's 128k vocabulary; the plain one
fp32 log-probabilities), and form their gradient, as large, in the backward. This one keeps neither: the forward
computes the logits of `chunk_rows` rows of the weight at a time and keeps, per token, the running log-sum-exp (as
flash attention does over keys) and the label's logit; the backward computes each slice's logits again (one more
GEMM of the output layer's forward), its softmax from the kept log-sum-exp, the gradient of that slice, and from it
the weight gradient of the slice's rows (whole: every token at once, one GEMM per slice, written into
`weight.main_grad` where the weight has a buffer, as model/grad_accumulation.py's linears do) and a part of the input
gradient (summed over the slices in fp32). Only one slice's logits exist at a time.

Over a tensor-parallel group (the vocabulary split over its ranks) each rank's log-sum-exp over its rows is combined
with two all-reduces over the tokens (a maximum, then a sum), and the label's logit with one, as in the plain
vocabulary-parallel loss. With one slice and no tensor parallelism the loss is the native fused one's, bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .cross_entropy import all_reduce_over_group
from .grad_accumulation import fuses_wgrad, linear_accumulating_wgrad, wgrad_placeholder, write_wgrad

# Elements of one slice's logits (256 MiB in fp32; a slice's work holds 6 bytes per element at most, the fp32 logits
# beside the GEMM's 16-bit output or the 16-bit gradient): a sequence of 8192 takes 8192 vocabulary rows at a time,
# 16 slices of Llama-3's vocabulary, each GEMM still large enough to run at the GEMM's full rate.
CHUNK_ELEMENTS = 1 << 26
SLICE_BYTES_PER_ELEMENT = 6


def chunk_rows(tokens: int) -> int:
    """Vocabulary rows per slice for `tokens` tokens."""
    return max(1, CHUNK_ELEMENTS // max(tokens, 1))


def _slices(vocab: int, tokens: int) -> list[tuple[int, int]]:
    rows = chunk_rows(tokens)
    return [(start, min(start + rows, vocab)) for start in range(0, vocab, rows)]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, group, fuse: bool) -> torch.Tensor:
        vocab_local = weight.shape[0]
        start = (dist.get_rank(group) if group is not None else 0) * vocab_local
        local_label = labels - start  # in [0, vocab_local) on the rank that holds the label's row
        lse = torch.full(labels.shape, float("-inf"), dtype=torch.float32, device=x.device)
        label_logit = torch.zeros(labels.shape, dtype=torch.float32, device=x.device)
        for lo, hi in _slices(vocab_local, x.shape[0]):
            z = F.linear(x, weight[lo:hi]).float()
            here = (local_label >= lo) & (local_label < hi)
            label_logit += z.gather(-1, (local_label - lo).clamp(0, hi - lo - 1).unsqueeze(-1)).squeeze(-1) * here
            top = torch.maximum(lse, z.max(dim=-1).values)
            # the running log-sum-exp, from -inf (whose exp is 0: the first slice's is the native loss's, bit for bit)
            lse = top + ((lse - top).exp() + z.sub_(top.unsqueeze(-1)).exp_().sum(dim=-1)).log()
        if group is not None and dist.get_world_size(group) > 1:  # log-sum-exp over the ranks' vocabulary slices
            top = lse.clone()
            all_reduce_over_group(top, group, dist.ReduceOp.MAX)
            total = (lse - top).exp()
            all_reduce_over_group(total, group)
            lse = top + total.log()
        all_reduce_over_group(label_logit, group)
        ctx.group, ctx.fuse = group, fuse
        ctx.save_for_backward(x, weight, local_label, lse)
        return lse - label_logit

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, local_label, lse = ctx.saved_tensors
        vocab_local = weight.shape[0]
        grad_x = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        # the weight gradient's rows, each slice's written whole: into the buffer, or into autograd's own gradient
        target = weight.main_grad if ctx.fuse else torch.empty_like(weight)
        overwrite = not ctx.fuse or getattr(weight, "overwrite_main_grad", False)
        for lo, hi in _slices(vocab_local, x.shape[0]):
            rows = weight[lo:hi]
            softmax = F.linear(x, rows).float().sub_(lse.unsqueeze(-1)).exp_()
            here = ((local_label >= lo) & (local_label < hi)).float()
            softmax.scatter_add_(-1, (local_label - lo).clamp(0, hi - lo - 1).unsqueeze(-1), -here.unsqueeze(-1))
            dz = softmax.mul_(grad.unsqueeze(-1)).to(x.dtype)
            del softmax
            grad_x.add_(dz @ rows)  # into fp32 as it is read: no fp32 copy of the product
            write_wgrad(target[lo:hi], dz, x, overwrite)
        if not ctx.fuse:
            return grad_x.to(x.dtype), target, None, None, None
        weight.grad_added_to_main_grad = True
        return grad_x.to(x.dtype), wgrad_placeholder(weight, target), None, None, None


def linear_cross_entropy(
    x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, group=None, fuse_wgrad: bool = False
) -> torch.Tensor:
    """Per-token loss [n] (fp32) of logits x @ weight^T, never formed whole: x [n, h], weight [V/tp, h] (this rank's
    vocabulary rows), labels [n]. `fuse_wgrad`: the weight gradient goes into `weight.main_grad` where it has one
    (not for a weight with another use in the step, the tied embedding)."""
    fuse = fuses_wgrad(weight, fuse_wgrad)
    return _LinearCrossEntropy.apply(x, weight, labels, group, fuse)


class OutputLinear(nn.Linear):
    """The untied output layer (module docstring). Called with `labels`, it returns the per-token loss of
    `linear_cross_entropy` instead of the logits: the loss runs inside the module's forward, where FSDP2 has
    gathered its weight."""

    gradient_accumulation_fusion = True

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, group=None) -> torch.Tensor:
        if labels is not None:
            return linear_cross_entropy(x, self.weight, labels, group, self.gradient_accumulation_fusion)
        if fuses_wgrad(self.weight, self.gradient_accumulation_fusion):
            return linear_accumulating_wgrad(x, self.weight, self.bias)
        return super().forward(x)
