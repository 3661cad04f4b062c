"""Gradient bookkeeping across model-parallel ranks, driven by attributes the parallel layers set on parameters.

param.sequence_parallel = True     replicated on the tensor-parallel ranks but fed a sequence *shard*
                                   (norm weights, row-parallel biases under --sequence-parallel): each rank
                                   holds a partial gradient, summed over the tensor-parallel group
param.shared_embedding = True      the word embedding on the first stage and its tied copy on the last stage:
                                   gradients summed over the embedding group so both stay equal
param.grad_norm_duplicate = True   a copy whose gradient another rank already counts (replicated parameters
                                   on tensor-parallel ranks > 0, the last stage's tied embedding): left out of
                                   the gradient norm so that every element counts once
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from .dims import ParallelDims


def _all_reduce_coalesced(tensors: list[torch.Tensor], group) -> None:
    if not tensors or group is None:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def reduce_tied_embedding_grads(params: list[nn.Parameter], dims: ParallelDims) -> None:
    """Sum the tied embedding's gradient over its first- and last-stage copies. Call before the data-parallel
    reduction: the distributed optimizer shards the two stages' buckets differently, so afterwards the parts of
    the two copies that hold the average need not line up (the sum commutes with the data-parallel average)."""
    if dims.pp > 1:
        shared = [p.main_grad for p in params if getattr(p, "shared_embedding", False)]
        _all_reduce_coalesced(shared, dims.embedding_group)


def reduce_sequence_parallel_grads(
    params: list[nn.Parameter],
    dims: ParallelDims,
    reduced_grad: Callable[[nn.Parameter], torch.Tensor],
) -> None:
    """Sum the partial gradients of sequence-parallel parameters over the tensor-parallel group (call after the
    data-parallel reduction, before clipping; tensor-parallel peers shard their buckets alike). `reduced_grad`:
    where a parameter's reduced gradient lives (the gradient buffers' `reduced_grad`: its `main_grad`, or under
    megatron/parallel/fsdp/flat_shards.py this rank's piece of it)."""
    if dims.tp > 1:
        sequence_parallel = [p for p in params if getattr(p, "sequence_parallel", False)]
        _all_reduce_coalesced([reduced_grad(p) for p in sequence_parallel], dims.tp_group)


def counts_in_grad_norm(param: nn.Parameter) -> bool:
    """False for copies whose gradient another rank already counts (see the module docstring)."""
    return not getattr(param, "grad_norm_duplicate", False)


def grad_norm(
    grads: list[torch.Tensor],
    dims: ParallelDims,
    sharded: bool = False,
    device: torch.device | None = None,
    skip: bool = False,
) -> torch.Tensor:
    """Global L2 norm of the model's gradient from this rank's part of it (`grads`: the gradients of its
    parameters that `counts_in_grad_norm`, or with the distributed optimizer (`sharded`) their parts in this rank's
    shard): squares summed here, then over the model-parallel group (tensor x pipeline), and over the data- (x
    context-) parallel group when each replica holds a different shard. `device`: where the sum lives when this rank
    has no gradients. `skip`: make the norm infinite on every rank of the reduction, so that all of them skip the step
    (this rank found inf/NaN FP8 amaxes, which other pipeline stages did not see)."""
    if grads:
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)  # bf16 gradients too: an fp32 norm
        squares = torch.stack(norms).square().sum()
    else:
        squares = torch.zeros((), device=device)
    if skip:
        squares = squares + float("inf")
    if sharded and dims.dp_cp_group is not None:
        dist.all_reduce(squares)  # data (x context) x model parallel ranks: the whole world, in one reduction
    elif dims.mp_group is not None:
        dist.all_reduce(squares, group=dims.mp_group)
    return squares.sqrt()
