"""Process groups, owned by one explicit object (no module-level globals).

Rank layout, Megatron-LM's order: tensor-parallel ranks innermost, then data-parallel, then pipeline:

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

so a tensor-parallel group is `tp` consecutive ranks (one node's NVLink domain when tp <= GPUs per node).

Groups every rank belongs to:
    tp         same (pp, dp): splits each layer's weights
    dp         same (pp, tp): replicas; gradients are averaged over it
    pp         same (dp, tp): the stages of one pipeline
    mp         same dp: one whole model copy (tp x pp ranks)
    amax       same pp: tp x dp ranks whose FP8 amaxes are max-reduced together (same layers, same tensors);
               the tp group only with --tp-only-amax-red
    embedding  first and last pipeline stage of the same (dp, tp): keeps tied input/output embeddings in sync
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
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    tp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    """Replicas of the same model shard (gradients are averaged over it); None in one process."""
    mp_group: dist.ProcessGroup | None = None
    amax_group: dist.ProcessGroup | None = None
    """Ranks whose FP8 amaxes are max-reduced together (tensor x data parallel of one pipeline stage)."""
    embedding_group: dist.ProcessGroup | None = None
    pp_ranks: tuple[int, ...] = (0,)
    """Global ranks of this rank's pipeline, stage by stage (point-to-point peers)."""

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def is_checkpoint_writer(self) -> bool:
        """The first data-parallel replica writes each model shard."""
        return self.dp_rank == 0

    @classmethod
    def single(cls) -> ParallelDims:
        return cls(world_size=1, rank=0, tp=1, pp=1, dp=1)

    @classmethod
    def build(cls, cfg: Config) -> ParallelDims:
        """Create every group for an initialized torch.distributed world (`single()` when it is not)."""
        if not dist.is_initialized():
            return cls.single()
        return cls.create(
            dist.get_world_size(),
            dist.get_rank(),
            cfg.parallel.tensor_model_parallel_size,
            cfg.parallel.pipeline_model_parallel_size,
            tp_only_amax=cfg.precision.tp_only_amax_red,
            timeout=timedelta(minutes=cfg.parallel.distributed_timeout_minutes),
        )

    @classmethod
    def create(
        cls, world: int, rank: int, tp: int, pp: int, tp_only_amax: bool = False, timeout: timedelta | None = None
    ) -> ParallelDims:
        """`timeout`: of every group (torch gives a new group its backend's default, not the default group's)."""
        if world % (tp * pp):
            raise ValueError(f"world size {world} is not divisible by tensor x pipeline parallel size {tp * pp}")
        dp = world // (tp * pp)
        tp_rank, dp_rank, pp_rank = rank % tp, (rank // tp) % dp, rank // (tp * dp)
        at = lambda p, d, t: p * dp * tp + d * tp + t  # noqa: E731 - the layout formula, once

        def make(all_groups: list[list[int]]) -> dist.ProcessGroup | None:
            # Every rank must create every group, in the same order; it keeps the one it belongs to.
            mine = None
            for ranks in all_groups:
                group = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                if rank in ranks:
                    mine = group
            return mine

        tp_group = make([[at(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)])
        dp_group = make([[at(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)])
        pp_group = make([[at(p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)])
        mp_group = make([[at(p, d, t) for p in range(pp) for t in range(tp)] for d in range(dp)])
        if tp_only_amax:
            amax_group = tp_group
        else:
            amax_group = make([[at(p, d, t) for d in range(dp) for t in range(tp)] for p in range(pp)])
        embedding_group = make([sorted({at(0, d, t), at(pp - 1, d, t)}) for d in range(dp) for t in range(tp)])
        return cls(
            world_size=world,
            rank=rank,
            tp=tp,
            pp=pp,
            dp=dp,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            dp_rank=dp_rank,
            tp_group=tp_group,
            pp_group=pp_group,
            dp_group=dp_group,
            mp_group=mp_group,
            amax_group=amax_group,
            embedding_group=embedding_group,
            pp_ranks=tuple(at(p, dp_rank, tp_rank) for p in range(pp)),
        )


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
