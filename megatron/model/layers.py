"""Local (pure PyTorch) building blocks, named and shaped like Transformer Engine's modules.

`LayerNormLinear` is TE's `te.LayerNormLinear` (input norm fused into the linear: parameters `layer_norm_weight`,
`layer_norm_bias`, `weight`, `bias`), `Linear` is `te.Linear`, `Norm` is `te.LayerNorm` / `te.RMSNorm`. Keeping the
parameter names and layouts identical lets a checkpoint move between `--transformer-impl local` and
`transformer_engine` without key maps.

Every matrix multiply of a transformer layer goes through `Linear.forward`, where the FP8 engine hooks in: when a
linear's `fp8` attribute holds a quantization state (set by `megatron.fp8` after the model is built), the GEMMs run
on FP8 operands; otherwise it is a plain `F.linear`.

Tensor parallelism is declared at construction, as in TE (`parallel_mode`): a `column` linear holds a slice of the
output rows (its input is copied to, or with sequence parallelism all-gathered from, the tensor-parallel ranks), a
`row` linear holds a slice of the input columns (its partial outputs are all-reduced, or reduce-scattered along the
sequence). Weights are drawn at full size and sliced, so every layout starts from the single-process weights.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.fp8.params import is_fp8_param  # noqa: F401  (re-exported: the model's users ask it here)
from megatron.parallel.tensor_parallel import (
    NO_TP,
    TensorParallel,
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    reduce_scatter_to_sp,
)

from .grad_accumulation import fuses_wgrad, linear_accumulating_wgrad
from .init_draws import init_normal
from .recompute import NormRecompute
from .smooth_swiglu import add_smoothing, smooth


def mark_replicated(param: nn.Parameter, tp: TensorParallel) -> None:
    """A parameter every tensor-parallel rank holds whole: counted once in the gradient norm, and (when it sees only
    a sequence shard) its partial gradients summed over the group (see megatron.parallel.grads)."""
    param.grad_norm_duplicate = tp.rank > 0
    param.sequence_parallel = tp.sequence_parallel and tp.size > 1


def mark_tensor_parallel(param: nn.Parameter, dim: int, parts: int = 1) -> None:
    """A parameter split over the tensor-parallel ranks along `dim`, with the attributes Megatron-LM and TE set
    (`tensor_model_parallel`, `partition_dim`, `partition_stride`) plus `partition_parts`: how many stacked matrices
    were sliced separately (2 for SwiGLU's [gate; up]). Tests gather shards by them, whatever the implementation."""
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, 1
    param.partition_parts = parts


def normalize(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    kind: str,
    eps: float,
    zero_centered: bool = False,
) -> torch.Tensor:
    """LayerNorm ((x - mean) / std * w + b) or RMSNorm (x / rms * w) over the last dimension.

    `zero_centered` (--apply-layernorm-1p, TE's `zero_centered_gamma`): the stored weight w is applied as 1 + w.
    Computed as x_hat + x_hat * w rather than x_hat * (1 + w): in bf16, 1 + w would round w to steps of 2^-8, while
    TE's kernels form 1 + w in fp32."""
    if not zero_centered:
        if kind == "LayerNorm":
            return F.layer_norm(x, weight.shape, weight, bias, eps)
        return F.rms_norm(x, weight.shape, weight, eps)
    if kind == "LayerNorm":
        x_hat = F.layer_norm(x, weight.shape, None, None, eps)
    else:
        x_hat = F.rms_norm(x, weight.shape, None, eps)
    y = torch.addcmul(x_hat, x_hat, weight)
    return y if bias is None else y + bias


class Norm(nn.Module):
    """A standalone LayerNorm / RMSNorm (TE's `te.LayerNorm` / `te.RMSNorm`: parameters `weight`, `bias`)."""

    def __init__(
        self,
        hidden_size: int,
        kind: str,
        eps: float,
        dtype: torch.dtype | None = None,
        tp: TensorParallel = NO_TP,
        zero_centered: bool = False,
    ):
        """`zero_centered`: --apply-layernorm-1p, the weight is stored as w = gamma - 1 (initialized to 0)."""
        super().__init__()
        self.kind, self.eps, self.zero_centered = kind, eps, zero_centered
        self.weight = nn.Parameter(torch.full((hidden_size,), 0.0 if zero_centered else 1.0, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype)) if kind == "LayerNorm" else None
        for param in self.parameters():
            mark_replicated(param, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return normalize(x, self.weight, self.bias, self.kind, self.eps, self.zero_centered)


def qk_norms(cfg: ModelConfig, dtype: torch.dtype | None, tp: TensorParallel) -> tuple[Norm, Norm] | None:
    """--qk-layernorm: one norm over kv-channels for all query heads, one for all key heads (Megatron-Core's
    q_layernorm / k_layernorm). Each tensor-parallel rank sees only its heads, so their partial gradients are
    summed over the tensor-parallel group, as sequence-parallel parameters' are. Both layer implementations use
    these norms (the TE layer moves them to its device)."""
    if not cfg.qk_layernorm:
        return None
    norms = tuple(
        Norm(cfg.kv_channels, cfg.normalization, cfg.norm_epsilon, dtype, tp, cfg.apply_layernorm_1p) for _ in "qk"
    )
    for param in (p for norm in norms for p in norm.parameters()):
        param.sequence_parallel = tp.size > 1
    return norms


class Linear(nn.Module):
    """y = x W^T + b with W: [out, in], optionally split over tensor-parallel ranks (`parallel_mode` "column" or
    "row"; `parts`: number of stacked matrices in W sliced separately, 2 for SwiGLU's [gate; up]).
    `fp8` is the FP8 engine's per-layer state (None: high precision; `attach_fp8` takes over the layers that have
    what `megatron.fp8.manager.Fp8Capable` names). `gradient_accumulation_fusion`: the weight gradient goes straight
    into `weight.main_grad` when it has one (megatron/model/grad_accumulation.py). `smooth_input` (--smooth-swiglu,
    linear_fc2): y = (x * s) (W / s)^T, s a power of two per input channel (megatron/model/smooth_swiglu.py)."""

    gradient_accumulation_fusion = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        init_std: float,
        dtype=None,
        *,
        parallel_mode: str | None = None,
        tp: TensorParallel = NO_TP,
        parts: int = 1,
        smooth_input: bool = False,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.parallel_mode, self.tp, self.parts = parallel_mode, tp, parts
        split = tp.size if parallel_mode else 1
        out_local = out_features // split if parallel_mode == "column" else out_features
        in_local = in_features // split if parallel_mode == "row" else in_features
        self.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_local, dtype=dtype)) if bias else None
        if parallel_mode:
            mark_tensor_parallel(self.weight, 0 if parallel_mode == "column" else 1, parts)
        if self.bias is not None and parallel_mode == "column":
            mark_tensor_parallel(self.bias, 0, parts)
        elif self.bias is not None:
            mark_replicated(self.bias, tp)  # added after the reduction: whole on every rank
        self.init_std = init_std
        self.fp8: Any = None
        self.smooth_input = smooth_input
        if smooth_input:
            add_smoothing(self, in_local)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.parallel_mode == "column":
            shard = partial(self.tp.shard, dim=0, parts=self.parts)
        else:
            shard = partial(self.tp.shard, dim=1) if self.parallel_mode == "row" else lambda full: full
        init_normal(self.weight, (self.out_features, self.in_features), self.init_std, shard)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        column, row, tp = self.parallel_mode == "column", self.parallel_mode == "row", self.tp
        if column:
            x = gather_from_sp(x, tp.group) if tp.sequence_parallel else copy_to_tp(x, tp.group)
        bias = None if row else self.bias
        weight = self.weight
        if self.smooth_input:
            x, weight = smooth(x, weight, self.smooth_scale, self.smooth_amax, self.training)
        if self.fp8 is not None:
            y = self.fp8.linear(x, weight, bias)
        elif fuses_wgrad(weight, self.gradient_accumulation_fusion) and not is_fp8_param(weight):
            y = linear_accumulating_wgrad(x, weight, bias)
        else:
            y = F.linear(x, weight, bias)
        if row:
            y = reduce_scatter_to_sp(y, tp.group) if tp.sequence_parallel else reduce_from_tp(y, tp.group)
            if self.bias is not None:
                y = y + self.bias
        return y

    def extra_repr(self) -> str:
        mode = f", {self.parallel_mode}-parallel over {self.tp.size}" if self.parallel_mode and self.tp.size > 1 else ""
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}{mode}"


class LayerNormLinear(Linear):
    """Norm of the input fused into a linear (TE's `te.LayerNormLinear`)."""

    def __init__(
        self,
        in_features,
        out_features,
        bias,
        init_std,
        norm: str,
        eps: float,
        dtype=None,
        zero_centered: bool = False,
        **parallel,
    ):
        """`parallel`: Linear's parallel_mode / tp / parts. The norm runs before the column-parallel gather, on
        the sequence shard under --sequence-parallel. `zero_centered`: --apply-layernorm-1p (see `normalize`)."""
        super().__init__(in_features, out_features, bias, init_std, dtype, **parallel)
        self.norm_kind, self.eps, self.zero_centered = norm, eps, zero_centered
        self.layer_norm_weight = nn.Parameter(torch.full((in_features,), 0.0 if zero_centered else 1.0, dtype=dtype))
        self.layer_norm_bias = nn.Parameter(torch.zeros(in_features, dtype=dtype)) if norm == "LayerNorm" else None
        for param in (self.layer_norm_weight, self.layer_norm_bias):
            if param is not None:
                mark_replicated(param, self.tp)
        self.recompute_norm = False
        """--recompute-modules layernorm: free the norm output after the GEMM, recompute it in backward."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return normalize(x, self.layer_norm_weight, self.layer_norm_bias, self.norm_kind, self.eps, self.zero_centered)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute_norm and torch.is_grad_enabled() and x.requires_grad:
            recompute = NormRecompute(self._norm)
            y = super().forward(recompute.forward(x))
            recompute.discard(y)
            return y
        return super().forward(self._norm(x))


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoFormer), in the non-interleaved `rotate_half` layout Megatron-Core and TE use:
    channel i is paired with channel i + d/2 and rotated by angle pos * base^(-2i/d)."""

    def __init__(self, rotary_dim: int, base: float):
        super().__init__()
        self.rotary_dim, self.base = rotary_dim, base
        self.register_buffer("inv_freq", self._inv_freq(torch.device("cpu")), persistent=False)

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float64, device=device) / self.rotary_dim
        return (1.0 / self.base**exponents).float()

    def _apply(self, fn, recurse=True):
        # `model.to(torch.bfloat16)` casts every floating buffer; a bf16 inv_freq moves the angle at position 4096 by
        # about 0.5 rad. Take only the device from the cast and recompute the frequencies in fp32.
        super()._apply(fn, recurse)
        self.inv_freq = self._inv_freq(self.inv_freq.device)
        return self

    def forward(self, seq_len: int, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Angles [s, 1, 1, d] (or [s, b, 1, d] for per-sample position ids [b, s])."""
        if position_ids is None:
            positions = torch.arange(seq_len, device=self.inv_freq.device, dtype=torch.float32)[:, None]  # [s, 1]
        else:
            positions = position_ids.t().float()  # [s, b]
        freqs = positions[..., None] * self.inv_freq  # [s, b|1, d/2]
        return torch.cat([freqs, freqs], dim=-1)[:, :, None, :]  # [s, b|1, 1, d]


def apply_rotary(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate the first angles.shape[-1] channels of x [s, b, n, d]; the rest pass through."""
    rot_dim = angles.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (--squared-relu, Primer's activation)."""
    return torch.square(F.relu(x))


def mlp_activation(cfg) -> Any:
    """The non-gated MLP activation: GELU, or squared ReLU with --squared-relu."""
    return squared_relu if cfg.squared_relu else F.gelu


def init_std_of_output(cfg) -> float:
    """Megatron's scaled init for the layers that write into the residual stream: std / sqrt(2 * layers)."""
    return cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
