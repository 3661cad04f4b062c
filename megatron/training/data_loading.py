"""Batches from a dataset to the device: this data-parallel rank's micro-batches from a position (the consumed
samples), moved to the device and split for context parallelism; and the end of a loader's worker processes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset

from megatron.data import PretrainingSampler
from megatron.parallel import ParallelDims
from megatron.parallel.context_parallel import NO_CP, ContextParallel, split_batch


def build_loader(
    dataset: Dataset,
    consumed_samples: int,
    micro_batch_size: int,
    num_workers: int,
    dims: ParallelDims,
    device: torch.device,
) -> DataLoader:
    """This data-parallel rank's micro-batches of `dataset`, from sample `consumed_samples` on."""
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dims.dp_rank, dims.dp)
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
        # A private generator: creating a loader must not draw from the global RNG (that would shift dropout
        # between a resumed run and an uninterrupted one).
        generator=torch.Generator(),
    )


@dataclass(frozen=True)
class Loaders:
    """This rank's loaders of any split, the run's loader settings bound once: `loaders(dataset, consumed_samples)`
    is `build_loader` of `dataset` from sample `consumed_samples` on."""

    micro_batch_size: int
    num_workers: int
    dims: ParallelDims
    device: torch.device

    def __call__(self, dataset: Dataset, consumed_samples: int) -> DataLoader:
        return build_loader(dataset, consumed_samples, self.micro_batch_size, self.num_workers, self.dims, self.device)


def to_device(
    batch: dict[str, torch.Tensor], device: torch.device, cp: ContextParallel = NO_CP
) -> dict[str, torch.Tensor]:
    """On the device, this context-parallel rank's chunks of the sequence (after the copy: the pinned batch moves
    whole, asynchronously)."""
    return split_batch({k: v.to(device, non_blocking=True) for k, v in batch.items()}, cp)


def close_loader(iterator: object) -> None:
    """End a DataLoader iterator's worker processes and pin-memory thread now, not whenever the garbage collector
    finds it (the call its `__del__` makes; torch has no public one). A single-process iterator has nothing to end."""
    shutdown_workers = getattr(iterator, "_shutdown_workers", None)
    if shutdown_workers is not None:
        shutdown_workers()
