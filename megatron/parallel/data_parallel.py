"""Data-parallel gradient averaging."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def allreduce_gradients(grads: list[torch.Tensor], group: dist.ProcessGroup | None, bucket_bytes: int = 2**28) -> None:
    """Average `grads` in place over `group`, a few large flat buckets at a time (one collective per bucket instead
    of one per tensor). A no-op without a group."""
    if group is None or dist.get_world_size(group) == 1:
        return
    world = dist.get_world_size(group)
    bucket: list[torch.Tensor] = []
    size = 0
    for grad in grads + [None]:
        if grad is not None and (not bucket or (grad.dtype == bucket[0].dtype and size < bucket_bytes)):
            bucket.append(grad)
            size += grad.numel() * grad.element_size()
            continue
        if bucket:
            flat = _flatten_dense_tensors(bucket)
            flat.div_(world)
            dist.all_reduce(flat, group=group)
            for g, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                g.copy_(synced)
        bucket, size = ([grad], grad.numel() * grad.element_size()) if grad is not None else ([], 0)
