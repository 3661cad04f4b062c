"""Gradient buffers and data-parallel gradient reduction (Megatron-LM's DDP, simplified).

Every trainable parameter gets `param.main_grad`: an fp32 (bf16 with --grad-reduce-in-bf16) view into a contiguous
bucket. A post-accumulate-grad hook adds each micro-batch's gradient into it and frees `param.grad`, so accumulation
over micro-batches happens in the buffer's dtype whatever the parameter dtype, and the optimizer reads one flat
buffer. (Transformer Engine's fused wgrad
accumulation writes into `main_grad` itself and sets `param.grad_added_to_main_grad`, or, for weights that always
take that path, `param.fused_wgrad_accumulation`: a CUDA-graph replay runs no Python to set the former. The hook
then only frees.)

Data parallelism averages the buckets over the data-parallel group once per optimizer step, never on the
accumulation steps: either all at the end (`finish()`), or — with `--overlap-grad-reduce` — each bucket's
all-reduce starts asynchronously during the last micro-batch's backward as soon as all of its gradients are in,
overlapping communication with the rest of the backward pass. Buckets are filled in reverse parameter order, the
order backward produces gradients. With --fp8-grad-reduce the buckets travel as FP8 and are summed in fp32 on
arrival (megatron/parallel/fp8_reduce.py), still asynchronously; the sums are written back when the work is waited
for.

With the distributed optimizer (`shard=True`) each bucket is split into dp equal, contiguous shards (padded to a
multiple of dp); data-parallel rank r owns shard r. The buckets are reduce-scattered instead of all-reduced, so
only the owned shard of `main_grad` holds the average afterwards (the rest is stale), and the parameters live in
a bucket-shaped buffer of their own (`param.data` is a view into it) so that the optimizer, having updated the
owned shard, all-gathers every bucket's parameters in one collective (`gather_params()`). With
`--overlap-param-gather` those all-gathers run asynchronously, last bucket (the first layers) first, and the next
forward pass waits for each bucket just before the first module that uses it (`wait_for_params_in_forward`), so
the gathers overlap the forward pass instead of preceding it.

`FlatGradShards` (parallel/fsdp/flat_shards.py, --use-megatron-fsdp's optim_grads) keeps these buckets, parameter
buffers and shards but reduce-scatters every micro-batch into persistent gradient shards, each bucket's gradients
allocated only while in use.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from megatron.fp8.params import fp8_raw_data, is_fp8_param, move_fp8_storage

from .fp8_reduce import (
    FP8_REDUCE_ALIGN,
    Fp8ReduceHandle,
    Fp8ReduceStats,
    start_fp8_all_reduce,
    start_fp8_reduce_scatter,
)

# torch 2.13 renamed the single-tensor collectives; the device image's torch 2.11 has the old names only.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Shards are whole multiples of this many elements (512 bytes of fp32), so each starts aligned.
_SHARD_ALIGN = 128


class _Bucket:
    def __init__(
        self, params: list[nn.Parameter], device: torch.device, dtype: torch.dtype, pad_to: int = 1, allocate=True
    ):
        self.params = params
        self.numel = -(-sum(p.numel() for p in params) // pad_to) * pad_to
        self.device, self.dtype = device, dtype
        # the gradients; not allocated here for megatron/parallel/fsdp/flat_shards.py, whose buckets allocate it per
        # micro-batch
        self.data = torch.zeros(self.numel, dtype=dtype, device=device) if allocate else None
        self.param_data: torch.Tensor | None = None  # the distributed optimizer's parameter buffer
        self.shard: torch.Tensor | None = None  # sharded: this rank's shard of `data`, made once (`_start` reads it)
        self.pending = len(params)
        self.work: dist.Work | Fp8ReduceHandle | None = None
        self.gather: dist.Work | None = None  # an overlapped parameter all-gather still in flight


def _mark_rewritten(bucket: _Bucket) -> None:
    """Bump the version counters of a bucket's parameters, whose other ranks' pieces an all-gather into
    `param_data` rewrites: a parameter holds that buffer through `.data` (`_move_params_into_buffer`), so writes to
    the buffer leave the parameter's own counter as it was, and only a piece this rank steps on (a view of the
    parameter) bumps it. Transformer Engine's layers tell a new step from the next micro-batch by these counters
    (`TETransformerLayer._first_microbatch`): a layer with no piece here (a small model in one bucket, large
    buckets, a high data-parallel degree) would otherwise keep its first step's FP8 weight casts. FP8 parameters
    (their bytes gathered) are left alone: TE reads them as they are, with no cast to renew."""
    if bucket.param_data.dtype == torch.uint8:  # a bucket of FP8 weights' bytes (`_move_params_into_buffer`)
        return
    for param in bucket.params:
        torch.autograd.graph.increment_version(param)


def _storage_kind(param: nn.Parameter) -> object:
    """What the distributed optimizer's all-gather moves for a parameter: "fp8" bytes, or its plain dtype."""
    if is_fp8_param(param):
        fp8_raw_data(param)  # raises for an FP8 weight that cannot be gathered as bytes
        return "fp8"
    if type(param.data) is not torch.Tensor:
        raise ValueError(f"the distributed optimizer cannot gather {type(param.data).__name__} parameters")
    return param.dtype


class GradientBuffers:
    """The data-parallel gradient buffers, and with `shard` the distributed optimizer's (the module docstring): a
    `GradientEngine` (megatron/parallel/engines.py)."""

    # Each bucket's whole gradient buffer is allocated at construction and kept (parallel/fsdp/flat_shards.py's buckets:
    # not)
    _bucket_type = _Bucket

    def __init__(
        self,
        model: nn.Module,
        dp_group: dist.ProcessGroup | None,
        overlap: bool = False,
        bucket_size: int = 40_000_000,
        shard: bool = False,
        overlap_param_gather: bool = False,
        grad_dtype: torch.dtype = torch.float32,
        fp8_reduce: bool = False,
    ):
        """`bucket_size`: elements per bucket (Megatron-LM's default is 40M); `shard`: for the distributed
        optimizer, `overlap_param_gather`: its all-gathers asynchronous (see the module docstring); `grad_dtype`:
        the buffers' dtype (fp32, or bf16 for --grad-reduce-in-bf16); `fp8_reduce`: reduce them as FP8
        (--fp8-grad-reduce, megatron/parallel/fp8_reduce.py; `fp8_stats` counts what flushed to zero)."""
        self.group = dp_group
        self.dp = 1 if dp_group is None else dist.get_world_size(dp_group)
        self.dp_rank = 0 if dp_group is None else dist.get_rank(dp_group)
        self.sharded_state = shard
        self.overlap_param_gather = overlap_param_gather and shard
        # NCCL averages inside the all-reduce; gloo has no AVG, so its buckets are divided first. On a GPU the
        # division would be one more pass over every gradient byte, on the compute stream, during the backward.
        self._nccl_avg = self.dp > 1 and dist.get_backend(dp_group) == "nccl"
        self._reduce_op = dist.ReduceOp.AVG if self._nccl_avg else dist.ReduceOp.SUM
        self.overlap = overlap and self.dp > 1
        self.fp8_reduce = fp8_reduce and self.dp > 1
        self.fp8_stats = Fp8ReduceStats() if self.fp8_reduce else None
        # Shards start aligned; FP8 reduction also needs whole scaling blocks in every rank's chunk.
        pad_to = self.dp * FP8_REDUCE_ALIGN if self.fp8_reduce else (self.dp * _SHARD_ALIGN if shard else 1)
        self.is_last_micro_batch = True
        self._paused = False
        params = [p for p in model.parameters() if p.requires_grad]
        self.params = params
        self.buckets: list[_Bucket] = []
        new_bucket = functools.partial(self._bucket_type, dtype=grad_dtype, pad_to=pad_to)
        # Sharded, a bucket's parameters share one storage type, which its all-gather moves: FP8 weights
        # (--fp8-param-gather) fill buckets of their own, interleaved in backward order with the others'.
        current: dict[object, list[nn.Parameter]] = {}
        for param in reversed(params):
            kind = _storage_kind(param) if shard else None
            current.setdefault(kind, []).append(param)
            if sum(p.numel() for p in current[kind]) >= bucket_size:
                self.buckets.append(new_bucket(current.pop(kind), param.device))
        for rest in current.values():
            self.buckets.append(new_bucket(rest, rest[0].device))
        # Torch keeps a parameter's hooks on its C++ side, out of the garbage collector's sight: until they are
        # removed (`remove_hooks`), the parameters keep these buffers, and with them their process group, alive.
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._bucket_of: dict[nn.Parameter, _Bucket] = {}
        self._offset_of: dict[nn.Parameter, int] = {}
        for bucket in self.buckets:
            offset = 0
            for param in bucket.params:
                param.grad_added_to_main_grad = False
                self._bucket_of[param], self._offset_of[param] = bucket, offset
                offset += param.numel()
                self._hooks.append(param.register_post_accumulate_grad_hook(self._on_grad))
            self._point_main_grads(bucket)
            if shard:
                self._move_params_into_buffer(bucket)

    def _point_main_grads(self, bucket: _Bucket) -> None:
        """Every parameter's `main_grad`, its view into the bucket's gradients, and (sharded) the bucket's `shard`:
        made once, at construction."""
        for param in bucket.params:
            offset = self._offset_of[param]
            param.main_grad = bucket.data[offset : offset + param.numel()].view_as(param)
        if self.sharded_state:
            bucket.shard = self._shard(bucket.data)

    def _move_params_into_buffer(self, bucket: _Bucket) -> None:
        kind = _storage_kind(bucket.params[0])
        dtype = torch.uint8 if kind == "fp8" else kind
        bucket.param_data = torch.zeros(bucket.numel, dtype=dtype, device=bucket.device)
        with torch.no_grad():
            for param in bucket.params:
                offset = self._offset_of[param]
                view = bucket.param_data[offset : offset + param.numel()]
                if kind == "fp8":
                    move_fp8_storage(param, view)
                else:
                    view = view.view_as(param)
                    view.copy_(param.data)
                    param.data = view

    def _shard_bounds(self, bucket_numel: int) -> tuple[int, int]:
        """[start, stop) of this rank's shard in a bucket of `bucket_numel` elements."""
        size = bucket_numel // self.dp
        return self.dp_rank * size, (self.dp_rank + 1) * size

    def _shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a bucket-sized flat tensor."""
        start, stop = self._shard_bounds(flat.numel())
        return flat[start:stop]

    def owned_range(self, param: nn.Parameter) -> tuple[int, int] | None:
        """The [start, stop) range of `param`'s flattened elements that lie in this rank's shard (all of them when
        not sharded), or None when none do."""
        if not self.sharded_state:
            return 0, param.numel()
        offset = self._offset_of[param]
        shard_start, shard_stop = self._shard_bounds(self._bucket_of[param].numel)
        start, stop = max(offset, shard_start), min(offset + param.numel(), shard_stop)
        return (start - offset, stop - offset) if start < stop else None

    def grad_piece(self, param: nn.Parameter, start: int, stop: int) -> torch.Tensor:
        """Where the optimizer reads the reduced gradient of `param`'s flattened elements [start, stop) (a range of
        `owned_range` when sharded): its `main_grad`."""
        return param.main_grad.view(-1)[start:stop]

    def reduced_grad(self, param: nn.Parameter) -> torch.Tensor:
        """`param`'s gradient after `finish()`, which `reduce_sequence_parallel_grads` sums over the tensor-parallel
        peers: its `main_grad`."""
        return param.main_grad

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
        if self.fp8_reduce:  # averages in fp32 after the sum: no division first
            start = start_fp8_reduce_scatter if self.sharded_state else start_fp8_all_reduce
            bucket.work = start(bucket.data, self.group, average=True, stats=self.fp8_stats)
            return
        if not self._nccl_avg:
            bucket.data.div_(self.dp)
        if self.sharded_state:  # in place: this rank's shard of the bucket receives the average
            bucket.work = _reduce_scatter(bucket.shard, bucket.data, self._reduce_op, group=self.group, async_op=True)
        else:
            bucket.work = dist.all_reduce(bucket.data, self._reduce_op, group=self.group, async_op=True)

    def finish(self) -> None:
        """Complete the data-parallel average of every bucket (call after the last micro-batch's backward)."""
        self.wait_for_params()  # a parameter no forward used would still be gathering into its bucket
        if self.dp > 1:
            for bucket in self.buckets:
                if bucket.work is None:  # not overlapped, or a parameter that got no gradient this step
                    self._start(bucket)
            for bucket in self.buckets:
                bucket.work.wait()
                bucket.work = None
        self._reset_pending()

    def gather_params(self) -> None:
        """After the distributed optimizer has written its shard of every bucket's parameters: all-gather them, so
        every rank holds the whole updated model. With `overlap_param_gather` this only starts the gathers;
        `wait_for_params` (or the forward hooks) completes them before the parameters are read."""
        if not (self.sharded_state and self.dp > 1):
            return
        self.wait_for_params()
        for bucket in reversed(self.buckets):  # the forward pass reads the last bucket (the first layers) first
            shard = self._shard(bucket.param_data)
            bucket.gather = _all_gather(bucket.param_data, shard, group=self.group, async_op=self.overlap_param_gather)
            _mark_rewritten(bucket)

    def wait_for_params(self, buckets: list[_Bucket] | None = None) -> None:
        """Complete the parameter all-gathers still in flight (of `buckets`, default all)."""
        for bucket in self.buckets if buckets is None else buckets:
            if bucket.gather is not None:
                bucket.gather.wait()
                bucket.gather = None

    def reclaim_shards(self) -> None:
        """Nothing to reclaim: every rank holds its weights whole."""

    def shards_released(self) -> bool:
        return False

    def wait_for_params_in_forward(self, model: nn.Module, layers: list[nn.Module]) -> None:
        """Forward pre-hooks that complete the all-gathers of a module's buckets before it runs: of its own
        parameters for every module, and of all their parameters for `layers` (a CUDA-graphed layer replays its
        sub-modules' kernels without calling their forward)."""

        def hook_for(params: list[nn.Parameter]):
            buckets = list({id(b): b for b in (self._bucket_of[p] for p in params if p in self._bucket_of)}.values())
            return lambda module, args: self.wait_for_params(buckets)

        for module in model.modules():
            if params := list(module.parameters(recurse=False)):
                self._hooks.append(module.register_forward_pre_hook(hook_for(params)))
        for layer in layers:
            self._hooks.append(layer.register_forward_pre_hook(hook_for(list(layer.parameters()))))

    def remove_hooks(self) -> None:
        """Take the buffers' hooks off the model (gradients stop flowing into the buffers): at the end of a run, so
        that the buffers and their process group can go."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

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
