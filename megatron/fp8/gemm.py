"""FP8 GEMMs: C = A . B^T for A [M, K] and B [N, K] quantized along K, on the fastest path that is exact.

Paths, chosen per (device, scaling of A and B, dtypes) and probed once against the emulation:

* `torch._scaled_mm`, tensorwise (one fp32 scale each) and rowwise (scales [M, 1] and [1, N]): CUDA (Hopper's FP8
  tensor cores through cuBLAS / CUTLASS) and CPU (torch >= 2.13). On CUDA it needs M, N, K multiples of 16; the
  linear layer pads M (tokens) with zero rows, and `attach_fp8` refuses N, K that are not.
* `torch._scaled_mm`, blockwise 1x128 x 128x128 and 1x128 x 1x128 (cuBLAS >= 12.9 on Hopper, in torch builds
  that have it), when M and N are multiples of 128 and K of 512, always with exact (not fast) accumulation;
  MXFP8 (E8M0 scales in cuBLAS's swizzled layout) on compute capability >= 10, when M, N, K are multiples of 128
  (never run here: no Blackwell GPU was available; the probe decides).
* emulation: dequantize each operand (q * scale_inv, per block) and run an ordinary GEMM. On CPU the dequantized
  operands are fp32 (the products q * scale_inv are exact for power-of-two scales, within fp32 rounding
  otherwise). On CUDA they are bf16 and the GEMM accumulates in fp32: exact when the scales are powers of two
  (MXFP8, blockwise by default) because an FP8 value times a power of two fits bf16's 8-bit mantissa; with fp32
  scales each dequantized element is rounded to bf16 (relative error <= 2^-9).

A path is used only after a probe: a small GEMM of random operands through it must match the emulation (relative
error < 2^-6, above bf16 output rounding and accumulation order) and, on a CPU, not be many times slower than it
(`CPU_SLOWER_LIMIT`). Whatever fails, mismatches or crawls is emulated, and `describe_path` says so at startup.
"""

from __future__ import annotations

import time

import torch

from .formats import E8M0
from .quantize import Fp8Tensor, quantize

#: (device type, index, kind A, kind B, dtype A, dtype B, out dtype, fast accumulation) -> path name or why emulated
_PROBED: dict[tuple, str] = {}

EMULATED_CPU = "emulated (dequantize to fp32, fp32 GEMM)"
CPU_SLOWER_LIMIT = 20.0
"""On a CPU, `torch._scaled_mm` is skipped when the probe's GEMMs took this many times the emulation's. oneDNN runs
some FP8 matmuls on its reference kernel where the CPU has no FP8 instructions (Sapphire Rapids, tensorwise e4m3 x
e4m3: 1.5-2.3 s against 3 ms for the probe's 256 x 384 x 512, 74 ms against 0.7 ms for its 64 x 64 x 256); a small
GEMM's second call, then the large one's first, its setup included, are each timed against one emulated GEMM, so
only a path that much slower is refused. (CUDA is not timed: its native paths are the fast ones.)"""
EMULATED_CUDA = "emulated (dequantize to bf16, GEMM with fp32 accumulation)"


def scaling_kind(q: Fp8Tensor) -> str:
    """'tensor', 'row', 'tile' (1x128), 'block' (128x128) or 'mx' (1x32, E8M0) from the block shape."""
    rows, cols = q.data.shape
    if q.scale_inv.dtype == E8M0:
        return "mx"
    if q.block == (max(rows, 1), max(cols, 1)):
        return "tensor"
    if q.block == (1, max(cols, 1)):
        return "row"
    if q.block == (128, 128):
        return "block"
    if q.block == (1, 128):
        return "tile"
    raise ValueError(f"no GEMM for blocks of shape {q.block}")


def _scaled_mm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype, fast_accum: bool, bias) -> torch.Tensor:
    """One torch._scaled_mm call for the scalings it takes; raises when this torch/device does not take them."""
    kinds = (scaling_kind(a), scaling_kind(b))
    mat_b = b.data.t()  # [K, N], column-major as cuBLAS wants
    fast_accum = fast_accum and kinds in (("tensor", "tensor"), ("row", "row"))  # cuBLAS: not with block scales
    if kinds == ("tensor", "tensor"):
        scale_a, scale_b = a.scale_inv.reshape(()), b.scale_inv.reshape(())
    elif kinds == ("row", "row"):
        scale_a, scale_b = a.scale_inv.reshape(-1, 1), b.scale_inv.reshape(1, -1)
    elif kinds in (("tile", "block"), ("tile", "tile")):
        # torch's layouts for cuBLAS block scaling: 1x128 scales "outer-dim major" (A's [M, K/128] with stride
        # [1, M]; B's as [K/128, N] contiguous), 128x128 scales as the transpose of B's [N/128, K/128] grid
        scale_a = a.scale_inv.t().contiguous().t()
        scale_b = b.scale_inv.t().contiguous() if kinds[1] == "tile" else b.scale_inv.contiguous().t()
    elif kinds == ("mx", "mx"):
        scale_a, scale_b = _swizzle_mx(a.scale_inv), _swizzle_mx(b.scale_inv)
    else:
        raise NotImplementedError(f"no torch._scaled_mm for {kinds}")
    # the bias epilogue exists for tensorwise scaling with a 16-bit output (CUDA refuses it with fp32 output)
    fused_bias = kinds == ("tensor", "tensor") and (out_dtype != torch.float32 or not a.data.is_cuda)
    out = torch._scaled_mm(
        a.data,
        mat_b,
        scale_a,
        scale_b,
        bias=bias.to(out_dtype) if bias is not None and fused_bias else None,
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )
    return out + bias.to(out_dtype) if bias is not None and not fused_bias else out


def _swizzle_mx(scale_inv: torch.Tensor) -> torch.Tensor:
    """E8M0 scales [rows, K/32] in cuBLAS's block-scaled layout: padded to [128 * i, 4 * j], then 128x4 tiles each
    stored as 32 rows of (4 x 4) interleaved values, flattened."""
    rows, cols = scale_inv.shape
    padded = torch.zeros(-(-rows // 128) * 128, -(-cols // 4) * 4, dtype=torch.uint8, device=scale_inv.device)
    padded[:rows, :cols] = scale_inv.view(torch.uint8)
    r_blocks, c_blocks = padded.shape[0] // 128, padded.shape[1] // 4
    tiles = padded.view(r_blocks, 128, c_blocks, 4).permute(0, 2, 1, 3)
    return tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1).view(E8M0)


def _emulated(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype, bias) -> torch.Tensor:
    compute = torch.float32 if a.data.device.type == "cpu" else torch.bfloat16
    out = torch.mm(a.dequantize(compute), b.dequantize(compute).t())
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.to(out_dtype)


def _native_candidate(device: torch.device, kind_a: str, kind_b: str) -> bool:
    """Whether a torch._scaled_mm path exists in principle for this pair on this device (the probe decides)."""
    if (kind_a, kind_b) in (("tensor", "tensor"), ("row", "row")):
        return device.type in ("cpu", "cuda")
    if device.type != "cuda":
        return False
    major = torch.cuda.get_device_capability(device)[0]
    if (kind_a, kind_b) in (("tile", "block"), ("tile", "tile")):
        return major == 9
    return (kind_a, kind_b) == ("mx", "mx") and major >= 10


def _shape_ok(kind: str, m: int, n: int, k: int, device: torch.device) -> bool:
    """Shapes the native path takes: multiples of 16 on CUDA; for block scales, whole 128-blocks and a number of
    K-blocks divisible by 4 (cuBLAS pads the scale grid's leading dimension to 4; the probe checks this layout)."""
    if kind in ("tile", "block"):
        return m % 128 == 0 and n % 128 == 0 and k % 512 == 0
    if kind == "mx":
        return m % 128 == 0 and n % 128 == 0 and k % 128 == 0
    multiple = 16 if device.type == "cuda" else 1
    return m % multiple == 0 and n % multiple == 0 and k % multiple == 0


def _emulated_name(device: torch.device) -> str:
    return EMULATED_CPU if device.type == "cpu" else EMULATED_CUDA


def _operands(m: int, n: int, k: int, key: tuple, device: torch.device, recipe_quantize) -> tuple[Fp8Tensor, Fp8Tensor]:
    """Random A [m, k] and B [n, k] quantized as `key` says, from a private generator (the run's RNG is untouched)."""
    _, _, kind_a, kind_b, dtype_a, dtype_b, _, _ = key
    gen = torch.Generator(device=device).manual_seed(1234)
    a_hp = torch.randn(m, k, generator=gen, device=device)
    b_hp = torch.randn(n, k, generator=gen, device=device)
    return recipe_quantize(a_hp, kind_a, dtype_a), recipe_quantize(b_hp, kind_b, dtype_b)


def _timed(fn) -> tuple[torch.Tensor, float]:
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def _both(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype, fast_accum: bool) -> tuple[torch.Tensor, ...]:
    """torch._scaled_mm's product and the emulation's (fp32 operands), and the seconds each took."""
    got, native_s = _timed(lambda: _scaled_mm(a, b, out_dtype, fast_accum, None).float())
    want, emulated_s = _timed(lambda: torch.mm(a.dequantize(), b.dequantize().t()))
    return got, want, native_s, emulated_s


def _probe(key: tuple, recipe_quantize) -> str:
    """Run the candidate path on random operands (M, N, K = 256, 384, 512) and compare with the emulation; the path's
    name, or why it is emulated. On a CPU a small GEMM (64 x 64 x 256, its second call: the first builds oneDNN's
    kernel) is timed first, so that the reference kernel is refused in a tenth of a second rather than after the
    large GEMM's seconds (at 32 x 32 x 128 the emulation's fixed cost hides it: 26x); the large one's time is checked
    again."""
    device_type, index, kind_a, kind_b, _, _, out_dtype, fast_accum = key
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    if not _native_candidate(device, kind_a, kind_b):
        return _emulated_name(device)
    try:
        if device.type == "cpu":
            small = _operands(64, 64, 256, key, device, recipe_quantize)
            _scaled_mm(*small, out_dtype, fast_accum, None)  # builds oneDNN's kernel: the next call is timed
            *_, native_s, emulated_s = _both(*small, out_dtype, fast_accum)
            if native_s > CPU_SLOWER_LIMIT * emulated_s:
                return _slower(native_s / emulated_s)
        large = _operands(256, 384, 512, key, device, recipe_quantize)
        got, want, native_s, emulated_s = _both(*large, out_dtype, fast_accum)
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as exc:
        return f"{_emulated_name(device)}; torch._scaled_mm refused: {str(exc).splitlines()[0][:120]}"
    error = float((got - want).norm() / want.norm())
    if not error < 2**-6:
        return f"{_emulated_name(device)}; torch._scaled_mm mismatched (relative error {error:.2e})"
    if device.type == "cpu" and native_s > CPU_SLOWER_LIMIT * emulated_s:
        return _slower(native_s / emulated_s)
    return f"torch._scaled_mm ({kind_a} x {kind_b})"


def _slower(ratio: float) -> str:
    return f"{EMULATED_CPU}; torch._scaled_mm {ratio:.0f}x slower here (oneDNN's reference kernel)"


def _probe_quantize(x: torch.Tensor, kind: str, dtype: torch.dtype) -> Fp8Tensor:
    spec = {"tensor": (None, None), "row": (1, None), "tile": (1, 128), "block": (128, 128), "mx": (1, 32)}[kind]
    return quantize(x, spec, dtype, mx=kind == "mx")[0]


def describe_path(
    device: torch.device,
    kind_a: str,
    kind_b: str,
    dtype_a: torch.dtype,
    dtype_b: torch.dtype,
    out_dtype: torch.dtype,
    fast_accum: bool = False,
) -> str:
    """The path name a GEMM of such operands takes on `device` (probing the combination once per process)."""
    fast_accum = fast_accum and device.type == "cuda" and kind_a in ("tensor", "row")
    key = (device.type, device.index, kind_a, kind_b, dtype_a, dtype_b, out_dtype, fast_accum)
    if key not in _PROBED:
        _PROBED[key] = _probe(key, _probe_quantize)
    return _PROBED[key]


def fp8_gemm(
    a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype, *, fast_accum: bool = False, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """A . B^T + bias in `out_dtype`. fast_accum: Hopper's faster FP8 accumulation (fprop only, as TE does)."""
    (m, k), (n, k_b) = a.data.shape, b.data.shape
    if k != k_b:
        raise ValueError(f"FP8 GEMM reduction dims differ: A {tuple(a.data.shape)}, B {tuple(b.data.shape)}")
    kind_a, kind_b, device = scaling_kind(a), scaling_kind(b), a.data.device
    path = describe_path(device, kind_a, kind_b, a.data.dtype, b.data.dtype, out_dtype, fast_accum)
    if path.startswith("torch._scaled_mm") and _shape_ok(kind_a, m, n, k, device):
        return _scaled_mm(a, b, out_dtype, fast_accum and a.data.is_cuda, bias)
    return _emulated(a, b, out_dtype, bias)
