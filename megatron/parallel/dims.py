"""Process groups, owned by one explicit object (no module-level globals).

Rank layout, Megatron-LM's default order (tp-cp-dp-pp): tensor-parallel ranks innermost, then context-parallel,
then data-parallel, then pipeline:

    rank = pp_rank * (dp * cp * tp) + dp_rank * (cp * tp) + cp_rank * tp + tp_rank

so a tensor-parallel group is `tp` consecutive ranks (one node's NVLink domain when tp <= GPUs per node), and a
context-parallel group the next-closest ranks (its attention exchanges keys and values every layer).

Groups every rank belongs to:
    tp         same (pp, dp, cp): splits each layer's weights
    cp         same (pp, dp, tp): splits each sequence (context parallelism, megatron/parallel/context_parallel.py)
    dp         same (pp, cp, tp): replicas fed different samples
    dp_cp      same (pp, tp): dp x cp ranks that hold the same weights; gradients are averaged over it and the
               distributed optimizer shards over it (Megatron-LM's data-parallel group "with context parallel");
               the dp group itself when cp = 1
    pp         same (dp, cp, tp): the stages of one pipeline
    mp         same (dp, cp): one whole model copy (tp x pp ranks)
    amax       same pp: tp x cp x dp ranks whose FP8 amaxes are max-reduced together (same layers, same tensors,
               different tokens); only the tp (x cp) group with --tp-only-amax-red
    embedding  first and last pipeline stage of the same (dp, cp, tp): keeps tied input/output embeddings in sync
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.config import Config

from . import launch


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    rank: int
    tp: int
    pp: int
    dp: int
    cp: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    cp_rank: int = 0
    tp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    """Replicas of the same model shard fed different samples; None in one process."""
    cp_group: dist.ProcessGroup | None = None
    """Ranks that split each sequence (None without context parallelism)."""
    dp_cp_group: dist.ProcessGroup | None = None
    """dp x cp ranks with the same weights: gradients are averaged over it, the distributed optimizer shards over it."""
    mp_group: dist.ProcessGroup | None = None
    amax_group: dist.ProcessGroup | None = None
    """Ranks whose FP8 amaxes are max-reduced together (tensor x data parallel of one pipeline stage)."""
    embedding_group: dist.ProcessGroup | None = None
    pp_ranks: tuple[int, ...] = (0,)
    """Global ranks of this rank's pipeline, stage by stage (point-to-point peers)."""
    cp_ranks: tuple[int, ...] = (0,)
    """Global ranks of this rank's context-parallel group, by cp rank (Transformer Engine's cp_global_ranks)."""

    @property
    def dp_cp(self) -> int:
        """Size of the dp x cp group (gradient averaging, optimizer sharding)."""
        return self.dp * self.cp

    @property
    def dp_cp_rank(self) -> int:
        """Rank in the dp x cp group (its ranks ordered by global rank: cp inner, dp outer)."""
        return self.dp_rank * self.cp + self.cp_rank

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
        """The first data-parallel replica (its first context-parallel rank) writes each model shard."""
        return self.dp_rank == 0 and self.cp_rank == 0

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
            cp=cfg.parallel.context_parallel_size,
            tp_only_amax=cfg.precision.tp_only_amax_red,
            timeout=timedelta(minutes=cfg.parallel.distributed_timeout_minutes),
        )

    @classmethod
    def create(
        cls,
        world: int,
        rank: int,
        tp: int,
        pp: int,
        tp_only_amax: bool = False,
        timeout: timedelta | None = None,
        cp: int = 1,
    ) -> ParallelDims:
        """`timeout`: of every group (torch gives a new group its backend's default, not the default group's)."""
        if world % (tp * cp * pp):
            raise ValueError(
                f"world size {world} is not divisible by tensor x context x pipeline parallel size {tp * cp * pp}"
            )
        dp = world // (tp * cp * pp)
        tp_rank, cp_rank = rank % tp, (rank // tp) % cp
        dp_rank, pp_rank = (rank // (tp * cp)) % dp, rank // (tp * cp * dp)
        at = lambda p, d, c, t: ((p * dp + d) * cp + c) * tp + t  # noqa: E731 - the layout formula, once
        P, D, C, T = range(pp), range(dp), range(cp), range(tp)

        def make(all_groups: list[list[int]]) -> dist.ProcessGroup | None:
            # Every rank must create every group, in the same order; it keeps the one it belongs to.
            mine = None
            for ranks in all_groups:
                group = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                if rank in ranks:
                    mine = group
            return mine

        tp_group = make([[at(p, d, c, t) for t in T] for p in P for d in D for c in C])
        dp_group = make([[at(p, d, c, t) for d in D] for p in P for c in C for t in T])
        pp_group = make([[at(p, d, c, t) for p in P] for d in D for c in C for t in T])
        mp_group = make([[at(p, d, c, t) for p in P for t in T] for d in D for c in C])
        if tp_only_amax and cp == 1:
            amax_group = tp_group
        elif tp_only_amax:  # the cp ranks' tokens are parts of the same samples: Megatron-LM reduces over tp x cp
            amax_group = make([[at(p, d, c, t) for c in C for t in T] for p in P for d in D])
        else:
            amax_group = make([[at(p, d, c, t) for d in D for c in C for t in T] for p in P])
        embedding_group = make([sorted({at(0, d, c, t), at(pp - 1, d, c, t)}) for d in D for c in C for t in T])
        cp_group, dp_cp_group = None, dp_group
        if cp > 1:  # no extra groups without context parallelism
            cp_group = make([[at(p, d, c, t) for c in C] for p in P for d in D for t in T])
            dp_cp_group = make([[at(p, d, c, t) for d in D for c in C] for p in P for t in T])
        return cls(
            world_size=world,
            rank=rank,
            tp=tp,
            pp=pp,
            dp=dp,
            cp=cp,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            dp_rank=dp_rank,
            cp_rank=cp_rank,
            tp_group=tp_group,
            pp_group=pp_group,
            dp_group=dp_group,
            cp_group=cp_group,
            dp_cp_group=dp_cp_group,
            mp_group=mp_group,
            amax_group=amax_group,
            embedding_group=embedding_group,
            pp_ranks=tuple(at(p, dp_rank, cp_rank, tp_rank) for p in P),
            cp_ranks=tuple(at(pp_rank, dp_rank, c, tp_rank) for c in C),
        )


def world_size_from_env() -> int:
    """The launcher's world size: torchrun's WORLD_SIZE, else the `srun` step's task count, else 1 (plain `python`)."""
    return launch.world_size(os.environ)


def init_distributed(cfg: Config) -> torch.device:
    """Start torch.distributed when launched with several processes; returns this rank's device.

    On CUDA the device is selected *before* init_process_group and passed as device_id: without it, NCCL and TE
    can pick the wrong device and hang. Under `srun` without torchrun, rank and world come from Slurm's variables
    (megatron/parallel/launch.py).
    """
    launch.adopt_slurm_env(os.environ)
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
