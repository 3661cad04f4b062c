"""FSDP's gradient reduce-scatter in FP8 (--fp8-grad-reduce / --fp8-optimizer-level O1|O2 under FSDP).

FSDP2 reduce-scatters each unit's gradients through a `ReduceScatter` comm object that a module may replace
(`FSDPModule.set_custom_reduce_scatter`, torch 2.11 and later): it allocates the unit's input (dp chunks of the
unit's flattened, padded gradient shards, in the reduce dtype) and its output (one chunk), then calls the comm on
its reduce-scatter stream, after the backward's gradients are copied in. `Fp8ReduceScatter` sends the chunks as
the distributed optimizer's FP8 reduction does (megatron/parallel/fp8_reduce.py: e4m3 bytes with a power-of-two
scale per 128 values in one all-to-all, dequantized and summed in fp32 in rank order on arrival, divided by dp for
FSDP2's average), and writes the sum in the reduce dtype (fp32, or bf16 with --megatron-fsdp-grad-comm-dtype bf16 or
bf16 gradient shards); FSDP2 then adds it into the gradient shards as for its own reduce-scatter. Everything runs on
FSDP2's reduce-scatter stream, so it overlaps the rest of the backward as the bf16 reduce-scatter does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from ..fp8_reduce import Fp8ReduceStats, fp8_reduce_scatter_chunks
from .fsdp2_internals import ReduceScatter


class Fp8ReduceScatter(ReduceScatter or object):  # None: a torch without FSDP2's custom collectives
    """FSDP2's reduce-scatter, moving FP8 bytes and their scales (the module docstring); counts into `stats`."""

    def __init__(self, stats: Fp8ReduceStats):
        self.stats = stats

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> None:
        # FSDP2 averages fp32 and bf16 gradients inside the collective (AVG), or sums them and divides after (SUM)
        if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            raise ValueError(
                f"the FP8 reduce-scatter sums or averages, got {op}; set no gradient divide factor on the FSDP units"
            )
        if async_op:  # FSDP2 calls it on its reduce-scatter stream and waits there, never asynchronously
            raise ValueError(
                "the FP8 reduce-scatter runs to completion on the calling stream; call it with async_op=False"
            )
        chunks = input_tensor.view(group.size(), -1)
        fp8_reduce_scatter_chunks(chunks, output_tensor, group, average=op == dist.ReduceOp.AVG, stats=self.stats)


def use_fp8_reduce_scatter(model: torch.nn.Module) -> Fp8ReduceStats:
    """Make every FSDP unit of `model` reduce-scatter its gradients in FP8; returns the counters they share."""
    if not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise RuntimeError(
            f"--fp8-grad-reduce under FSDP needs torch 2.11 or later (FSDP2's set_custom_reduce_scatter), this is"
            f" torch {torch.__version__}; drop --fp8-grad-reduce / --fp8-optimizer-level or upgrade torch"
        )
    stats = Fp8ReduceStats()
    comm = Fp8ReduceScatter(stats)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(comm)
    return stats
