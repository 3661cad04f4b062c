"""Triton kernels of the FP8 gradient reduction (megatron/parallel/fp8_reduce.py), one pass over memory each:

    encode    a bucket's 128-element blocks -> e4m3 bytes and E8M0 scale bytes, with the saturated / flushed counts
    decode    the dp received chunks -> their fp32 sum in rank order (divided by dp when averaging), in the
              bucket's dtype; or each row dequantized into its own shard (the all-reduce's gather)

The eager path of fp8_reduce.py is about twenty full-size elementwise passes (abs, amax, scale, clamp, cast, the
counting) on the compute stream; these write the same bits in two. The formulas are fp8_reduce.py's; where torch's
ops would be re-derived here (the power-of-two scale, the E8M0 byte, the rounding to e4m3) the kernels work on fp32
bit patterns, so no division, logarithm or cast can round differently. Used where Triton is (CUDA, or its CPU
interpreter in tests): the kernels are plain functions until `build()` (called by each launcher) imports Triton and
wraps them with triton.jit, so that this module imports on a machine without Triton.
"""

from __future__ import annotations

from types import ModuleType

import torch

from megatron.fp8 import triton_rounding

# Bound by `build()`: triton.language and the shared rounding helpers (jitted); None until then.
tl = None
e4m3_to_fp32 = to_bf16 = to_fp8_grid = to_fp32 = None

#: 128-element blocks per program.
_GROUP = 32
_NUM_WARPS = 4


def _encode_kernel(
    x_ptr, payload_ptr, counts_ptr, n_blocks, blocks_per_row, cols, BLOCK: tl.constexpr, GROUP: tl.constexpr
):
    b = tl.program_id(0) * GROUP + tl.arange(0, GROUP)
    live = b < n_blocks
    e = tl.arange(0, BLOCK)
    mask = live[:, None]
    x = to_fp32(tl.load(x_ptr + b[:, None].to(tl.int64) * BLOCK + e[None, :], mask=mask, other=0.0))
    # amax with NaN propagated (tl.max drops NaN): the whole block's scale is then NaN, as in torch
    nans = tl.sum((x != x).to(tl.int32), axis=1)
    amax = tl.max(tl.abs(x), axis=1)
    # scale = 2^floor(log2(448 / amax)), from amax's bits: amax = m 2^E, m in [1, 2): 448 / amax = (1.75 / m) 2^(8-E),
    # so the exponent is 8 - E, one less when m > 1.75 (mantissa field above 0x600000). Subnormal amax overflows
    # 448 / amax: fp32 max, rounded down to 2^127; 0 -> 1; inf -> 0; NaN -> NaN.
    bits = amax.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    k = 135 - biased - ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    k = tl.where(biased == 0, 127, tl.minimum(k, 127))
    k = tl.where(amax == 0, 0, k)
    scale = ((k + 127) << 23).to(tl.float32, bitcast=True)
    scale = tl.where(biased == 0xFF, 0.0, scale)
    scale = tl.where(nans > 0, float("nan"), scale)
    scaled = x * scale[:, None]
    q = to_fp8_grid(tl.minimum(tl.maximum(scaled, -448.0), 448.0), 0, False)  # the cast below is then exact
    q = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    nan_code = 0x7F | ((scaled.to(tl.int32, bitcast=True) >> 24) & 0x80)  # NaN keeps its sign, as torch's cast
    q = tl.where(scaled != scaled, nan_code.to(tl.uint8), q)
    row = b // blocks_per_row
    base = row.to(tl.int64) * (cols + blocks_per_row)
    tl.store(payload_ptr + base[:, None] + (b % blocks_per_row)[:, None] * BLOCK + e[None, :], q, mask=mask)
    # the decode scale 2^-k as its E8M0 byte 127 - k; NaN (255) for a scale of 0 or NaN
    code = tl.where((scale > 0) & (biased != 0xFF), 127 - k, 255)
    tl.store(payload_ptr + base + cols + b % blocks_per_row, code.to(tl.uint8), mask=live)
    saturated = tl.sum(tl.sum((tl.abs(scaled) > 448.0).to(tl.int32), axis=1), axis=0)
    flushed = tl.sum(tl.sum(((x != 0) & ((q & 0x7F) == 0) & mask).to(tl.int32), axis=1), axis=0)
    tl.store(counts_ptr + tl.program_id(0) * 2, saturated)
    tl.store(counts_ptr + tl.program_id(0) * 2 + 1, flushed)


def _dequantized(row_ptr, b, e, mask, cols, BLOCK: tl.constexpr):
    """Blocks `b` of one payload row in fp32: each e4m3 value times its block's 2^(byte - 127), exact."""
    q = tl.load(row_ptr + b[:, None].to(tl.int64) * BLOCK + e[None, :], mask=mask, other=0)
    q = e4m3_to_fp32(q)
    code = tl.load(row_ptr + cols + b, mask=b * BLOCK < cols, other=127).to(tl.int32)
    scale = tl.where(code == 0, 0x400000, code << 23).to(tl.float32, bitcast=True)  # code 0: 2^-127, subnormal
    scale = tl.where(code == 255, float("nan"), scale)
    return q * scale[:, None]


def _store_narrowed(ptrs, x, mask):
    """fp32 x stored in the pointers' dtype (fp32, or bf16 rounded to nearest even as torch's copy_)."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        tl.store(ptrs, to_bf16(x, 0, False), mask=mask)
    else:
        tl.store(ptrs, x, mask=mask)


def _decode_kernel(
    payload_ptr,
    out_ptr,
    cols,
    divisor,
    DP: tl.constexpr,
    SUM: tl.constexpr,
    AVERAGE: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
):
    b = tl.program_id(0) * GROUP + tl.arange(0, GROUP)
    e = tl.arange(0, BLOCK)
    mask = (b * BLOCK < cols)[:, None]
    width = cols + cols // BLOCK
    offsets = b[:, None].to(tl.int64) * BLOCK + e[None, :]
    if SUM:  # rank order, each addition rounded once in fp32, as fp8_reduce.py's loop
        acc = _dequantized(payload_ptr, b, e, mask, cols, BLOCK)
        # DP is a constexpr (a run's data-parallel size is fixed): Triton's interpreter cannot bound a loop by a
        # runtime argument under numpy 2
        for r in range(1, DP):
            acc += _dequantized(payload_ptr + r * width, b, e, mask, cols, BLOCK)
        if AVERAGE:
            acc = tl.math.div_rn(acc, divisor)  # correctly rounded, as torch's division (Triton's `/` is not)
        _store_narrowed(out_ptr + offsets, acc, mask)
    else:  # row r into shard r
        r = tl.program_id(1)
        values = _dequantized(payload_ptr + r.to(tl.int64) * width, b, e, mask, cols, BLOCK)
        _store_narrowed(out_ptr + r.to(tl.int64) * cols + offsets, values, mask)


_BUILT = False


def build() -> ModuleType:
    """Import Triton and jit the kernels (once), rebinding this module's names to the jitted versions; returns the
    triton module. ImportError without Triton (fp8_reduce then takes its torch path)."""
    global _BUILT, tl, e4m3_to_fp32, to_bf16, to_fp8_grid, to_fp32
    global _encode_kernel, _dequantized, _store_narrowed, _decode_kernel
    triton = triton_rounding.build()
    if not _BUILT:
        # The kernels resolve their helpers through this module's globals: the jitted versions from here on.
        tl = triton.language
        e4m3_to_fp32, to_bf16 = triton_rounding.e4m3_to_fp32, triton_rounding.to_bf16
        to_fp8_grid, to_fp32 = triton_rounding.to_fp8_grid, triton_rounding.to_fp32
        _encode_kernel, _dequantized = triton.jit(_encode_kernel), triton.jit(_dequantized)
        _store_narrowed, _decode_kernel = triton.jit(_store_narrowed), triton.jit(_decode_kernel)
        _BUILT = True
    return triton


def encode(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] contiguous (fp32 or bf16; cols a multiple of `block`) -> (payload uint8 [rows, cols + cols /
    block], counts int32 [programs, 2]: saturated and flushed values per program)."""
    triton = build()
    rows, cols = x.shape
    n_blocks = rows * cols // block
    programs = triton.cdiv(n_blocks, _GROUP)
    payload = torch.empty(rows, cols + cols // block, dtype=torch.uint8, device=x.device)
    counts = torch.empty(programs, 2, dtype=torch.int32, device=x.device)
    _encode_kernel[(programs,)](
        x, payload, counts, n_blocks, cols // block, cols, BLOCK=block, GROUP=_GROUP, num_warps=_NUM_WARPS
    )
    return payload, counts


def decode_sum(payload: torch.Tensor, cols: int, block: int, out: torch.Tensor, average: bool) -> None:
    """out [cols] (fp32 or bf16) = the sum over payload's rows of their dequantized values, in row order, in fp32,
    divided by the number of rows when `average`."""
    triton = build()
    dp = payload.shape[0]
    grid = (triton.cdiv(cols // block, _GROUP),)
    _decode_kernel[grid](
        payload,
        out,
        cols,
        float(dp),
        DP=dp,
        SUM=True,
        AVERAGE=average,
        BLOCK=block,
        GROUP=_GROUP,
        num_warps=_NUM_WARPS,
    )


def decode_rows(payload: torch.Tensor, cols: int, block: int, out: torch.Tensor) -> None:
    """out [rows * cols] (fp32 or bf16): row r of payload dequantized into out[r * cols:(r + 1) * cols]."""
    triton = build()
    rows = payload.shape[0]
    grid = (triton.cdiv(cols // block, _GROUP), rows)
    _decode_kernel[grid](
        payload, out, cols, 1.0, DP=1, SUM=False, AVERAGE=False, BLOCK=block, GROUP=_GROUP, num_warps=_NUM_WARPS
    )
