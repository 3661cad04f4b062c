"""Sharded gradient accumulation on the distributed optimizer's flat buckets (ZeRO-2): the engine of
`--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads`.

The buckets, their parameter buffers, their shards and the parameter all-gather after the step are the distributed
optimizer's (`GradientBuffers` with `shard=True`, megatron/parallel/data_parallel.py), and so is the optimizer's
state layout (its checkpoints load under the distributed optimizer and back). What differs is where the gradients
are accumulated over the micro-batches of a step:

* every micro-batch's backward reduce-scatters each bucket as soon as all of its parameters' gradients are in (the
  distributed optimizer does so during the last micro-batch only), and this rank's shard of the average is added
  into a persistent shard buffer (`shards`: one flat tensor, 1/dp of the buckets, fp32 or bf16:
  --megatron-fsdp-main-grads-dtype, whose auto follows --grad-reduce-in-bf16). The optimizer reads its pieces of
  the gradient there (`grad_piece`);
* a bucket's whole gradient buffer (`bucket.data`, in the reduce-scatter's dtype: --megatron-fsdp-grad-comm-dtype)
  lives only from just before its first gradient of a micro-batch is produced until its reduce-scatter has been
  waited for and its shard added: it is allocated by a hook on the gradient of the output of each transformer layer
  holding its parameters, or of each other module holding them directly (that gradient is computed before the
  layer's or module's backward, where the fused wgrad GEMMs, Transformer Engine's and
  megatron/model/grad_accumulation.py's, write `weight.main_grad`; one hook a layer, not one per module in it:
  the host registers it every micro-batch), or else by the parameter's post-accumulate-grad hook (a gradient
  autograd accumulated, e.g. the tied output layer's). Every parameter's `main_grad` is a view of `bucket.data` made
  once; allocating and freeing resize the storage under it, to the bucket's bytes and to none (`_FreshBucket`), so
  no whole-model gradient buffer exists between micro-batches or steps. A write into a freed bucket's view is a
  bug that no error names (a write through a null pointer, as with FSDP2's freed parameters); the tests fill new
  buckets with NaN and check that only the buckets whose reduce-scatters are in flight hold storage.
* a bucket is not zeroed (only its padding is): within its micro-batch each parameter gets one gradient (autograd
  sums a parameter's uses before the post-accumulate-grad hook runs, and a recomputed layer runs its backward
  once; a second one is an error), so the fused wgrad GEMMs write theirs instead of accumulating
  (`overwrite_main_grad`, Transformer Engine's weight attribute, which grad_accumulation.py and
  megatron/fp8/params.py honour too) and the others' (norm weights, biases, embeddings) are copied, all of a
  bucket's in one `_foreach_copy_` before its reduce-scatter starts. A
  parameter that got no gradient has its slice zeroed before the reduce-scatter, so no unwritten element is ever
  reduced.
  Waiting for a reduce-scatter lags `LAG` buckets behind the latest started, keeping it overlapped with the
  backward; the last buckets of a micro-batch are waited for during the next forward (before its last transformer
  layer) or by `finish()` after the last micro-batch.
* on a GPU that wait, and the add of the shard into the persistent shards, run on a stream of their own
  (`_retire`), not the compute stream: the compute stream meets the peers' reduce-scatters only in `finish()`, as
  under the distributed optimizer. Waiting on the compute stream made it stop at every bucket until the slowest
  rank had started that bucket's reduce-scatter, so any delay on one rank's host stalled every GPU. A bucket's
  storage goes back to the allocator once that stream's add is done (`record_stream`).
* a step's first reduce-scatter of each bucket is copied into its shard, later ones added: the shards are not
  zeroed between steps (`zero()` only marks them stale; `finish()` zeroes a shard no micro-batch reached).

The end of each micro-batch's backward (an autograd callback queued from the hook on the model's output, in the
outer backward, not in a recomputed layer's nested one) starts the reduce-scatter of every bucket not yet started
(a parameter that got no gradient), so that all ranks run the same collectives.
A paused pass (`GradientBuffers.paused`: delayed scaling's calibration, whose gradients are thrown away) allocates
the buckets alike and frees each, unreduced, once its gradients are in.

With --fp8-grad-reduce each reduce-scatter sends FP8 (megatron/parallel/fp8_reduce.py), as the distributed
optimizer's does. Not built (config/sharding.py refuses them): CUDA graphs (a captured wgrad GEMM writes into fixed
`main_grad` addresses) and pipeline parallelism (the schedule interleaves micro-batches' backward passes).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..data_parallel import GradientBuffers, _Bucket

# Reduce-scatters in flight before the oldest is waited for: enough to overlap each with the next buckets' backward.
LAG = 2


def _first_grad_tensor(output: object) -> torch.Tensor | None:
    """The first tensor of a module's output (a tensor, or a tuple or list of them) that will receive a gradient."""
    for item in output if isinstance(output, (tuple, list)) else (output,):
        if isinstance(item, torch.Tensor) and item.requires_grad:
            return item
    return None


class _FreshBucket(_Bucket):
    """A bucket whose storage is allocated for each micro-batch, uninitialized, and which records the parameters
    written since (`marks[i] == stamp` for its i-th parameter; plain ints: this runs once per parameter and
    micro-batch, where a set of tensors would call their Python `__hash__`).

    `data` and every view of it (each parameter's `main_grad`, this rank's shard, the padding) are made once; the
    storage under them is resized to the bucket's bytes to allocate it and to none to free it, as FSDP2 does with its
    unsharded parameters: a view is a few microseconds of host time per parameter, which a step would otherwise pay
    twice per bucket and micro-batch."""

    def __init__(self, params: list[nn.Parameter], device: torch.device, dtype: torch.dtype, pad_to: int = 1):
        super().__init__(params, device, dtype, pad_to, allocate=False)
        self.used = sum(p.numel() for p in params)  # the elements before the padding
        self.data = torch.empty(self.numel, dtype=dtype, device=device)
        self.storage, self.nbytes = self.data.untyped_storage(), self.data.nbytes
        self.storage.resize_(
            0
        )  # `FlatGradShards._point_main_grads` makes the views while it briefly holds storage again
        self.padding: torch.Tensor | None = None  # `data` after its parameters' elements, zeroed at each allocation
        self.live = False  # whether the storage is allocated
        self.grad_shard: torch.Tensor | None = (
            None  # this rank's shard of the step's gradients (`FlatGradShards.shards`)
        )
        self.shard_stale = True  # grad_shard holds no gradient of this step yet: the next reduce-scatter is copied
        # allocations so far, the allocation each parameter was last written in, and how many were in this one
        self.stamp, self.marks, self.written = 0, [0] * len(params), 0
        # gradients autograd accumulated (not the fused wgrad GEMMs'), copied into their `main_grad` in one
        # `_foreach_copy_` when the bucket's reduce-scatter starts, not one copy kernel each
        self.copy_to: list[torch.Tensor] = []
        self.copy_from: list[torch.Tensor] = []


class FlatGradShards(GradientBuffers):
    """The distributed optimizer's flat buckets with each micro-batch's gradients reduce-scattered into persistent
    shards (the module docstring): a `GradientEngine` (megatron/parallel/engines.py)."""

    _bucket_type = _FreshBucket
    # Tests set NaN: a bucket region reduced without having been written or zeroed then reaches the losses.
    fill_new_buckets: float | None = None

    def __init__(
        self,
        model: nn.Module,
        dp_group: dist.ProcessGroup | None,
        bucket_size: int = 40_000_000,
        overlap_param_gather: bool = False,
        shard_dtype: torch.dtype = torch.float32,
        comm_dtype: torch.dtype = torch.float32,
        fp8_reduce: bool = False,
        layers: Sequence[nn.Module] = (),
    ):
        """`shard_dtype`: of the persistent gradient shards; `comm_dtype`: of the transient buckets (the wgrad GEMMs'
        output and the reduce-scatter); `layers`: the transformer layers, whose output gradient allocates the buckets
        of all their parameters (the module docstring), and before whose last one's forward the previous
        micro-batch's last reduce-scatters are waited for (without layers: per module holding parameters, and before
        the model's forward). The rest as `GradientBuffers`."""
        super().__init__(
            model, dp_group, True, bucket_size, True, overlap_param_gather, grad_dtype=comm_dtype, fp8_reduce=fp8_reduce
        )
        if self.dp < 2:
            raise ValueError("sharded gradient accumulation needs a data-parallel group of at least two ranks")
        total = sum(b.numel for b in self.buckets) // self.dp
        self.shards = torch.zeros(total, dtype=shard_dtype, device=self.params[0].device if self.params else None)
        start = 0
        for bucket in self.buckets:
            bucket.grad_shard = self.shards[start : start + bucket.numel // self.dp]
            start += bucket.numel // self.dp
        self._in_flight: list[_FreshBucket] = []
        # where reduce-scatters are waited for and added into the shards (module docstring); None: the current stream
        device = self.shards.device
        self._reduce_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._callback_queued = False
        # each parameter's bucket and its index there: the one dictionary lookup per gradient
        self._slot_of = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        for param in self.params:  # read by the fused wgrad GEMMs (TE: at each forward)
            param.overwrite_main_grad = True
        self._allocator_of: dict[nn.Module, functools.partial] = {}
        layer_ids = {id(layer) for layer in layers}
        inside = {id(m) for layer in layers for m in layer.modules()} - layer_ids  # their layer's hook allocates
        for module in model.modules():
            if id(module) in inside:
                continue
            params = module.parameters(recurse=id(module) in layer_ids)
            owned = {id(b): b for p in params if (b := self._bucket_of.get(p)) is not None}
            if owned:  # one bound callable per module, made once: the forward hook registers it each micro-batch
                self._allocator_of[module] = functools.partial(self._allocate_all, list(owned.values()))
                self._hooks.append(module.register_forward_hook(self._on_output))
        self._hooks.append(model.register_forward_hook(self._end_of_backward_hook))
        # the previous micro-batch's last reduce-scatters overlap the forward up to the last layer
        drain = layers[-1] if layers else model
        self._hooks.append(drain.register_forward_pre_hook(lambda module, args: self._retire(0)))

    def _on_output(self, module: nn.Module, args: object, output: object) -> None:
        """Forward hook of a module whose buckets `_allocate_all` allocates from its output's gradient."""
        if torch.is_grad_enabled() and (out := _first_grad_tensor(output)) is not None:
            out.register_hook(self._allocator_of[module])

    def _allocate_all(self, buckets: list[_FreshBucket], grad: torch.Tensor) -> None:
        for bucket in buckets:
            self._allocate(bucket)

    def _end_of_backward_hook(self, module: nn.Module, args: object, output: object) -> None:
        if torch.is_grad_enabled() and (out := _first_grad_tensor(output)) is not None:
            out.register_hook(self._queue_end_of_backward)

    def _queue_end_of_backward(self, grad: torch.Tensor) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _point_main_grads(self, bucket: _FreshBucket) -> None:
        """Make, once, the views `_FreshBucket` keeps: every parameter's `main_grad` and the shard (as for every
        bucket), and the padding (the storage is held only while they are made: a view of a storage too small for it
        cannot be made)."""
        bucket.storage.resize_(bucket.nbytes)
        super()._point_main_grads(bucket)
        bucket.padding = bucket.data[bucket.used :] if bucket.used < bucket.numel else None
        bucket.storage.resize_(0)

    def _allocate(self, bucket: _FreshBucket) -> None:
        """Give a bucket storage for this micro-batch's gradients, on the current stream: uninitialized but for its
        padding (the module docstring says why)."""
        if not bucket.live:
            bucket.storage.resize_(bucket.nbytes)
            bucket.live = True
            if self.fill_new_buckets is not None:
                bucket.data.fill_(self.fill_new_buckets)
            if bucket.padding is not None:
                bucket.padding.zero_()
            bucket.stamp, bucket.written = bucket.stamp + 1, 0

    def _free(self, bucket: _FreshBucket) -> None:
        bucket.storage.resize_(0)
        bucket.live = False
        bucket.copy_to.clear()
        bucket.copy_from.clear()

    def _on_grad(self, param: nn.Parameter) -> None:
        bucket, index = self._slot_of[param]
        if self._paused:  # a pass whose gradients are thrown away (calibration): a bucket goes once complete
            param.grad = None
            param.grad_added_to_main_grad = False
            bucket.pending -= 1
            if bucket.pending == 0 and bucket.live:
                self._free(bucket)
            return
        if not bucket.live:
            self._allocate(bucket)
        if bucket.marks[index] == bucket.stamp:  # its first gradient would be lost, or its bucket reduced early
            raise RuntimeError(
                "a parameter got two gradients in one micro-batch (used in two separately recomputed regions?):"
                " optim_grads on the flat buckets takes one per parameter; use --use-distributed-optimizer"
            )
        if param.grad_added_to_main_grad or getattr(param, "fused_wgrad_accumulation", False):
            bucket.marks[index], bucket.written = bucket.stamp, bucket.written + 1  # its wgrad GEMM wrote main_grad
        elif param.grad is not None:  # the bucket is not zeroed: the gradient is copied (in `_start`), not added
            bucket.copy_to.append(param.main_grad)
            bucket.copy_from.append(param.grad)
            bucket.marks[index], bucket.written = bucket.stamp, bucket.written + 1
        param.grad = None
        param.grad_added_to_main_grad = False
        bucket.pending -= 1
        if bucket.pending == 0:
            self._start(bucket)

    def _start(self, bucket: _FreshBucket) -> None:
        if bucket.copy_to:
            torch._foreach_copy_(bucket.copy_to, bucket.copy_from)
            bucket.copy_to.clear()
            bucket.copy_from.clear()
        if not bucket.written:
            bucket.data.zero_()
        elif bucket.written < len(bucket.params):  # zero what no gradient wrote: nothing uninitialized is reduced
            for param, mark in zip(bucket.params, bucket.marks):
                if mark != bucket.stamp:
                    param.main_grad.zero_()
        super()._start(bucket)
        self._in_flight.append(bucket)
        self._retire(LAG)

    def _retire(self, keep: int) -> None:
        """Wait for the oldest reduce-scatters until `keep` are in flight: add each one's shard of the average into
        the persistent shards and free its bucket."""
        if len(self._in_flight) <= keep:
            return
        stream = self._reduce_stream
        if stream is not None:  # set directly, the device by its index: each a fraction of a stream context's host time
            current = torch.cuda.current_stream(stream.device_index)
            torch.cuda.set_stream(stream)
        try:
            while len(self._in_flight) > keep:
                bucket = self._in_flight.pop(0)
                bucket.work.wait()
                if bucket.shard_stale:
                    bucket.grad_shard.copy_(bucket.shard)
                else:
                    bucket.grad_shard.add_(bucket.shard)
                bucket.work, bucket.shard_stale = None, False
                if stream is not None:  # the allocator reuses the storage only once that stream's add is done
                    bucket.data.record_stream(stream)
                self._free(bucket)
        finally:
            if stream is not None:
                torch.cuda.set_stream(current)

    def _end_of_backward(self) -> None:
        """After a micro-batch's backward: reduce every bucket still waiting for a gradient (all ranks run the same
        collectives), then count the next micro-batch's gradients afresh."""
        self._callback_queued = False
        for bucket in self.buckets if not self._paused else []:
            if bucket.pending:
                self._allocate(bucket)
                bucket.pending = 0
                self._start(bucket)
        self._reset_pending()

    def finish(self) -> None:
        """Complete the step's gradient shards (after the last micro-batch's backward)."""
        self.wait_for_params()
        self._retire(0)
        if any(bucket.live for bucket in self.buckets):
            raise RuntimeError("a gradient bucket was filled but never reduced: its backward did not end")
        if self._reduce_stream is not None:
            torch.cuda.current_stream(self.shards.device).wait_stream(self._reduce_stream)
        for bucket in self.buckets:
            if bucket.shard_stale:  # no micro-batch's backward reached it (none ran): no gradient, not last step's
                bucket.grad_shard.zero_()

    def grad_piece(self, param: nn.Parameter, start: int, stop: int) -> torch.Tensor:
        """`param`'s flattened elements [start, stop), within this rank's shard, in the persistent shards."""
        bucket = self._bucket_of[param]
        offset = self._offset_of[param] - self._shard_bounds(bucket.numel)[0]
        return bucket.grad_shard[offset + start : offset + stop]

    def reduced_grad(self, param: nn.Parameter) -> torch.Tensor:
        """This rank's piece of `param`'s reduced gradient in the shards (empty where it owns none): what
        `reduce_sequence_parallel_grads` sums over the tensor-parallel peers, whose shards are laid out alike."""
        owned = self.owned_range(param)
        return self.shards[:0] if owned is None else self.grad_piece(param, *owned)

    def zero(self) -> None:
        """Start the next step's gradient shards (each is overwritten by its first reduce-scatter, not zeroed here),
        and drop any bucket left allocated (a paused pass's: see `GradientBuffers.paused`; nothing is reduced)."""
        for bucket in self.buckets:
            if bucket.live:
                self._free(bucket)
            bucket.shard_stale = True

    def remove_hooks(self) -> None:
        super().remove_hooks()
        for param in self.params:  # gradient buffers built later for the model accumulate again
            param.overwrite_main_grad = False

    def held_grad_bytes(self) -> int:
        """Bytes of gradient storage this rank holds now: the shards and the buckets allocated at the moment."""
        buckets = sum(b.storage.nbytes() for b in self.buckets)
        return self.shards.untyped_storage().nbytes() + buckets
