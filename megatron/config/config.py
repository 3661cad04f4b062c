"""The whole run's configuration: one object of grouped sections, validated in one place."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from . import te_rules
from .base import ConfigError, require
from .batch_schedule import BatchSchedule, parse_step_schedule
from .data import DataConfig
from .model import ModelConfig
from .optimizer import OptimizerConfig
from .parallel import ParallelConfig
from .pipeline_split import accounted_layout, chunk_layer_numbers, layout_stage_counts, stage_layer_numbers
from .precision import LOCAL_FP8_PARAM_RECIPES, TE_FP8_PARAM_RECIPES, PrecisionConfig
from .sharding import Sharding, check_meta_device_layers, resolve_sharding, resolved_sharding
from .training import CheckpointConfig, LoggingConfig, TrainingConfig

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "precision": PrecisionConfig,
    "optimizer": OptimizerConfig,
    "data": DataConfig,
    "training": TrainingConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    world_size: int = 1
    """Number of processes (set from the launcher's environment, not a flag)."""
    device_type: str = "cpu"
    """`cuda` or `cpu` (set from the machine, not a flag)."""
    notes: list[str] = field(default_factory=list)
    """Decisions validation made on the user's behalf (implied flags), logged at start."""
    resolved: Sharding | None = field(default=None, repr=False, compare=False)
    """What `finalize` resolved of the flags (`sharding`); None before. Not saved: a loaded configuration resolves
    it again."""

    @property
    def sharding(self) -> Sharding:
        """The data-parallel sharding and its precisions, resolved by `finalize` (config/sharding.py)."""
        if self.resolved is None:
            raise RuntimeError("Config.sharding is resolved by Config.finalize(): call it first")
        return self.resolved

    @property
    def data_parallel_size(self) -> int:
        par = self.parallel
        model_parallel = par.tensor_model_parallel_size * par.pipeline_model_parallel_size * par.context_parallel_size
        return self.world_size // model_parallel

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step at --global-batch-size (the final batch
        size of a batch-size ramp; batch_schedule.py gives each step's)."""
        assert self.training.global_batch_size is not None
        return self.training.global_batch_size // (self.training.micro_batch_size * self.data_parallel_size)

    def finalize(self, check_files: bool = True) -> Config:
        """Apply defaults that depend on several sections and check every rule, and (`check_files`) that the data
        and tokenizer files exist; raises ConfigError. Idempotent."""
        for name in SECTIONS:
            getattr(self, name).finalize()
        self._check_cross_section()
        self.resolved = resolved_sharding(self)
        if check_files:
            self.data.check_files()
        return self

    def _check_cross_section(self) -> None:
        par, train, opt, prec = self.parallel, self.training, self.optimizer, self.precision
        model_parallel = par.tensor_model_parallel_size * par.pipeline_model_parallel_size * par.context_parallel_size
        if par.sequence_parallel and par.tensor_model_parallel_size == 1:
            par.sequence_parallel = False
            self.notes.append("--sequence-parallel turned off: --tensor-model-parallel-size 1 has nothing to split")
        require(
            self.world_size % model_parallel == 0,
            f"world size {self.world_size} is not divisible by --tensor-model-parallel-size x"
            f" --pipeline-model-parallel-size x --context-parallel-size ({model_parallel})",
        )
        per_step = train.micro_batch_size * self.data_parallel_size
        self._resolve_batch_schedule()
        require(
            train.global_batch_size >= 1 and train.global_batch_size % per_step == 0,
            f"--global-batch-size ({train.global_batch_size}) must be a multiple of --micro-batch-size"
            f" ({train.micro_batch_size}) x data-parallel size ({self.data_parallel_size})",
        )
        self._check_lr_schedule()
        resolve_sharding(self)  # FSDP flags -> strategy (optim: the distributed optimizer)
        require(
            opt.use_distributed_optimizer or par.gradient_engine == "fsdp2" or not par.overlap_param_gather,
            "--overlap-param-gather overlaps the distributed optimizer's parameter all-gathers: add"
            " --use-distributed-optimizer or drop the flag",
        )
        self._check_parallel_layout()
        self._resolve_transformer_impl()  # after the layout: TE's shape rules apply to the tensor-parallel shards
        check_meta_device_layers(self)
        if prec.fp8 and self.device_type == "cuda" and not (prec.bf16 or prec.fp16):
            # FP8 GEMMs with fp32 weights would keep fp32 master copies *and* fp32 activations around the FP8 ops:
            # Megatron-LM silently does that. We imply bf16 instead and say so.
            prec.bf16 = True
            self.notes.append("--fp8-format on a GPU implies --bf16 (FP8 with fp32 weights wastes memory and time)")
        if prec.first_last_layers_bf16:
            require(
                prec.num_layers_at_start_in_bf16 + prec.num_layers_at_end_in_bf16 <= self.model.num_layers,
                "--num-layers-at-start-in-bf16 + --num-layers-at-end-in-bf16 exceed --num-layers",
            )
        require(
            not (self.model.cross_entropy_loss_fusion and self.model.cross_entropy_fusion_impl == "te")
            or self.device_type == "cuda",
            "--cross-entropy-fusion-impl te runs Transformer Engine's kernel on a CUDA GPU; use"
            " --cross-entropy-fusion-impl native",
        )
        require(
            not (self.model.cross_entropy_loss_fusion and self.model.cross_entropy_fusion_impl == "te" and prec.fp16),
            "--cross-entropy-fusion-impl te: Transformer Engine's kernel takes bf16 or fp32 logits, not --fp16's; use"
            " --cross-entropy-fusion-impl native",
        )
        if opt.fp8_optimizer_level is not None:  # O1 and O2 both communicate gradients in FP8
            par.fp8_grad_reduce = True
        if opt.main_grads_dtype == "bf16":
            par.grad_reduce_in_bf16 = True  # the optimizer reads the gradient buffers themselves
        require(
            opt.main_params_dtype == "fp32" or prec.bf16 or prec.fp16 or prec.fp8_param_gather,
            "--main-params-dtype fp16 needs --bf16 or --fp16: with fp32 weights the weights are the main parameters",
        )
        require(
            not (prec.fp16 and prec.fp8_param_gather),
            "--fp8-param-gather with --fp16: FP8 weights are built around bf16 (as in Megatron-LM's FP8 recipe); use"
            " --bf16",
        )

    def _resolve_batch_schedule(self) -> None:
        """--global-batch-size is the final batch size of a batch-size schedule (batch_schedule.py); the schedule's
        own rules are checked by building it."""
        train = self.training
        if train.step_batch_size_schedule is not None:
            final = parse_step_schedule(train.step_batch_size_schedule, self.model.seq_length)[-1][1]
            require(
                train.global_batch_size in (None, final),
                f"--global-batch-size ({train.global_batch_size}) differs from the last batch size of"
                f" --step-batch-size-schedule ({final}); drop --global-batch-size or make them equal",
            )
            train.global_batch_size = final
        elif train.global_batch_size is None:
            train.global_batch_size = train.micro_batch_size * self.data_parallel_size
        BatchSchedule.from_config(self)

    def _check_lr_schedule(self) -> None:
        """Iteration- and sample-based schedules are not mixed (as in Megatron-LM); defaults of the decay span."""
        train, opt = self.training, self.optimizer
        by_iters = train.train_iters is not None
        unit, other = ("iters", "samples") if by_iters else ("samples", "iters")
        kind = {"iters": "iteration-based", "samples": "sample-based"}
        for name in ("lr_decay", "lr_warmup", "lr_wsd_decay"):
            require(
                getattr(opt, f"{name}_{other}") in (None, 0),
                f"--{name.replace('_', '-')}-{other} is for {kind[other]} training, this run is {kind[unit]}"
                f" (--train-{unit}); use --{name.replace('_', '-')}-{unit}",
            )
        if by_iters and opt.lr_decay_iters is None:
            opt.lr_decay_iters = max(train.train_iters, 1)
        if not by_iters and opt.lr_decay_samples is None:
            opt.lr_decay_samples = max(train.train_samples, 1)
        decay, warmup = getattr(opt, f"lr_decay_{unit}"), getattr(opt, f"lr_warmup_{unit}")
        require(
            warmup <= decay,
            f"--lr-warmup-{unit} ({warmup}) must be <= --lr-decay-{unit} ({decay})",
        )
        if opt.lr_decay_style == "WSD":
            wsd = getattr(opt, f"lr_wsd_decay_{unit}")
            require(
                wsd is not None and wsd <= decay,
                f"--lr-decay-style WSD needs --lr-wsd-decay-{unit} (the annealing length) <= --lr-decay-{unit}"
                f" ({decay})",
            )

    def _check_parallel_layout(self) -> None:
        """Shapes that tensor and pipeline parallelism must be able to split."""
        par, model = self.parallel, self.model
        tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
        cp = par.context_parallel_size
        if tp > 1:
            for flag, value in (
                ("--num-attention-heads", model.num_attention_heads),
                ("--num-query-groups", model.num_query_groups),
                ("--ffn-hidden-size", model.ffn_hidden_size),
            ):
                require(value % tp == 0, f"{flag} ({value}) must be divisible by --tensor-model-parallel-size ({tp})")
            if par.sequence_parallel:
                require(
                    model.seq_length % (tp * cp) == 0,
                    f"--seq-length ({model.seq_length}) must be divisible by --tensor-model-parallel-size ({tp}) x"
                    f" --context-parallel-size ({cp}) with --sequence-parallel",
                )
        if cp > 1:
            self._check_context_parallel()
        if pp > 1 or self.pipeline_layout is not None:
            first, last = par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers
            stage_layer_numbers(model.num_layers, pp, 0, first, last, self.pipeline_layout)
        self._check_virtual_pipeline()

    @property
    def pipeline_layout(self) -> str | None:
        """The --pipeline-model-parallel-layout string that places the layers, also the one that
        --account-for-embedding/loss-in-pipeline-split stand for; None for the even (or first/last) split."""
        par = self.parallel
        embedding, loss = par.account_for_embedding_in_pipeline_split, par.account_for_loss_in_pipeline_split
        if par.pipeline_model_parallel_layout is not None or not (embedding or loss):
            return par.pipeline_model_parallel_layout
        pp = par.pipeline_model_parallel_size
        return accounted_layout(self.model.num_layers, pp, self.virtual_pipeline_size, embedding, loss)

    def stage_chunks(self, pp_rank: int) -> tuple[tuple[int, ...], ...]:
        """Global layer numbers of each model chunk of pipeline rank `pp_rank`, as the pipeline flags place them
        (pipeline_split.py)."""
        par = self.parallel
        first, last = par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers
        pp, vpp = par.pipeline_model_parallel_size, self.virtual_pipeline_size
        return chunk_layer_numbers(self.model.num_layers, pp, pp_rank, vpp, first, last, self.pipeline_layout)

    @property
    def _pipelined_layers(self) -> int:
        """--num-layers plus the embedding and loss where the pipeline split counts them as layers."""
        par = self.parallel
        accounted = par.account_for_embedding_in_pipeline_split + par.account_for_loss_in_pipeline_split
        return self.model.num_layers + accounted

    @property
    def virtual_pipeline_size(self) -> int:
        """Model chunks per pipeline rank: more than 1 runs the interleaved 1F1B schedule."""
        par = self.parallel
        if par.pipeline_model_parallel_layout is not None:
            stages = layout_stage_counts(
                par.pipeline_model_parallel_layout, par.pipeline_model_parallel_size, self.model.num_layers
            )
            return len(stages) // par.pipeline_model_parallel_size
        if par.num_virtual_stages_per_pipeline_rank is not None:
            return par.num_virtual_stages_per_pipeline_rank
        if par.num_layers_per_virtual_pipeline_stage is not None:
            per_rank = self._pipelined_layers // par.pipeline_model_parallel_size
            return per_rank // par.num_layers_per_virtual_pipeline_stage
        return 1

    def _check_virtual_pipeline(self) -> None:
        """What the interleaved schedule needs (Megatron-LM's rules)."""
        par, layers, pp = self.parallel, self._pipelined_layers, self.parallel.pipeline_model_parallel_size
        per_stage = par.num_layers_per_virtual_pipeline_stage
        if per_stage is not None:
            flag = f"--num-layers-per-virtual-pipeline-stage {per_stage}"
            require(
                par.decoder_first_pipeline_num_layers is None and par.decoder_last_pipeline_num_layers is None,
                f"{flag} with --decoder-first/last-pipeline-num-layers: give the virtual pipeline size as"
                " --num-virtual-stages-per-pipeline-rank instead",
            )
            require(
                layers % pp == 0 and (layers // pp) % per_stage == 0,
                f"{flag}: the layers per pipeline stage (--num-layers {layers} / --pipeline-model-parallel-size"
                f" {pp}) must be a multiple of it",
            )
        vpp = self.virtual_pipeline_size
        if vpp == 1:
            return
        flags = "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank"
        if par.pipeline_model_parallel_layout is not None:
            flags = "--pipeline-model-parallel-layout"
        require(
            pp > 1,
            f"{flags}: {vpp} virtual pipeline stages per rank need --pipeline-model-parallel-size > 1; give one stage"
            " per pipeline rank",
        )
        self.stage_chunks(0)  # ConfigError where the layers cannot be placed on the virtual stages
        group = par.microbatch_group_size_per_virtual_pipeline_stage or pp
        flag = "--microbatch-group-size-per-virtual-pipeline-stage"
        per_step = self.training.micro_batch_size * self.data_parallel_size
        for _, batch in BatchSchedule.from_config(self).phases:
            micro = batch // per_step
            what = f"global batch size {batch} makes {micro} micro-batches (of --micro-batch-size x data-parallel size"
            what += f" = {per_step})"
            require(
                pp <= group <= micro,
                f"the interleaved pipeline schedule runs micro-batches in groups of {flag} (default"
                f" --pipeline-model-parallel-size), {group}, which must lie between the pipeline size {pp} and the"
                f" micro-batches per step: {what}",
            )
            require(
                micro % group == 0 or micro % group >= pp,
                f"the interleaved pipeline schedule needs the micro-batches per step to be a multiple of {flag}"
                f" (default --pipeline-model-parallel-size), {group}, or to leave a last group of at least {pp}:"
                f" {what}",
            )

    def _resolve_transformer_impl(self) -> None:
        """Default --transformer-impl (TE where it can run, else local, with a note saying why); an explicit
        transformer_engine that cannot run, or FP8 settings TE cannot express, is a ConfigError."""
        model, prec = self.model, self.precision
        if model.transformer_impl is None:
            if self.device_type != "cuda":
                reason = "no CUDA device"
            elif (error := te_rules.te_import_error()) is not None:
                reason = f"Transformer Engine does not import: {error}"
            elif prec.fp8 and prec.fp8_recipe not in te_rules.TE_RECIPES:
                reason = f"--fp8-recipe {prec.fp8_recipe} has no Transformer Engine recipe"
            elif model.smooth_swiglu:
                reason = "--smooth-swiglu runs on the local layers"
            else:
                reason = None
            model.transformer_impl = "local" if reason else "transformer_engine"
            self.notes.append(
                f"--transformer-impl local ({reason})"
                if reason
                else "--transformer-impl transformer_engine (CUDA with Transformer Engine; --transformer-impl local"
                " for the pure-PyTorch layers)"
            )
        elif model.transformer_impl == "transformer_engine":
            require(
                self.device_type == "cuda",
                "--transformer-impl transformer_engine needs a CUDA GPU; use --transformer-impl local",
            )
            te_rules.require_te()
        if prec.fp8_param_gather:
            self._check_fp8_params()
        # TE's linears own their weights and quantize inside their forward: no place to fold 1/s into the weight
        require(
            not (model.smooth_swiglu and model.transformer_impl == "transformer_engine"),
            "--smooth-swiglu is built for the local layers only: use --transformer-impl local",
        )
        # an FP8 weight is cast once per step with one scale; the folded W/s would need a second cast per step
        require(
            not (model.smooth_swiglu and prec.fp8_param_gather),
            "--smooth-swiglu with --fp8-param-gather: linear_fc2's weight is divided by the scales before its cast,"
            " so it cannot be kept in FP8; drop one of the two",
        )
        require(
            model.transformer_impl == "transformer_engine" or not prec.fp8_dot_product_attention,
            "--fp8-dot-product-attention needs --transformer-impl transformer_engine (the local attention runs in"
            " bf16)",
        )
        require(
            model.transformer_impl == "transformer_engine" or not prec.tp_only_amax_red,
            "--tp-only-amax-red applies to Transformer Engine's amax reductions; the local FP8 engine reduces its"
            " amaxes over all tensor x data parallel ranks once per step, which also keeps the replicas' inf/NaN"
            " step skipping in agreement; drop the flag or add --transformer-impl transformer_engine",
        )
        require(
            model.transformer_impl == "transformer_engine" or not self.parallel.tp_comm_overlap,
            "--tp-comm-overlap uses Transformer Engine's userbuffers; add --transformer-impl transformer_engine or"
            " drop the flag",
        )
        require(
            not (self.parallel.tp_comm_overlap and prec.fp8 and prec.fp8_recipe == "blockwise"),
            "--tp-comm-overlap with --fp8-recipe blockwise: Transformer Engine's userbuffers gather per-tensor or"
            " MXFP8 FP8 data only; use --fp8-recipe delayed or tensorwise, or drop --tp-comm-overlap",
        )
        if self.parallel.tp_comm_overlap and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
            self.notes.append(
                "--tp-comm-overlap without CUDA_DEVICE_MAX_CONNECTIONS=1: the GPU may start a GEMM before the"
                " communication it should overlap (Megatron-LM sets it to 1)"
            )
        if model.transformer_impl == "transformer_engine":
            te_rules.check_te_config(model, self.training.micro_batch_size, prec, self.parallel)
        self._check_cuda_graphs()
        self._check_attention_and_determinism()

    def _check_attention_and_determinism(self) -> None:
        backend = self.model.attention_backend
        require(
            backend in ("auto", "fused") or not self.precision.fp8_dot_product_attention,
            f"--fp8-dot-product-attention runs in Transformer Engine's fused (cuDNN) attention; use"
            f" --attention-backend auto or fused (got {backend})",
        )
        if self.training.deterministic_mode:
            require(
                not self.parallel.tp_comm_overlap,
                "--deterministic-mode with --tp-comm-overlap: the overlapped GEMMs reduce in a varying order;"
                " drop one of the two",
            )
            fused_ce = any(getattr(getattr(self, name), "cross_entropy_loss_fusion", False) for name in SECTIONS)
            require(
                not fused_ce,
                "--deterministic-mode with --cross-entropy-loss-fusion is not bitwise reproducible (Megatron-LM's"
                " rule); drop one of the two",
            )

    def _check_fp8_params(self) -> None:
        """Recipes whose weights can live in FP8 (and be all-gathered as FP8 bytes): see megatron/fp8/params.py."""
        recipe, te = self.precision.fp8_recipe, self.model.transformer_impl == "transformer_engine"
        fsdp2 = self.parallel.gradient_engine == "fsdp2"
        if not te and not fsdp2:  # FSDP keeps no FP8 weights; its rules: sharding.py
            require(
                recipe in LOCAL_FP8_PARAM_RECIPES,
                f"--fp8-param-gather with --fp8-recipe {recipe}: the local engine keeps FP8 weights with one scale"
                f" per tensor ({', '.join(LOCAL_FP8_PARAM_RECIPES)}); use one of those, --transformer-impl"
                " transformer_engine for blockwise, FSDP (--use-megatron-fsdp) for every recipe, or drop"
                " --fp8-param-gather",
            )
        elif te and (self.optimizer.use_distributed_optimizer or fsdp2):
            sharding = "FSDP" if fsdp2 else "--use-distributed-optimizer"
            require(
                recipe in TE_FP8_PARAM_RECIPES,
                f"--fp8-param-gather with {sharding} and --fp8-recipe {recipe}: Transformer Engine's {recipe}"
                f" weights cannot be all-gathered as FP8 bytes; use --fp8-recipe {'|'.join(TE_FP8_PARAM_RECIPES)}"
                " (or, under FSDP, --transformer-impl local, which gathers every recipe), or drop --fp8-param-gather",
            )

    def _check_context_parallel(self) -> None:
        """What splitting each sequence over --context-parallel-size ranks needs (parallel/context_parallel.py)."""
        par, model = self.parallel, self.model
        cp, tp, comm = par.context_parallel_size, par.tensor_model_parallel_size, par.cp_comm_type
        require(
            model.seq_length % (2 * cp) == 0,
            f"--seq-length ({model.seq_length}) must be divisible by 2 x --context-parallel-size ({2 * cp}): each rank"
            " holds two of 2 x cp equal chunks",
        )
        require(
            len(comm) in (1, model.num_layers),
            f"--cp-comm-type takes one value or one per layer ({model.num_layers}), not {len(comm)}",
        )
        te_attention = model.transformer_impl == "transformer_engine" and model.attention_backend != "local"
        if te_attention and "a2a" in comm:
            heads = (model.num_attention_heads // tp, model.num_query_groups // tp)
            require(
                heads[0] % cp == 0 and heads[1] % cp == 0,
                f"--cp-comm-type a2a scatters the attention heads over the context-parallel ranks: the heads"
                f" ({heads[0]}) and query groups ({heads[1]}) per tensor-parallel rank must be divisible by"
                f" --context-parallel-size ({cp}); use p2p",
            )
        require(
            not (te_attention and model.attention_backend == "unfused"),
            "--attention-backend unfused: Transformer Engine's unfused attention has no context parallelism; use"
            " auto, flash or fused, or local (this project's attention, which all-gathers keys and values)",
        )
        require(
            not te_attention or self.precision.bf16 or self.precision.fp16,
            "--context-parallel-size > 1 with Transformer Engine's attention needs --bf16 or --fp16 (its"
            " context-parallel kernels, flash and fused attention, take half-precision inputs); or use"
            " --attention-backend local",
        )
        require(
            self.training.cuda_graph_impl == "none",
            f"--cuda-graph-impl {self.training.cuda_graph_impl} with --context-parallel-size > 1: capturing the"
            " context-parallel attention is not implemented; drop one of the two",
        )
        require(
            not (te_attention and self.data.reset_attention_mask),
            "--reset-attention-mask with --context-parallel-size > 1: Transformer Engine's context-parallel attention"
            " is causal only; drop --reset-attention-mask or use --attention-backend local",
        )

    def _check_cuda_graphs(self) -> None:
        if self.training.cuda_graph_impl == "none":
            return
        flag = "--cuda-graph-impl transformer_engine"
        require(
            self.model.transformer_impl == "transformer_engine",
            f"{flag} graphs Transformer Engine layers; add --transformer-impl transformer_engine or drop the flag",
        )
        require(
            self.parallel.pipeline_model_parallel_size == 1,
            f"{flag} needs --pipeline-model-parallel-size 1: the 1F1B schedule keeps several micro-batches in flight"
            " per layer, and a layer's graph holds one micro-batch's activations",
        )
        require(
            self.model.recompute_granularity is None,
            f"{flag} with --recompute-granularity: a graphed layer replays its captured backward, which needs the"
            " activations the recomputation drops; drop one of the two",
        )
        require(
            not self.precision.fp8_stats_interval,
            f"--fp8-stats-interval observes the layers through hooks, which {flag} does not run; drop one of the two",
        )
        require(
            not (self.precision.fp8_param_gather and self.optimizer.use_distributed_optimizer)
            or self.data_parallel_size == 1,
            f"{flag} with --fp8-param-gather and --use-distributed-optimizer: after the FP8 all-gather Transformer"
            " Engine rebuilds the weights' transposes outside the captured graphs (not yet supported); drop"
            f" {flag} or --use-distributed-optimizer",
        )
        for name in ("reset_position_ids", "reset_attention_mask"):
            require(
                not getattr(self.data, name),
                f"{flag} captures fixed shapes without an attention mask or per-sample positions; drop"
                f" --{name.replace('_', '-')} or the CUDA graphs",
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form of the sections (what checkpoints and config.json hold)."""
        out = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}
        out["world_size"] = self.world_size
        out["device_type"] = self.device_type
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """Rebuild a configuration from `to_dict` output; unknown keys (from newer versions) are an error."""
        kwargs: dict[str, Any] = {}
        for name, section_cls in SECTIONS.items():
            values = data.get(name, {})
            known = {f.name for f in dataclasses.fields(section_cls)}
            unknown = set(values) - known
            if unknown:
                raise ConfigError(f"unknown {name} config keys {sorted(unknown)}")
            kwargs[name] = section_cls(**values)
        return cls(**kwargs, world_size=data.get("world_size", 1), device_type=data.get("device_type", "cpu"))
