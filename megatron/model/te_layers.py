"""The transformer layer built from Transformer Engine modules (`--transformer-impl transformer_engine`).

Module tree and parameter names are the local layer's (transformer.py), so each implementation loads the other's
checkpoints:

    self_attention.linear_qkv      te.LayerNormLinear      input norm fused into the QKV GEMM (layer_norm_weight)
    self_attention.core_attention  te.DotProductAttention  fused attention (cuDNN / flash); no parameters
    self_attention.linear_proj     te.Linear
    mlp.linear_fc1                 te.LayerNormLinear      pre-MLP norm fused in; rows [gate; up] for SwiGLU
    mlp.linear_fc2                 te.Linear

TE adds one `_extra_state` entry per TE module (its FP8 scaling state); GPTModel reconciles those when loading.

What this layer does that the local one does not, and why:
  * FP8 GEMMs through `te.autocast` (TEFp8Autocast) with the recipe built in megatron/fp8/te_recipe.py.
  * RoPE by TE's fused QKV kernel on the QKV GEMM's packed output: no split copies, no concatenation in backward.
  * SwiGLU as one TE kernel each way; under delayed scaling those kernels write the FP8 operands of the MLP's
    linears directly (`_SwiGLU`).
  * with --fp8-param-gather, FP8-only weights (TE's quantized parameters; see `TEFp8Autocast.param_init`).
  * fused wgrad accumulation: when a weight carries the fp32 `main_grad` of `megatron.parallel.GradientBuffers`,
    TE's weight-gradient GEMM accumulates into it in place (fp32 output, no bf16 gradient, no separate add). It
    then sets `weight.grad_added_to_main_grad = True` and returns a placeholder gradient, so the buffers'
    post-accumulate-grad hook still fires (it counts finished parameters to start overlapped all-reduces) but only
    frees it. Norm weights and biases come back as ordinary gradients that the hook adds.
  * FP8 weight casts once per optimizer step instead of once per micro-batch (`is_first_microbatch`, see
    `TETransformerLayer._first_microbatch`).

transformer_engine is imported inside functions only: importing this module on a CPU machine is harmless.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig, PrecisionConfig
from megatron.config.base import require
from megatron.config.te_rules import check_te_recipe_name, require_te
from megatron.errors import UserError
from megatron.fp8.te_recipe import (
    check_fp8_attention_on_gpu,
    check_te_fp8_on_this_gpu,
    describe_te_recipe,
    te_recipe,
    te_version,
)
from megatron.parallel.tensor_parallel import NO_TP, TensorParallel

from .attention import CoreAttention
from .layers import apply_rotary, init_std_of_output, mark_replicated, mlp_activation
from .recompute import RecomputePlan, checkpoint, in_checkpointed_forward
from .transformer import qk_norms


def _te() -> Any:
    import transformer_engine.pytorch as te

    return te


def sharded_normal_init(std: float, tp: TensorParallel, dim: int, parts: int = 1) -> Callable[[torch.Tensor], None]:
    """A TE `init_method` for a weight that is this rank's tensor-parallel shard along `dim`: draw the full matrix
    N(0, std) from the CPU generator in fp32, as the local `Linear` does, and copy this rank's slice (`parts`: stacked
    matrices sliced separately, 2 for SwiGLU's [gate; up]) to the (GPU) weight.

    TE calls each module's init in construction order (linear_qkv, linear_proj, linear_fc1, linear_fc2), the order
    the local layer draws in, so with the same seed both implementations, under any layout, start from identical
    weights."""

    def init(weight: torch.Tensor) -> None:
        shape = list(weight.shape)
        shape[dim] *= tp.size
        full = torch.empty(shape, dtype=torch.float32).normal_(0.0, std)
        with torch.no_grad():
            weight.copy_(tp.shard(full, dim, parts))

    return init


def te_linear(
    cfg: ModelConfig,
    in_features: int,
    out_features: int,
    parallel_mode: str,
    std: float,
    tp: TensorParallel,
    params_dtype: torch.dtype,
    device: torch.device,
    *,
    norm: bool = False,
    parts: int = 1,
    ub_name: str,
) -> nn.Module:
    """A TE linear of the layer: `te.LayerNormLinear` (norm=True: the layer's input norm fused in; linear_qkv,
    linear_fc1) or `te.Linear`, column- or row-parallel over `tp` through TE's own arguments (TE all-gathers and
    reduce-scatters along the sequence with --sequence-parallel, as the local layers do).

    `parts`: stacked matrices sharded separately (2 for SwiGLU's [gate; up]), see `mark_te_params`. `ub_name`: the
    GEMM's name among TE's userbuffers ("qkv", "proj", "fc1", "fc2"); with --tp-comm-overlap the column-parallel
    linears gather their input inside the forward GEMM and overlap their backward's all-gather and reduce-scatter
    with the dgrad and wgrad GEMMs (bulk), and the row-parallel ones reduce-scatter inside the forward GEMM and
    gather the output gradient inside the dgrad GEMM (Megatron-LM's defaults)."""
    te = _te()
    column = parallel_mode == "column"
    overlap = (
        dict(ub_name=ub_name, ub_overlap_ag=True, ub_overlap_rs=not column, ub_bulk_dgrad=column, ub_bulk_wgrad=column)
        if tp.comm_overlap
        else {}
    )
    common: dict[str, Any] = dict(
        bias=cfg.add_bias,
        init_method=sharded_normal_init(std, tp, 0 if column else 1, parts),
        params_dtype=params_dtype,
        device=device,
        parallel_mode=parallel_mode,
        tp_group=tp.group,
        tp_size=tp.size,
        sequence_parallel=tp.sequence_parallel,
        **overlap,
    )
    if norm:
        module = te.LayerNormLinear(
            in_features,
            out_features,
            eps=cfg.norm_epsilon,
            normalization=cfg.normalization,
            zero_centered_gamma=cfg.apply_layernorm_1p,
            **common,
        )
    else:
        module = te.Linear(in_features, out_features, **common)
    mark_te_params(module, tp, parts)
    return module


def mark_te_params(module: nn.Module, tp: TensorParallel, parts: int = 1) -> None:
    """TE marks its sharded parameters (`tensor_model_parallel`, `partition_dim`) and its sequence-parallel ones;
    add what the local layers record: `partition_parts` on column-parallel shards and the replicated marking on the
    rest (norm weights, row-parallel biases), so the gradient norm counts those once (megatron.parallel.grads)."""
    for param in module.parameters():
        if getattr(param, "tensor_model_parallel", False):
            param.partition_parts = parts if param.partition_dim == 0 else 1
        else:
            mark_replicated(param, tp)


class TEFp8Autocast:
    """FP8 regions for the TE layers: one TE recipe and one amax-reduction group for the whole stack.

    GPTModel enters `stack()` around all transformer layers, and each layer enters `layer(n)`, enabled or not
    (--first-last-layers-bf16). The nesting keeps delayed scaling right: TE reduces (MAX over the group) and
    updates the amax histories of *every* module it has seen when the outermost autocast exits (and, in backward,
    after the first FP8 module of that region), so one reduction per micro-batch covers all FP8 layers. Separate
    top-level autocasts per layer, Megatron-LM's scheme and the reason it rejects this flag with delayed scaling,
    would run that reduction at every layer's exit: L collectives per pass, each rolling all histories once more.
    """

    def __init__(
        self,
        recipe: Any,
        amax_group: dist.ProcessGroup | None,
        fp8_layers: set[int],
        fp8_params: bool = False,
        kept_reason: str = "",
    ):
        self.recipe, self.amax_group, self.fp8_layers = recipe, amax_group, fp8_layers
        self.kept_reason = kept_reason
        """Why the layers not in `fp8_layers` are kept out of FP8 (for the startup log)."""
        self.fp8_params = fp8_params
        """--fp8-param-gather: the FP8 layers' weights are built as TE quantized tensors (see `param_init`)."""
        self.calibrating = False
        """Delayed scaling's calibration pass (megatron/fp8/calibration.py): TE runs the FP8 layers in high precision
        and sets up their FP8 state (`calibrating=True`) without casting anything."""

    def param_init(self, layer_number: int) -> Any:
        """The context a layer is built in: with --fp8-param-gather and the layer in FP8, TE creates its linear
        weights as FP8 tensors of this recipe (`quantized_model_init`); each keeps its high-precision initial value
        on the CPU until the optimizer has taken it as its fp32 main parameter (`get_high_precision_init_val`)."""
        enabled = self.fp8_params and layer_number in self.fp8_layers
        return _te().quantized_model_init(enabled=enabled, recipe=self.recipe, preserve_high_precision_init_val=enabled)

    def stack(self) -> Any:
        return self._autocast(True)

    def layer(self, layer_number: int) -> Any:
        """`fp8_layers` is live: the FP8 guard (megatron/fp8/guard.py) removes layers it moves to bf16."""
        return _keeping_the_mark(self._autocast(layer_number in self.fp8_layers))

    def update_backward_amaxes_at(self, x: torch.Tensor) -> None:
        """Inside `stack()`, before the stage's layers run on `x` (their input), with recomputation: take TE's
        first-module mark from every module and reduce and update the backward amaxes once `x`'s gradient is formed,
        after the last FP8 backward of the stage, which is where the first FP8 module's backward does it without
        recomputation. A reentrant checkpoint runs its first forward without autograd, so a checkpointed module
        cannot keep the mark for backward; TE queues the mark at each region's entry in forward order but hands the
        queue out to the recomputations in reverse order, and while recomputing leaves it set for every module of
        the region: the update would run early, several times per backward, and (with some layers recomputed and
        some not) out of step with the modules' amaxes."""
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        state = FP8GlobalStateManager.quantization_state
        if not (state.is_first_fp8_module and FP8GlobalStateManager.is_fp8_enabled() and x.requires_grad):
            return
        state.is_first_fp8_module = False
        x.register_hook(_reduce_and_update_backward_amaxes)

    def _autocast(self, fp8: bool) -> Any:
        calibrating = fp8 and self.calibrating
        return _te().autocast(
            enabled=fp8 and not calibrating,
            calibrating=calibrating,
            recipe=self.recipe,
            amax_reduction_group=self.amax_group,
        )


class TESelfAttention(nn.Module):
    """Causal grouped-query attention; linear_qkv's output is laid out per query group as in the local layer."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_number: int,
        params_dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallel = NO_TP,
    ):
        super().__init__()
        te = _te()
        # This rank's heads and query groups (tensor parallelism splits whole groups, as in the local layer).
        self.num_heads, self.num_groups = cfg.num_attention_heads // tp.size, cfg.num_query_groups // tp.size
        self.head_dim = cfg.kv_channels
        qkv_size = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * self.head_dim
        self.linear_qkv = te_linear(
            cfg, cfg.hidden_size, qkv_size, "column", cfg.init_method_std, tp, params_dtype, device, norm=True,
            ub_name="qkv",
        )  # fmt: skip
        norms = qk_norms(cfg, params_dtype, tp)
        if norms is not None:
            self.q_layernorm, self.k_layernorm = (norm.to(device) for norm in norms)
        # Fused RoPE on the packed QKV output, unless the q/k norms must see q and k first.
        self.fused_rope = cfg.apply_rope_fusion and not cfg.qk_layernorm
        self.te_attention = cfg.attention_backend != "local"
        self.attention_backend = cfg.attention_backend
        if self.te_attention:
            # TE's unfused backend reads NVTE_APPLY_QK_LAYER_SCALING when the module is built (and applies it to fp16
            # inputs only); set it for this construction, not for the process.
            with _environ(NVTE_APPLY_QK_LAYER_SCALING="1" if cfg.apply_query_key_layer_scaling else "0"):
                self.core_attention = te.DotProductAttention(
                    cfg.num_attention_heads,  # TE takes the totals and divides by the tensor-parallel size
                    self.head_dim,
                    num_gqa_groups=cfg.num_query_groups,
                    attention_dropout=cfg.attention_dropout,
                    qkv_format="sbhd",
                    attn_mask_type="causal",
                    layer_number=layer_number,
                    tp_group=tp.group,
                    tp_size=tp.size,
                    sequence_parallel=tp.sequence_parallel,
                )
        else:  # --attention-backend local: this project's PyTorch attention between TE's linears
            self.core_attention = CoreAttention(cfg, layer_number)
        self.recompute_core_attn = False  # --recompute-modules core_attn (set by TETransformerLayer)
        from transformer_engine.pytorch.attention.rope import apply_fused_qkv_rotary_pos_emb

        self._qkv_rope = apply_fused_qkv_rotary_pos_emb
        self.linear_proj = te_linear(
            cfg, cfg.num_attention_heads * self.head_dim, cfg.hidden_size, "row", init_std_of_output(cfg), tp,
            params_dtype, device, ub_name="proj",
        )  # fmt: skip

    def forward(
        self,
        x: torch.Tensor,
        rotary: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        first_microbatch: bool | None,
    ) -> torch.Tensor:
        groups, per_group, hn = self.num_groups, self.num_heads // self.num_groups, self.head_dim
        mixed = self.linear_qkv(x, is_first_microbatch=first_microbatch)
        s, b = mixed.shape[:2]  # the full sequence, also when x is a sequence-parallel shard
        if rotary is not None and rotary.shape[1] == 1 and self.fused_rope:
            # One TE kernel each way: RoPE on q and k of the packed output, q, k and v written out contiguous
            # ([s, b, np, hn], [s, b, ng, hn] x 2); its backward writes the packed gradient directly, where
            # separate RoPE calls on views of `mixed` end in a concatenation of the three gradients.
            packed = mixed.view(s, b, groups, (per_group + 2) * hn)
            q, k, v = self._qkv_rope(packed, rotary, rotary, [per_group * hn, hn, hn], tensor_format="sbhd")
        else:
            # [s, b, ng * (np/ng + 2) * hn] -> [s, b, ng, (np/ng + 2) * hn] -> q, k, v views
            q, k, v = mixed.view(s, b, groups, (per_group + 2) * hn).split([per_group * hn, hn, hn], dim=-1)
            q = q.reshape(s, b, self.num_heads, hn)  # one copy (q is strided within each group's row)
            if hasattr(self, "q_layernorm"):
                q, k = self.q_layernorm(q), self.k_layernorm(k)
            if rotary is not None:  # per-sample positions (TE's kernels take [s, 1, 1, d] angles only) or unfused
                q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)
        if not self.te_attention:
            q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
            if self.recompute_core_attn:  # no TE module inside: this project's checkpoint
                out = checkpoint(self.core_attention, q, k, v, attention_mask)
            else:
                out = self.core_attention(q, k, v, attention_mask)  # [b, np, s, hn]
            out = out.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * hn)
        elif self.recompute_core_attn:  # TE's checkpoint: its RNG and FP8 (attention) handling
            out = checkpoint(self._te_attention_masked, q, k, v, attention_mask, te=True)
        else:
            out = self._te_attention_masked(q, k, v, attention_mask)  # [s, b, np * hn]
        return self.linear_proj(out, is_first_microbatch=first_microbatch)

    def _te_attention_masked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        if attention_mask is None:
            return self._te_attention(q, k, v)
        # TE masks where the mask is True; ours marks where a query may attend
        return self._te_attention(q, k, v, attention_mask=~attention_mask, attn_mask_type="arbitrary")

    def _te_attention(self, *args, **kwargs) -> torch.Tensor:
        try:
            return self.core_attention(*args, **kwargs)
        except ValueError as exc:  # TE found no backend among those --attention-backend allows
            if "No dot product attention backend is available" not in str(exc):
                raise
            raise UserError(
                f"--attention-backend {self.attention_backend}: Transformer Engine has no such attention kernel for"
                f" these inputs on this GPU (flash needs the flash-attn package); use --attention-backend auto"
            ) from None


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up over x = [gate; up] (last dimension), with TE's fused forward and backward kernels (TE's gated
    activations gate the first half, as Megatron-Core and the local MLP do).

    Given TE quantizers (see `TEMLP._fp8_quantizers`), the kernels write FP8 directly: the forward linear_fc2's input,
    the backward linear_fc1's output gradient. Those TE modules then take the FP8 tensors as they are instead of
    reading a bf16 tensor back to cast it (a bf16 write and read of each tensor saved)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_quantizer: Any, grad_quantizer: Any) -> torch.Tensor:
        import transformer_engine_torch as tex

        ctx.save_for_backward(x)
        ctx.grad_quantizer = grad_quantizer
        return tex.swiglu(x, out_quantizer)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        import transformer_engine_torch as tex

        (x,) = ctx.saved_tensors
        return tex.dswiglu(grad.contiguous(), x, ctx.grad_quantizer), None, None


class TEMLP(nn.Module):
    """h -> ffn -> h with GELU, or SwiGLU (linear_fc1 outputs [gate; up], 2*ffn wide).

    Not `te.LayerNormMLP`: measured on an H100 (llama-1b, FP8 delayed) it ran the same kernel time (685-688 against
    688-690 ms per step), because on Hopper it runs dSwiGLU and the FP8 cast of its output as two kernels, which
    `_SwiGLU` fuses here, and it would need its parameter names (fc1_weight, ...) mapped to these keys."""

    def __init__(self, cfg: ModelConfig, params_dtype: torch.dtype, device: torch.device, tp: TensorParallel = NO_TP):
        super().__init__()
        self.swiglu, self.activation = cfg.swiglu, mlp_activation(cfg)
        self.fp8_swiglu = True
        """Let `_SwiGLU` write FP8 under delayed scaling; the FP8 monitor turns it off on the steps it watches, so
        that TE casts (and the monitor sees) the high-precision activation and gradient."""
        fc1_out = 2 * cfg.ffn_hidden_size if cfg.swiglu else cfg.ffn_hidden_size
        self.linear_fc1 = te_linear(
            cfg, cfg.hidden_size, fc1_out, "column", cfg.init_method_std, tp, params_dtype, device, norm=True,
            parts=2 if cfg.swiglu else 1, ub_name="fc1",
        )  # fmt: skip
        self.linear_fc2 = te_linear(
            cfg, cfg.ffn_hidden_size, cfg.hidden_size, "row", init_std_of_output(cfg), tp, params_dtype, device,
            ub_name="fc2",
        )  # fmt: skip

    def _fp8_quantizers(self) -> tuple[Any, Any]:
        """(linear_fc2's input quantizer, linear_fc1's output-gradient quantizer) for `_SwiGLU` to quantize with, or
        (None, None) for bf16 outputs.

        Only under delayed scaling: its per-tensor scales are known before the kernel runs (they come from the amax
        history), and the kernel records the amax into the same history the TE module would have. Current scaling
        needs the whole tensor's amax before it can scale, and TE casts Hopper's blockwise recipe separately; MXFP8
        (Blackwell) could take this path too but is left on TE's own cast until it can be tested on such a GPU. The
        quantizers are shallow copies of the modules' own: they share the scale and amax tensors TE quantizes with."""
        from transformer_engine.pytorch.constants import FP8BwdTensorIdx, FP8FwdTensorIdx
        from transformer_engine.pytorch.distributed import in_fp8_activation_recompute_phase
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        if not (self.fp8_swiglu and FP8GlobalStateManager.is_fp8_enabled()):
            return None, None
        recipe = FP8GlobalStateManager.get_fp8_recipe()
        if not recipe.delayed():
            return None, None
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        # linear_fc2 sets up its FP8 state (scales, amax history, quantizers) at the start of its forward, which
        # has not run yet: do it now, so the very first micro-batch takes this path as every other one does
        # (TE's own forward then finds it done; the amaxes still join the reduction there).
        fc2.init_fp8_metadata()
        if not all(m.fp8_initialized and m.fp8_meta.get("recipe") == recipe for m in (fc1, fc2)):
            return None, None  # not expected: linear_fc1 ran under this recipe a moment ago
        out_quantizer = fc2.quantizers["scaling_fwd"][FP8FwdTensorIdx.GEMM1_INPUT].copy()
        if in_fp8_activation_recompute_phase():
            _first_forward_scale(out_quantizer, fc2, FP8FwdTensorIdx.GEMM1_INPUT)
        # Row-wise data only, as linear_fc2 keeps of an input it casts itself: its wgrad transposes it in backward.
        out_quantizer.set_usage(rowwise=True, columnwise=False)
        grad_quantizer = fc1.quantizers["scaling_bwd"][FP8BwdTensorIdx.GRAD_OUTPUT1].copy()
        grad_quantizer.set_usage(rowwise=True, columnwise=True)  # dgrad and wgrad GEMMs, as linear_fc1 asks for
        for quantizer in (out_quantizer, grad_quantizer):
            quantizer.internal = False  # torch.Tensor subclasses (Float8Tensor), which autograd passes along
        return out_quantizer, grad_quantizer

    def forward(self, x: torch.Tensor, first_microbatch: bool | None) -> torch.Tensor:
        # 2-D tokens x features through the MLP: TE's reshape of an FP8 tensor to 2-D drops its transpose, and
        # linear_fc1's backward reshapes its output gradient (FP8 from `_SwiGLU`) so.
        shape = x.shape
        h = self.linear_fc1(x.reshape(-1, shape[-1]), is_first_microbatch=first_microbatch)
        h = _SwiGLU.apply(h, *self._fp8_quantizers()) if self.swiglu else self.activation(h)
        out = self.linear_fc2(h, is_first_microbatch=first_microbatch)
        return out.view(*shape[:-1], out.shape[-1])


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
        device = torch.device("cuda", torch.cuda.current_device())
        self.layer_number = layer_number  # 1-based, global across pipeline stages
        self.self_attention = TESelfAttention(cfg, layer_number, params_dtype, device, tp)
        self.mlp = TEMLP(cfg, params_dtype, device, tp)
        self.hidden_dropout = cfg.hidden_dropout
        self.gradient_accumulation_fusion = cfg.gradient_accumulation_fusion
        self.fp8 = fp8
        plan = RecomputePlan.from_config(cfg)
        self.self_attention.recompute_core_attn = plan.selective("core_attn")
        self.recompute_mlp = plan.selective("mlp")
        self._weights_version: int | None = None
        self._graphed: Callable[..., torch.Tensor] | None = None  # see `use_graph`

    def te_modules(self) -> tuple[nn.Module, ...]:
        """The TE modules holding this layer's linear weights."""
        return (
            self.self_attention.linear_qkv,
            self.self_attention.linear_proj,
            self.mlp.linear_fc1,
            self.mlp.linear_fc2,
        )

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
        version = sum(module.weight._version for module in self.te_modules())
        first = version != self._weights_version
        self._weights_version = version
        return first

    def forget_weight_casts(self) -> None:
        """Make the next training forward cast the weights again, as after an optimizer step (after a pass that
        cached no FP8 weight casts: delayed scaling's calibration, megatron/fp8/calibration.py)."""
        self._weights_version = None

    def _sync_wgrad_fusion(self) -> None:
        """Fuse wgrad accumulation into main_grad exactly for the weights that have one (see the module docstring):
        a model used without gradient buffers (tests, inference) keeps ordinary `.grad`s."""
        for module in self.te_modules():
            fuse = hasattr(module.weight, "main_grad") and self.gradient_accumulation_fusion
            if module.fuse_wgrad_accumulation != fuse:
                module.fuse_wgrad_accumulation = fuse
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
        mlp = checkpoint(self.mlp, x, first, te=True) if self.recompute_mlp else self.mlp(x, first)
        return x + self._dropout(mlp)


def _first_forward_scale(quantizer: Any, module: nn.Module, index: int) -> None:
    """Point `quantizer` (a copy of one of `module`'s delayed-scaling quantizers) at the scale the first forward
    used, and at an amax of its own, for a kernel that writes `module`'s input during a recomputation.

    TE's checkpoint stashes each module's scales and amax history when the module's forward starts in the first
    forward, and swaps them in when the module's forward starts in the recomputation; a kernel that runs before
    the module (the fused SwiGLU writing linear_fc2's FP8 input) would otherwise quantize with the scales updated
    since, and record an amax that the next update would count a second time. The stash to be swapped in next is
    the oldest of the module's queue (TE pops it in order)."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    queue = FP8GlobalStateManager.quantization_state.fp8_tensors_recompute_buffer
    _, scale = queue[module.fp8_meta["global_fp8_buffer_pos_fwd_recompute"]][0]
    quantizer.scale = scale[index]
    quantizer.amax = torch.zeros(1, dtype=torch.float32, device=scale.device)


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """Set environment variables for the duration of the block, then restore them."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def te_checkpoint(function: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """function(*args) under TE's reentrant activation checkpoint (see megatron/model/recompute.py)."""
    from transformer_engine.pytorch.distributed import checkpoint

    return checkpoint(
        function, *args, distribute_saved_activations=False, use_reentrant=True, context_fn=_te_checkpoint_contexts
    )


def _reduce_and_update_backward_amaxes(grad: torch.Tensor) -> None:
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)


def _te_checkpoint_contexts() -> tuple[Any, Any]:
    """TE checkpoint's (forward, recompute) contexts: nothing around the first forward; one more level of FP8
    autocast nesting around the recomputation. TE's checkpoint runs the recomputation inside an autocast of its own,
    whose exit at the outermost level would reduce and update every module's forward amax history once more (in
    backward, with no new amaxes: an extra roll of the histories per checkpoint). Nested, it leaves that update to
    the model's own autocast, which runs it once per forward as without recomputation. (The backward update:
    `TEFp8Autocast.update_backward_amaxes_at`.)"""
    return contextlib.nullcontext(), _nested_te_autocast()


@contextlib.contextmanager
def _keeping_the_mark(autocast: Any) -> Iterator[None]:
    """A layer's FP8 autocast, nested in the stack's, that leaves TE's first-module mark as its body left it.

    Delayed scaling reduces and updates the backward amaxes at the end of the backward of the micro-batch's first
    FP8 module, which takes the mark (`is_first_fp8_module`) in forward. TE's autocast restores the whole FP8
    state on exit, mark included: after each layer the mark would be set again, the next layer's first FP8 module
    would take it too, and the backward would reduce (a collective over the amax group) and roll every backward
    amax history once per FP8 layer instead of once, where a graphed layer (which takes the mark whether in FP8 or
    not) or a recomputation updates once."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    state = FP8GlobalStateManager.quantization_state
    with autocast:
        yield
        mark = state.is_first_fp8_module
    state.is_first_fp8_module = mark


@contextlib.contextmanager
def _nested_te_autocast() -> Iterator[None]:
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    state = FP8GlobalStateManager.quantization_state
    state.autocast_depth += 1
    try:
        yield
    finally:
        state.autocast_depth -= 1


def te_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, tp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Per-token loss [b, s] (fp32) from logits [s, b, V/tp] (this rank's vocabulary slice) and labels [b, s] with
    TE's fused kernel: it reads the bf16 logits once and writes the gradient into their storage in backward, where
    the plain path materializes fp32 copies of the logits (V floats per token) for log-softmax and for its gradient.
    Over a tensor-parallel group it exchanges only per-token maxima and sums, as vocab-parallel cross-entropy does."""
    loss = _te().parallel_cross_entropy(
        logits, labels.t().contiguous(), dist_process_group=tp_group, overwrite_input=True
    )  # [s, b]
    return loss.t()


def build_te_fp8(
    cfg: ModelConfig, precision: PrecisionConfig | None, amax_group: dist.ProcessGroup | None
) -> TEFp8Autocast | None:
    """Check that TE and this GPU can run the configuration (ConfigError naming the flag otherwise), then build the
    FP8 autocast of the TE layers; None with FP8 off."""
    require_te()
    no_gpu = "--transformer-impl transformer_engine needs a CUDA GPU; use --transformer-impl local"
    require(torch.cuda.is_available(), no_gpu)
    if precision is None or not precision.fp8:
        return None
    check_te_recipe_name(precision)  # (shapes against TE's GEMM rules are checked when the flags are parsed)
    check_te_fp8_on_this_gpu(precision)
    if precision.fp8_dot_product_attention:
        check_fp8_attention_on_gpu(cfg.kv_channels, torch.cuda.get_device_capability(), torch.cuda.get_device_name())
    fp8_layers = set(precision.fp8_layer_numbers(cfg.num_layers))
    require(bool(fp8_layers), "FP8 is on but no transformer layer is left in FP8; lower --num-layers-at-*-in-bf16")
    recipe = te_recipe(precision)
    if amax_group is None and hasattr(recipe, "reduce_amax"):
        # Nothing to reduce with. TE would otherwise all-reduce the amaxes over the *world* group whenever
        # torch.distributed is up: across pipeline stages, whose layers and timing differ, that hangs.
        recipe.reduce_amax = False
    return TEFp8Autocast(recipe, amax_group, fp8_layers, precision.fp8_param_gather, precision.fp8_kept_layers_reason())


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
