"""The step's agreement on the FP8 all-gathers' scales under FSDP2 (fp8_gather.py holds the wrapped shards and
the gathered weights): `Fp8GatherScales.agree` max-reduces the amaxes of every wrapped shard in one all-reduce,
once per optimizer step, and casts each shard with its weight's scale.

The cast happens once per step, in `agree`, into a persistent buffer per weight (`GatherScale.data`, the shard's rows
padded to FSDP's), which every all-gather of the step sends as it is: the shard and the scale do not change between
optimizer steps, while a unit is gathered before its forward and again before its backward, for every micro-batch
(8 casts of each weight per step with 4 micro-batches, each a handful of kernels launched from Python on the
host's critical path). It costs 1 byte per FP8-gathered element / dp, held between steps, as Megatron-LM keeps its
FP8 shard beside the main one. Whatever writes the shards marks the scales stale, and so the bytes: the optimizer
step (`Fsdp2Grads.zero`), a checkpoint load or an initialization (`shards_written`); `agree` then recomputes both
before the next forward's gathers, and a gather that comes first (none in training) casts the shard itself.

Where the shards are not the main weights (--use-precision-aware-optimizer: bf16 shards written from the optimizer's
fp16 main weights after each step), a shard is only the source of that cast: `agree` frees its storage once a
training forward has it cast (`release`), and the optimizer step gives it back (`reclaim`) just before writing the
new weights into every element of it. The peak, the forward and backward, then holds 2 bytes per FP8-gathered
element / dp less; eval forwards and everything between steps (checkpoints, the parameter norm) see whole shards.
A shard with pad rows (FSDP pads the last ranks' shards when the ranks do not divide the rows) is freed whole, its
pad rows included: nothing reads them (the all-gather sends `GatherScale.data`, whose pad rows are zero), and FSDP2
keeps the storage it padded (parallel/fsdp/fsdp2.py, `share_padded_storage`), which the optimizer steps.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .fp8_gather import Fp8ShardWeight, shard_rows


class Fp8GatherScales:
    """The scales of the FP8 all-gathers (per tensor, or per block), agreed once per optimizer step by the ranks
    holding pieces of the weights."""

    def __init__(self, shards: list[torch.Tensor], group: dist.ProcessGroup | None, release: bool = False):
        """`shards`: the wrapped weights' sharded parameters (DTensors whose local tensors are `Fp8ShardWeight`);
        `group`: the data-parallel ranks FSDP shards them over, and under tensor parallelism the ranks holding the
        other tensor-parallel pieces too (every rank lists its shards in the same order), so that each piece is
        cast with the whole weight's scale, as the tensorwise recipe casts a tensor-parallel weight. Blockwise
        weights agree over the data-parallel ranks sharding them (their FSDP mesh) only: a tensor-parallel piece's
        blocks are its own, as the linear casts them. `release`: free the shards' storage from a training
        forward's cast until `reclaim` (only where the shards are not the main weights: see the module docstring)."""
        self.shards, self.group, self.release = shards, group, release
        self._freed: list[tuple[torch.UntypedStorage, int]] = []  # (storage, its bytes) of each freed shard
        for shard in shards:
            shard.to_local()._scale.agreement = self
        self.stale = True

    @property
    def stale(self) -> bool:
        """Whether the shards changed since the scales were agreed (their cast bytes are then stale too)."""
        return self._stale

    @stale.setter
    def stale(self, stale: bool) -> None:
        if stale and self._freed:  # whatever wrote the shards wrote (or read) no storage: a step must reclaim first
            raise RuntimeError(
                "FP8-gathered weight shards freed by a training forward were marked written without an optimizer"
                " step giving them back: call reclaim() before writing them (MixedPrecisionAdamW.step does)"
            )
        self._stale = stale
        if stale:
            for shard in self.shards:
                shard.to_local()._scale.fresh = False

    def agree(self) -> None:
        """If the weights changed since the last call: max-reduce all shards' amaxes (block amaxes) in one
        all-reduce per group, set each weight's scale (`GatherScale.set`) and cast each shard with it, once for all
        of the step's all-gathers (`GatherScale.fill`). Then, in a training forward, `release` the shards."""
        # (every rank leaves out the same weights: the FP8 guard's decisions are the same on all ranks)
        shards = self._fp8_gathered()
        if self.stale and shards:
            with torch.no_grad():
                blockwise = [s.to_local()._scale.own_pieces for s in shards]
                per_tensor = [s for s, blocks in zip(shards, blockwise) if not blocks]
                if per_tensor:
                    self._agree(per_tensor, self.group)
                if any(blockwise):  # one FSDP mesh shards them all
                    blocked = [s for s, blocks in zip(shards, blockwise) if blocks]
                    self._agree(blocked, blocked[0].device_mesh.get_group())
        self.stale = False
        if self.release and not self._freed and torch.is_grad_enabled() and not self._monitored():
            self._free()

    def _fp8_gathered(self) -> list[torch.Tensor]:
        """The shards gathered as FP8 this step: all but those of the layers the FP8 guard moved to bf16."""
        return [s for s in self.shards if not s.to_local()._scale.high_precision]

    def _monitored(self) -> bool:
        """Whether the FP8 monitor watches this step: a local linear then counts its weight's cast from the shard in
        its forward (`Fp8LinearState.weight_piece`), which must stay."""
        return any(getattr(s.to_local()._scale.state, "stats", None) is not None for s in self.shards)

    def _free(self) -> None:
        """Free every FP8-gathered shard's storage (FSDP's padded shard, which the DTensor's local tensor and the
        optimizer's views of it share: they keep their shapes and get the storage back with `reclaim`); a shard gathered
        in the training dtype is read by every gather and stays, as would one in storage of another size than FSDP's
        padded shard (not the one the optimizer steps)."""
        for shard in self._fp8_gathered():
            tensor = shard.to_local()._tensor
            storage = tensor.untyped_storage()
            rows = shard_rows(shard.shape[0], shard.device_mesh.size())
            if storage.nbytes() and storage.nbytes() == rows * math.prod(shard.shape[1:]) * tensor.element_size():
                self._freed.append((storage, storage.nbytes()))
                storage.resize_(0)

    @property
    def released(self) -> bool:
        """Whether the shards' storage is freed (from a training forward's cast to the optimizer step)."""
        return bool(self._freed)

    def reclaim(self) -> None:
        """Give freed shards their storage back, uninitialized: for a writer of every element of the shards (the
        optimizer step: its main weights' new values, or on a skipped step their unchanged values; after a pass no
        step follows, such as delayed scaling's calibration, `MixedPrecisionAdamW.restore_freed_shards`)."""
        for storage, nbytes in self._freed:
            storage.resize_(nbytes)
        self._freed = []

    @staticmethod
    def _agree(shards: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
        locals_ = [s.to_local() for s in shards]
        rows = [shard_rows(s.shape[0], s.device_mesh.size()) for s in shards]
        first_rows = [s.device_mesh.get_local_rank() * n for s, n in zip(shards, rows)]
        amaxes = [t._scale.local_amax(t._tensor, row, n) for t, row, n in zip(locals_, first_rows, rows)]
        flat = torch.cat([a.reshape(-1) for a in amaxes])
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        for shard, local, row, n, agreed in zip(
            shards, locals_, first_rows, rows, flat.split([a.numel() for a in amaxes])
        ):
            local._scale.set(agreed, n)
            local._scale.fill(local._tensor, row, n, shard.device_mesh.size())


def shards_written(model: torch.nn.Module) -> None:
    """The FSDP shards of `model` were written other than by the optimizer's step (a checkpoint load, the meta-device
    initialization): its FP8 all-gathers' scales are agreed, and the shards cast, again before the next forward."""
    agreements = set()
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        if isinstance(local, Fp8ShardWeight):
            local._scale.fresh = False
            if local._scale.agreement is not None:
                agreements.add(local._scale.agreement)
    for agreement in agreements:  # once each: marking it stale marks all its shards' bytes stale
        agreement.stale = True
