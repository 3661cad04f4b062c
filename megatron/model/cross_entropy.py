"""The fused cross-entropy of `--cross-entropy-loss-fusion --cross-entropy-fusion-impl native`.

The plain loss (megatron/parallel/tensor_parallel.py) keeps fp32 log-probabilities or softmax of the whole
vocabulary for backward: 4 bytes x V per token. This one keeps the logits as they are (2 bytes per entry in
bf16/fp16) and one fp32 log-sum-exp per token, and recomputes the softmax in backward, where the gradient is formed
in the logits' dtype. Over a tensor-parallel group (logits split along the vocabulary) only per-token maxima, sums
and label logits are all-reduced, as in the plain vocab-parallel loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_over_group(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    """all_reduce over `group`, nothing where there is no group or one rank (the tensor-parallel losses' sums)."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)


class _FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, group) -> torch.Tensor:
        vocab_local = logits.shape[-1]
        start = (dist.get_rank(group) if group is not None else 0) * vocab_local
        z = logits.float()
        top = z.max(dim=-1).values
        all_reduce_over_group(top, group, dist.ReduceOp.MAX)
        in_range = (labels >= start) & (labels < start + vocab_local)
        local_label = (labels - start).clamp(0, vocab_local - 1)
        label_logit = z.gather(-1, local_label.unsqueeze(-1)).squeeze(-1) * in_range
        all_reduce_over_group(label_logit, group)
        sum_exp = (z - top.unsqueeze(-1)).exp_().sum(dim=-1)
        all_reduce_over_group(sum_exp, group)
        lse = top + sum_exp.log()
        ctx.group = group
        ctx.save_for_backward(logits, local_label, in_range, lse)
        return lse - label_logit

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, local_label, in_range, lse = ctx.saved_tensors
        softmax = (logits.float() - lse.unsqueeze(-1)).exp_()
        softmax.scatter_add_(-1, local_label.unsqueeze(-1), -in_range.float().unsqueeze(-1))
        return (softmax * grad.unsqueeze(-1)).to(logits.dtype), None, None


def fused_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group=None) -> torch.Tensor:
    """Per-token loss [...] (fp32) from logits [..., V/tp] (this rank's vocabulary slice) and labels [...]."""
    return _FusedCrossEntropy.apply(logits, labels, group)
