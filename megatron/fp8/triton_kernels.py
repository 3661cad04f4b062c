"""Triton kernels for per-tensor FP8 quantization on CUDA (tensorwise and delayed scaling): the two passes of
`quantize.block_amax` / `quantize.scaled_cast` for a whole-tensor block, each one pass over x.

    amax      one program per 8192 elements writes max |x| of its chunk (NaN if the chunk has one); the few
              thousand partial maxima are reduced by torch (NaN-propagating)
    cast      one program per 64x64 tile: q = saturate(round_rne(fp32(x) * scale)), stored row-major and, in the
              same pass, transposed (the wgrad / dgrad operand), so x is read once

They compute exactly the formulas of `quantize.py` (fp32 product, clamp to +-fp8_max with NaN kept, round to
nearest even), and `quantize.compiled_kernels()` checks that byte for byte against the eager functions once per process
before using them. Used on CUDA machines with Triton: the kernels are plain functions until `build()` (called by
each launcher) imports Triton and wraps them with triton.jit, so that this module imports without Triton.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch

from .formats import E4M3, E5M2, fp8_max

_AMAX_BLOCK = 8192
_TILE = 64
# Bound by `build()`: triton.language and Triton's fp8 type of each torch dtype; None and empty until then.
tl = None
_TRITON_DTYPE = {}


def _amax_kernel(x_ptr, partial_ptr, n, nan, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0).to(tl.float32)
    chunk_max = tl.max(tl.abs(x), axis=0)
    nans = tl.sum((x != x).to(tl.int32), axis=0)
    tl.store(partial_ptr + pid, tl.where(nans > 0, nan, chunk_max))


def _cast_kernel(
    x_ptr,
    scale_ptr,
    q_ptr,
    qt_ptr,
    rows,
    cols,
    stride_r,
    stride_c,
    limit,
    OUT: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    TILE: tl.constexpr,
):
    r = tl.program_id(0) * TILE + tl.arange(0, TILE)
    c = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    x = tl.load(x_ptr + r[:, None].to(tl.int64) * stride_r + c[None, :] * stride_c, mask=mask, other=0.0)
    v = x.to(tl.float32) * tl.load(scale_ptr)
    is_nan = v != v
    v = tl.minimum(tl.maximum(v, -limit), limit)  # saturate
    q = v.to(OUT, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    q = tl.where(is_nan, 0x7F, q)  # NaN stays NaN (0x7F is NaN in e4m3fn and e5m2), whatever min/max did to it
    tl.store(q_ptr + r[:, None].to(tl.int64) * cols + c[None, :], q, mask=mask)
    if TRANSPOSE:
        tl.store(qt_ptr + c[:, None].to(tl.int64) * rows + r[None, :], tl.trans(q), mask=tl.trans(mask))


def build() -> ModuleType:
    """Import Triton and jit the kernels (once), rebinding this module's names to the jitted versions; returns the
    triton module. ImportError without Triton (quantize then compiles the eager functions instead)."""
    global tl, _amax_kernel, _cast_kernel
    import triton
    import triton.language

    if tl is None:
        _amax_kernel, _cast_kernel = triton.jit(_amax_kernel), triton.jit(_cast_kernel)
        _TRITON_DTYPE.update({E4M3: triton.language.float8e4nv, E5M2: triton.language.float8e5})
        tl = triton.language
    return triton


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the whole tensor as fp32 [1, 1] (NaN if any element is NaN)."""
    triton = build()
    x = x.contiguous()
    n = x.numel()
    partial = torch.empty(max(triton.cdiv(n, _AMAX_BLOCK), 1), device=x.device, dtype=torch.float32)
    if n == 0:
        partial.zero_()
    else:
        _amax_kernel[(partial.numel(),)](x, partial, n, math.nan, BLOCK=_AMAX_BLOCK, num_warps=8)
    return partial.amax().reshape(1, 1)


def tensor_cast(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, transpose: bool, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """saturate(round_rne(fp32(x) * scale)) as `dtype`, and its transpose when asked; x [R, C], scale fp32 [1, 1].
    `out`: a contiguous [R, C] tensor of `dtype` to write q into (FSDP's cached FP8 shard), instead of a new one."""
    triton = build()
    rows, cols = x.shape
    q = torch.empty(rows, cols, device=x.device, dtype=dtype) if out is None else out
    assert q.shape == (rows, cols) and q.dtype == dtype and q.is_contiguous(), (q.shape, q.dtype)
    q_t = torch.empty(cols, rows, device=x.device, dtype=dtype) if transpose else q
    grid = (triton.cdiv(rows, _TILE), triton.cdiv(cols, _TILE))
    _cast_kernel[grid](
        x,
        scale.float().contiguous(),
        q.view(torch.uint8),
        q_t.view(torch.uint8),
        rows,
        cols,
        x.stride(0),
        x.stride(1),
        fp8_max(dtype),
        OUT=_TRITON_DTYPE[dtype],
        TRANSPOSE=transpose,
        TILE=_TILE,
        num_warps=4,
    )
    return q, (q_t if transpose else None)
