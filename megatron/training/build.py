"""The run's parts, built from a Config in the order each needs the previous: seeds -> model (built in fp32 on the CPU
from the seed, so every device and layout starts from the same weights, then moved and cast) -> FP8 state attached to
its linears -> gradient buffers -> optimizer."""

from __future__ import annotations

import os
import random
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from megatron.config import Config
from megatron.fp8.linear import Fp8LinearState
from megatron.fp8.monitor import Fp8Monitor, build_fp8_monitor
from megatron.model import GPTModel, Stage
from megatron.model.meta_init import DeferredInit
from megatron.model.recompute import check_units_whole
from megatron.optim import MixedPrecisionAdamW
from megatron.parallel import ParallelDims
from megatron.parallel.context_parallel import ContextParallel, attach_context_parallel
from megatron.parallel.engines import GradientEngine, build_gradient_engine
from megatron.parallel.fsdp.fsdp2 import fp8_gather_pieces
from megatron.parallel.tensor_parallel import TensorParallel

if TYPE_CHECKING:
    from megatron.fp8 import Fp8Manager

    from .startup_times import StartupTimes


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _cpus() -> int:
    """This process's share of the CPUs it may run on (the node's ranks share them): the threads that draw the initial
    weights (megatron/model/init_draws.py)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def build_model(
    cfg: Config, dims: ParallelDims, device: torch.device, vocab_size: int, times: StartupTimes
) -> tuple[TensorParallel, ContextParallel, Stage, GPTModel, DeferredInit | None]:
    """This rank's pipeline stage of the GPT, on `device` in --params-dtype, with its tensor- and context-parallel
    settings (returned with the stage and the model). With --init-model-with-meta-device the model is built without
    storage and the returned `DeferredInit` gives it its values once FSDP has sharded it (model/meta_init.py).
    `times`: where the construction's and the move's seconds go (the start-up's phases)."""
    par = cfg.parallel
    tp = TensorParallel(dims.tp_group, dims.tp, dims.tp_rank, par.sequence_parallel, par.tp_comm_overlap)
    cp = ContextParallel.from_dims(dims, par.cp_comm_type)
    if par.tp_comm_overlap:  # TE's userbuffers must exist before the TE modules that use them are built
        from megatron.model.te_comm_overlap import initialize_userbuffers

        initialize_userbuffers(cfg, dims.tp)
    chunks = cfg.stage_chunks(dims.pp_rank)
    stage = Stage.of_chunks(chunks, pre_process=dims.is_first_stage, post_process=dims.is_last_stage)
    # Under FSDP the FP8 weights are high-precision shards that FSDP all-gathers as FP8
    # (megatron/parallel/fsdp/fsdp2.py), not TE's quantized parameters (as the local layers' are not Fp8Parameters then:
    # megatron/fp8/manager.py)
    precision = replace(cfg.precision, fp8_param_gather=False) if cfg.sharding.fsdp2 else cfg.precision
    build = partial(
        GPTModel, cfg.model, vocab_size, precision=precision, amax_group=dims.amax_group, tp=tp, init_threads=_cpus()
    )
    if par.init_model_with_meta_device:
        with times.phase("model built on the meta device"):
            deferred = DeferredInit(build, stage, cfg.precision.params_dtype)
        model = deferred.model
        if not cfg.sharding.fsdp2:  # the flat-bucket engine keeps the weights whole: its values now, a part at a time
            with times.phase(f"model given its values on {device.type}, a part at a time"):
                model = deferred.materialize(device)
            deferred = None
    else:
        deferred = None
        with times.phase("model built, its weights drawn on the CPU"):
            model = build(stage=stage)
        with times.phase(f"model moved to {device.type} in {str(cfg.precision.params_dtype).removeprefix('torch.')}"):
            model = model.to(device, cfg.precision.params_dtype)
    attach_context_parallel(model, cp)
    return tp, cp, stage, model, deferred


def build_fp8(
    cfg: Config, model: GPTModel, dims: ParallelDims, device: torch.device
) -> tuple[Fp8Manager | None, Fp8Monitor | None]:
    """The local engine's FP8 state attached to the model's linears (None under Transformer Engine, which runs its
    FP8 inside the model, and without FP8), and the FP8 monitor (None without FP8)."""
    fp8 = None
    if cfg.precision.fp8 and cfg.model.transformer_impl == "local":
        from megatron.fp8 import attach_fp8

        fp8 = attach_fp8(model, cfg, dims.amax_group, device=device)  # the model may be on the meta device
    return fp8, build_fp8_monitor(cfg, model, fp8, dims, device)


def build_grad_buffers(
    cfg: Config, dims: ParallelDims, model: GPTModel, device: torch.device, deferred: DeferredInit | None
) -> GradientEngine:
    """Where the gradients go: the gradient engine the configuration chose (megatron/parallel/engines.py); under
    FSDP2 a model built on the meta device is given its values there, its shards only."""
    engine = build_gradient_engine(cfg, dims, model, device, deferred)
    if cfg.sharding.fsdp2:
        check_units_whole(model)
    return engine


def build_optimizer(
    cfg: Config, dims: ParallelDims, model: GPTModel, device: torch.device, grad_buffers: GradientEngine
) -> MixedPrecisionAdamW:
    # FP8 weights' amaxes, when their main copies are cast: TE scales each tensor-parallel shard by itself, the
    # local engine the whole tensor (as in one process)
    fp8_group = dims.amax_group if cfg.model.transformer_impl == "local" else dims.dp_cp_group
    return MixedPrecisionAdamW(model, cfg.optimizer, device.type == "cuda", grad_buffers, fp8_group)


def point_fp8_weights_at_their_casts(
    cfg: Config, model: GPTModel, optimizer: MixedPrecisionAdamW, monitor: Fp8Monitor | None = None
) -> None:
    """--fp8-param-gather: tell the FP8 monitor which high-precision piece this rank casts into each FP8 weight
    (FSDP: the shard it gathers; the distributed optimizer: its main piece), for the weight statistics: the local
    linears' states and Transformer Engine's taps (`TETaps.count_weight_casts`). The pieces of all ranks make up
    each weight once, under either layout: the monitor's sums over the data-parallel ranks count it once."""
    if not cfg.precision.fp8_param_gather:
        return
    pieces = fp8_gather_pieces(model) if cfg.sharding.fsdp2 else optimizer.fp8_cast_pieces()
    by_weight = {id(weight): piece for weight, piece in pieces}
    for module in model.modules():
        state, weight = getattr(module, "fp8", None), getattr(module, "weight", None)
        if isinstance(state, Fp8LinearState) and id(weight) in by_weight:
            state.weight_piece = by_weight[id(weight)]
    if monitor is not None and cfg.model.transformer_impl == "transformer_engine":
        monitor.taps.count_weight_casts(by_weight)
