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
  * RoPE by TE's fused kernel, applied to strided views of the QKV GEMM's output: no split copies.
  * SwiGLU as one TE kernel each way.
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

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig, PrecisionConfig
from megatron.config.base import require
from megatron.fp8.te_recipe import (
    check_te_fp8_on_this_gpu,
    check_te_recipe_name,
    describe_te_recipe,
    require_te,
    te_fp8_layer_numbers,
    te_recipe,
    te_version,
)

from .layers import apply_rotary, init_std_of_output


def _te() -> Any:
    import transformer_engine.pytorch as te

    return te


def cpu_normal_init(std: float) -> Callable[[torch.Tensor], None]:
    """A TE `init_method` that draws N(0, std) from the CPU generator in fp32 and copies it to the (GPU) weight.

    The local model draws each weight the same way, in the same order (linear_qkv, linear_proj, linear_fc1,
    linear_fc2 of layer 1, then layer 2, ...), so with the same seed both implementations start from identical
    weights, and a TE run reproduces a local run's start."""

    def init(weight: torch.Tensor) -> None:
        with torch.no_grad():
            weight.copy_(torch.empty(weight.shape, dtype=torch.float32).normal_(0.0, std))

    return init


class TEFp8Autocast:
    """FP8 regions for the TE layers: one TE recipe and one amax-reduction group for the whole stack.

    GPTModel enters `stack()` around all transformer layers, and each layer enters `layer(n)`, enabled or not
    (--first-last-layers-bf16). The nesting keeps delayed scaling right: TE reduces (MAX over the group) and
    updates the amax histories of *every* module it has seen when the outermost autocast exits (and, in backward,
    after the first FP8 module of that region), so one reduction per micro-batch covers all FP8 layers. Separate
    top-level autocasts per layer, Megatron-LM's scheme and the reason it rejects this flag with delayed scaling,
    would run that reduction at every layer's exit: L collectives per pass, each rolling all histories once more.
    """

    def __init__(self, recipe: Any, amax_group: dist.ProcessGroup | None, fp8_layers: set[int]):
        self.recipe, self.amax_group, self.fp8_layers = recipe, amax_group, fp8_layers

    def stack(self) -> Any:
        return _te().autocast(enabled=True, recipe=self.recipe, amax_reduction_group=self.amax_group)

    def layer(self, layer_number: int) -> Any:
        return _te().autocast(
            enabled=layer_number in self.fp8_layers, recipe=self.recipe, amax_reduction_group=self.amax_group
        )


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up over x = [gate; up] (last dimension), with TE's fused forward and backward kernels (TE's gated
    activations gate the first half, as Megatron-Core and the local MLP do)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        import transformer_engine_torch as tex

        ctx.save_for_backward(x)
        return tex.swiglu(x, None)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        import transformer_engine_torch as tex

        (x,) = ctx.saved_tensors
        return tex.dswiglu(grad.contiguous(), x, None)


class TESelfAttention(nn.Module):
    """Causal grouped-query attention; linear_qkv's output is laid out per query group as in the local layer."""

    def __init__(self, cfg: ModelConfig, layer_number: int, params_dtype: torch.dtype, device: torch.device):
        super().__init__()
        te = _te()
        self.num_heads, self.num_groups, self.head_dim = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
        qkv_size = (self.num_heads + 2 * self.num_groups) * self.head_dim
        self.linear_qkv = te.LayerNormLinear(
            cfg.hidden_size,
            qkv_size,
            eps=cfg.norm_epsilon,
            bias=cfg.add_bias,
            normalization=cfg.normalization,
            init_method=cpu_normal_init(cfg.init_method_std),
            params_dtype=params_dtype,
            device=device,
        )
        self.core_attention = te.DotProductAttention(
            self.num_heads,
            self.head_dim,
            num_gqa_groups=self.num_groups,
            attention_dropout=cfg.attention_dropout,
            qkv_format="sbhd",
            attn_mask_type="causal",
            layer_number=layer_number,
        )
        from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb

        self._rope = apply_rotary_pos_emb
        self.linear_proj = te.Linear(
            self.num_heads * self.head_dim,
            cfg.hidden_size,
            bias=cfg.add_bias,
            init_method=cpu_normal_init(init_std_of_output(cfg)),
            params_dtype=params_dtype,
            device=device,
        )

    def forward(
        self,
        x: torch.Tensor,
        rotary: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        first_microbatch: bool | None,
    ) -> torch.Tensor:
        s, b, _ = x.shape
        groups, per_group, hn = self.num_groups, self.num_heads // self.num_groups, self.head_dim
        mixed = self.linear_qkv(x, is_first_microbatch=first_microbatch)
        # [s, b, ng * (np/ng + 2) * hn] -> [s, b*ng, (np/ng + 2) * hn]: batch and group merge into one strided dim,
        # so q, k and v below are 4-D views with uniform strides that TE's RoPE kernel reads in place.
        mixed = mixed.view(s, b * groups, (per_group + 2) * hn)
        q, k, v = mixed.split([per_group * hn, hn, hn], dim=-1)
        q = q.unflatten(-1, (per_group, hn))  # [s, b*ng, np/ng, hn]
        k, v = k.unflatten(1, (b, groups)), v.unflatten(1, (b, groups))  # [s, b, ng, hn]
        if rotary is not None and rotary.shape[1] == 1:
            q = self._rope(q, rotary, tensor_format="sbhd", fused=True)
            k = self._rope(k, rotary, tensor_format="sbhd", fused=True)
        q = q.reshape(s, b, self.num_heads, hn)  # a view after RoPE (its output is contiguous), else one copy
        if rotary is not None and rotary.shape[1] != 1:  # per-sample positions: TE's kernel takes [s, 1, 1, d]
            q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)
        if attention_mask is None:
            out = self.core_attention(q, k, v)  # [s, b, np * hn]
        else:  # TE masks where the mask is True; ours marks where a query may attend
            out = self.core_attention(q, k, v, attention_mask=~attention_mask, attn_mask_type="arbitrary")
        return self.linear_proj(out, is_first_microbatch=first_microbatch)


class TEMLP(nn.Module):
    """h -> ffn -> h with GELU, or SwiGLU (linear_fc1 outputs [gate; up], 2*ffn wide)."""

    def __init__(self, cfg: ModelConfig, params_dtype: torch.dtype, device: torch.device):
        super().__init__()
        te = _te()
        self.swiglu = cfg.swiglu
        fc1_out = 2 * cfg.ffn_hidden_size if cfg.swiglu else cfg.ffn_hidden_size
        self.linear_fc1 = te.LayerNormLinear(
            cfg.hidden_size,
            fc1_out,
            eps=cfg.norm_epsilon,
            bias=cfg.add_bias,
            normalization=cfg.normalization,
            init_method=cpu_normal_init(cfg.init_method_std),
            params_dtype=params_dtype,
            device=device,
        )
        self.linear_fc2 = te.Linear(
            cfg.ffn_hidden_size,
            cfg.hidden_size,
            bias=cfg.add_bias,
            init_method=cpu_normal_init(init_std_of_output(cfg)),
            params_dtype=params_dtype,
            device=device,
        )

    def forward(self, x: torch.Tensor, first_microbatch: bool | None) -> torch.Tensor:
        h = self.linear_fc1(x, is_first_microbatch=first_microbatch)
        h = _SwiGLU.apply(h) if self.swiglu else F.gelu(h)
        return self.linear_fc2(h, is_first_microbatch=first_microbatch)


class TETransformerLayer(nn.Module):
    """x + drop(attn(norm(x))), then + drop(mlp(norm(.))), under this layer's FP8 autocast (if FP8 is on)."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_number: int,
        params_dtype: torch.dtype | None = None,
        fp8: TEFp8Autocast | None = None,
    ):
        super().__init__()
        params_dtype = params_dtype or torch.float32
        device = torch.device("cuda", torch.cuda.current_device())
        self.layer_number = layer_number  # 1-based, global across pipeline stages
        self.self_attention = TESelfAttention(cfg, layer_number, params_dtype, device)
        self.mlp = TEMLP(cfg, params_dtype, device)
        self.hidden_dropout = cfg.hidden_dropout
        self.fp8 = fp8
        self._weights_version: int | None = None

    def linears(self) -> tuple[nn.Module, ...]:
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
        if not (self.training and torch.is_grad_enabled()):
            return None
        version = sum(linear.weight._version for linear in self.linears())
        first = version != self._weights_version
        self._weights_version = version
        return first

    def _sync_wgrad_fusion(self) -> None:
        """Fuse wgrad accumulation into main_grad exactly for the weights that have one (see the module docstring):
        a model used without gradient buffers (tests, inference) keeps ordinary `.grad`s."""
        for linear in self.linears():
            fuse = hasattr(linear.weight, "main_grad")
            if linear.fuse_wgrad_accumulation != fuse:
                linear.fuse_wgrad_accumulation = fuse

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.hidden_dropout, self.training) if self.hidden_dropout > 0 else x

    def forward(
        self, x: torch.Tensor, rotary: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        self._sync_wgrad_fusion()
        first = self._first_microbatch()
        if self.fp8 is None:
            return self._forward(x, rotary, attention_mask, first)
        with self.fp8.layer(self.layer_number):
            return self._forward(x, rotary, attention_mask, first)

    def _forward(
        self, x: torch.Tensor, rotary: torch.Tensor | None, attention_mask: torch.Tensor | None, first: bool | None
    ) -> torch.Tensor:
        x = x + self._dropout(self.self_attention(x, rotary, attention_mask, first))
        return x + self._dropout(self.mlp(x, first))


def te_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token loss [b, s] (fp32) from logits [s, b, V] and labels [b, s] with TE's fused kernel: it reads the bf16
    logits once and writes the gradient into their storage in backward, where the plain path materializes fp32
    copies of the logits (V floats per token) for log-softmax and for its gradient."""
    loss = _te().parallel_cross_entropy(logits, labels.t().contiguous(), overwrite_input=True)  # [s, b]
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
    fp8_layers = te_fp8_layer_numbers(cfg.num_layers, precision)
    require(bool(fp8_layers), "FP8 is on but no transformer layer is left in FP8; lower --num-layers-at-*-in-bf16")
    return TEFp8Autocast(te_recipe(precision), amax_group, fp8_layers)


def describe_te(model: nn.Module) -> list[str]:
    """Startup log lines for a GPT model with TE layers."""
    lines = [
        f"transformer layers: Transformer Engine {te_version()} (fused norm+GEMM, fused attention, fused RoPE and"
        " SwiGLU, wgrad GEMMs accumulating into fp32 main_grad where gradient buffers provide one)"
    ]
    fp8 = getattr(model, "te_fp8", None)
    if fp8 is not None:
        lines.append(describe_te_recipe(fp8.recipe, fp8.fp8_layers, len(model.decoder.layers)))
    return lines
