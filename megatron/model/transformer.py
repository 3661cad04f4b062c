"""A pre-norm GPT transformer layer with Megatron-Core's module tree:

    layers.N.self_attention.linear_qkv   (input norm fused in: layer_norm_weight [, layer_norm_bias])
    layers.N.self_attention.linear_proj
    layers.N.mlp.linear_fc1              (pre-MLP norm fused in; gate and up stacked for SwiGLU)
    layers.N.mlp.linear_fc2

Activations are [s, b, h] (sequence first), as in Megatron-Core and TE; with --sequence-parallel the residual
stream between the tensor-parallel GEMMs is a sequence shard [s/tp, b, h].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.parallel.tensor_parallel import NO_TP, TensorParallel

from .attention import CoreAttention
from .layers import LayerNormLinear, Linear, apply_rotary, init_std_of_output, mlp_activation, qk_norms
from .recompute import RecomputePlan, checkpoint
from .rope_kernel import fused_qkv_rope, rope_path


def norm_column_linear(
    cfg: ModelConfig, out_features: int, dtype: torch.dtype | None, tp: TensorParallel, parts: int = 1
) -> LayerNormLinear:
    """The layer's input norm fused into a column-parallel linear from the residual stream (linear_qkv, linear_fc1)."""
    return LayerNormLinear(
        cfg.hidden_size,
        out_features,
        cfg.add_bias,
        cfg.init_method_std,
        cfg.normalization,
        cfg.norm_epsilon,
        dtype,
        zero_centered=cfg.apply_layernorm_1p,
        parallel_mode="column",
        tp=tp,
        parts=parts,
    )


def row_linear(
    cfg: ModelConfig, in_features: int, dtype: torch.dtype | None, tp: TensorParallel, smooth_input: bool = False
) -> Linear:
    """A row-parallel linear back into the residual stream (linear_proj, linear_fc2), with Megatron's scaled init;
    `smooth_input`: --smooth-swiglu's scales on its input (linear_fc2)."""
    std = init_std_of_output(cfg)
    return Linear(
        in_features, cfg.hidden_size, cfg.add_bias, std, dtype, parallel_mode="row", tp=tp, smooth_input=smooth_input
    )


class SelfAttention(nn.Module):
    """Causal multi-head / grouped-query attention.

    linear_qkv's output is laid out per query group, as in Megatron-Core: for each of the ng groups, its np/ng query
    heads, then its key head, then its value head (so a tensor-parallel shard holds whole groups).
    """

    def __init__(self, cfg: ModelConfig, layer_number: int, dtype: torch.dtype | None, tp: TensorParallel = NO_TP):
        super().__init__()
        # Tensor parallelism splits whole query groups (and their heads) over the ranks.
        self.num_heads, self.num_groups = cfg.num_attention_heads // tp.size, cfg.num_query_groups // tp.size
        self.head_dim = cfg.kv_channels
        qkv_size = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * self.head_dim
        self.linear_qkv = norm_column_linear(cfg, qkv_size, dtype, tp)
        norms = qk_norms(cfg, dtype, tp)
        if norms is not None:
            self.q_layernorm, self.k_layernorm = norms
        self.core_attention = CoreAttention(cfg, layer_number)
        self.linear_proj = row_linear(cfg, cfg.num_attention_heads * self.head_dim, dtype, tp)
        # RoPE on CUDA by the fused kernel on the packed output (rope_kernel.rope_path), unless q/k norms come first
        self.fused_rope = cfg.apply_rope_fusion and not cfg.qk_layernorm
        self.recompute_core_attn = False  # --recompute-modules core_attn (set by TransformerLayer)

    def forward(
        self, x: torch.Tensor, rotary: torch.Tensor | None, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        heads_per_group = self.num_heads // self.num_groups
        mixed = self.linear_qkv(x)  # [s, b, local qkv]: the full sequence, also when x is a sequence shard
        s, b = mixed.shape[:2]
        mixed = mixed.view(s, b, self.num_groups, (heads_per_group + 2) * self.head_dim)
        rope = "none" if rotary is None else rope_path(self.fused_rope, rotary, mixed.device, te_kernel=False)
        if rope == "triton":  # CUDA: q, k, v written out contiguous, RoPE applied in fp32 and rounded once
            q, k, v = fused_qkv_rope(mixed, rotary, heads_per_group)
        else:  # the CPU (the oracle), --no-rope-fusion, per-sample positions
            q, k, v = mixed.split([heads_per_group * self.head_dim, self.head_dim, self.head_dim], dim=-1)
            q = q.reshape(s, b, self.num_heads, self.head_dim)  # [s, b, np, hn]
            if hasattr(self, "q_layernorm"):
                q, k = self.q_layernorm(q), self.k_layernorm(k)
            if rope == "unfused":
                q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)  # k: [s, b, ng, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, hn]
        if self.recompute_core_attn:
            out = checkpoint(self.core_attention, q, k, v, attention_mask)  # [b, np, s, hn]
        else:
            out = self.core_attention(q, k, v, attention_mask)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * self.head_dim)
        return self.linear_proj(out)


class MLP(nn.Module):
    """h -> ffn -> h with GELU (or squared ReLU), or SwiGLU (linear_fc1 outputs [gate; up], 2*ffn wide)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None, tp: TensorParallel = NO_TP):
        super().__init__()
        self.swiglu, self.activation = cfg.swiglu, mlp_activation(cfg)
        fc1_out = 2 * cfg.ffn_hidden_size if cfg.swiglu else cfg.ffn_hidden_size
        self.linear_fc1 = norm_column_linear(cfg, fc1_out, dtype, tp, parts=2 if cfg.swiglu else 1)
        self.linear_fc2 = row_linear(cfg, cfg.ffn_hidden_size, dtype, tp, smooth_input=cfg.smooth_swiglu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = self.activation(h)
        return self.linear_fc2(h)


class TransformerLayer(nn.Module):
    """x + drop(attn(norm(x))), then + drop(mlp(norm(.))); the norms live inside linear_qkv and linear_fc1."""

    def __init__(self, cfg: ModelConfig, layer_number: int, dtype: torch.dtype | None, tp: TensorParallel = NO_TP):
        super().__init__()
        self.layer_number = layer_number  # 1-based, global across pipeline stages
        self.self_attention = SelfAttention(cfg, layer_number, dtype, tp)
        self.mlp = MLP(cfg, dtype, tp)
        self.hidden_dropout = cfg.hidden_dropout
        self.set_recompute(RecomputePlan.from_config(cfg))

    def set_recompute(self, plan: RecomputePlan) -> None:
        """Switch the selective recomputation inside this layer (--recompute-modules core_attn, mlp, layernorm)
        as `plan` says; full recomputation is the model's (`run_layers`)."""
        self.self_attention.recompute_core_attn = plan.selective("core_attn")
        self.recompute_mlp = plan.selective("mlp")
        for linear in (self.self_attention.linear_qkv, self.mlp.linear_fc1):
            linear.recompute_norm = plan.selective("layernorm")

    def forward(
        self, x: torch.Tensor, rotary: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + F.dropout(self.self_attention(x, rotary, attention_mask), self.hidden_dropout, self.training)
        mlp = checkpoint(self.mlp, x) if self.recompute_mlp else self.mlp(x)
        return x + F.dropout(mlp, self.hidden_dropout, self.training)
