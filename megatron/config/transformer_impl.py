"""--transformer-impl resolved (Transformer Engine where it can run, else the local layers) and the rules of the
layer engine it picks: what each one can express of the FP8 flags (FP8 weights, FP8 attention, amax reductions),
Transformer Engine's own shape rules (te_rules.py), and its CUDA graphs. `Config.finalize` calls
`resolve_transformer_impl` once the parallel layout is checked: TE's shape rules apply to the tensor-parallel
shards."""

from __future__ import annotations

import os
from typing import Protocol

from . import te_rules
from .base import require
from .data import DataConfig
from .model import ModelConfig
from .optimizer import OptimizerConfig
from .parallel import ParallelConfig
from .precision import LOCAL_FP8_PARAM_RECIPES, TE_FP8_PARAM_RECIPES, PrecisionConfig
from .training import TrainingConfig


class Config(Protocol):
    """What these rules read of the run's configuration: megatron.config.Config, which calls them while it is
    finalized (and so cannot be imported here)."""

    model: ModelConfig
    parallel: ParallelConfig
    precision: PrecisionConfig
    optimizer: OptimizerConfig
    data: DataConfig
    training: TrainingConfig
    device_type: str
    notes: list[str]

    @property
    def data_parallel_size(self) -> int: ...


def resolve_transformer_impl(cfg: Config) -> None:
    """Default --transformer-impl (TE where it can run, else local, with a note saying why); an explicit
    transformer_engine that cannot run, or FP8 settings TE cannot express, is a ConfigError."""
    model, prec = cfg.model, cfg.precision
    if model.transformer_impl is None:
        if cfg.device_type != "cuda":
            reason = "no CUDA device"
        elif (error := te_rules.te_import_error()) is not None:
            reason = f"Transformer Engine does not import: {error}"
        elif prec.fp8 and prec.fp8_recipe not in te_rules.TE_RECIPES:
            reason = f"--fp8-recipe {prec.fp8_recipe} has no Transformer Engine recipe"
        else:
            reason = None
        model.transformer_impl = "local" if reason else "transformer_engine"
        cfg.notes.append(
            f"--transformer-impl local ({reason})"
            if reason
            else "--transformer-impl transformer_engine (CUDA with Transformer Engine; --transformer-impl local"
            " for the pure-PyTorch layers)"
        )
    elif model.transformer_impl == "transformer_engine":
        require(
            cfg.device_type == "cuda",
            "--transformer-impl transformer_engine needs a CUDA GPU; use --transformer-impl local",
        )
        te_rules.require_te()
    if prec.fp8_param_gather:
        _check_fp8_params(cfg)
    # an FP8 weight is cast once per step with one scale; the folded W/s would need a second cast per step
    require(
        not (model.smooth_swiglu and prec.fp8_param_gather),
        "--smooth-swiglu with --fp8-param-gather: linear_fc2's weight is divided by the scales before its cast,"
        " so it cannot be kept in FP8; drop one of the two",
    )
    require(
        not (model.smooth_swiglu_migration < 1 and (cfg.parallel.use_megatron_fsdp or cfg.parallel.use_torch_fsdp2)),
        "--smooth-swiglu-migration below 1 reads linear_fc2's whole weight columns, which FSDP shards: use 1 or drop"
        " FSDP",
    )
    require(
        model.transformer_impl == "transformer_engine" or not prec.fp8_dot_product_attention,
        "--fp8-dot-product-attention needs --transformer-impl transformer_engine (the local attention runs in bf16)",
    )
    require(
        model.transformer_impl == "transformer_engine" or not prec.tp_only_amax_red,
        "--tp-only-amax-red applies to Transformer Engine's amax reductions; the local FP8 engine reduces its"
        " amaxes over all tensor x data parallel ranks once per step, which also keeps the replicas' inf/NaN"
        " step skipping in agreement; drop the flag or add --transformer-impl transformer_engine",
    )
    require(
        model.transformer_impl == "transformer_engine" or not cfg.parallel.tp_comm_overlap,
        "--tp-comm-overlap uses Transformer Engine's userbuffers; add --transformer-impl transformer_engine or"
        " drop the flag",
    )
    require(
        not (cfg.parallel.tp_comm_overlap and prec.fp8 and prec.fp8_recipe == "blockwise"),
        "--tp-comm-overlap with --fp8-recipe blockwise: Transformer Engine's userbuffers gather per-tensor or"
        " MXFP8 FP8 data only; use --fp8-recipe delayed or tensorwise, or drop --tp-comm-overlap",
    )
    if cfg.parallel.tp_comm_overlap and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        cfg.notes.append(
            "--tp-comm-overlap without CUDA_DEVICE_MAX_CONNECTIONS=1: the GPU may start a GEMM before the"
            " communication it should overlap (Megatron-LM sets it to 1)"
        )
    if model.transformer_impl == "transformer_engine":
        te_rules.check_te_config(model, cfg.training.micro_batch_size, prec, cfg.parallel)
    _check_cuda_graphs(cfg)


def _check_fp8_params(cfg: Config) -> None:
    """Recipes whose weights can live in FP8 (and be all-gathered as FP8 bytes): see megatron/fp8/params.py."""
    recipe, te = cfg.precision.fp8_recipe, cfg.model.transformer_impl == "transformer_engine"
    fsdp2 = cfg.parallel.gradient_engine == "fsdp2"
    if not te and not fsdp2:  # FSDP keeps no FP8 weights; its rules: sharding.py
        require(
            recipe in LOCAL_FP8_PARAM_RECIPES,
            f"--fp8-param-gather with --fp8-recipe {recipe}: the local engine keeps FP8 weights with one scale"
            f" per tensor ({', '.join(LOCAL_FP8_PARAM_RECIPES)}); use one of those, --transformer-impl"
            " transformer_engine for blockwise, FSDP (--use-megatron-fsdp) for every recipe, or drop"
            " --fp8-param-gather",
        )
    elif te and (cfg.optimizer.use_distributed_optimizer or fsdp2):
        sharding = "FSDP" if fsdp2 else "--use-distributed-optimizer"
        require(
            recipe in TE_FP8_PARAM_RECIPES,
            f"--fp8-param-gather with {sharding} and --fp8-recipe {recipe}: Transformer Engine's {recipe}"
            f" weights cannot be all-gathered as FP8 bytes; use --fp8-recipe {'|'.join(TE_FP8_PARAM_RECIPES)}"
            " (or, under FSDP, --transformer-impl local, which gathers every recipe), or drop --fp8-param-gather",
        )


def _check_cuda_graphs(cfg: Config) -> None:
    if cfg.training.cuda_graph_impl == "none":
        return
    flag = "--cuda-graph-impl transformer_engine"
    require(
        cfg.model.transformer_impl == "transformer_engine",
        f"{flag} graphs Transformer Engine layers; add --transformer-impl transformer_engine or drop the flag",
    )
    require(
        cfg.parallel.pipeline_model_parallel_size == 1,
        f"{flag} needs --pipeline-model-parallel-size 1: the 1F1B schedule keeps several micro-batches in flight"
        " per layer, and a layer's graph holds one micro-batch's activations",
    )
    require(
        cfg.model.recompute_granularity is None,
        f"{flag} with --recompute-granularity: a graphed layer replays its captured backward, which needs the"
        " activations the recomputation drops; drop one of the two",
    )
    require(
        not cfg.precision.fp8_stats_interval,
        f"--fp8-stats-interval observes the layers through hooks, which {flag} does not run; drop one of the two",
    )
    require(
        not (cfg.precision.fp8_param_gather and cfg.optimizer.use_distributed_optimizer) or cfg.data_parallel_size == 1,
        f"{flag} with --fp8-param-gather and --use-distributed-optimizer: after the FP8 all-gather Transformer"
        " Engine rebuilds the weights' transposes outside the captured graphs (not yet supported); drop"
        f" {flag} or --use-distributed-optimizer",
    )
    for name in ("reset_position_ids", "reset_attention_mask"):
        require(
            not getattr(cfg.data, name),
            f"{flag} captures fixed shapes without an attention mask or per-sample positions; drop"
            f" --{name.replace('_', '-')} or the CUDA graphs",
        )
