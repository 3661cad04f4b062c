"""Rounding helpers for Triton kernels that must write exactly what torch writes, on CUDA and under Triton's CPU
interpreter alike: fp32 rounded by its bits (nearest even or stochastic), onto the e4m3 grid (so that the fp8 cast
that follows is exact: the interpreter's own fp8 cast does not round to nearest even), and bf16 widened through its
bits (the interpreter's bf16 cast garbles subnormals). Used by the fused AdamW step (megatron/optim/adam_kernel.py)
and the FP8 gradient reduction (megatron/parallel/fp8_reduce_kernels.py).

Triton is imported on first use only: the helpers are plain functions below until `build()` wraps them with
triton.jit, so that this module imports on a machine without Triton (the CPU build of torch brings none).
"""

from __future__ import annotations

from types import ModuleType

# Bound by `build()` (triton.language); None until then.
tl = None


def round_bits(x, rnd, DROPPED: tl.constexpr, STOCHASTIC: tl.constexpr):
    """fp32 x with its DROPPED low mantissa bits cleared: rounded to nearest even, or up with probability (dropped
    part) / ulp using the uniform uint32 `rnd` (its top DROPPED bits). Sign-magnitude bits: the same for negative
    values, a carry moves into the exponent; NaN is kept."""
    bits = x.to(tl.int32, bitcast=True)
    if STOCHASTIC:
        bias = (rnd >> (32 - DROPPED)).to(tl.int32)
    else:
        bias = ((bits >> DROPPED) & 1) + ((1 << (DROPPED - 1)) - 1)
    rounded = ((bits + bias) & -(1 << DROPPED)).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded)


def to_fp8_grid(y, rnd, STOCHASTIC: tl.constexpr):
    """y (|y| <= 448) rounded onto the e4m3 grid in fp32, as torch's cast (nearest even) or `round_stochastically_`
    then the cast (stochastic above e4m3's smallest normal 2^-6, the cast's nearest below): the cast that follows is
    exact. Below 2^-6 the grid is the fixed step 2^-9: |x| + 1.5 * 2^14 has exactly that ulp, so the add rounds it
    to nearest even and the subtraction is exact; the sign is put back so that -0 stays -0 as in torch."""
    rounded = round_bits(y, rnd, 20, STOCHASTIC)
    if STOCHASTIC:
        src = rounded
    else:
        src = y
    mag = tl.abs(src)
    sub = (mag + 24576.0) - 24576.0
    sign = src.to(tl.int32, bitcast=True) & -2147483648
    sub = (sub.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(mag < 0.015625, sub, rounded)


def to_fp32(raw):
    """Loaded values as fp32; bf16 through its bits (exact: the top half of the fp32 pattern), which is what the
    hardware does and what Triton's interpreter, whose bf16 casts garble subnormals, does not."""
    if raw.dtype == tl.bfloat16:
        return (raw.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return raw.to(tl.float32)


def e4m3_to_fp32(code):
    """e4m3 (float8_e4m3fn) bytes, as integers, to fp32 through their bits: exact, with NaN for 0x7F / 0xFF (the
    interpreter's fp8 cast does not know e4m3fn's NaN). Normal codes are (1 + m / 8) 2^(e - 7), subnormal m 2^-9."""
    code = code.to(tl.int32)
    exponent = (code >> 3) & 0xF
    mantissa = code & 0x7
    normal = ((exponent + 120) << 23) | (mantissa << 20)
    value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))
    value = tl.where((code & 0x80) != 0, -value, value)
    return tl.where((code & 0x7F) == 0x7F, float("nan"), value)


def to_bf16(x, rnd, STOCHASTIC: tl.constexpr):
    """fp32 x as bf16, rounded to nearest even (or stochastically): the rounded pattern's top half, an exact cast
    done on the bits as in `to_fp32`."""
    top = round_bits(x, rnd, 16, STOCHASTIC).to(tl.int32, bitcast=True) >> 16
    return top.to(tl.int16).to(tl.bfloat16, bitcast=True)


def build() -> ModuleType:
    """Import Triton and jit the helpers (once), rebinding this module's names to the jitted versions; returns the
    triton module. ImportError without Triton. A kernel calling the helpers takes them from here after this call."""
    global tl, round_bits, to_fp8_grid, to_fp32, e4m3_to_fp32, to_bf16
    import triton
    import triton.language

    if tl is None:
        # to_fp8_grid and to_bf16 resolve round_bits through this module's globals: the jitted version from here on.
        round_bits, to_fp8_grid, to_fp32 = triton.jit(round_bits), triton.jit(to_fp8_grid), triton.jit(to_fp32)
        e4m3_to_fp32, to_bf16 = triton.jit(e4m3_to_fp32), triton.jit(to_bf16)
        tl = triton.language
    return triton
