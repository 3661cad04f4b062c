"""Core attention (softmax(QK^T / sqrt(d)) V, causal or masked) and --attention-backend.

The local engine runs either PyTorch's `scaled_dot_product_attention`, restricted to the kernels the backend names,
or `explicit_attention`, which computes the scores and the softmax itself: only there do
--attention-softmax-in-fp32 and --apply-query-key-layer-scaling have something to act on (the fused kernels keep
their scores in fp32 anyway). Transformer Engine reads its backend choice from the environment
(`te_attention_env`); `local` replaces TE's DotProductAttention by `CoreAttention` inside the TE layer.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import MutableMapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.config import ModelConfig
from megatron.errors import UserError
from megatron.parallel.context_parallel import NO_CP, ContextParallel, attention_inputs

SDPA_BACKENDS: dict[str, list[SDPBackend] | None] = {
    "auto": None,  # PyTorch chooses among all its kernels
    "flash": [SDPBackend.FLASH_ATTENTION],
    "fused": [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
}
"""The SDPA kernels each --attention-backend allows on the local engine; unfused and local are `explicit_attention`."""

EXPLICIT_BACKENDS = ("unfused", "local")


def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    dropout: float = 0.0,
    softmax_in_fp32: bool = False,
    layer_scale: int | None = None,
) -> torch.Tensor:
    """q [b, np, sq, hn], k and v [b, ng, sk, hn] (ng divides np) -> [b, np, sq, hn].

    `attention_mask`: bool [b|1, 1, sq, sk], True where a query may attend (None: causal, sq = sk).
    `softmax_in_fp32`: upcast half-precision scores before masking and softmax. `layer_scale`
    (--apply-query-key-layer-scaling): divide the scores by it inside the QK^T GEMM and multiply them back in fp32
    before the softmax (Megatron-LM's fp16 trick; mathematically the identity)."""
    b, heads, s, hn = q.shape
    sk = k.shape[2]
    if k.shape[1] != heads:  # grouped-query attention: each key/value head serves heads/ng query heads
        k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    scale = 1.0 / math.sqrt(hn) / (layer_scale or 1)
    # The scale inside the GEMM (alpha), so that fp16 scores are never formed unscaled.
    q3, k3 = q.reshape(b * heads, s, hn), k.reshape(b * heads, sk, hn)
    scores = torch.baddbmm(q3.new_empty(b * heads, s, sk), q3, k3.transpose(1, 2), beta=0.0, alpha=scale)
    scores = scores.view(b, heads, s, sk)  # in the activations' dtype
    if softmax_in_fp32 or layer_scale:
        scores = scores.float()
    if layer_scale:
        scores = scores * layer_scale
    if attention_mask is None:
        attention_mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    probs = torch.softmax(scores.masked_fill(~attention_mask, float("-inf")), dim=-1).to(v.dtype)
    probs = F.dropout(probs, dropout) if dropout > 0 else probs
    return torch.matmul(probs, v)


class CoreAttention(nn.Module):
    """The attention between linear_qkv and linear_proj, as --attention-backend picks it (no parameters).

    With context parallelism (`context_parallel`, set by megatron.parallel.context_parallel.attach_context_parallel)
    q, k and v hold this rank's two sequence chunks: keys and values are all-gathered over the group and the queries
    attend to them under the mask of their positions, whatever --cp-comm-type says (that is Transformer Engine's)."""

    context_parallel: ContextParallel = NO_CP

    def __init__(self, cfg: ModelConfig, layer_number: int, backend: str | None = None):
        super().__init__()
        self.backend = backend or cfg.attention_backend
        self.dropout = cfg.attention_dropout
        self.softmax_in_fp32 = cfg.attention_softmax_in_fp32
        self.layer_scale = max(1, layer_number) if cfg.apply_query_key_layer_scaling else None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """q [b, np, s, hn], k and v [b, ng, s, hn] -> [b, np, s, hn]."""
        dropout = self.dropout if self.training else 0.0
        if self.context_parallel.size > 1:
            k, v, attention_mask = attention_inputs(q, k, v, attention_mask, self.context_parallel)
        if self.backend in EXPLICIT_BACKENDS:
            return explicit_attention(
                q, k, v, attention_mask, dropout=dropout, softmax_in_fp32=self.softmax_in_fp32,
                layer_scale=self.layer_scale,
            )  # fmt: skip
        kwargs = dict(
            attn_mask=attention_mask,
            dropout_p=dropout,
            is_causal=attention_mask is None,
            enable_gqa=k.shape[1] != q.shape[1],
        )
        kernels = SDPA_BACKENDS[self.backend]
        if self.backend == "fused" and q.device.type == "cpu":
            # Megatron-LM's fused backend is cuDNN's; on a CPU PyTorch's one fused kernel (its CPU flash attention)
            # is the counterpart, so that GPU scripts run unchanged on CPUs.
            kernels = [SDPBackend.FLASH_ATTENTION]
        if kernels is None:
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
        try:
            with sdpa_kernel(kernels):
                return F.scaled_dot_product_attention(q, k, v, **kwargs)
        except RuntimeError as exc:
            if "No viable backend" not in str(exc) and "No available kernel" not in str(exc):
                raise
            raise UserError(
                f"--attention-backend {self.backend}: PyTorch has no {self.backend} attention kernel for these inputs"
                f" ({q.dtype}, head dim {q.shape[-1]}, {q.device.type}); use --attention-backend auto or unfused"
            ) from None

    def extra_repr(self) -> str:
        return f"backend={self.backend}"


def te_attention_env(backend: str) -> dict[str, str]:
    """The NVTE_* switches Megatron-LM sets for each --attention-backend: TE opts out of what is set to 0 (all on for
    auto, all off for local, whose attention is not TE's)."""
    on = {"auto": ("flash", "fused", "unfused"), "local": ()}.get(backend, (backend,))
    return {f"NVTE_{name.upper()}_ATTN": str(int(name in on)) for name in ("flash", "fused", "unfused")}


_SET_BY_US: dict[str, str] = {}
"""What `set_te_attention_env` wrote, so that a second model in this process may choose another backend while a
value the user put in the environment still may not be contradicted."""


def set_te_attention_env(backend: str, env: MutableMapping[str, str] = os.environ) -> None:
    """Select TE's attention backends for this process (before the first TE attention forward: TE reads the
    variables when it chooses a backend, and caches its choice per input shape, which is made to choose again).
    A value the user set that contradicts the flag is a UserError, as in Megatron-LM."""
    for name, value in te_attention_env(backend).items():
        current = env.get(name)
        if current is None or current == _SET_BY_US.get(name):
            env[name] = _SET_BY_US[name] = value
        elif current != value:  # the user's own setting, which an agreeing value leaves theirs
            raise UserError(
                f"--attention-backend {backend} needs {name}={value} but the environment has {name}={current}:"
                " unset NVTE_FLASH_ATTN, NVTE_FUSED_ATTN and NVTE_UNFUSED_ATTN and choose with --attention-backend"
            )
    module = sys.modules.get("transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention")
    cache = getattr(module, "_attention_backends", None)
    if isinstance(cache, dict):
        cache["backend_selection_requires_update"] = True
