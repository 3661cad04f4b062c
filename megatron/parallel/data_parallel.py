"""Gradient buffers and data-parallel gradient reduction (Megatron-LM's DDP, simplified).

Every trainable parameter gets `param.main_grad`: an fp32 view into a contiguous bucket. A post-accumulate-grad
hook adds each micro-batch's gradient into it and frees `param.grad`, so accumulation over micro-batches happens in
fp32 whatever the parameter dtype, and the optimizer reads one flat buffer. (Transformer Engine's fused wgrad
accumulation writes into `main_grad` itself and sets `param.grad_added_to_main_grad`, or, for weights that always
take that path, `param.fused_wgrad_accumulation`: a CUDA-graph replay runs no Python to set the former. The hook
then only frees.)

Data parallelism averages the buckets over the data-parallel group once per optimizer step, never on the
accumulation steps: either all at the end (`finish()`), or — with `--overlap-grad-reduce` — each bucket's
all-reduce starts asynchronously during the last micro-batch's backward as soon as all of its gradients are in,
overlapping communication with the rest of the backward pass. Buckets are filled in reverse parameter order, the
order backward produces gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn


class _Bucket:
    def __init__(self, params: list[nn.Parameter], device: torch.device):
        self.params = params
        self.data = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=device)
        self.pending = len(params)
        self.work: dist.Work | None = None


class GradientBuffers:
    def __init__(
        self,
        model: nn.Module,
        dp_group: dist.ProcessGroup | None,
        overlap: bool = False,
        bucket_size: int = 40_000_000,
    ):
        """`bucket_size`: elements per bucket (Megatron-LM's default is 40M)."""
        self.group = dp_group
        self.dp = 1 if dp_group is None else dist.get_world_size(dp_group)
        self.overlap = overlap and self.dp > 1
        self.is_last_micro_batch = True
        self._paused = False
        params = [p for p in model.parameters() if p.requires_grad]
        self.params = params
        self.buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        for param in reversed(params):
            current.append(param)
            if sum(p.numel() for p in current) >= bucket_size:
                self.buckets.append(_Bucket(current, param.device))
                current = []
        if current:
            self.buckets.append(_Bucket(current, current[0].device))
        self._bucket_of = {}
        for bucket in self.buckets:
            offset = 0
            for param in bucket.params:
                param.main_grad = bucket.data[offset : offset + param.numel()].view_as(param)
                param.grad_added_to_main_grad = False
                offset += param.numel()
                self._bucket_of[param] = bucket
                param.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, param: nn.Parameter) -> None:
        if self._paused:
            return
        fused = param.grad_added_to_main_grad or getattr(param, "fused_wgrad_accumulation", False)
        if param.grad is not None and not fused:
            param.main_grad.add_(param.grad)
        param.grad = None
        param.grad_added_to_main_grad = False
        if self.overlap and self.is_last_micro_batch:
            bucket = self._bucket_of[param]
            bucket.pending -= 1
            if bucket.pending == 0:
                self._start(bucket)

    def _start(self, bucket: _Bucket) -> None:
        bucket.data.div_(self.dp)
        bucket.work = dist.all_reduce(bucket.data, group=self.group, async_op=True)

    def finish(self) -> None:
        """Complete the data-parallel average of every bucket (call after the last micro-batch's backward)."""
        if self.dp > 1:
            for bucket in self.buckets:
                if bucket.work is None:  # not overlapped, or a parameter that got no gradient this step
                    self._start(bucket)
            for bucket in self.buckets:
                bucket.work.wait()
                bucket.work = None
        self._reset_pending()

    def _reset_pending(self) -> None:
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Gradients computed inside are thrown away: the hook leaves `param.grad` as it is (CUDA-graph capture
        reads it to find the parameters that get gradients) and neither accumulates nor starts a reduction. On exit
        every `param.grad` is cleared and every buffer zeroed (fused wgrad GEMMs wrote into them)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False
            for param in self.params:
                param.grad = None
                param.grad_added_to_main_grad = False
            self._reset_pending()
            self.zero()

    def zero(self) -> None:
        for bucket in self.buckets:
            bucket.data.zero_()
