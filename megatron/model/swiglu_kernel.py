"""Smooth-SwiGLU on CUDA as one Triton kernel each way (--smooth-swiglu under delayed scaling, Transformer Engine's
layers): the SwiGLU, the per-channel scale s, the channels' amaxes and the FP8 cast in one pass over the activation.

    forward    x = [gate; up] [T, 2F] -> q(silu(gate) * up * s) [T, F], FP8 with the delayed scale of linear_fc2's input
               (or bf16); max |silu(gate) * up| per channel raised into the smoothing's running amax [F] and
               max |h * s| into the quantizer's amax (the delayed-scaling history TE reduces)
    backward   g [T, F] (the gradient of h * s) -> [dgate; dup] [T, 2F] of (g * s) through SwiGLU, FP8 row-wise and
               transposed (linear_fc1's dgrad and wgrad operands) with its amax, or bf16

What they replace (megatron/model/te_mlp.py, without Triton): TE's SwiGLU writing h in bf16, a read of h for its
amax, h * s written out and read back by linear_fc2's cast; backward, g * s written out and read back by TE's
dSwiGLU. Here x and g are read once and only the FP8 results are written. The arithmetic is TE's (math.h): sigmoid
1 / (1 + exp(-x)) with a correctly rounded exp and division, in fp32 from the bf16 inputs; the cast saturates to the
format's largest finite value and rounds to nearest even, NaN kept (megatron/fp8/triton_kernels.py's cast). h * s is
exact (s is a power of two), so the FP8 result is the cast of the plain SwiGLU's fp32 output times s; TE's own
path rounds h to bf16 before the product, so the two may differ by one FP8 step where that rounding crosses a
boundary.

A third kernel serves linear_fc2's side (megatron/model/te_linear.py): W / s per column, and its gradient
g / s added into W's fp32 main_grad, each one vectorized pass (PyTorch's broadcasting division is not
vectorized, and the gradient would otherwise be divided, written and read back by the buffers' hook).

Each program takes BF channels over a run of rows, so that each channel's amax goes to memory once per program
(an int32 atomic max on the float's bits: every amax is >= 0, where the bits order as the values do; NaN's bits
exceed inf's, so a NaN is kept and the next scale update keeps the old scale).

Triton is imported on first use only (`build()`); `available()` is False without it. The CPU never runs these
kernels (tests/gpu/test_swiglu_kernel.py runs them on a GPU against the composed TE path).
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace
from typing import Any

import torch

# Bound by `build()`; None until then, so that importing this module never imports Triton.
tl = None
libdevice = None
_TRITON: Any = None  # the triton module once built, False when it cannot be imported

# Launch shapes (scripts/probes/microbench_swiglu_fp8.py sweeps them): rows x channels per tile, warps, programs
# per SM, and whether exp and the division are the correctly rounded ones (TE's math.h) or the GPU's fast forms
FORWARD = dict(BT=16, BF=128, num_warps=4, per_sm=4, accurate=False)
BACKWARD = dict(BT=64, BF=64, num_warps=4, per_sm=4, accurate=False)


# --------------------------------------------------------------------------------------------------------------------
# Kernels (plain functions: `build()` wraps them with triton.jit and rebinds these names to the jitted versions)
# --------------------------------------------------------------------------------------------------------------------


def _sigmoid(x, ACCURATE: tl.constexpr):
    if ACCURATE:  # TE's expf and division, correctly rounded
        return tl.math.div_rn(1.0, 1.0 + libdevice.exp(-x))
    return 1.0 / (1.0 + tl.exp(-x))


def _fp8(v, limit, OUT: tl.constexpr):
    """saturate(round_rne(v)) as the FP8 format OUT's bytes, NaN kept."""
    is_nan = v != v
    v = tl.minimum(tl.maximum(v, -limit), limit)
    q = v.to(OUT, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    return tl.where(is_nan, 0x7F, q)  # 0x7F is NaN in e4m3fn and e5m2


def _amax_bits(a, axis: tl.constexpr):
    """max over `axis` of a >= 0 as int32 bits, NaN if any element is NaN."""
    bits = tl.max(a, axis=axis).to(tl.int32, bitcast=True)
    return tl.where(tl.max((a != a).to(tl.int32), axis=axis) > 0, 0x7FC00000, bits)


def _forward_kernel(x_ptr, s_ptr, out_ptr, channel_amax_ptr, amax_ptr, scale_ptr, scale_inv_ptr, rows, F, limit,
                    RUN: tl.constexpr, OBSERVE: tl.constexpr, FP8: tl.constexpr, OUT: tl.constexpr, BT: tl.constexpr,
                    BF: tl.constexpr, ACCURATE: tl.constexpr):  # fmt: skip
    c = tl.program_id(0) * BF + tl.arange(0, BF)
    c_mask = c < F
    s = tl.load(s_ptr + c, mask=c_mask, other=1.0)
    first = tl.program_id(1) * RUN
    seen = tl.zeros([BT, BF], tl.float32)
    cast = tl.zeros([BT, BF], tl.float32)
    if FP8:
        scale = tl.load(scale_ptr)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale))
    for step in range(0, RUN, BT):
        r = first + step + tl.arange(0, BT)
        mask = (r < rows)[:, None] & c_mask[None, :]
        row = r.to(tl.int64)[:, None]
        gate = tl.load(x_ptr + row * (2 * F) + c[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * (2 * F) + F + c[None, :], mask=mask, other=0.0).to(tl.float32)
        h = gate * _sigmoid(gate, ACCURATE) * up
        if OBSERVE:
            seen = tl.maximum(seen, tl.abs(h), propagate_nan=tl.PropagateNan.ALL)
        hs = h * s[None, :]
        if FP8:
            cast = tl.maximum(cast, tl.abs(hs), propagate_nan=tl.PropagateNan.ALL)
            tl.store(out_ptr + row * F + c[None, :], _fp8(hs * scale, limit, OUT), mask=mask)
        else:
            tl.store(out_ptr + row * F + c[None, :], hs.to(out_ptr.dtype.element_ty), mask=mask)
    if OBSERVE:
        tl.atomic_max(channel_amax_ptr + c, _amax_bits(seen, 0), mask=c_mask)
    if FP8:
        tl.atomic_max(amax_ptr, tl.max(_amax_bits(cast, 0), axis=0))


def _backward_kernel(g_ptr, x_ptr, s_ptr, dx_ptr, dxt_ptr, amax_ptr, scale_ptr, scale_inv_ptr, rows, F, limit,
                     RUN: tl.constexpr, FP8: tl.constexpr, OUT: tl.constexpr, BT: tl.constexpr,
                     BF: tl.constexpr, ACCURATE: tl.constexpr):  # fmt: skip
    c = tl.program_id(0) * BF + tl.arange(0, BF)
    c_mask = c < F
    s = tl.load(s_ptr + c, mask=c_mask, other=1.0)
    first = tl.program_id(1) * RUN
    cast = tl.zeros([BT, BF], tl.float32)
    if FP8:
        scale = tl.load(scale_ptr)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale))
    for step in range(0, RUN, BT):
        r = first + step + tl.arange(0, BT)
        mask = (r < rows)[:, None] & c_mask[None, :]
        row = r.to(tl.int64)[:, None]
        g = tl.load(g_ptr + row * F + c[None, :], mask=mask, other=0.0).to(tl.float32) * s[None, :]
        gate = tl.load(x_ptr + row * (2 * F) + c[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * (2 * F) + F + c[None, :], mask=mask, other=0.0).to(tl.float32)
        sig = _sigmoid(gate, ACCURATE)
        d_gate = g * up * (gate * (sig * (1.0 - sig)) + sig)
        d_up = g * (gate * sig)
        gate_at, up_at = row * (2 * F) + c[None, :], row * (2 * F) + F + c[None, :]
        if FP8:
            cast = tl.maximum(cast, tl.maximum(tl.abs(d_gate), tl.abs(d_up)), propagate_nan=tl.PropagateNan.ALL)
            q_gate, q_up = _fp8(d_gate * scale, limit, OUT), _fp8(d_up * scale, limit, OUT)
            tl.store(dx_ptr + gate_at, q_gate, mask=mask)
            tl.store(dx_ptr + up_at, q_up, mask=mask)
            # the transpose [2F, T]: channel rows, token columns
            t_mask = tl.trans(mask)
            tl.store(dxt_ptr + c.to(tl.int64)[:, None] * rows + r[None, :], tl.trans(q_gate), mask=t_mask)
            tl.store(dxt_ptr + (c + F).to(tl.int64)[:, None] * rows + r[None, :], tl.trans(q_up), mask=t_mask)
        else:
            tl.store(dx_ptr + gate_at, d_gate.to(dx_ptr.dtype.element_ty), mask=mask)
            tl.store(dx_ptr + up_at, d_up.to(dx_ptr.dtype.element_ty), mask=mask)
    if FP8:
        tl.atomic_max(amax_ptr, tl.max(_amax_bits(cast, 0), axis=0))


def _divide_kernel(src_ptr, s_ptr, dst_ptr, skip_ptr, numel, K, SKIP: tl.constexpr, ACCUMULATE: tl.constexpr,
                   BLOCK: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    if SKIP:  # TE's device-side flag: 1 where a graph replay reuses the FP8 weight cast (which then reads nothing)
        mask = mask & (tl.zeros([BLOCK], tl.float32) + tl.load(skip_ptr) == 0)
    s = tl.load(s_ptr + offs % K, mask=mask, other=1.0).to(tl.float32)
    q = tl.math.div_rn(tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32), s)
    if ACCUMULATE:
        q += tl.load(dst_ptr + offs, mask=mask, other=0.0)
    tl.store(dst_ptr + offs, q.to(dst_ptr.dtype.element_ty), mask=mask)


def build() -> Any:
    """Import Triton and jit the kernels (once): the triton module, or None without Triton."""
    global _TRITON, tl, libdevice, _sigmoid, _fp8, _amax_bits, _forward_kernel, _backward_kernel, _divide_kernel
    if _TRITON is None:
        try:
            import triton
            from triton.language.extra import libdevice as _libdevice
        except ImportError:
            _TRITON = False
            return None
        tl = triton.language
        # Triton's interpreter (the CPU) has no libdevice: its exp there is numpy's, correctly rounded too
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        libdevice = SimpleNamespace(exp=lambda x: tl.exp(x)) if interpreted else _libdevice
        # The kernels resolve their helpers through this module's globals: rebind them to their jitted versions.
        _sigmoid, _fp8, _amax_bits = triton.jit(_sigmoid), triton.jit(_fp8), triton.jit(_amax_bits)
        _forward_kernel, _backward_kernel = triton.jit(_forward_kernel), triton.jit(_backward_kernel)
        _divide_kernel = triton.jit(_divide_kernel)
        _TRITON = triton
    return _TRITON or None


# --------------------------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------------------------


def available() -> bool:
    """Whether the kernels can run: Triton imports (tried once, at the first call)."""
    return build() is not None


def _require_triton() -> None:
    if build() is None:
        raise RuntimeError("the Smooth-SwiGLU kernels need Triton (pip install triton)")


@functools.cache
def _sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _launch_shape(rows: int, channels: int, device: torch.device, tune: dict[str, Any]) -> tuple[tuple, dict]:
    """(grid, the kernel's sizes): BF channels per program over a run of rows, enough programs to fill the GPU,
    each run a whole number of BT-row tiles."""
    bt, bf = tune["BT"], tune["BF"]
    blocks = _cdiv(channels, bf)
    runs = max(1, min(_cdiv(rows, bt), tune["per_sm"] * _sms(device.index or 0) // blocks))
    run = _cdiv(_cdiv(rows, runs), bt) * bt
    sizes = dict(RUN=run, BT=bt, BF=bf, ACCURATE=tune["accurate"], num_warps=tune["num_warps"])
    return (blocks, _cdiv(rows, run)), sizes


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _fp8_format(quantizer: Any) -> tuple[Any, float]:
    """Triton's FP8 type and the largest finite value of a TE quantizer's format."""
    import transformer_engine_torch as tex

    if quantizer.dtype == tex.DType.kFloat8E4M3:
        return tl.float8e4nv, 448.0
    if quantizer.dtype == tex.DType.kFloat8E5M2:
        return tl.float8e5, 57344.0
    raise ValueError(f"the fused Smooth-SwiGLU kernel casts to e4m3 or e5m2, not {quantizer.dtype}")


def _float8_tensor(data: torch.Tensor, transpose: torch.Tensor | None, scale_inv: torch.Tensor, quantizer: Any,
                   dtype: torch.dtype) -> Any:  # fmt: skip
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

    return Float8Tensor(
        shape=data.shape, dtype=dtype, data=data, fp8_scale_inv=scale_inv, fp8_dtype=quantizer.dtype,
        requires_grad=False, data_transpose=transpose, quantizer=quantizer, device=data.device,
    )  # fmt: skip


def _launch(kernel: Any, grid: tuple[int, int], device: torch.device, *args: Any, **sizes: Any) -> None:
    if device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):  # Triton launches on the current device
            kernel[grid](*args, **sizes)
    else:
        kernel[grid](*args, **sizes)


def smooth_swiglu_forward(
    x: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor | None, quantizer: Any, **tune: Any
) -> Any:
    """silu(gate) * up * s for x = [gate; up] [T, 2F]: a TE Float8Tensor (row-wise data) cast with `quantizer`'s
    delayed scale, its amax raised into the quantizer's, or bf16 when `quantizer` is None. `amax` ([F], or None:
    not observed) is raised to each channel's max |silu(gate) * up|. `tune` overrides `FORWARD`."""
    _require_triton()
    rows, F = x.shape[0], x.shape[1] // 2
    x = x.contiguous()
    grid, sizes = _launch_shape(rows, F, x.device, {**FORWARD, **tune})
    fp8 = quantizer is not None
    out = torch.empty(rows, F, device=x.device, dtype=torch.uint8 if fp8 else x.dtype)
    out_type, limit = _fp8_format(quantizer) if fp8 else (tl.float8e4nv, 0.0)
    scale_inv = torch.empty(1, device=x.device, dtype=torch.float32) if fp8 else out
    # the kernel raises fp32 amaxes; a model cast to bf16 holds its buffers in bf16
    seen = amax if amax is None or amax.dtype == torch.float32 else torch.zeros(F, device=x.device)
    _launch(
        _forward_kernel, grid, x.device, x, scale.float(), out, seen.view(torch.int32) if seen is not None else out,
        quantizer.amax.view(torch.int32) if fp8 else out, quantizer.scale if fp8 else out, scale_inv, rows, F, limit,
        OBSERVE=amax is not None, FP8=fp8, OUT=out_type, **sizes,
    )  # fmt: skip
    if seen is not amax:
        torch.maximum(amax, seen.to(amax.dtype), out=amax)  # NaN propagates
    return _float8_tensor(out, None, scale_inv, quantizer, x.dtype) if fp8 else out


def smooth_swiglu_backward(
    grad: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, quantizer: Any, **tune: Any
) -> Any:
    """The gradient of x = [gate; up] [T, 2F] from that of silu(gate) * up * s [T, F]: a TE Float8Tensor with its
    transpose, cast with `quantizer`'s delayed scale and its amax raised into the quantizer's, or bf16 when
    `quantizer` is None. `tune` overrides `BACKWARD`."""
    _require_triton()
    rows, F = x.shape[0], x.shape[1] // 2
    grad = grad.contiguous()
    grid, sizes = _launch_shape(rows, F, x.device, {**BACKWARD, **tune})
    fp8 = quantizer is not None
    dx = torch.empty(rows, 2 * F, device=x.device, dtype=torch.uint8 if fp8 else x.dtype)
    dxt = torch.empty(2 * F, rows, device=x.device, dtype=torch.uint8) if fp8 else dx
    out_type, limit = _fp8_format(quantizer) if fp8 else (tl.float8e4nv, 0.0)
    scale_inv = torch.empty(1, device=x.device, dtype=torch.float32) if fp8 else dx
    _launch(
        _backward_kernel, grid, x.device, grad, x, scale.float(), dx, dxt,
        quantizer.amax.view(torch.int32) if fp8 else dx, quantizer.scale if fp8 else dx, scale_inv, rows, F, limit,
        FP8=fp8, OUT=out_type, **sizes,
    )  # fmt: skip
    return _float8_tensor(dx, dxt, scale_inv, quantizer, x.dtype) if fp8 else dx


def divide_columns(
    src: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None, accumulate: bool = False,
    skip: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """out = src / s (or out += src / s with `accumulate`) for src [N, K] and s [K], the quotient computed in fp32
    (exact for the powers of two Smooth-SwiGLU's scales are) and stored in out's dtype (src's for a new out): the
    smoothed linear_fc2's weight W / s, and its gradient's way back into W's fp32 main_grad, in one pass each.
    `skip` (a device flag, non-zero: leave out as it is) is TE's for a CUDA-graph replay that reuses its FP8 weight
    cast."""
    _require_triton()
    src = src.contiguous()
    out = torch.empty_like(src) if out is None else out
    assert out.is_contiguous() and out.shape == src.shape, "divide_columns writes a contiguous out of src's shape"
    block = 4096
    _launch(
        _divide_kernel, (_cdiv(src.numel(), block),), src.device, src, scale, out, out if skip is None else skip,
        src.numel(), src.shape[-1], SKIP=skip is not None, ACCUMULATE=accumulate, BLOCK=block, num_warps=8,
    )  # fmt: skip
    return out


class _SmoothSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor | None, out_quantizer: Any,
                grad_quantizer: Any) -> Any:  # fmt: skip
        ctx.save_for_backward(x, scale)
        ctx.grad_quantizer = grad_quantizer
        return smooth_swiglu_forward(x, scale, amax, out_quantizer)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None, None, None]:
        x, scale = ctx.saved_tensors
        return smooth_swiglu_backward(grad, x, scale, ctx.grad_quantizer), None, None, None, None


def smooth_swiglu(x: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, observe: bool, out_quantizer: Any,
                  grad_quantizer: Any) -> Any:  # fmt: skip
    """`smooth_swiglu_forward` under autograd, its backward `smooth_swiglu_backward` (x [T, 2F] on CUDA; `scale`
    and `amax` fp32 [F], the amax raised only with `observe`)."""
    return _SmoothSwiGLU.apply(x, scale, amax if observe else None, out_quantizer, grad_quantizer)
