"""The self-attention of the Transformer Engine layer (`TESelfAttention`): TE's linears around TE's fused attention
(`te.DotProductAttention`, cuDNN / flash) or, with --attention-backend local, this project's attention; RoPE by one
fused kernel on the QKV GEMM's packed output (no split copies, no concatenation in backward): this project's Triton
kernel (`rope_kernel.py`), TE's fused QKV kernel where Triton is missing.

transformer_engine is imported inside functions only: importing this module on a CPU machine is harmless.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import nn

from megatron.config import ModelConfig
from megatron.errors import UserError
from megatron.parallel.tensor_parallel import NO_TP, TensorParallel

from .attention import CoreAttention
from .layers import apply_rotary, init_std_of_output, qk_norms
from .recompute import checkpoint
from .rope_kernel import fused_qkv_rope, rope_path
from .te_fp8 import te_checkpoint
from .te_linear import te_linear


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
        import transformer_engine.pytorch as te

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
        rope = "none" if rotary is None else rope_path(self.fused_rope, rotary, mixed.device, te_kernel=True)
        if rope in ("triton", "te"):
            # One kernel each way: RoPE on q and k of the packed output, q, k and v written out contiguous
            # ([s, b, np, hn], [s, b, ng, hn] x 2); its backward writes the packed gradient directly, where
            # separate RoPE calls on views of `mixed` end in a concatenation of the three gradients.
            packed = mixed.view(s, b, groups, (per_group + 2) * hn)
            q, k, v = (fused_qkv_rope if rope == "triton" else te_qkv_rope)(packed, rotary, per_group)
        else:
            # [s, b, ng * (np/ng + 2) * hn] -> [s, b, ng, (np/ng + 2) * hn] -> q, k, v views
            q, k, v = mixed.view(s, b, groups, (per_group + 2) * hn).split([per_group * hn, hn, hn], dim=-1)
            q = q.reshape(s, b, self.num_heads, hn)  # one copy (q is strided within each group's row)
            if hasattr(self, "q_layernorm"):
                q, k = self.q_layernorm(q), self.k_layernorm(k)
            if rope == "unfused":  # per-sample positions (the kernels take [s, 1, 1, d] angles only), or asked for
                q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)
        if not self.te_attention:
            q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
            if self.recompute_core_attn:  # no TE module inside: this project's checkpoint
                out = checkpoint(self.core_attention, q, k, v, attention_mask)
            else:
                out = self.core_attention(q, k, v, attention_mask)  # [b, np, s, hn]
            out = out.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * hn)
        elif self.recompute_core_attn:  # TE's checkpoint: its RNG and FP8 (attention) handling
            out = checkpoint(self._te_attention_masked, q, k, v, attention_mask, runner=te_checkpoint)
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
                attention_kernel_missing(
                    self.attention_backend,
                    self.head_dim,
                    args[0].dtype,
                    _fp8_attention(),
                    deterministic=getattr(self.core_attention, "deterministic", False),
                )
            ) from None


def _fp8_attention() -> bool:
    """Whether the enclosing te.autocast runs attention in FP8 (its recipe's fp8_dpa)."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    return FP8GlobalStateManager.is_fp8_enabled() and getattr(FP8GlobalStateManager.get_fp8_recipe(), "fp8_dpa", False)


def attention_kernel_missing(
    backend: str, head_dim: int, dtype: torch.dtype, fp8_attention: bool, deterministic: bool = False
) -> str:
    """The one line for an attention call Transformer Engine has no kernel for: what was asked, and the change that
    gives it one (a forced backend, FP8 attention in deterministic mode or outside what Hopper trains, or none of
    these: then TE's debug log names each backend's reason). `deterministic`: the module was built with TE's
    deterministic switch (NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 or PyTorch's deterministic algorithms)."""
    asked = f"head dim {head_dim}, {str(dtype).removeprefix('torch.')}, {'FP8' if fp8_attention else 'no FP8'}"
    if backend != "auto":
        fix = f"--attention-backend {backend} allows only that kernel (flash needs the flash-attn package): use auto"
    elif fp8_attention and deterministic:
        fix = (
            "cuDNN has no deterministic FP8 attention kernel for them (NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 or"
            " --deterministic-mode is set): drop --fp8-dot-product-attention or --deterministic-mode"
        )
    elif fp8_attention:
        fix = (
            "--fp8-dot-product-attention runs only on cuDNN's FP8 kernels (on Hopper: head dim 128, delayed scaling):"
            " drop the flag or change --kv-channels"
        )
    else:
        fix = "run once with NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 to see why Transformer Engine refused each backend"
    return f"Transformer Engine has no attention kernel for these inputs on this GPU ({asked} attention); {fix}"


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


def te_qkv_rope(
    packed: torch.Tensor, angles: torch.Tensor, heads_per_group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v with RoPE from the packed QKV output by Transformer Engine's fused QKV kernel, as
    `rope_kernel.fused_qkv_rope` computes them: the layer's fallback without Triton, and the reference that
    tests/gpu/test_rope_kernel.py and scripts/probes/rope_bench.py compare the Triton kernel with."""
    from transformer_engine.pytorch.attention.rope import apply_fused_qkv_rotary_pos_emb

    hn = packed.shape[-1] // (heads_per_group + 2)
    split = [heads_per_group * hn, hn, hn]
    return apply_fused_qkv_rotary_pos_emb(packed, angles, angles, split, tensor_format="sbhd")
