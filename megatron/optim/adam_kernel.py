"""The precision-aware AdamW step (`states.adamw_update_`) as one fused Triton kernel per tensor, for CUDA.

The eager step decodes master, m and v to fp32, runs torch.optim.AdamW's arithmetic and re-encodes the three, about
30 passes over the tensor and 5.5 fp32 temporaries. This kernel reads the gradient and the encoded states once and
writes the new encodings once: 14 bytes per element in O2 (bf16 grad 2, fp16 master + int8 remainder 3 + 3, fp8 m
1 + 1, fp16 v 2 + 2), 28 for fp32 states and grads, plus 4 B per 128 elements and state for the scales.

Layout. A program takes ROWS whole scale blocks, a [ROWS, COLS] tile of the flattened tensor (row r = block r, COLS
the block size rounded up to a power of two, the excess columns and the partial last block masked). A new block
scale needs the block's amax of the *new* values, which then scale every element of the block: with whole blocks
in one program that is a row reduction in registers, so decode, update, amax and encode are one pass with no
temporaries in memory. Unscaled formats (fp32, bf16) take the same tiles. ROWS * COLS ~ 1024 elements per program
(`_TILE`); with 128-element blocks that is 8 blocks, enough work per program to stream at memory bandwidth.

Arithmetic: `adamw_update_`'s, operation for operation, in fp32, so that rounding to nearest gives the eager
result bit for bit (checked by tests/gpu/test_adam_kernel.py on every format):

    * IEEE division and square root (`div_rn`, `sqrt_rn`; Triton's `/` and `tl.sqrt` are approximate on GPUs) and no
      contraction of mul + add into fma (`enable_fp_fusion=False`) except where torch's kernels have one: lerp is
      `fma(w, g - m, m)` (CPU: `vec::fmadd`; CUDA: nvcc contracts `self + weight * (end - self)`), addcmul
      `fma(1 - b2, g * g, b2 v)` on CUDA (`a + alpha * (b * c)`, contracted) but `fma((1 - b2) g, g, b2 v)` on
      the CPU (`self + value * t1 * t2`, contracted by GCC). Compilers decide these, so `torch_roundings` checks
      them once per device type on a few thousand values and the kernel takes the matching variant.
    * Bias corrections: computed once per step by the same torch expressions on the device step tensor (float64),
      then read by every program as fp32 (the rounding torch applies when an fp32 tensor meets a 0-dim float64).
      An int step (the standalone functions) gives Python floats, and CUDA divides by those as a multiplication
      by the fp32 reciprocal: so does the kernel there (`step_scalars`).
    * Not matched: torch's CPU sqrt (MKL's, in the x86 builds) is not correctly rounded; the kernel's, like CUDA's,
      is. Against CPU tensors the update can then be an ulp off (the interpreter tests give the reference an IEEE
      sqrt).
    * Encodings as `ScaledState.encode_`: scale = T / amax (clamped to 2^126, 1 for an all-zero block), value *
      scale clamped to +-T, round to nearest even; the fp16 master's int8 remainder in quanta ulp/256, rounded half
      to even. fp8 and bf16 are rounded to their grid in fp32 bit arithmetic before the (then exact) cast, and bf16
      is cast on its bits: the same results as the hardware casts, and right under Triton's CPU interpreter too,
      whose fp8 and bf16 casts round wrongly (and garble bf16 subnormals).

found_inf: every program reads it first and, when nonzero, returns before touching memory: all encodings stay bit for
bit, decided on the device without a host sync.

Stochastic rounding (moments only, as the eager step): the same construction as `states.round_stochastically_`
(add a uniform integer below 2^d to the fp32 bit pattern, clear the d dropped bits; subnormals of the format
rounded to nearest by the cast), with the integers from Philox (`tl.philox`, 10 rounds) keyed by the optimizer's
`seed` and counted by (element index, step, tensor index): one call gives m's and v's numbers. The stream differs
from the eager path's torch.Generator (so a kernel run and an eager run are equal in distribution, not bitwise), but
it depends only on the seed, the step count and the layout: runs are deterministic and a run resumed from a
checkpoint (which holds the step and the seed) reproduces the uninterrupted one bit for bit.

Triton is imported on first use only (`available()` is False without it): the kernels are plain functions below,
wrapped by `triton.jit` in `_build()`. `python -m megatron.optim.adam_kernel` times the step on a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import struct
import time
from collections.abc import Sequence

import torch

from .states import BLOCK, ScaledState, adamw_update_

# Bound by `_build()` (triton.language); None until then, so that importing this module never imports Triton.
tl = None

_KINDS = {"fp32": 0, "bf16": 1, "fp16": 2, "fp8": 3}
# Elements per program and warps for them: 8 elements per thread (94 registers in O2 on sm_90, no spills). A larger
# block is one row of next_pow2(block) elements with proportionally more warps.
_TILE = 1024
_NUM_WARPS = 4
#: Set by tests under TRITON_INTERPRET=1 to step CPU tensors with the interpreted kernel (`available("cpu")`); off
#: otherwise, so that CPU runs keep the eager step and its torch.Generator stream whatever the environment says.
INTERPRET_ON_CPU = False
# A block is one row of registers, 32 warps at most: larger blocks are left to the eager step.
_MAX_BLOCK = 8192

State = ScaledState | torch.Tensor


# --------------------------------------------------------------------------------------------------------------------
# Kernel (plain functions: `_build()` wraps them with triton.jit and rebinds these names to the jitted versions)
# --------------------------------------------------------------------------------------------------------------------


# The rounding helpers (megatron/fp8/triton_rounding.py, shared with the FP8 gradient reduction's kernels), bound
# by `_build()`.
_round_bits = _to_fp8_grid = _to_fp32 = _to_bf16 = None


def _fp16_quantum(bits):
    """ulp / 256 of fp16 values given as int16 bits, and its inverse, as fp32 powers of two: 2^(max(e, 1) - 33) for
    the biased exponent e (subnormals share e = 1's ulp), built from the exponent bits (`states._fp16_quantum`)."""
    e = tl.maximum(((bits >> 10) & 0x1F).to(tl.int32), 1)
    quantum = ((e + (127 - 33)) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 + 33 - e) << 23).to(tl.float32, bitcast=True)
    return quantum, inverse


def _load_state(
    ptr, scale_ptr, rem_ptr, offs, mask, rows, row_mask, KIND: tl.constexpr, ROOT: tl.constexpr, REM: tl.constexpr
):
    """The fp32 values of a tile of a state (`ScaledState._read`): data (+ remainder * quantum, exact), / scale
    (IEEE division, as torch's), squared for the root encoding. Masked elements are 0 or garbage: never stored."""
    if KIND <= 1:
        x = _to_fp32(tl.load(ptr + offs, mask=mask, other=0.0))
    elif KIND == 3:
        x = tl.load(ptr + offs, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        raw = tl.load(ptr + offs, mask=mask, other=0.0)
        x = raw.to(tl.float32)
        if REM:
            quantum, _ = _fp16_quantum(raw.to(tl.int16, bitcast=True))
            x = x + tl.load(rem_ptr + offs, mask=mask, other=0).to(tl.float32) * quantum
    if KIND >= 2:
        scale = tl.load(scale_ptr + rows, mask=row_mask, other=1.0)
        x = tl.math.div_rn(x, scale[:, None])
        if ROOT:
            x = x * x
    return x


def _store_state(
    x,
    rnd,
    ptr,
    scale_ptr,
    rem_ptr,
    offs,
    mask,
    rows,
    row_mask,
    KIND: tl.constexpr,
    ROOT: tl.constexpr,
    REM: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    """Encode the fp32 tile x in place with new per-row (block) scales: `ScaledState.encode_`. Returns the fp32
    values the encoding now holds (what `_load_state` would read back) for the master's model copy; fp16 and fp32
    only, the master formats (moments' callers drop it)."""
    stored = x
    if KIND == 0:
        tl.store(ptr + offs, x, mask=mask)
    elif KIND == 1:
        tl.store(ptr + offs, _to_bf16(x, rnd, STOCHASTIC), mask=mask)
    else:
        if KIND == 3:
            target: tl.constexpr = 448.0
        else:
            target: tl.constexpr = 32768.0
        if ROOT:
            x = tl.sqrt_rn(tl.where(x < 0.0, 0.0, x))
        amax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1)
        # T / amax, at most 2^126 (`states.block_scales`): dividing by max(amax, T 2^-126) gives exactly that (both
        # exact powers of two apart) without an overflow to clamp; an all-zero block gets 1.
        scale = tl.math.div_rn(tl.full(amax.shape, target, tl.float32), tl.maximum(amax, target * 2.0**-126))
        scale = tl.where(amax == 0.0, 1.0, scale)
        y = tl.clamp(x * scale[:, None], -target, target, propagate_nan=tl.PropagateNan.ALL)
        if KIND == 3:
            y = _to_fp8_grid(y, rnd, STOCHASTIC)
            data = y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
            tl.store(ptr + offs, data.to(tl.uint8, bitcast=True), mask=mask)
        else:
            if STOCHASTIC and not REM:
                y = _round_bits(y, rnd, 13, True)
            data = y.to(tl.float16)  # round to nearest even (exact after stochastic rounding, but for subnormals)
            tl.store(ptr + offs, data, mask=mask)
            held = data.to(tl.float32)
            if REM:
                # The write's rounding error in quanta: a difference of neighbours and a power-of-two scaling, both
                # exact; rounded half to even by the 1.5 * 2^23 trick (|rest| <= 128), as torch.round.
                quantum, inverse = _fp16_quantum(data.to(tl.int16, bitcast=True))
                rest = (y - held) * inverse
                rest = (rest + 12582912.0) - 12582912.0
                rest = tl.minimum(tl.maximum(rest, -127.0), 127.0)
                tl.store(rem_ptr + offs, rest.to(tl.int8), mask=mask)
                held = held + rest * quantum
            stored = tl.math.div_rn(held, scale[:, None])
        tl.store(scale_ptr + rows, scale, mask=row_mask)
    return stored


def _store_model_copy(x, ptr, offs, mask, OUT_KIND: tl.constexpr):
    """The master's new value into the model's copy (OUT_KIND 1 fp32, 2 bf16, 3 fp16), rounded to nearest even as
    `Tensor.copy_` does: the update writes the weights the next forward reads, instead of a second pass decoding
    the master after the step."""
    if OUT_KIND == 1:
        tl.store(ptr + offs, x, mask=mask)
    elif OUT_KIND == 2:
        tl.store(ptr + offs, _to_bf16(x, 0, False), mask=mask)
    elif OUT_KIND == 3:
        tl.store(ptr + offs, x.to(tl.float16), mask=mask)


def _adamw_kernel(
    grad_ptr,
    p_ptr,
    p_scale_ptr,
    p_rem_ptr,
    m_ptr,
    m_scale_ptr,
    v_ptr,
    v_scale_ptr,
    coef_ptr,
    step_ptr,
    grad_scale_ptr,
    found_inf_ptr,
    out_ptr,
    n,
    decay,
    lerp_w,
    beta2,
    sq_w,
    eps,
    seed,
    index,
    P_KIND: tl.constexpr,
    P_ROOT: tl.constexpr,
    P_REM: tl.constexpr,
    M_KIND: tl.constexpr,
    M_ROOT: tl.constexpr,
    V_KIND: tl.constexpr,
    V_ROOT: tl.constexpr,
    OUT_KIND: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    LERP_SMALL: tl.constexpr,
    LERP_FMA: tl.constexpr,
    ADDCMUL: tl.constexpr,
    BC2_RECIPROCAL: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BLOCK: tl.constexpr,
    COLS: tl.constexpr,
    ROWS: tl.constexpr,
):
    """One AdamW step over ROWS scale blocks of one tensor; see the module docstring."""
    if HAS_FOUND_INF:
        run = tl.load(found_inf_ptr) == 0
    else:
        run = True
    if run:
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, COLS)
        offs = rows[:, None] * BLOCK + cols[None, :]
        if COLS == BLOCK:
            mask = offs < n  # no padding columns: keeps the mask's alignment visible (vectorized accesses)
        else:
            mask = (cols[None, :] < BLOCK) & (offs < n)
        row_mask = rows * BLOCK < n

        g = _to_fp32(tl.load(grad_ptr + offs, mask=mask, other=0.0))
        if HAS_GRAD_SCALE:
            g = tl.math.div_rn(g, tl.load(grad_scale_ptr).to(tl.float32))
        # Decoupled weight decay: p * (1 - lr wd); with wd = 0 a multiplication by 1, exact as the eager skip.
        p = _load_state(p_ptr, p_scale_ptr, p_rem_ptr, offs, mask, rows, row_mask, P_KIND, P_ROOT, P_REM) * decay
        m = _load_state(m_ptr, m_scale_ptr, m_ptr, offs, mask, rows, row_mask, M_KIND, M_ROOT, False)
        v = _load_state(v_ptr, v_scale_ptr, v_ptr, offs, mask, rows, row_mask, V_KIND, V_ROOT, False)
        # torch.lerp(m, g, w): m + w (g - m) for |w| < 0.5, else g - (g - m)(1 - w), the product and the sum fused
        # into one fma where torch's kernel is (LERP_FMA, see `torch_roundings`).
        if LERP_SMALL:
            if LERP_FMA:
                m = tl.fma(lerp_w, g - m, m)
            else:
                m = m + lerp_w * (g - m)
        else:
            if LERP_FMA:
                m = tl.fma(lerp_w - 1.0, g - m, g)
            else:
                m = g - (g - m) * (1.0 - lerp_w)
        # v * b2, then addcmul_(g, g, value=1 - b2) = v + (1 - b2) g g, associated and fused as torch's kernel is.
        v = v * beta2
        if ADDCMUL == 0:
            v = tl.fma(sq_w, g * g, v)
        elif ADDCMUL == 1:
            v = tl.fma(sq_w * g, g, v)
        elif ADDCMUL == 2:
            v = v + sq_w * (g * g)
        else:
            v = v + (sq_w * g) * g
        neg_step_size = tl.load(coef_ptr)
        bias_correction2_sqrt = tl.load(coef_ptr + 1)
        if BC2_RECIPROCAL:  # an int step on CUDA, see step_scalars
            denom = tl.sqrt_rn(v) * bias_correction2_sqrt + eps
        else:
            denom = tl.math.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
        p = p + tl.math.div_rn(m * neg_step_size, denom)

        if STOCHASTIC:
            # Philox counter (element index lo, hi, step, tensor index), key the seed: m and v take 2 of its 4 words.
            lo = offs.to(tl.uint32)
            zero = lo * 0
            step = tl.load(step_ptr).to(tl.int64).to(tl.uint32)
            rnd_m, rnd_v, _, _ = tl.philox(seed, lo, (offs >> 32).to(tl.uint32), zero + step, zero + index)
        else:
            rnd_m = 0
            rnd_v = 0
        _store_state(m, rnd_m, m_ptr, m_scale_ptr, m_ptr, offs, mask, rows, row_mask, M_KIND, M_ROOT, False, STOCHASTIC)
        _store_state(v, rnd_v, v_ptr, v_scale_ptr, v_ptr, offs, mask, rows, row_mask, V_KIND, V_ROOT, False, STOCHASTIC)
        p = _store_state(p, 0, p_ptr, p_scale_ptr, p_rem_ptr, offs, mask, rows, row_mask, P_KIND, P_ROOT, P_REM, False)
        _store_model_copy(p, out_ptr, offs, mask, OUT_KIND)


_TRITON = None


def _build():
    """Import Triton and jit the kernel functions (once); None if Triton is not installed."""
    global _TRITON, tl, _round_bits, _to_fp8_grid, _to_fp32, _to_bf16, _fp16_quantum, _load_state, _store_state
    global _store_model_copy, _adamw_kernel
    if _TRITON is None:
        try:
            import triton
            import triton.language
        except ImportError:
            _TRITON = False
            return None
        tl = triton.language
        # The kernel resolves its helpers through this module's globals: rebind them to their jitted versions.
        from megatron.fp8 import triton_rounding

        _round_bits, _to_fp8_grid = triton_rounding.round_bits, triton_rounding.to_fp8_grid
        _to_fp32, _to_bf16 = triton_rounding.to_fp32, triton_rounding.to_bf16
        _fp16_quantum, _load_state = triton.jit(_fp16_quantum), triton.jit(_load_state)
        _store_state, _store_model_copy = triton.jit(_store_state), triton.jit(_store_model_copy)
        _adamw_kernel = triton.jit(_adamw_kernel)
        _TRITON = triton
    return _TRITON or None


# --------------------------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------------------------


def interpreting() -> bool:
    """Whether Triton runs kernels with its CPU interpreter (TRITON_INTERPRET=1, read when Triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def available(device: torch.device | str | None = None) -> bool:
    """Whether `PrecisionAwareAdamW` steps tensors on `device` (default: CUDA) with the kernel: Triton importable and
    a CUDA device; the CPU only under Triton's interpreter with `INTERPRET_ON_CPU` set (tests)."""
    device = torch.device("cuda" if device is None else device)
    if device.type == "cuda":
        return torch.cuda.is_available() and _build() is not None
    return device.type == "cpu" and INTERPRET_ON_CPU and interpreting() and _build() is not None


_Layout = tuple[int, bool, bool, int | None]
#: What `torch_roundings` found where torch rounds like none of the kernel's variants (then within 1 ulp, not bitwise).
KERNEL_NOTES: list[str] = []


def _operands(state: State) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], _Layout]:
    """((data, scales, remainder) to pass, (kind, root, remainder, block or None when unscaled)). Absent tensors are
    passed as the data again (never read: the layout's flags say so); fp8 data as uint8, which the kernel bitcasts.
    ValueError for what the kernel cannot take: non-contiguous data, plain tensors other than fp32."""
    if isinstance(state, ScaledState):
        data, scales, remainder = state.data, state.scales, state.remainder
        if not data.is_contiguous():
            raise ValueError("a non-contiguous state")
        if state.dtype_name == "fp8":
            data = data.view(torch.uint8)
        layout = (_KINDS[state.dtype_name], state.root, remainder is not None, None if scales is None else state.block)
        return (data, data if scales is None else scales, data if remainder is None else remainder), layout
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"a plain {state.dtype} state of strides {state.stride()} (plain states: contiguous fp32)")
    return (state, state, state), (0, False, False, None)


_OUT_KINDS = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}


def _out_kind(copy: torch.Tensor | None, numel: int) -> int:
    """The kernel's OUT_KIND for a model copy; ValueError for one it cannot write."""
    if copy is None:
        return 0
    if copy.dtype not in _OUT_KINDS or not copy.is_contiguous() or copy.numel() != numel:
        raise ValueError(
            f"a model copy of {copy.dtype}, {copy.numel()} elements (contiguous fp32/bf16/fp16 of {numel})"
        )
    return _OUT_KINDS[copy.dtype]


def _block(layouts: tuple[_Layout, _Layout, _Layout]) -> int:
    """The scale block the states share (BLOCK, as a tile width, when none is scaled); ValueError if they differ."""
    blocks = {layout[3] for layout in layouts} - {None}
    if len(blocks) > 1:
        raise ValueError(f"scale blocks of different sizes {sorted(blocks)}")
    block = blocks.pop() if blocks else BLOCK
    if block > _MAX_BLOCK:
        raise ValueError(f"scale blocks of {block} elements (at most {_MAX_BLOCK})")
    return block


def unsupported(master: State, exp_avg: State, exp_avg_sq: State) -> str | None:
    """Why the kernel cannot step these states, or None: the scaled ones must share one block size (at most
    _MAX_BLOCK), the data be contiguous, plain tensors fp32."""
    try:
        _block(tuple(_operands(state)[1] for state in (master, exp_avg, exp_avg_sq)))
    except ValueError as exc:
        return str(exc)
    return None


def supports(masters: Sequence[State], exp_avgs: Sequence[State], exp_avg_sqs: Sequence[State]) -> bool:
    """Whether `unsupported` finds nothing for every tensor."""
    return all(unsupported(p, m, v) is None for p, m, v in zip(masters, exp_avgs, exp_avg_sqs))


@functools.lru_cache(maxsize=64)
def _config(
    layouts: tuple[_Layout, _Layout, _Layout], out_kind: int, flags: tuple[bool, ...], tile: int, warps: int
) -> tuple:
    """(block, rows per program, launch keywords: the constexprs, warps and no fp fusion) for these layouts and the
    model copy's kind (`_OUT_KINDS`, 0 for none)."""
    (p_kind, p_root, p_rem, _), (m_kind, m_root, _, _), (v_kind, v_root, _, _) = layouts
    block = _block(layouts)
    cols = 1 << (block - 1).bit_length()
    rows = max(1, tile // cols)
    # A block beyond the tile is one row: more warps keep it at the tile's elements per thread (no spills).
    warps = min(32, warps * max(1, cols // tile))
    has_grad_scale, has_found_inf, lerp_small, lerp_fma, addcmul, bc2_reciprocal, stochastic = flags
    keywords = dict(
        P_KIND=p_kind,
        P_ROOT=p_root,
        P_REM=p_rem,
        M_KIND=m_kind,
        M_ROOT=m_root,
        V_KIND=v_kind,
        V_ROOT=v_root,
        OUT_KIND=out_kind,
        HAS_GRAD_SCALE=has_grad_scale,
        HAS_FOUND_INF=has_found_inf,
        LERP_SMALL=lerp_small,
        LERP_FMA=lerp_fma,
        ADDCMUL=addcmul,
        BC2_RECIPROCAL=bc2_reciprocal,
        STOCHASTIC=stochastic,
        BLOCK=block,
        COLS=cols,
        ROWS=rows,
        num_warps=warps,
        enable_fp_fusion=False,
    )
    return block, rows, keywords


@functools.cache
def _roundings(device_type: str) -> tuple[bool, int]:
    device = torch.device(device_type)
    gen = torch.Generator().manual_seed(0)
    a, b, v = (torch.randn(4096, generator=gen) for _ in range(3))
    w, alpha, beta2 = _fp32(0.1), _fp32(0.05), _fp32(0.95)
    # The candidates in fp32 on the CPU (one rounding per op; an fma as fp64 product and sum rounded to fp32, which
    # rounds twice only on ties of the fp64 sum: ~2^-29 of the values).
    fma = lambda x, y, z: (x.double() * y.double() + z.double()).float()  # noqa: E731
    lerp = torch.lerp(a.to(device), b.to(device), w).cpu()
    lerp_fma = torch.equal(lerp, fma(torch.full_like(a, w), b - a, a))
    if not lerp_fma and not torch.equal(lerp, a + w * (b - a)):
        KERNEL_NOTES.append(f"torch.lerp on {device_type} rounds like no candidate: the kernel's m may be 1 ulp off")
    vb = v.abs() * beta2
    got = v.abs().to(device).mul(beta2).addcmul_(b.to(device), b.to(device), value=alpha).cpu()
    candidates = [fma(torch.full_like(b, alpha), b * b, vb), fma(alpha * b, b, vb), vb + alpha * (b * b)]
    candidates.append(vb + (alpha * b) * b)
    matches = [i for i, candidate in enumerate(candidates) if torch.equal(got, candidate)]
    if not matches:
        KERNEL_NOTES.append(f"addcmul on {device_type} rounds like no candidate: the kernel's v may be 1 ulp off")
    return lerp_fma, matches[0] if matches else 0


def torch_roundings(device: torch.device) -> tuple[bool, int]:
    """How torch's lerp and addcmul round on `device`, which the kernel then does too: (whether lerp fuses its
    product and sum into an fma, which association and fusion addcmul_'s v + a g g has: 0 fma(a, g g, v) (CUDA's
    `a + alpha * (b * c)`, contracted by nvcc), 1 fma(a g, g, v) (the CPU's `self + value * t1 * t2`, contracted by
    GCC), 2 and 3 those two unfused). Found once per device type by running both ops on 4096 values against
    fp32 emulations (one host sync, at the first step); a build matching none is noted in KERNEL_NOTES."""
    return _roundings(device.type)


def step_scalars(
    step: int | torch.Tensor, lr: float, beta1: float, beta2: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(fp32 [neg_step_size, bias_correction2_sqrt or its reciprocal], float64 step, whether the reciprocal) on
    `device`: `adamw_update_`'s expressions (on the device for a tensor step: no host sync), rounded to fp32 as torch
    does when they meet the fp32 moments. An int step makes them Python floats there, and CUDA's division by a
    Python scalar multiplies by its fp32 reciprocal (`div_true_kernel_cuda`; the CPU's divides): so does the kernel."""
    if isinstance(step, torch.Tensor):
        step = step.to(device=device, dtype=torch.float64)
        neg_step_size = -lr / (1 - torch.pow(beta1, step))
        bias_correction2_sqrt = (1 - torch.pow(beta2, step)).sqrt()
        return torch.stack([neg_step_size, bias_correction2_sqrt]).float(), step.reshape(()), False
    neg_step_size, bias_correction2_sqrt = -(lr / (1 - beta1**step)), math.sqrt(1 - beta2**step)
    reciprocal = device.type == "cuda"
    if reciprocal:
        bias_correction2_sqrt = 1.0 / _fp32(bias_correction2_sqrt)  # 1 / fp32 in fp64, then to fp32: exact as fp32's
    coef = torch.tensor([neg_step_size, bias_correction2_sqrt], dtype=torch.float32, device=device)
    return coef, torch.tensor(float(step), dtype=torch.float64, device=device), reciprocal


def _fp32(x: float) -> float:
    """x rounded to nearest fp32 (what torch does with a Python scalar in an fp32 op), as a Python float."""
    return struct.unpack("f", struct.pack("f", x))[0]


def adamw_step_(
    masters: Sequence[State],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[State],
    exp_avg_sqs: Sequence[State],
    weight_decays: Sequence[float],
    *,
    lr: float | Sequence[float],
    beta1: float,
    beta2: float,
    eps: float,
    step: int | torch.Tensor,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    seed: int | None = None,
    model_copies: Sequence[torch.Tensor | None] | None = None,
) -> None:
    """`adamw_update_` on every tensor i, one kernel launch each, no host synchronisation. `lr`: one for all
    tensors or one per tensor (the tensors sharing a rate are launched together).

    Same arguments as `adamw_update_` (states: ScaledStates or contiguous fp32 tensors on one device, see
    `unsupported`; grads fp32, bf16 or fp16), except `seed`: None rounds the moments to nearest (bit for bit the
    eager result), an int rounds them stochastically with Philox keyed by it and counted by (element, step, i). The
    bias corrections are computed once for all tensors: from a device step tensor without a host sync (an int step
    is copied to the device). `grad_scale`, `found_inf`: 0-dim tensors, best on the device (a CPU one is copied
    there, and a CPU grad_scale then divides where CUDA's eager step multiplies by its reciprocal: 1 ulp apart).
    `model_copies[i]`: a contiguous fp32, bf16 or fp16 tensor of master i's size (or None) that receives the new
    master as `copy_(master.decode())` would, written by the same pass (left alone on a skipped step)."""
    count = len(masters)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(weight_decays) == count):
        raise ValueError(
            f"{len(grads)} grads, {len(exp_avgs)} exp_avg, {len(exp_avg_sqs)} exp_avg_sq and {len(weight_decays)}"
            f" weight decays for {count} masters: pass one of each per tensor"
        )
    copies = [None] * count if model_copies is None else list(model_copies)
    if len(copies) != count:
        raise ValueError(f"{len(copies)} model copies for {count} masters: pass one (or None) per tensor")
    items = list(zip(range(count), masters, grads, exp_avgs, exp_avg_sqs, weight_decays, copies))
    lrs = [lr] * count if isinstance(lr, (int, float)) else list(lr)
    if len(lrs) != count:
        raise ValueError(f"{len(lrs)} learning rates for {count} masters: pass one, or one per tensor")
    for rate in dict.fromkeys(lrs):  # the bias-corrected step size is computed once per rate
        group = [item for item, r in zip(items, lrs) if r == rate]
        _launch(group, rate, beta1, beta2, eps, step, grad_scale, found_inf, seed)


def _launch(
    items: list[tuple[int, State, torch.Tensor, State, State, float, torch.Tensor | None]],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int | torch.Tensor,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    seed: int | None,
) -> None:
    if not items:
        return
    triton = _build()
    if triton is None:
        raise RuntimeError("the fused AdamW step needs Triton (pip install triton); states.adamw_update_ does not")
    first = items[0][1]
    device = (first.data if isinstance(first, ScaledState) else first).device
    coef, step_tensor, bc2_reciprocal = step_scalars(step, lr, beta1, beta2, device)
    if grad_scale is not None:
        grad_scale = grad_scale.to(device).reshape(1)
    if found_inf is not None:
        found_inf = found_inf.to(device).reshape(1)
        found_inf = found_inf if found_inf.is_floating_point() else found_inf.float()
    lerp_w = _fp32(1 - beta1)
    scalars = (_fp32(beta2), _fp32(1 - beta2), _fp32(eps))
    lerp_fma, addcmul = torch_roundings(device)
    flags = (grad_scale is not None, found_inf is not None, abs(lerp_w) < 0.5, lerp_fma, addcmul, bc2_reciprocal)
    flags += (seed is not None,)
    placeholders = (coef if grad_scale is None else grad_scale, coef if found_inf is None else found_inf)
    # Philox keys are 64-bit: any int seed is folded into [0, 2^63).
    seed_key = 0 if seed is None else int(seed) % (1 << 63)
    decays: dict[float, float] = {}
    launches = []  # all checked before the first launch: a refused tensor leaves every state as it was
    for index, master, grad, m, v, wd, copy in items:
        try:
            (p_ops, p_layout), (m_ops, m_layout), (v_ops, v_layout) = (_operands(s) for s in (master, m, v))
            out_kind = _out_kind(copy, p_ops[0].numel())
            block, rows, keywords = _config((p_layout, m_layout, v_layout), out_kind, flags, _TILE, _NUM_WARPS)
        except ValueError as exc:
            raise ValueError(
                f"the fused AdamW step does not handle {exc} (tensor {index}): use adamw_update_"
            ) from None
        n = p_ops[0].numel()
        if grad.numel() != n:
            raise ValueError(f"a gradient of {grad.numel()} elements for a parameter of {n}; pass its own grad")
        if wd not in decays:
            decays[wd] = _fp32(1 - lr * wd)
        programs = (n + block * rows - 1) // (block * rows)  # whole blocks, ROWS of them per program
        out = grad if copy is None else copy  # absent: never written (OUT_KIND 0)
        operands = (grad.reshape(-1), *p_ops, m_ops[0], m_ops[1], v_ops[0], v_ops[1], coef, step_tensor, *placeholders)
        operands += (out,)
        if n:
            launches.append((programs, (*operands, n, decays[wd], lerp_w, *scalars, seed_key, index), keywords))
    # Triton launches on the current device: make it the tensors' (a rank's tensors need not be on cuda:0).
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        for programs, args, keywords in launches:
            _adamw_kernel[(programs,)](*args, **keywords)


# --------------------------------------------------------------------------------------------------------------------
# Timing (python -m megatron.optim.adam_kernel, on a GPU)
# --------------------------------------------------------------------------------------------------------------------


def _llama_1b_pieces(numel: int) -> list[int]:
    """Tensor sizes like half of llama-1b's (hidden 2048, ffn 8192, 8 kv heads of 64, vocabulary 128256: the pieces
    of one rank of two with the distributed optimizer), cycled until `numel` elements in all (the last one cut)."""
    layer = [2048 * 3072 // 2, 2048 * 2048 // 2, 2048 * 16384 // 2, 8192 * 2048 // 2, 2048, 2048]
    sizes: list[int] = []
    for size in itertools.chain([128256 * 2048 // 2], itertools.cycle(layer)):
        size = min(size, numel - sum(sizes))
        if size <= 0:
            return sizes
        sizes.append(size)
    return sizes


def _time_ms(fn, steps: int) -> tuple[float, float]:
    """(device ms per call, host ms per call to enqueue it) over `steps` calls after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    host = time.perf_counter()
    for _ in range(steps):
        fn()
    host = time.perf_counter() - host
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps, 1e3 * host / steps


def _o2_states(sizes: list[int], device: torch.device) -> tuple[list, list, list, list]:
    """(bf16 grads, fp16 + remainder masters, fp8 m, fp16 v) of these sizes, random values of typical magnitudes."""
    gen = torch.Generator(device).manual_seed(0)
    grads = [torch.randn(s, device=device, generator=gen).mul_(1e-3).bfloat16() for s in sizes]
    masters = [
        ScaledState(torch.randn(s, device=device, generator=gen).mul_(0.02), "fp16", remainder=True) for s in sizes
    ]
    return (
        grads,
        masters,
        [ScaledState(g.float(), "fp8") for g in grads],
        [ScaledState(g.float() ** 2, "fp16") for g in grads],
    )


def benchmark(numel: int = 550_000_000, steps: int = 20, eager_steps: int = 3) -> dict[str, float]:
    """ms per step for `numel` elements in llama-1b-like tensors, O2 (bf16 grads, fp16 master + remainder, fp8 m,
    fp16 v): the kernel rounding stochastically and to nearest, for a few tile shapes, against `adamw_update_` (the
    eager step) and torch's fused AdamW on fp32 states. Prints a table; returns {name: ms per step}."""
    global _TILE, _NUM_WARPS
    if not available():
        raise RuntimeError("the benchmark needs a CUDA GPU and Triton")
    device = torch.device("cuda")
    sizes = _llama_1b_pieces(numel)
    grads, masters, exp_avgs, exp_avg_sqs = _o2_states(sizes, device)
    decays = [0.1 if s > 2048 else 0.0 for s in sizes]
    step = torch.ones((), dtype=torch.float64, device=device)
    found_inf, grad_scale = torch.zeros((), device=device), torch.ones((), device=device)
    hyper = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, step=step, grad_scale=grad_scale, found_inf=found_inf)
    state_bytes = sum(s.nbytes for states in (masters, exp_avgs, exp_avg_sqs) for s in states)
    moved = sum(g.numel() * g.element_size() for g in grads) + 2 * state_bytes
    total = sum(sizes)
    print(f"{total / 1e6:.1f}M elements in {len(sizes)} tensors, O2: bf16 grads, fp16 master + int8 remainder, fp8 m,")
    print(f"fp16 v: {moved / total:.2f} B/element moved; {torch.cuda.get_device_name()}")
    results: dict[str, float] = {}
    default = _TILE, _NUM_WARPS
    try:
        for seed, mode in ((0, "stochastic"), (None, "nearest")):
            for tile, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8)):
                _TILE, _NUM_WARPS = tile, warps
                ms, host = _time_ms(
                    lambda seed=seed: adamw_step_(masters, grads, exp_avgs, exp_avg_sqs, decays, **hyper, seed=seed),
                    steps,
                )
                name = f"kernel {mode}, tile {tile}, {warps} warps"
                results[name] = ms
                print(f"  {name:<42} {ms:8.2f} ms/step  {moved / ms / 1e9:5.2f} TB/s  (host: {host:.2f} ms to launch)")
    finally:
        _TILE, _NUM_WARPS = default
    eager_gen = torch.Generator(device).manual_seed(0)

    def eager() -> None:
        for p, g, m, v, wd in zip(masters, grads, exp_avgs, exp_avg_sqs, decays):
            adamw_update_(p, g, m, v, weight_decay=wd, **hyper, generator=eager_gen)

    name = "eager adamw_update_, stochastic"
    results[name], _ = _time_ms(eager, eager_steps)
    print(f"  {name:<42} {results[name]:8.2f} ms/step")
    for states in (masters, exp_avgs, exp_avg_sqs):
        states.clear()  # room for the fp32 states
    params = [torch.zeros(s, device=device, requires_grad=True) for s in sizes]
    for p, g in zip(params, grads):
        p.grad = g.float()
    name = "torch fused AdamW, fp32 states and grads"
    results[name], _ = _time_ms(torch.optim.AdamW(params, lr=1e-4, fused=True).step, steps)
    print(f"  {name:<42} {results[name]:8.2f} ms/step")
    return results


if __name__ == "__main__":
    benchmark()
