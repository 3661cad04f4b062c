"""The gradient engine: where the model's gradients go, how they are reduced over the data-parallel ranks, and which
piece of each parameter this rank's optimizer steps on. The optimizer, the checkpoints and the training step speak to
the `GradientEngine` protocol only; `build_gradient_engine` picks the engine from the resolved configuration
(`cfg.sharding.engine`; docs/fsdp.md's "Gradient engines" maps Megatron-LM's flags to them):

  buffers      `GradientBuffers` (data_parallel.py): whole gradient buckets, all-reduced; with the distributed
               optimizer reduce-scattered, each rank stepping on its shard of every bucket
  flat_shards  `FlatGradShards` (fsdp/flat_shards.py): the distributed optimizer's buckets, each micro-batch
               reduce-scattered into persistent gradient shards (ZeRO-2), weights whole on every rank
  fsdp2        `Fsdp2Grads` (fsdp/fsdp2.py): PyTorch's FSDP2 holds the parameters, 1/dp of every weight, gradient
               and optimizer state per rank
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch import nn

from megatron.config import Config

from .data_parallel import GradientBuffers
from .dims import ParallelDims
from .fp8_reduce import Fp8ReduceStats
from .fsdp.flat_shards import FlatGradShards
from .fsdp.fsdp2 import build_fsdp2


class GradientEngine(Protocol):
    """What the optimizer, the checkpoints and the training step use of a gradient engine. Every parameter that
    trains has `main_grad` (where its gradient accumulates, or its local gradient shard) once the engine is built."""

    params: list[nn.Parameter]
    """The trainable parameters, in the model's order."""
    sharded_state: bool
    """Each data-parallel rank steps on its own pieces of the parameters (`owned_range`), and the gradient norm
    sums over the data-parallel ranks: the distributed optimizer, the flat gradient shards and FSDP2."""
    overlap_param_gather: bool
    fp8_stats: Fp8ReduceStats | None
    """--fp8-grad-reduce: what the FP8 reductions flushed to zero (the log's); None otherwise."""
    is_last_micro_batch: bool
    """Set by the training step before each micro-batch's forward."""

    def owned_range(self, param: nn.Parameter) -> tuple[int, int] | None:
        """[start, stop) of `param`'s flattened local elements this rank steps on (None: none)."""

    def grad_piece(self, param: nn.Parameter, start: int, stop: int) -> torch.Tensor:
        """Where the optimizer reads the reduced gradient of `param`'s flattened elements [start, stop)."""

    def reduced_grad(self, param: nn.Parameter) -> torch.Tensor:
        """This rank's part of `param`'s gradient after `finish()` (summed over tensor-parallel peers where the
        parameter is sequence-parallel)."""

    def finish(self) -> None:
        """Complete the step's data-parallel reduction (after the last micro-batch's backward)."""

    def zero(self) -> None:
        """Start the next step's gradients (after the optimizer step)."""

    def gather_params(self) -> None:
        """After the optimizer wrote its pieces of the weights: make every rank's weights whole again (if the engine
        gathers them between steps)."""

    def wait_for_params(self) -> None:
        """Complete the parameter all-gathers still in flight."""

    def paused(self) -> AbstractContextManager[None]:
        """Gradients computed inside are thrown away (delayed scaling's calibration pass)."""

    def reclaim_shards(self) -> None:
        """Before the optimizer writes the weights: storage back for weight shards freed since the forward."""

    def shards_released(self) -> bool:
        """Whether a training forward freed weight shards that only the optimizer step writes again."""

    def remove_hooks(self) -> None:
        """Take the engine's hooks off the model at the end of a run."""


def _dtype(bf16: bool) -> torch.dtype:
    return torch.bfloat16 if bf16 else torch.float32


def build_gradient_engine(
    cfg: Config,
    dims: ParallelDims,
    model: nn.Module,
    device: torch.device,
    initialize: Callable[[nn.Module], None] | None = None,
) -> GradientEngine:
    """The engine the configuration chose (`cfg.sharding.engine`), built for `model` (a GPT model). Under FSDP2 a
    model built on the meta device is given its values by `initialize(model)` once sharded, its shards only."""
    par, sharding = cfg.parallel, cfg.sharding
    if sharding.engine == "fsdp2":
        # FP8 weights gathered as FP8 (--fp8-param-gather): each weight's scale is agreed over the amax group, every
        # rank holding a piece of it (data x tensor (x context) parallel under the local engine), as one process's
        return build_fsdp2(model, cfg, dims.dp_cp_group, device, initialize, scale_group=dims.amax_group)
    if sharding.engine == "flat_shards":  # each micro-batch reduce-scattered into gradient shards
        engine = FlatGradShards(
            model,
            dims.dp_cp_group,
            par.ddp_bucket_size,
            par.overlap_param_gather,
            shard_dtype=_dtype(sharding.main_grads_bf16),
            comm_dtype=_dtype(sharding.grad_comm_bf16),
            fp8_reduce=par.fp8_grad_reduce,
            layers=list(model.decoder.layers),
        )
    else:
        engine = GradientBuffers(
            model,
            dims.dp_cp_group,
            # Under the pipeline schedule the last micro-batch's backward is not the last backward of the step on
            # every stage, so the buckets are reduced after the schedule there
            par.overlap_grad_reduce and dims.pp == 1,
            par.ddp_bucket_size,
            sharding.distributed_optimizer,
            par.overlap_param_gather,
            grad_dtype=_dtype(sharding.grad_comm_bf16),
            fp8_reduce=par.fp8_grad_reduce,
        )
    if engine.overlap_param_gather:
        engine.wait_for_params_in_forward(model, list(model.decoder.layers))
    return engine
