"""The transformer layer built from Transformer Engine modules (`--transformer-impl transformer_engine`).

Module tree and parameter names are the local layer's (transformer.py), so each implementation loads the other's
checkpoints:

    self_attention.linear_qkv      te.LayerNormLinear      input norm fused into the QKV GEMM (layer_norm_weight)
    self_attention.core_attention  te.DotProductAttention  fused attention (cuDNN / flash); no parameters
    self_attention.linear_proj     te.Linear
    mlp.linear_fc1                 te.LayerNormLinear      pre-MLP norm fused in; rows [gate; up] for SwiGLU
    mlp.linear_fc2                 te.Linear

TE adds one `_extra_state` entry per TE module (its FP8 scaling state); GPTModel reconciles those when loading.

The pieces, each in its own module (imported in this order, lowest first):

    te_linear.py     te.Linear / te.LayerNormLinear built and marked as the local linears are (`te_linear`)
    te_fp8.py        the FP8 autocast regions (`TEFp8Autocast`) and TE's activation checkpoint (`te_checkpoint`)
    te_attention.py  `TESelfAttention`
    te_mlp.py        `TEMLP`
    te_layers.py     `TETransformerLayer`, TE's fused cross-entropy, the startup description

What this layer does that the local one does not, and why:
  * FP8 GEMMs through `te.autocast` (TEFp8Autocast) with the recipe built in megatron/fp8/te_recipe.py.
  * RoPE by TE's fused QKV kernel on the QKV GEMM's packed output: no split copies, no concatenation in backward.
  * SwiGLU as one TE kernel each way; under delayed scaling those kernels write the FP8 operands of the MLP's
    linears directly (`te_mlp._SwiGLU`).
  * with --fp8-param-gather, FP8-only weights (TE's quantized parameters; see `TEFp8Autocast.param_init`).
  * fused wgrad accumulation: when a weight carries the fp32 `main_grad` of `megatron.parallel.GradientBuffers`,
    TE's weight-gradient GEMM accumulates into it in place (fp32 output, no bf16 gradient, no separate add; it
    writes it instead for weights marked `overwrite_main_grad`: megatron/parallel/fsdp/flat_shards.py's buckets). It
    then sets `weight.grad_added_to_main_grad = True` and returns a placeholder gradient, so the buffers'
    post-accumulate-grad hook still fires (it counts finished parameters to start overlapped all-reduces) but only
    frees it. Norm weights and biases come back as ordinary gradients that the hook adds.
  * FP8 weight casts once per optimizer step instead of once per micro-batch (`is_first_microbatch`, see
    `TETransformerLayer._first_microbatch`), under FSDP's optim_grads too (`keep_weight_casts_under_fsdp2`).

transformer_engine is imported inside functions only: importing this module on a CPU machine is harmless.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.fp8.te_recipe import describe_te_recipe, te_version
from megatron.parallel.tensor_parallel import NO_TP, TensorParallel

from .recompute import RecomputePlan, checkpoint, in_checkpointed_forward
from .te_attention import TESelfAttention
from .te_fp8 import TEFp8Autocast, te_checkpoint
from .te_linear import te_norm_input
from .te_mlp import TEMLP


class TETransformerLayer(nn.Module):
    """x + drop(attn(norm(x))), then + drop(mlp(norm(.))), under this layer's FP8 autocast (if FP8 is on)."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_number: int,
        params_dtype: torch.dtype | None = None,
        fp8: TEFp8Autocast | None = None,
        tp: TensorParallel = NO_TP,
    ):
        super().__init__()
        params_dtype = params_dtype or torch.float32
        # Built inside DeferredInit's meta-device context (--init-model-with-meta-device): TE allocates nothing, and
        # FSDP gives the weights storage and values shard by shard (model/meta_init.py)
        meta = torch.get_default_device().type == "meta"
        device = torch.device("meta") if meta else torch.device("cuda", torch.cuda.current_device())
        self.layer_number = layer_number  # 1-based, global across pipeline stages
        self.self_attention = TESelfAttention(cfg, layer_number, params_dtype, device, tp)
        self.mlp = TEMLP(cfg, params_dtype, device, tp)
        self.hidden_dropout = cfg.hidden_dropout
        self.gradient_accumulation_fusion = cfg.gradient_accumulation_fusion
        self.fp8 = fp8
        self.set_recompute(RecomputePlan.from_config(cfg))
        self._weights_version: int | None = None
        # Keep each step's FP8 weight casts for its later micro-batches (off under FSDP's optim_grads_params: a cast of
        # every weight kept for the whole step would be an unsharded copy of the model, megatron/parallel/fsdp/fsdp2.py;
        # kept under optim_grads, `keep_weight_casts_under_fsdp2`)
        self.cache_weight_casts = True
        self._graphed: Callable[..., torch.Tensor] | None = None  # see `use_graph`

    def set_recompute(self, plan: RecomputePlan) -> None:
        """Switch the selective recomputation inside this layer as `plan` says (core_attn, mlp; TE's norms run
        inside its LayerNormLinear, with nothing of their own to recompute)."""
        self.self_attention.recompute_core_attn = plan.selective("core_attn")
        self.recompute_mlp = plan.selective("mlp")

    def te_modules(self) -> tuple[nn.Module, ...]:
        """The TE modules holding this layer's linear weights."""
        return (
            self.self_attention.linear_qkv,
            self.self_attention.linear_proj,
            self.mlp.linear_fc1,
            self.mlp.linear_fc2,
        )

    fp8_gemm_input = staticmethod(te_norm_input)
    """fp8_gemm_input(module, x): what the forward GEMM of one of `te_modules()` casts to FP8 given its input x (the
    FP8 monitor's taps, megatron/fp8/te_monitor.py, count that tensor; the norm fused into TE's LayerNormLinear is
    the model's to know)."""

    def _first_microbatch(self) -> bool | None:
        """TE's `is_first_microbatch`: True when the weights changed since this layer's previous training forward,
        False while the micro-batches of one step reuse them, None outside training (no caching).

        Every in-place update (the optimizer copying main parameters back, a checkpoint load) bumps a tensor's
        version counter, so the weights' versions tell a new step from the next micro-batch without the trainer
        having to say so. With True TE casts each weight to FP8 and keeps the cast; with False it reuses it; and its
        fused wgrad GEMM writes the first micro-batch's gradient into main_grad instead of adding it (main_grad is
        zero then anyway)."""
        if not (self.training and (torch.is_grad_enabled() or in_checkpointed_forward())):
            return None  # (a recomputed layer's first forward runs without autograd, yet is a training forward)
        if not self.cache_weight_casts:
            return None
        version = sum(module.weight._version for module in self.te_modules())
        first = version != self._weights_version
        self._weights_version = version
        return first

    def forget_weight_casts(self) -> None:
        """Make the next training forward cast the weights again, as after an optimizer step (after a pass that
        cached no FP8 weight casts: delayed scaling's calibration, megatron/fp8/calibration.py; under FSDP whenever
        it gathers the weights anew, megatron/parallel/fsdp/fsdp2.py)."""
        self._weights_version = None

    def keep_weight_casts_under_fsdp2(self) -> None:
        """Let TE keep each step's FP8 weight casts for its later micro-batches although FSDP2 holds the weights, as
        without FSDP: for FSDP's optim_grads, which keeps the gathered weights unchanged from a step's first forward
        to its last backward. Call it after `fully_shard`. FSDP2 preserves the gathered weights' version counters
        across all-gathers, so the caller must `forget_weight_casts` whenever it gathers them anew."""
        for module in self.te_modules():
            _treat_as_unsharded(module)
        self.cache_weight_casts = True
        self._weights_version = None

    def _sync_wgrad_fusion(self) -> None:
        """Fuse wgrad accumulation into main_grad exactly for the weights that have one (see the module docstring):
        a model used without gradient buffers (tests, inference) keeps ordinary `.grad`s."""
        for module in self.te_modules():
            fuse = hasattr(module.weight, "main_grad") and self.gradient_accumulation_fusion
            smoothed = getattr(module, "smooth_input", False)
            if smoothed:
                # a smoothed linear_fc2 multiplies W / s, not W: its wgrad reaches W's main_grad through autograd
                # (te_linear.smoothed_te_linear), fused there where it runs the kernels
                fuse = fuse and module.runs_kernels()
                module.smooth_wgrad_fusion = fuse
            module.fuse_wgrad_accumulation = fuse and not smoothed
            module.weight.fused_wgrad_accumulation = fuse  # for the gradient buffers' hook (data_parallel.py)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.hidden_dropout, self.training) if self.hidden_dropout > 0 else x

    def use_graph(self, graphed: Callable[..., torch.Tensor]) -> None:
        """Run training forwards (and so their backwards) through `graphed(x, *rotary, is_first_microbatch=...)`,
        this layer captured as a CUDA graph (megatron/model/cuda_graphs.py); evaluation stays eager."""
        self._graphed = graphed

    def forward(
        self, x: torch.Tensor, rotary: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        self._sync_wgrad_fusion()
        first = self._first_microbatch()
        with self.fp8.layer(self.layer_number) if self.fp8 is not None else contextlib.nullcontext():
            if self._graphed is not None and first is not None and attention_mask is None:
                # TE's replay reads `is_first_microbatch` to decide whether the FP8 weight casts run again.
                return self._graphed(x, *(() if rotary is None else (rotary,)), is_first_microbatch=first)
            return self._forward(x, rotary, attention_mask, first)

    def _forward(
        self, x: torch.Tensor, rotary: torch.Tensor | None, attention_mask: torch.Tensor | None, first: bool | None
    ) -> torch.Tensor:
        x = x + self._dropout(self.self_attention(x, rotary, attention_mask, first))
        mlp = checkpoint(self.mlp, x, first, runner=te_checkpoint) if self.recompute_mlp else self.mlp(x, first)
        return x + self._dropout(mlp)


def _treat_as_unsharded(module: nn.Module) -> None:
    """Make a TE linear held by FSDP2 take the path it takes without FSDP (the one place we override a private of
    Transformer Engine; read in TE 2.20.2's module/base.py, linear.py and layernorm_linear.py).

    TE's `is_fsdp2` (a property of `TransformerEngineBaseModule`) finds out at its first call whether an FSDP2 unit
    holds the module and keeps the answer in `_is_fsdp2`. Where True, Linear and LayerNormLinear (LayerNormMLP too)
    keep no FP8 weight cast whatever `is_first_microbatch` says, cast the weight row-wise only in forward, save no
    cast for backward and cast it again there, then clear that transpose (FSDP2 frees the gathered weight after each
    use, and a cast kept of every weight would be an unsharded FP8 copy of the model; NVIDIA/TransformerEngine's
    issues/2681 and issues/2717 on GitHub).
    Under optim_grads the gathered weights live for the whole step, so with `_is_fsdp2` False TE casts each weight
    once per step with its transpose (is_first_microbatch=True), keeps both in its `_fp8_workspaces` ("weight") and
    reuses them in every later forward and backward of the step (False), reading the weight's storage only when it
    casts: stale only if the weights change without a True, which the caller's `forget_weight_casts` prevents. The
    cast is TE's own tensor, never FSDP's storage, so FSDP freeing and re-gathering the weight leaves it intact.
    Fails loudly where TE no longer answers through `_is_fsdp2`, rather than quietly casting at every GEMM."""
    prop = getattr(type(module), "is_fsdp2", None)
    if not isinstance(prop, property):
        raise RuntimeError(
            f"Transformer Engine {te_version()} has no `is_fsdp2` property on {type(module).__name__}: FSDP's"
            " optim_grads cannot keep its FP8 weight casts (read for TE 2.20; update megatron/model/te_layers.py)"
        )
    module._is_fsdp2 = False
    if module.is_fsdp2:
        raise RuntimeError(
            f"Transformer Engine {te_version()} ignores `_is_fsdp2` on {type(module).__name__}: FSDP's optim_grads"
            " cannot keep its FP8 weight casts (read for TE 2.20; update megatron/model/te_layers.py)"
        )


def te_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, tp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Per-token loss [b, s] (fp32) from logits [s, b, V/tp] (this rank's vocabulary slice) and labels [b, s] with
    TE's fused kernel: it reads the bf16 logits once and writes the gradient into their storage in backward, where
    the plain path materializes fp32 copies of the logits (V floats per token) for log-softmax and for its gradient.
    Over a tensor-parallel group it exchanges only per-token maxima and sums, as vocab-parallel cross-entropy does."""
    import transformer_engine.pytorch as te

    loss = te.parallel_cross_entropy(
        logits, labels.t().contiguous(), dist_process_group=tp_group, overwrite_input=True
    )  # [s, b]
    return loss.t()


def describe_te(model: nn.Module) -> list[str]:
    """Startup log lines for a GPT model with TE layers."""
    lines = [
        f"transformer layers: Transformer Engine {te_version()} (fused norm+GEMM, fused attention, fused RoPE and"
        " SwiGLU, wgrad GEMMs accumulating into fp32 main_grad where gradient buffers provide one)"
    ]
    fp8 = getattr(model, "te_fp8", None)
    if fp8 is not None:
        stage = {layer.layer_number for layer in model.decoder.layers}  # this pipeline stage's layers
        lines.append(describe_te_recipe(fp8.recipe, fp8.fp8_layers & stage, len(stage), fp8.kept_reason))
    return lines
