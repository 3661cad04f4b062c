"""Autograd-aware collectives for tensor and sequence parallelism (Megatron-LM's mappings), and vocab-parallel
cross-entropy.

Each function is a collective in the forward pass and its adjoint in the backward pass:

    copy_to_tp          identity          | all-reduce          (input of a column-parallel linear)
    reduce_from_tp      all-reduce        | identity            (output of a row-parallel linear)
    gather_from_tp      all-gather (last) | split (last)        (column-parallel output, gathered)
    gather_from_sp      all-gather (dim0) | reduce-scatter      (sequence-parallel region -> tensor-parallel)
    reduce_scatter_to_sp reduce-scatter   | all-gather (dim0)   (tensor-parallel -> sequence-parallel region)
    scatter_to_sp       split (dim0)      | all-gather (dim0)   (enter the sequence-parallel region)

With a None group (or one rank) every function is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """What a layer needs to know about tensor parallelism: its group, its rank and whether the regions between
    the tensor-parallel GEMMs (norms, dropout, residuals) are split along the sequence (--sequence-parallel), and
    whether the TE layers overlap those collectives with their GEMMs (--tp-comm-overlap)."""

    group: dist.ProcessGroup | None = None
    size: int = 1
    rank: int = 0
    sequence_parallel: bool = False
    comm_overlap: bool = False

    def shard(self, full: torch.Tensor, dim: int, parts: int = 1) -> torch.Tensor:
        """This rank's slice of `full` along `dim`. With parts > 1 (SwiGLU's [gate; up]) each of the parts is
        sliced and the slices are stacked again, so the shard is [gate_r; up_r]."""
        if self.size == 1:
            return full
        return torch.cat([p.chunk(self.size, dim)[self.rank] for p in full.chunk(parts, dim)], dim).contiguous()


NO_TP = TensorParallel()


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if _size(group) == 1:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    if _size(group) == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = _size(group)
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split over {size} ranks")
    return x.chunk(size, dim=dim)[dist.get_rank(group)].contiguous()


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    size = _size(group)
    if size == 1:
        return x
    parts = [p.contiguous() for p in x.chunk(size, dim=0)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, 0, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, 0, ctx.group), None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToTP.apply(x, group) if _size(group) > 1 else x


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group) if _size(group) > 1 else x


def gather_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherFromTP.apply(x, group) if _size(group) > 1 else x


def gather_from_sp(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherFromSP.apply(x, group) if _size(group) > 1 else x


def reduce_scatter_to_sp(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceScatterToSP.apply(x, group) if _size(group) > 1 else x


def scatter_to_sp(x: torch.Tensor, group) -> torch.Tensor:
    return _ScatterToSP.apply(x, group) if _size(group) > 1 else x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split along the vocabulary: rank r holds columns [r*V/tp, (r+1)*V/tp).

    loss = log(sum_j exp(z_j - m)) - (z_label - m), with the max m, the sum and the label's logit each all-reduced
    over the group, so no rank ever holds the full [tokens, V] logits.
    """

    @staticmethod
    def forward(ctx, logits, labels, group):
        logits = logits.float()
        vocab_local = logits.shape[-1]
        start = dist.get_rank(group) * vocab_local
        logits_max = logits.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        in_range = (labels >= start) & (labels < start + vocab_local)
        local_label = (labels - start).clamp(0, vocab_local - 1)
        label_logit = shifted.gather(-1, local_label.unsqueeze(-1)).squeeze(-1) * in_range
        dist.all_reduce(label_logit, group=group)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, local_label, in_range)
        return sum_exp.log() - label_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, local_label, in_range = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, local_label.unsqueeze(-1), -in_range.float().unsqueeze(-1))
        return grad_logits * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group) -> torch.Tensor:
    """Per-token loss [...] from vocab-sharded logits [..., V/tp] (fp32 inside); plain cross-entropy on one rank."""
    if _size(group) == 1:
        flat = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
        )
        return flat.view(labels.shape)
    return _VocabParallelCrossEntropy.apply(logits, labels, group)
