"""Data-parallel sharding (--use-megatron-fsdp / --use-torch-fsdp2 and their options): the one place that turns the
flags into a strategy and rejects what is not built. The engines: PyTorch's FSDP2 (megatron/parallel/fsdp/fsdp2.py), and
for
--use-megatron-fsdp's optim_grads sharded gradient accumulation on the distributed optimizer's flat buckets
(megatron/parallel/fsdp/flat_shards.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from .base import require
from .model import ModelConfig
from .optimizer import OptimizerConfig
from .parallel import ParallelConfig
from .precision import PrecisionConfig
from .training import CheckpointConfig, TrainingConfig


class Config(Protocol):
    """What the sharding rules read of the run's configuration: megatron.config.Config, which resolves its
    strategy through this module (and so cannot be imported here)."""

    parallel: ParallelConfig
    optimizer: OptimizerConfig
    precision: PrecisionConfig
    model: ModelConfig
    training: TrainingConfig
    checkpoint: CheckpointConfig
    notes: list[str]

    @property
    def data_parallel_size(self) -> int: ...


_FSDP2_UNITS = ("fsdp_double_buffer", "suggested_communication_unit_size")  # PyTorch FSDP2's, not the flat buckets'
_FSDP_ONLY = ("data_parallel_sharding_strategy", *_FSDP2_UNITS, "init_model_with_meta_device")
_DTYPES = ("megatron_fsdp_main_params_dtype", "megatron_fsdp_main_grads_dtype", "megatron_fsdp_grad_comm_dtype")
_DTYPE_DEFAULTS = {"megatron_fsdp_main_params_dtype": "fp32"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def resolve_sharding(cfg: Config) -> None:
    """Set --data-parallel-sharding-strategy from the flags (None without FSDP) and check the combination; the
    optim strategy turns on the distributed optimizer. Idempotent. Raises ConfigError naming the flags."""
    par, opt = cfg.parallel, cfg.optimizer
    engine = par.use_megatron_fsdp or par.use_torch_fsdp2
    no_reshard = not par.torch_fsdp2_reshard_after_forward
    require(
        not no_reshard or par.use_torch_fsdp2,
        "--torch-fsdp2-no-reshard-after-forward configures PyTorch FSDP2's units (Megatron-LM reads it for"
        " --use-torch-fsdp2 only): add --use-torch-fsdp2, or drop it",
    )
    if not engine:
        given = [_flag(n) for n in _FSDP_ONLY if getattr(par, n) not in (None, False)]
        given += [_flag(n) for n in _DTYPES if getattr(par, n) != _DTYPE_DEFAULTS.get(n, "auto")]
        require(not given, f"{', '.join(given)} configure FSDP: add --use-megatron-fsdp (or --use-torch-fsdp2)")
        return
    if par.data_parallel_sharding_strategy is None:
        par.data_parallel_sharding_strategy = "optim_grads_params"  # Megatron-LM's default
    strategy = par.data_parallel_sharding_strategy
    if strategy == "optim":
        if not opt.use_distributed_optimizer:
            opt.use_distributed_optimizer = True
            cfg.notes.append("--data-parallel-sharding-strategy optim: the distributed optimizer shards the states")
    elif strategy == "no_shard":
        require(
            not opt.use_distributed_optimizer,
            "--data-parallel-sharding-strategy no_shard with --use-distributed-optimizer: choose optim, or drop one",
        )
    if par.gradient_engine == "flat_shards":
        _check_grad_shards(cfg)
        return
    if (
        par.gradient_engine == "buffers"
    ):  # no_shard and optim: the gradient buffers without and with the distributed optimizer
        extras = [_flag(n) for n in _FSDP2_UNITS if getattr(par, n) not in (None, False)]
        extras += ["--torch-fsdp2-no-reshard-after-forward"] if no_reshard else []
        require(not extras, f"{', '.join(extras)} need --data-parallel-sharding-strategy optim_grads(_params)")
        return
    _check_fsdp(cfg)


def check_meta_device_layers(cfg: Config) -> None:
    """The one sharding rule that depends on the layers, checked once --transformer-impl is resolved: where every
    rank holds every weight (no_shard, optim, --use-megatron-fsdp's optim_grads), a meta-device model gets its
    storage and values right after it is built, which Transformer Engine's FP8 weights do not allow."""
    par = cfg.parallel
    te_fp8_weights = cfg.precision.fp8_param_gather and cfg.model.transformer_impl == "transformer_engine"
    require(
        not (par.init_model_with_meta_device and par.gradient_engine != "fsdp2" and te_fp8_weights),
        f"--data-parallel-sharding-strategy {par.data_parallel_sharding_strategy} with --init-model-with-meta-device"
        " and --fp8-param-gather: Transformer Engine makes its FP8 weights as it builds them, which the meta device"
        " defers (not built); drop one of the two flags, or shard the weights (optim_grads_params, or"
        " --use-torch-fsdp2)",
    )


def _check_dtypes(cfg: Config) -> None:
    """The FSDP dtype flags' rules, the same for both engines."""
    par, opt, prec = cfg.parallel, cfg.optimizer, cfg.precision
    main_params = par.megatron_fsdp_main_params_dtype
    if opt.use_precision_aware_optimizer:
        require(
            main_params in ("fp32", "auto"),
            f"--megatron-fsdp-main-params-dtype {main_params} with --use-precision-aware-optimizer: the optimizer"
            " holds the main weights (--main-params-dtype fp32|fp16), the shards the training dtype; drop the flag",
        )
    else:
        require(
            main_params == "fp32" or (main_params == "auto" and not (prec.bf16 or prec.fp16)),
            f"--megatron-fsdp-main-params-dtype {main_params}: only fp32 main weights are built (the shards are the"
            " main weights; units are gathered in the training dtype); or keep bf16 shards and fp16 or fp32 main"
            " weights with --use-precision-aware-optimizer",
        )
    require(
        par.megatron_fsdp_main_grads_dtype != "fp16",
        "--megatron-fsdp-main-grads-dtype fp16: accumulate the gradient shards in fp32 or bf16",
    )
    require(
        par.megatron_fsdp_grad_comm_dtype != "fp16",
        "--megatron-fsdp-grad-comm-dtype fp16: reduce in fp32 or bf16",
    )


def _check_grad_shards(cfg: Config) -> None:
    """--use-megatron-fsdp's optim_grads (megatron/parallel/fsdp/flat_shards.py): the distributed optimizer's state and
    buckets, so its rules hold; combinations the engine does not run, each a one-line error."""
    par, opt, prec = cfg.parallel, cfg.optimizer, cfg.precision
    strategy = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads"
    if not opt.use_distributed_optimizer:
        opt.use_distributed_optimizer = True
        cfg.notes.append(f"{strategy}: the distributed optimizer's buckets, state and checkpoints")
    require(cfg.data_parallel_size > 1, f"{strategy} shards over the data-parallel ranks: run at least two")
    extras = [_flag(n) for n in _FSDP2_UNITS if getattr(par, n) not in (None, False)]
    require(not extras, f"{', '.join(extras)} configure FSDP2's units: add --use-torch-fsdp2, or drop them")
    pp = par.pipeline_model_parallel_size
    require(
        pp == 1,
        f"{strategy} with --pipeline-model-parallel-size {pp}: not built (the schedule interleaves the micro-batches'"
        " backward passes); use --use-distributed-optimizer",
    )
    require(
        cfg.training.cuda_graph_impl == "none",
        f"{strategy} with --cuda-graph-impl {cfg.training.cuda_graph_impl}: not built (the graphs capture the"
        " gradient buckets' addresses, which change every micro-batch); use --use-distributed-optimizer",
    )
    require(not prec.fp16, f"{strategy} with --fp16: not built yet; use --bf16")
    _check_dtypes(cfg)


def _check_fsdp(cfg: Config) -> None:
    """Combinations FSDP (optim_grads, optim_grads_params) does not run yet, each a one-line error."""
    par, opt, prec = cfg.parallel, cfg.optimizer, cfg.precision
    strategy = f"--data-parallel-sharding-strategy {par.data_parallel_sharding_strategy}"
    require(
        not opt.use_distributed_optimizer,
        f"{strategy} shards the optimizer states itself: drop --use-distributed-optimizer",
    )
    require(cfg.data_parallel_size > 1, f"{strategy} shards over the data-parallel ranks: run at least two")
    # Tensor and context parallelism compose: FSDP shards each rank's tensor-parallel piece over the data (x context)
    # parallel ranks holding the same piece
    pp = par.pipeline_model_parallel_size
    require(
        pp == 1,
        f"{strategy} with --pipeline-model-parallel-size {pp}: not built yet (FSDP composes with tensor and context"
        " parallelism only)",
    )
    require(not prec.fp16, f"{strategy} with --fp16: not built yet; use --bf16")
    if prec.fp8_param_gather and prec.fp8_recipe == "mxfp8":
        _note_mx_weights_gathered_in_bf16(cfg)
    # --fp8-grad-reduce (and O1, O2): each unit's reduce-scatter sends FP8
    # (megatron/parallel/fsdp/fp8_reduce_scatter.py); O2's precision-aware states and bf16 gradients are FSDP's
    # --use-precision-aware-optimizer and bf16 shards
    require(
        cfg.training.cuda_graph_impl == "none",
        f"{strategy} with --cuda-graph-impl {cfg.training.cuda_graph_impl}: not built yet",
    )
    _check_dtypes(cfg)
    ckpt = cfg.checkpoint
    require(
        not (ckpt.save or ckpt.load) or ckpt.ckpt_format == "torch_dist",
        f"{strategy} with --ckpt-format {ckpt.ckpt_format}: FSDP saves its shards with --ckpt-format torch_dist",
    )
    if not par.torch_fsdp2_reshard_after_forward and par.data_parallel_sharding_strategy == "optim_grads":
        cfg.notes.append(
            f"{strategy}: the units stay gathered from the first forward to the last backward of each step already"
            " (--torch-fsdp2-no-reshard-after-forward changes nothing more)"
        )
    if par.overlap_grad_reduce or par.overlap_param_gather:
        cfg.notes.append(
            f"{strategy}: FSDP2 overlaps every unit's all-gather and reduce-scatter with computation itself"
            " (--overlap-grad-reduce / --overlap-param-gather change nothing more)"
        )


def _note_mx_weights_gathered_in_bf16(cfg: Config) -> None:
    """mxfp8's FP8 all-gathers carry their E8M0 scales beside the bytes, which FSDP2 allows only where its ranks divide
    a weight's rows (megatron/parallel/fsdp/fp8_gather_axes.py): say which linears gather in the training dtype
    instead."""
    model, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    ranks = cfg.data_parallel_size * cfg.parallel.context_parallel_size  # FSDP shards over data x context ranks
    heads, groups = model.num_attention_heads, model.num_query_groups
    rows = {  # each FP8 linear's output rows on this tensor-parallel rank
        "linear_qkv": model.kv_channels * (heads + 2 * groups) // tp,
        "linear_proj": model.hidden_size,
        "linear_fc1": model.ffn_hidden_size * (2 if model.swiglu else 1) // tp,
        "linear_fc2": model.hidden_size,
    }
    uneven = [f"{name} ({n} rows)" for name, n in rows.items() if n % ranks]
    if uneven:
        cfg.notes.append(
            f"--fp8-param-gather with mxfp8 under FSDP: {', '.join(uneven)} gather in the training dtype, as {ranks}"
            " FSDP ranks do not divide their rows (their E8M0 scales ride in the all-gather, which FSDP2 allows only"
            " for evenly divided shards); the other FP8 linears gather FP8"
        )


@dataclass(frozen=True)
class Sharding:
    """The run's data-parallel sharding and its precisions, resolved once by `Config.finalize` (`cfg.sharding`) from
    the flags; what the memory estimate, the build, the engines and the optimizer read."""

    engine: str
    """The gradient engine: "buffers", "flat_shards" or "fsdp2" (`ParallelConfig.gradient_engine`; the table in
    megatron/parallel/engines.py)."""
    distributed_optimizer: bool
    """The optimizer's states are sharded over the data-parallel ranks on the flat buckets (--use-distributed-optimizer,
    strategy optim, and the flat gradient shards); FSDP2 shards them itself."""
    main_grads_bf16: bool
    """The gradients accumulate in bf16, else fp32: the buffers with --grad-reduce-in-bf16; the gradient shards per
    --megatron-fsdp-main-grads-dtype (auto: as --grad-reduce-in-bf16)."""
    grad_comm_bf16: bool
    """The gradients are reduced (all-reduced or reduce-scattered) in bf16, else fp32: the buffers with
    --grad-reduce-in-bf16; the gradient shards per --megatron-fsdp-grad-comm-dtype (auto: as they accumulate)."""
    shards_hold_main_weights: bool
    """FSDP2's weight shards are the fp32 main weights the optimizer steps on in place (else, with
    --use-precision-aware-optimizer, they hold the training dtype, bf16 under --bf16, and the optimizer holds the
    main weights of its shard in --main-params-dtype: FSDP2 gathers the shards without a cast)."""
    keeps_weight_casts: bool
    """FSDP2 lets the FP8 linears keep each step's weight casts for its later micro-batches, as the distributed
    optimizer's do: under optim_grads, whose gathered weights stay unchanged from the first forward to the last
    micro-batch's backward, without --fp8-param-gather (whose gathered weights are FP8 already). Under
    optim_grads_params each weight is freed after use, and kept casts would be an unsharded FP8 copy of the model."""
    optimizer_shards: int
    """How many ranks share the main parameters and Adam states: the data x context parallel ranks under the
    distributed optimizer and FSDP2, else 1."""

    @property
    def fsdp2(self) -> bool:
        """Whether PyTorch's FSDP2 holds the parameters (each rank 1/dp of every weight)."""
        return self.engine == "fsdp2"

    @property
    def flat_shards(self) -> bool:
        """Whether the flat gradient shards run (--use-megatron-fsdp's optim_grads)."""
        return self.engine == "flat_shards"


def resolved_sharding(cfg: Config) -> Sharding:
    """The `Sharding` of a configuration whose flags are final (`Config.finalize` calls it last)."""
    par, opt = cfg.parallel, cfg.optimizer
    engine = par.gradient_engine
    fsdp_dtypes = engine != "buffers"  # the --megatron-fsdp-*-dtype flags, at their defaults without FSDP
    main_grads = par.megatron_fsdp_main_grads_dtype
    main_grads_bf16 = main_grads == "bf16" or (main_grads == "auto" and par.grad_reduce_in_bf16)
    comm = par.megatron_fsdp_grad_comm_dtype
    grad_comm_bf16 = comm == "bf16" or (comm == "auto" and main_grads_bf16)
    return Sharding(
        engine=engine,
        distributed_optimizer=opt.use_distributed_optimizer,
        main_grads_bf16=main_grads_bf16 if fsdp_dtypes else par.grad_reduce_in_bf16,
        grad_comm_bf16=grad_comm_bf16 if fsdp_dtypes else par.grad_reduce_in_bf16,
        shards_hold_main_weights=not opt.use_precision_aware_optimizer,
        keeps_weight_casts=(
            engine == "fsdp2"
            and par.data_parallel_sharding_strategy == "optim_grads"
            and not cfg.precision.fp8_param_gather
        ),
        optimizer_shards=(
            cfg.data_parallel_size * par.context_parallel_size
            if opt.use_distributed_optimizer or engine == "fsdp2"
            else 1
        ),
    )


def fsdp_layer_units(num_layers: int, layer_elements: float, unit_size: int | None) -> list[int]:
    """Layers per FSDP unit, in order: consecutive layers until a unit holds at least `unit_size` parameter elements
    (--suggested-communication-unit-size; None: one layer each), the rest in a last unit
    (`megatron.parallel.fsdp.fsdp2.fsdp_units` groups the modules so, on layers of `layer_elements` parameters)."""
    if unit_size is None:
        return [1] * num_layers
    per_unit = max(1, math.ceil(unit_size / layer_elements))
    whole, rest = divmod(num_layers, per_unit)
    return [per_unit] * whole + ([rest] if rest else [])
