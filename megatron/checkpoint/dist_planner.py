"""DCP planners for explicit chunks: each entry of the state dict handed to `torch.distributed.checkpoint` is this
rank's data for one chunk (global name, global shape, offsets) or a picklable object.

DCP's default planners take a chunk's place from a DTensor's mesh and placements. The chunks here (a tensor-parallel
slice, a distributed-optimizer piece cut into boxes, the part of a vocabulary shard that a checkpoint with other
padding holds) are not all DTensor shards, so these planners subclass DCP's default ones and declare each chunk
directly, through DCP's public planner interface. Entries of several ranks with the same name and offsets (data-
parallel replicas, replicated tensors) are written once (DCP's deduplication), by one of the ranks holding them
chosen to balance the bytes each rank writes (--ckpt-fully-parallel-save) or by the lowest."""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .safe_load import load_bytes_entry
from .sharding import Chunk

Where = tuple[str, tuple[int, ...], tuple[int, ...]]
"""(global name, global shape, offsets) of a chunk entry."""


def split_entries(chunks: list[Chunk], objects: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Where]]:
    """The flat state dict for DCP (unique local keys) and where each tensor entry lies."""
    state: dict[str, Any] = dict(objects)
    where: dict[str, Where] = {}
    for i, chunk in enumerate(chunks):
        key = f"{chunk.fqn}#{i}"
        state[key] = chunk.tensor
        where[key] = (chunk.fqn, tuple(chunk.global_shape), tuple(chunk.offsets))
    return state, where


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """torch.save writes a view's whole storage: copy views of larger tensors out first."""
    tensor = tensor.detach()
    if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor


class ChunkSavePlanner(DefaultSavePlanner):
    def __init__(self, where: dict[str, Where], fully_parallel: bool = True):
        # fully_parallel (--ckpt-fully-parallel-save, the default): DCP gives each replicated entry to the rank
        # holding it that has the least to write so far, so the replicas' bytes are spread over the ranks; otherwise
        # the lowest rank holding it writes it (--no-ckpt-fully-parallel-save)
        super().__init__(
            flatten_state_dict=False, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=not fully_parallel
        )
        self.where = where
        self._key_of: dict[tuple[str, tuple[int, ...] | None], str] = {}

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, value in self.state_dict.items():
            if key in self.where:
                fqn, shape, offsets = self.where[key]
                self._key_of[(fqn, offsets)] = key
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=value.size())
                data = TensorWriteData(
                    chunk=chunk, properties=TensorProperties.create_from_tensor(value), size=torch.Size(shape)
                )
                items.append(
                    WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD, tensor_data=data)
                )
            else:
                self._key_of[(key, None)] = key
                items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        offsets = None if index.offset is None else tuple(index.offset)
        value = self.state_dict[self._key_of[(index.fqn, offsets)]]
        return _compact(value) if isinstance(value, torch.Tensor) else value


class ChunkLoadPlanner(DefaultLoadPlanner):
    """Loads tensor entries in place (into the given tensors, which may be views) and object entries into the
    planner's `state_dict`. Entries the checkpoint lacks must have been left out by the caller."""

    def __init__(self, where: dict[str, Where], folder: Any = "the checkpoint"):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True)
        self.where, self.folder = where, folder
        self._key_of: dict[tuple[str, tuple[int, ...]], str] = {}

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        saved = self.metadata.state_dict_metadata
        requests = []
        for key, value in self.state_dict.items():
            if key in self.where:
                fqn, _, offsets = self.where[key]
                self._key_of[(fqn, offsets)] = key
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=value.size())
                requests += create_read_items_for_chunk_list(fqn, saved[fqn], [chunk])
            elif isinstance(saved.get(key), BytesStorageMetadata):
                index = MetadataIndex(key)
                one = torch.Size((0,))
                requests.append(ReadItem(LoadItemType.BYTE_IO, index, one, index, one, torch.Size((0,))))
        return LoadPlan(requests)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # weights only, unlike DCP's default planner (a checkpoint is data, never code: safe_load.py)
        self.state_dict[read_item.dest_index.fqn] = load_bytes_entry(value, read_item.dest_index.fqn, self.folder)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[self._key_of[(index.fqn, tuple(index.offset))]]
