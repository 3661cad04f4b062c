"""Process groups, owned by one explicit object (no module-level globals).

Rank layout (Megatron-LM's order): tensor-parallel ranks innermost, then data-parallel, then pipeline.
Today every layout has TP = PP = 1 (validated in the configuration), so the data-parallel group is the world.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.config import Config


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    rank: int
    tp: int
    pp: int
    dp: int
    dp_rank: int
    dp_group: dist.ProcessGroup | None
    """Ranks holding replicas of the same model shard (gradients are averaged over it); None in one process."""
    amax_group: dist.ProcessGroup | None
    """Ranks whose FP8 amaxes are max-reduced together (tensor x data parallel)."""

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    @classmethod
    def single(cls) -> ParallelDims:
        return cls(world_size=1, rank=0, tp=1, pp=1, dp=1, dp_rank=0, dp_group=None, amax_group=None)

    @classmethod
    def build(cls, cfg: Config) -> ParallelDims:
        """Groups for an initialized torch.distributed world (or `single()` when it is not initialized)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return cls.single()
        world, rank = dist.get_world_size(), dist.get_rank()
        tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
        group = dist.group.WORLD
        return cls(world, rank, tp, pp, dp=world // (tp * pp), dp_rank=rank, dp_group=group, amax_group=group)


def world_size_from_env() -> int:
    """The launcher's world size (torchrun / Slurm set WORLD_SIZE), 1 for a plain `python` run."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(cfg: Config) -> torch.device:
    """Start torch.distributed when launched with several processes; returns this rank's device.

    On CUDA the device is selected *before* init_process_group and passed as device_id: without it, NCCL and TE
    can pick the wrong device and hang.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cfg.device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if cfg.world_size > 1 and not dist.is_initialized():
        backend = cfg.parallel.distributed_backend or ("nccl" if cfg.device_type == "cuda" else "gloo")
        dist.init_process_group(
            backend,
            timeout=timedelta(minutes=cfg.parallel.distributed_timeout_minutes),
            device_id=device if device.type == "cuda" else None,
        )
    return device
