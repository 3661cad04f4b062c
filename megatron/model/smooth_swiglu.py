"""Smooth-SwiGLU (Fishman et al. 2024, "Scaling FP8 training to trillion-token LLMs"), --smooth-swiglu.

Over long runs SwiGLU's gate and up weights align and its output grows outlier channels (quadratic in the input);
under per-tensor FP8 scaling those channels set linear_fc2's input scale and the other channels lose their bits.
Smooth-SwiGLU scales each channel i of the SwiGLU output h by s_i before the cast and folds 1/s_i into
linear_fc2's weight columns:

    y = q(h * s) . q(W / s)^T              = h . W^T in exact arithmetic
    s_i = 2^-ceil(a log2 amax_i            amax_i: max |h_i| over the tokens of the previous optimizer step,
                  - (1 - a) log2 wmax_i)   max-reduced over the data (x context) parallel ranks; wmax_i: max |W|
                                           of column i after that step; a: --smooth-swiglu-migration; clamped to
                                           2^+-14; the previous s_i kept where amax_i (or wmax_i) is 0, inf or NaN;
                                           1 before the first step

At a = 1 (Fishman et al.'s scale) each smoothed channel's values lie within (-1, 1] (for the statistics the scale
came from), so no channel dominates the input's amax, but an outlier channel's range moves whole into linear_fc2's
weight, whose FP8 cast has one scale per tensor: a column divided by s_i = 2^-12 is 4096 times its neighbours, which
then lose their bits in the weight instead. At a = 0.5 (SmoothQuant's migration strength) the range is shared: the
input's channel i and the weight's column i both peak near sqrt(amax_i * wmax_i), each channel's spread its square
root (docs/fp8.md, "Induced outliers at llama-150m"). Because s is a power of two, x * s and W / s are exact in
fp32, bf16 and fp16 (the clamp keeps fp16 in range): the smoothed model computes the same outputs and gradients as
the plain one, bit for bit, when FP8 is off, and the weight the optimizer holds is the plain W. So checkpoints hold
the plain weight and the scales (`linear_fc2.smooth_scale`, a buffer sharded like the weight's columns), and an
export needs no fold beyond dropping them (megatron/convert/state.py).

Both engines smooth alike: the local `Linear` (megatron/model/layers.py) and Transformer Engine's linear_fc2 (the
MLP scales TE's input, megatron/model/te_mlp.py; the module's weight is W / s where TE reads it for its cast and
GEMMs, megatron/model/te_linear.py).

Tensor parallelism: linear_fc2 is row-parallel, so each rank holds the scales of its own slice of the channels
(whole channels: every rank sees all tokens of its channels, with or without sequence parallelism); only the
data (x context) parallel ranks, which see other tokens of the same channels, reduce their amaxes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

SCALES_KEY = "linear_fc2.smooth_scale"
"""How a smoothing scale's state-dict name ends."""
STARTED_LINE = "holds no Smooth-SwiGLU scales (saved without --smooth-swiglu): they start at 1, as at a first step"
"""What a load logs of a checkpoint without the scales: a run may turn --smooth-swiglu on when it resumes."""
MAX_EXPONENT = 14
"""|log2 s| at most: fp16's range (2^-14 .. 2^15 normal) keeps x * s and W / s exact there too."""


def add_smoothing(linear: nn.Module, in_local: int, device: torch.device | str | None = None) -> None:
    """Make `linear` smooth its input: `smooth_input`, its scales (`smooth_scale`, 1 to start, kept in checkpoints)
    and the running amax of its input channels (`smooth_amax`, not saved), one each per input channel of this rank
    (row-parallel: its slice of the ffn channels)."""
    linear.smooth_input = True
    linear.register_buffer("smooth_scale", torch.ones(in_local, dtype=torch.float32, device=device))
    linear.register_buffer("smooth_amax", torch.zeros(in_local, dtype=torch.float32, device=device), persistent=False)


def smooth_input(x: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, observe: bool) -> torch.Tensor:
    """x * s for a linear's input x [..., K]; with `observe` (training) the running per-channel amax of x is raised
    first."""
    if observe:
        with torch.no_grad():
            # one read of x (no |x| written out first)
            seen = torch.linalg.vector_norm(x.detach(), ord=float("inf"), dim=tuple(range(x.dim() - 1)))
            seen = seen.to(amax.dtype)
            torch.maximum(amax, seen, out=amax)  # NaN propagates: the update below then keeps the old scale
    return x * scale.to(x.dtype)


def smooth_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W / s for a linear's weight [N, K]; autograd carries W's gradient back through the division."""
    return weight / scale.to(weight.dtype)


def smooth(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, observe: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x * s, W / s): `smooth_input` and `smooth_weight` together."""
    return smooth_input(x, scale, amax, observe), smooth_weight(weight, scale)


def scale_from_amax(
    amax: torch.Tensor, previous: torch.Tensor, weight_amax: torch.Tensor | None = None, migration: float = 1.0
) -> torch.Tensor:
    """s = 2^-ceil(a log2 amax - (1 - a) log2 wmax) per channel (a: `migration`; wmax: `weight_amax`, the weight
    column's max |W|, needed when a < 1), clamped to 2^+-MAX_EXPONENT; `previous` where amax (or wmax) is 0 or not
    finite."""
    amax = amax.float()
    exponent, valid = torch.log2(amax), torch.isfinite(amax) & (amax > 0)
    if migration != 1:
        assert weight_amax is not None, "a migration below 1 needs the weight columns' amaxes"
        wmax = weight_amax.float()
        exponent = migration * exponent - (1 - migration) * torch.log2(wmax)
        valid &= torch.isfinite(wmax) & (wmax > 0)
    exponent = torch.ceil(exponent).clamp(-MAX_EXPONENT, MAX_EXPONENT)
    return torch.where(valid, torch.exp2(-exponent), previous.float())


def smoothed_linears(model: nn.Module) -> list[nn.Module]:
    """The linears of `model` with a smoothed input (linear_fc2 of every MLP under --smooth-swiglu), in order."""
    return [m for m in model.modules() if getattr(m, "smooth_input", False)]


@torch.no_grad()
def update_smoothing(linears: list[nn.Module], group: dist.ProcessGroup | None = None, migration: float = 1.0) -> None:
    """Once per optimizer step, after it: new scales of `linears` (`smoothed_linears`, found once per run) from the
    step's amaxes (max-reduced over `group`, the data x context parallel ranks, in one collective) and, when
    `migration` is below 1, the stepped weights' column amaxes (whole columns on every rank: linear_fc2 is
    row-parallel); the amaxes reset."""
    if not linears:
        return
    amax = torch.cat([linear.smooth_amax.float() for linear in linears])
    if group is not None and dist.get_world_size(group) > 1:
        amax = torch.where(torch.isnan(amax), torch.inf, amax)  # a MAX reduction may drop NaN: send it as inf
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    for linear, seen in zip(linears, amax.split([linear.smooth_amax.numel() for linear in linears])):
        # one read of W (no |W| written out first)
        weight = torch.linalg.vector_norm(linear.weight.detach(), ord=float("inf"), dim=0) if migration != 1 else None
        linear.smooth_scale.copy_(scale_from_amax(seen, linear.smooth_scale, weight, migration))
        linear.smooth_amax.zero_()


def mark_tensor_parallel_scales(model: nn.Module) -> dict[str, torch.Tensor]:
    """{state-dict name: buffer} of the smoothing scales, each marked split over the tensor-parallel ranks along
    dim 0 as its linear's weight columns are (the attributes a parameter carries; marked at each call, since
    moving a module to another device or dtype replaces its buffers)."""
    scales = {}
    for name, module in model.named_modules():
        if getattr(module, "smooth_input", False):
            buffer = module.smooth_scale
            buffer.tensor_model_parallel, buffer.partition_dim, buffer.partition_stride = True, 0, 1
            buffer.partition_parts = 1
            scales[f"{name}.smooth_scale" if name else "smooth_scale"] = buffer
    return scales
