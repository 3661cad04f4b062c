"""The fused AdamW step's Triton source (launched by `adam_kernel.py`): plain functions that `build()` wraps with
triton.jit on first use, so that importing this module never imports Triton.

Layout. A program takes ROWS whole scale blocks, a [ROWS, COLS] tile of the flattened tensor (row r = block r, COLS
the block size rounded up to a power of two, the excess columns and the partial last block masked). A new block
scale needs the block's amax of the *new* values, which then scale every element of the block: with whole blocks
in one program that is a row reduction in registers, so decode, update, amax and encode are one pass with no
temporaries in memory. Unscaled formats (fp32, bf16) take the same tiles. ROWS * COLS ~ 1024 elements per program
(`adam_kernel._TILE`); with 128-element blocks that is 8 blocks, enough work per program to stream at memory
bandwidth.

Arithmetic: `adamw_update_`'s, operation for operation, in fp32, so that rounding to nearest gives the eager
result bit for bit (checked by tests/gpu/test_adam_kernel.py on every format):

    * IEEE division and square root (`div_rn`, `sqrt_rn`; Triton's `/` and `tl.sqrt` are approximate on GPUs) and no
      contraction of mul + add into fma (`enable_fp_fusion=False`) except where torch's kernels have one: lerp is
      `fma(w, g - m, m)` (CPU: `vec::fmadd`; CUDA: nvcc contracts `self + weight * (end - self)`), addcmul
      `fma(1 - b2, g * g, b2 v)` on CUDA (`a + alpha * (b * c)`, contracted) but `fma((1 - b2) g, g, b2 v)` on
      the CPU (`self + value * t1 * t2`, contracted by GCC). Compilers decide these, so `adam_kernel.torch_roundings`
      checks them once per device type on a few thousand values and the kernel takes the matching variant.
    * Divisions by a block scale (decoding a state, the master's held value) take one reciprocal per block and
      correct each x * RN(1 / scale) by its exact residual (`_divide_rows`): the same correctly rounded quotient
      with a multiplication and two fma in place of a division per element.
    * Bias corrections: computed once per step by the same torch expressions on the device step tensor (float64),
      then read by every program as fp32 (the rounding torch applies when an fp32 tensor meets a 0-dim float64).
      An int step (the standalone functions) gives Python floats, and CUDA divides by those as a multiplication
      by the fp32 reciprocal: so does the kernel there (`adam_kernel.step_scalars`).
    * Not matched: torch's CPU sqrt (MKL's, in the x86 builds) is not correctly rounded; the kernel's, like CUDA's,
      is. Against CPU tensors the update can then be an ulp off (the interpreter tests give the reference an IEEE
      sqrt).
    * Not matched either: Triton links CUDA's libdevice in flush-to-zero mode (its sm_90 SASS calls
      `__cuda_sm3x_div_rn_ftz_f32_slowpath`), so a quotient below 2^-126 comes out 0 where torch keeps the
      subnormal: "bit for bit" holds for normal values. The update then moves by less than lr * 2^-126 / eps.
    * Encodings as `ScaledState.encode_`: scale = T / amax (clamped to 2^126, 1 for an all-zero block), value *
      scale clamped to +-T, round to nearest even; the fp16 master's int8 remainder in quanta ulp/256, rounded half
      to even. fp8 and bf16 are rounded to their grid in fp32 bit arithmetic before the (then exact) cast, and bf16
      is cast on its bits: the same results as the hardware casts, and right under Triton's CPU interpreter too,
      whose fp8 and bf16 casts round wrongly (and garble bf16 subnormals).

found_inf: every program reads it first and, when nonzero, writes no state: all encodings stay bit for bit, decided on
the device without a host sync. The model copies are still written, from the unchanged masters (as the eager step
copies them whatever found_inf says): a copy may be storage given back unwritten (FSDP's freed weight shards) or an
fp32 piece that is cast into an FP8 weight after the step.

Stochastic rounding (moments only, as the eager step): the same construction as `states.round_stochastically_`
(add a uniform integer below 2^d to the fp32 bit pattern, clear the d dropped bits; subnormals of the format
rounded to nearest by the cast), with the integers from Philox (`tl.philox`, 10 rounds) keyed by the optimizer's
`seed` and counted by (element index, step, tensor index): one call gives m's and v's numbers. The stream differs
from the eager path's torch.Generator (so a kernel run and an eager run are equal in distribution, not bitwise), but
it depends only on the seed, the step count and the layout: runs are deterministic and a run resumed from a
checkpoint (which holds the step and the seed) reproduces the uninterrupted one bit for bit.
"""

from __future__ import annotations

from typing import Any

from megatron.fp8 import triton_rounding

# Bound by `build()` (triton.language); None until then, so that importing this module never imports Triton.
tl = None


# --------------------------------------------------------------------------------------------------------------------
# Kernel (plain functions: `build()` wraps them with triton.jit and rebinds these names to the jitted versions)
# --------------------------------------------------------------------------------------------------------------------

# The rounding helpers (megatron/fp8/triton_rounding.py, shared with the FP8 gradient reduction's kernels), bound
# by `build()`.
_round_bits = _to_fp8_grid = _to_fp32 = _to_bf16 = None


def _fp16_quantum(bits):
    """ulp / 256 of fp16 values given as int16 bits, and its inverse, as fp32 powers of two: 2^(max(e, 1) - 33) for
    the biased exponent e (subnormals share e = 1's ulp), built from the exponent bits (`states._fp16_quantum`)."""
    e = tl.maximum(((bits >> 10) & 0x1F).to(tl.int32), 1)
    quantum = ((e + (127 - 33)) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 + 33 - e) << 23).to(tl.float32, bitcast=True)
    return quantum, inverse


def _divide_rows(x, scale):
    """x / scale[:, None], rounded as IEEE division (`div_rn`), for the decoded values of a state (or the master's
    held value): Markstein's correction of x * RN(1 / scale) by its exact residual, one reciprocal per row instead
    of a division per element. The result is the correctly rounded quotient where the residual is exact and the
    quotient normal: a nonzero decoded value is at least 2^-32 (fp16 subnormal data with its remainder) and at most
    about 2^16 (never infinite: encodings clamp), so scales within 2^-90 .. 2^90 keep every quotient far from
    fp32's subnormals; a tile with a scale outside (a block of values near 0) divides element by element. Zero keeps
    its sign (x * r, where the corrected sum would give +0)."""
    if (tl.max(scale) <= 2.0**90) & (tl.min(scale) >= 2.0**-90):
        r = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)[:, None]
        q = x * r
        corrected = tl.fma(tl.fma(-q, scale[:, None], x), r, q)
        out = tl.where(q == 0.0, q, corrected)
    else:
        out = tl.math.div_rn(x, scale[:, None])
    return out


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
        x = _divide_rows(x, scale)
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
            stored = _divide_rows(held, scale)
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
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, COLS)
    offs = rows[:, None] * BLOCK + cols[None, :]
    if COLS == BLOCK:
        mask = offs < n  # no padding columns: keeps the mask's alignment visible (vectorized accesses)
    else:
        mask = (cols[None, :] < BLOCK) & (offs < n)
    row_mask = rows * BLOCK < n
    if run:
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
    elif OUT_KIND != 0:
        # Skipped: no state changes, but the model copy still gets the master (unchanged), as the eager step's copy
        # does: it may be storage given back unwritten (FSDP's freed weight shards) or an fp32 piece cast to FP8 next
        p = _load_state(p_ptr, p_scale_ptr, p_rem_ptr, offs, mask, rows, row_mask, P_KIND, P_ROOT, P_REM)
        _store_model_copy(p, out_ptr, offs, mask, OUT_KIND)


_TRITON = None


def build() -> Any:
    """Import Triton and jit the kernel functions (once): the jitted `_adamw_kernel`, or None without Triton."""
    global _TRITON, tl, _round_bits, _to_fp8_grid, _to_fp32, _to_bf16, _fp16_quantum, _divide_rows, _load_state
    global _store_state
    global _store_model_copy, _adamw_kernel
    if _TRITON is None:
        try:
            triton = triton_rounding.build()
        except ImportError:
            _TRITON = False
            return None
        tl = triton.language
        # The kernel resolves its helpers through this module's globals: rebind them to their jitted versions.
        _round_bits, _to_fp8_grid = triton_rounding.round_bits, triton_rounding.to_fp8_grid
        _to_fp32, _to_bf16 = triton_rounding.to_fp32, triton_rounding.to_bf16
        _fp16_quantum, _divide_rows = triton.jit(_fp16_quantum), triton.jit(_divide_rows)
        _load_state = triton.jit(_load_state)
        _store_state, _store_model_copy = triton.jit(_store_state), triton.jit(_store_model_copy)
        _adamw_kernel = triton.jit(_adamw_kernel)
        _TRITON = triton
    return _adamw_kernel if _TRITON else None
