"""Numerical precision: bf16 / fp16 mixed precision (with fp16's loss scaling) and FP8."""

from __future__ import annotations

from dataclasses import dataclass

from .base import option, require

#: Recipes whose weights --fp8-param-gather can keep in FP8 and all-gather as bytes: the local engine's
#: `Fp8Parameter` has one scale per tensor; Transformer Engine's own quantized tensors (megatron/fp8/params.py).
LOCAL_FP8_PARAM_RECIPES = ("delayed", "tensorwise")
TE_FP8_PARAM_RECIPES = ("delayed", "tensorwise", "blockwise")
#: Under FSDP the weights stay high-precision shards cast for the all-gathers: Transformer Engine's with one scale per
#: tensor or per 128x128 block (`TE_FP8_PARAM_RECIPES`: parallel/fsdp/te_fp8_gather.py, te_blockwise_gather.py),
#: the local layers' with every recipe (megatron/parallel/fsdp/fp8_gather.py; rowwise and mxfp8, whose two GEMMs read
#: casts along both axes of the weight, gather the cast each pass needs: megatron/parallel/fsdp/fp8_gather_axes.py).


@dataclass
class PrecisionConfig:
    bf16: bool = False
    """Keep the model's parameters and activations in bf16, with fp32 main parameters and gradients in the optimizer
    (Megatron-LM's mixed precision). CPU runs without it compute in fp32."""
    fp16: bool = False
    """Keep the model's parameters and activations in fp16, with fp32 main parameters and gradients in the optimizer,
    and scale the loss so that small gradients survive fp16's range: dynamically (--initial-loss-scale,
    --min-loss-scale, --loss-scale-window, --hysteresis) unless --loss-scale fixes it. A step whose gradients hold
    inf/NaN is skipped (counted in `number of skipped iterations`); the step line shows `loss scale`."""
    loss_scale: float | None = None
    """With --fp16: a static loss scale (a positive power of 2 keeps the unscaling exact); dynamic scaling when
    absent."""
    initial_loss_scale: float = 2.0**32
    """With --fp16: the dynamic loss scale's starting value."""
    min_loss_scale: float = 1.0
    """With --fp16: the dynamic loss scale is never lowered below this."""
    loss_scale_window: float = 1000
    """With --fp16: the dynamic loss scale doubles after this many steps in a row without inf/NaN gradients."""
    hysteresis: int = 2
    """With --fp16: the dynamic loss scale halves at an inf/NaN step once this many such steps have been seen since
    it last grew (each one after that halves it again)."""
    fp8_format: str | None = option(None, choices=["e4m3", "hybrid"])
    """Turn FP8 on for the transformer layers' linear layers: `e4m3` everywhere, or `hybrid` (e4m3 for activations
    and weights, e5m2 for gradients). FP8 is off when absent."""
    fp8_recipe: str = option("delayed", choices=["delayed", "tensorwise", "blockwise", "mxfp8", "rowwise"])
    """How FP8 scales are chosen: `delayed` (per tensor, from an amax history), `tensorwise` (per tensor, current
    amax), `rowwise` (per row), `blockwise` (1x128 / 128x128 tiles), `mxfp8` (32-element blocks, E8M0 scales)."""
    fp8_margin: int = 0
    """Delayed scaling: scale = fp8_max / amax / 2^margin."""
    fp8_amax_history_len: int = 1
    """Delayed scaling: number of steps of amax history."""
    fp8_amax_compute_algo: str = option("most_recent", choices=["most_recent", "max"])
    """Delayed scaling: which amax of the history sets the scale."""
    fp8_calibration: bool = option(True, flag="--no-fp8-calibration", action="store_false")
    """Delayed scaling: set the first scales from one high-precision forward and backward pass over the first
    micro-batch (scale = fp8_max / amax / 2^margin), before any FP8 GEMM runs; `--no-fp8-calibration` starts every
    scale at 1, as Transformer Engine does (docs/fp8.md: what that costs). Skipped when resuming from a checkpoint
    of a delayed-scaling run, which holds the scales (one without them, saved in bf16, with another recipe or
    converted, is calibrated as a fresh start is), and with --tp-comm-overlap on Transformer Engine (the startup log
    says so)."""
    fp8_stats_interval: int = 0
    """Every N-th step, log per FP8 linear and tensor (input, weight, output gradient) the amax, the scale and the
    fractions of elements saturated and flushed to zero, to TensorBoard (`fp8/<linear>/<tensor>/...`) and as one
    summary line naming the worst tensors (0: off, no cost). Not with CUDA graphs."""
    fp8_guard_saturation: float = 1e-3
    """FP8 guard (with --fp8-stats-interval): a tensor whose saturated fraction exceeds this on
    --fp8-guard-intervals watched steps in a row is named in the log (and moved to bf16 with --fp8-auto-bf16)."""
    fp8_guard_underflow: float = 0.01
    """FP8 guard: the same for the fraction of nonzero elements flushed to zero."""
    fp8_guard_intervals: int = 3
    """FP8 guard: watched steps in a row over a threshold before it acts. While a tensor is over on fewer, the
    monitor watches every step: the guard acts N - 1 steps after the first flagged one, whatever the interval."""
    fp8_auto_bf16: bool = False
    """FP8 guard: move a transformer layer whose FP8 tensor stays over a threshold to bf16 for the rest of the run;
    the checkpoint records it, and a resumed run keeps the layer in bf16. Needs --fp8-stats-interval."""
    fp8_blockwise_fp32_scales: bool = False
    """Blockwise recipe: keep each block's scale fp8_max / amax in full fp32 instead of rounding it down to a power
    of two (the default, as Transformer Engine's NVTE_FP8_BLOCK_SCALING_FP32_SCALES=0)."""
    fp8_wgrad: bool = option(True, flag="--no-fp8-wgrad", action="store_false")
    """Compute the weight-gradient GEMM in FP8 (`--no-fp8-wgrad` keeps it in high precision)."""
    fp8_param_gather: bool = False
    """Keep the FP8 transformer layers' weights only in FP8 (Transformer Engine's quantized parameters, or the local
    engine's `Fp8Parameter`): no bf16 copy and no per-step cast; the optimizer's fp32 main parameters are the master
    copy, quantized straight into the weights after each step. Saves 2 bytes per weight (plus the FP8 copies that
    would otherwise be cached). With --use-distributed-optimizer each data-parallel rank casts its shard and the
    all-gather moves FP8 bytes (Megatron-LM's FP8 recipe). Recipes: delayed, tensorwise; blockwise on Transformer
    Engine; under FSDP (which gathers FP8 weights, keeping fp32 shards) every recipe with the local layers (rowwise
    and mxfp8 gather the row cast for the forward and the column cast for the backward: docs/fsdp.md). Checkpoints
    hold the weights dequantized (so they load anywhere) and the fp32 main parameters."""
    fp8_dot_product_attention: bool = False
    """Run attention's batched GEMMs (QK^T and softmax x V, forward and backward) in FP8 as well: Transformer
    Engine's `fp8_dpa` (cuDNN's FP8 fused attention; a beta feature of TE). Attention is about a quarter of an FP8
    llama-1b step when it stays in bf16. Off by default: on llama-150m it adds +0.25% (95% interval +0.07 .. +0.42%)
    to FP8 delayed's loss gap, growing over the run (docs/loss_parity.md). Needs --transformer-impl
    transformer_engine and --fp8-recipe delayed (the FP8 attention TE runs on Hopper)."""
    tp_only_amax_red: bool = False
    """Max-reduce the FP8 amaxes over the tensor-parallel ranks only, not over the data-parallel replicas as well
    (Megatron-LM's flag). Replicas then keep their own activation and gradient scales (their weights', like the
    weights, are equal anyway), and data parallelism runs none of the small all-reduces that Transformer Engine
    issues for every layer and micro-batch: 5.3 ms of a 366 ms llama-1b step on two H200s (DP=2, FP8 delayed).
    Needs --transformer-impl transformer_engine."""
    fp8_first_layer_bf16: bool = option(True, flag="--no-fp8-first-layer-bf16", action="store_false")
    """Keep the first transformer layer out of FP8 (models of two or more layers; the default here, not in
    Megatron-LM). It reads the embeddings, and its FP8 casts carried most of FP8's early loss gap to bf16 (llama-1b,
    iteration 30: +1.07% with it in FP8, +0.55% without; docs/fp8.md). After a shared bf16 trunk of 300 steps on
    llama-150m, every layer in FP8 costs +0.014% (95% interval +0.009 .. +0.018%), and saves 12% of the step on
    llama-8b-4l, within noise on llama-1b (docs/loss_parity.md).
    `--no-fp8-first-layer-bf16` runs it in FP8 as Megatron-LM does. --first-last-layers-bf16 overrides this with
    its own counts."""
    first_last_layers_bf16: bool = False
    """Keep the first --num-layers-at-start-in-bf16 and last --num-layers-at-end-in-bf16 layers out of FP8."""
    num_layers_at_start_in_bf16: int = 1
    """With --first-last-layers-bf16: transformer layers at the start kept in high precision."""
    num_layers_at_end_in_bf16: int = 1
    """With --first-last-layers-bf16: transformer layers at the end kept in high precision."""

    @property
    def fp8(self) -> bool:
        """Whether FP8 is on."""
        return self.fp8_format is not None

    @property
    def calibration_pass(self) -> bool:
        """Whether a run without delayed-scaling scales starts with the calibration pass (--fp8-calibration): a
        fresh one, or one loaded from a checkpoint that holds none (the trainer asks; a resumed delayed-scaling run
        reads its scales from the checkpoint)."""
        return self.fp8 and self.fp8_recipe == "delayed" and self.fp8_calibration

    def fp8_layer_numbers(self, num_layers: int) -> list[int]:
        """1-based numbers of the transformer layers whose linears run in FP8 (by global layer number); empty with
        FP8 off. One rule for both engines."""
        if not self.fp8:
            return []
        if self.first_last_layers_bf16:
            first, last = self.num_layers_at_start_in_bf16, self.num_layers_at_end_in_bf16
        else:
            first, last = int(self.fp8_first_layer_bf16 and num_layers > 1), 0
        return [n for n in range(1, num_layers + 1) if first < n <= num_layers - last]

    def fp8_kept_layers_reason(self) -> str:
        """The flag that keeps layers out of FP8, for log lines."""
        return (
            "--first-last-layers-bf16"
            if self.first_last_layers_bf16
            else "the first layer: --no-fp8-first-layer-bf16 puts it in FP8"
        )

    @property
    def params_dtype(self):
        """The model's parameter and activation dtype (a torch.dtype)."""
        import torch  # late: the configuration does not need torch to parse flags

        return torch.float16 if self.fp16 else torch.bfloat16 if self.bf16 else torch.float32

    def finalize(self) -> None:
        require(not (self.fp16 and self.bf16), "--fp16 and --bf16 exclude each other: keep one")
        require(self.loss_scale is None or self.loss_scale > 0, f"--loss-scale must be > 0, got {self.loss_scale}")
        require(
            0 < self.min_loss_scale <= self.initial_loss_scale,
            f"--min-loss-scale ({self.min_loss_scale}) must be in (0, --initial-loss-scale"
            f" ({self.initial_loss_scale})]",
        )
        require(self.loss_scale_window >= 1, f"--loss-scale-window must be >= 1, got {self.loss_scale_window}")
        require(self.hysteresis >= 1, f"--hysteresis must be >= 1, got {self.hysteresis}")
        require(self.fp8_margin >= 0, f"--fp8-margin must be >= 0, got {self.fp8_margin}")
        require(self.fp8_amax_history_len >= 1, "--fp8-amax-history-len must be >= 1")
        require(self.fp8_stats_interval >= 0, f"--fp8-stats-interval must be >= 0, got {self.fp8_stats_interval}")
        for name in ("fp8_guard_saturation", "fp8_guard_underflow"):
            value = getattr(self, name)
            require(0 <= value <= 1, f"--{name.replace('_', '-')} is a fraction in [0, 1], got {value}")
        require(self.fp8_guard_intervals >= 1, "--fp8-guard-intervals must be >= 1")
        require(
            self.fp8 or not self.fp8_stats_interval,
            "--fp8-stats-interval needs FP8 on (--fp8-format e4m3|hybrid)",
        )
        require(
            not self.fp8_auto_bf16 or self.fp8_stats_interval > 0,
            "--fp8-auto-bf16 acts on the FP8 monitor's statistics: add --fp8-stats-interval N",
        )
        require(self.num_layers_at_start_in_bf16 >= 0, "--num-layers-at-start-in-bf16 must be >= 0")
        require(self.num_layers_at_end_in_bf16 >= 0, "--num-layers-at-end-in-bf16 must be >= 0")
        require(
            not self.fp8_blockwise_fp32_scales or (self.fp8 and self.fp8_recipe == "blockwise"),
            "--fp8-blockwise-fp32-scales needs --fp8-recipe blockwise with --fp8-format e4m3|hybrid",
        )
        require(self.fp8 or not self.fp8_param_gather, "--fp8-param-gather needs FP8 on (--fp8-format e4m3|hybrid)")
        require(
            self.fp8 or not self.fp8_dot_product_attention,
            "--fp8-dot-product-attention needs FP8 on (--fp8-format e4m3|hybrid)",
        )
        require(
            self.fp8_recipe == "delayed" or not self.fp8_dot_product_attention,
            f"--fp8-dot-product-attention needs --fp8-recipe delayed (got {self.fp8_recipe}): Transformer Engine runs"
            " FP8 attention with delayed scaling",
        )
        require(
            not self.first_last_layers_bf16 or self.fp8,
            "--first-last-layers-bf16 needs FP8 on (--fp8-format e4m3|hybrid)",
        )
