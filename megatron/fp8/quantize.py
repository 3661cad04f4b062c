"""Pure FP8 quantizers: block scales, saturating casts, dequantization.

Every recipe is *block scaling* of a 2-D tensor x [R, C] with some block shape (br, bc):

    tensorwise / delayed   one block, the whole tensor            (br, bc) = (R, C)
    rowwise                one block per row                       (1, C)
    blockwise              1x128 tiles (activations, gradients)   (1, 128)
                           128x128 blocks (weights)               (128, 128)
    mxfp8                  32-element blocks along a row          (1, 32)

Ragged edges: a dimension that is not a multiple of its block size is zero-padded up to one for the scale
computation only (zeros do not change an amax), so the last block along it is partial; the FP8 data keeps the
tensor's own shape.

For every block b, with fp8_max = 448 (e4m3) or 57344 (e5m2) and amax_b = max |x| over the block:

    scale_b  = fp8_max / amax_b                          (fp32; 1 where amax_b = 0, fp32 max where it overflows)
    q        = saturate(round_rne(x * scale_b))          (saturate: clamp to +-fp8_max, NaN stays NaN)
    x       ~= q * scale_inv_b,  scale_inv_b = 1 / scale_b

Variants of the scale:

* power of two (blockwise by default, as in Transformer Engine):  scale_b = 2^floor(log2(fp8_max / amax_b)),
  the fp32 scale above with its mantissa bits dropped, so  amax_b * scale_b <= fp8_max  and dequantization is exact.
* given (delayed scaling): scale comes from the amax history (see `scaling.py`); amax_b is still measured.
* MXFP8 (OCP Microscaling): the decode scale is an E8M0 power of two 2^e_b with NVIDIA's MXFP8 pretraining rule,
  which rounds the exponent *up* so that no element saturates:

      e_b = ceil(log2(amax_b / fp8_max)),  clamped to [-127, 127]     (e_b = -127 where amax_b = 0,
                                                                     NaN (0xFF) where amax_b is inf or NaN)
      q   = round_rne(x * 2^-e_b)                                     (|x * 2^-e_b| <= fp8_max by construction)

  The OCP spec's own rule, e_b = floor(log2(amax_b)) - emax_elem, can put amax_b * 2^-e_b up to ~1.75 * fp8_max
  (then clamped); rounding up costs at most one bit of range in the block and never clips. The exponent is
  computed exactly from frexp(amax_b) = (m, E), m in [0.5, 1): with fp8_max = 0.875 * 2^F (F = 9 for e4m3,
  16 for e5m2), e_b = E - F if m <= 0.875 else E - F + 1.

A non-finite amax gives a zero or NaN scale (and NaN data): the FP8 manager reports it and the step is skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .formats import E8M0, fp8_max

#: A block shape; None means "the whole dimension" (so (None, None) is tensorwise and (1, None) rowwise).
BlockSpec = tuple[int | None, int | None]

TENSOR: BlockSpec = (None, None)
ROW: BlockSpec = (1, None)
TILE_1x128: BlockSpec = (1, 128)
BLOCK_128x128: BlockSpec = (128, 128)
MX_BLOCK: BlockSpec = (1, 32)

_FP32_MAX = torch.finfo(torch.float32).max


def resolve_block(spec: BlockSpec, shape: tuple[int, int]) -> tuple[int, int]:
    """The concrete (br, bc) of a block spec for a tensor of this shape."""
    return tuple(max(n, 1) if b is None else b for b, n in zip(spec, shape))  # type: ignore[return-value]


def _blocked(x: torch.Tensor, spec: BlockSpec) -> torch.Tensor:
    """x [R, C] viewed as [R/br, br, C/bc, bc], zero-padded up to whole blocks."""
    rows, cols = x.shape
    br, bc = resolve_block(spec, (rows, cols))
    pad_r, pad_c = (-rows) % br, (-cols) % bc
    if pad_r or pad_c:
        x = F.pad(x, (0, pad_c, 0, pad_r))
    return x.reshape((rows + pad_r) // br, br, (cols + pad_c) // bc, bc)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as fp32, 0-dim, in one read (abs().amax() writes and reads an |x| temporary of x first; a weight's
    once per step). The same value: a max is exact, NaN propagates. x must not be empty."""
    return torch.linalg.vector_norm(x, float("inf")).float()


def block_amax(x: torch.Tensor, spec: BlockSpec) -> torch.Tensor:
    """amax_b = max |x| over each block: fp32 [ceil(R/br), ceil(C/bc)]. Exact (no rounding involved)."""
    return _blocked(x, spec).abs().amax(dim=(1, 3)).float()


def scaled_cast(
    x: torch.Tensor, scale: torch.Tensor, spec: BlockSpec, dtype: torch.dtype, transpose: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q = saturate(round_rne(fp32(x) * scale_b)) as `dtype` [R, C], and q^T contiguous when asked.

    `scale` is fp32 [ceil(R/br), ceil(C/bc)]. The product is formed in fp32 (never in x's dtype: a bf16 product
    would round twice), clamped to +-fp8_max, then rounded to nearest-even by the cast.
    """
    rows, cols = x.shape
    limit = fp8_max(dtype)
    xb = _blocked(x, spec).float() * scale[:, None, :, None]
    q = xb.clamp(-limit, limit).to(dtype).reshape(xb.shape[0] * xb.shape[1], xb.shape[2] * xb.shape[3])
    q = q[:rows, :cols].contiguous()
    return q, (q.t().contiguous() if transpose else None)


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, power_of_two: bool = False) -> torch.Tensor:
    """scale = fp8_max / amax in fp32 (1 where amax = 0, fp32 max on overflow); optionally 2^floor(log2(scale))."""
    scale = torch.full_like(amax, fp8_max(dtype)) / amax
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    scale = torch.where(torch.isposinf(scale), torch.full_like(scale, _FP32_MAX), scale)
    if power_of_two:
        mantissa, exponent = torch.frexp(scale)  # scale = m * 2^E, m in [0.5, 1): floor(log2(scale)) = E - 1
        rounded = torch.ldexp(torch.ones_like(scale), exponent - 1)
        scale = torch.where(torch.isfinite(scale) & (scale > 0), rounded, scale)
    return scale


def mx_exponent(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e = ceil(log2(amax / fp8_max)) clamped to [-127, 127], exactly, as int32 (see the module docstring)."""
    mantissa, exponent = torch.frexp(amax)
    top_exponent = 9 if fp8_max(dtype) == 448.0 else 16  # fp8_max = 0.875 * 2^top_exponent
    e = exponent - top_exponent + (mantissa > 0.875).to(torch.int32)
    e = torch.where(amax == 0, torch.full_like(e, -127), e)
    return e.clamp(-127, 127)


@dataclass
class Fp8Tensor:
    """A quantized 2-D tensor: x ~= data * scale_inv, scale_inv broadcast over blocks of shape `block`.

    data: FP8 [R, C]. scale_inv: fp32 (or E8M0 for MXFP8) [ceil(R/br), ceil(C/bc)]. amax: fp32 scalar, the
    largest |x| seen (what the FP8 manager checks for inf/NaN and, for delayed scaling, records in the history).
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]
    amax: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def scale_inv_full(self) -> torch.Tensor:
        """scale_inv expanded to one fp32 value per element, [R, C] (or [1, 1] when tensorwise)."""
        scale_inv = self.scale_inv.float()
        if scale_inv.numel() == 1:
            return scale_inv.reshape(1, 1)
        rows, cols = self.data.shape
        br, bc = self.block
        return scale_inv.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """q * scale_inv in fp32, then cast to `dtype` (exact in bf16 when the scales are powers of two)."""
        return (self.data.float() * self.scale_inv_full()).to(dtype)

    def t(self) -> Fp8Tensor:
        """The transpose (data, scales and block shape transposed): the same numbers, blocks of shape (bc, br)."""
        return Fp8Tensor(
            self.data.t().contiguous(), self.scale_inv.t().contiguous(), (self.block[1], self.block[0]), self.amax
        )


class Kernels(NamedTuple):
    """The two tensor-sized passes of a quantization: `block_amax` and `scaled_cast` (eager or compiled)."""

    block_amax: Callable[..., torch.Tensor]
    scaled_cast: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


EAGER = Kernels(block_amax, scaled_cast)


def compiled_kernels() -> Kernels:
    """The fast versions of the two passes, computing the same bytes as `EAGER`:

    * whole-tensor blocks (tensorwise, delayed) on CUDA: the Triton kernels of `triton_kernels.py` (one read of x
      for the amax, one for the cast that also writes the transpose), used only after they reproduced the eager
      bytes on a test tensor in this process;
    * every other block shape: `torch.compile`d `block_amax` / `scaled_cast` (fused Triton kernels on CUDA).
      Only exact operations are compiled (abs, max, an fp32 product, clamp, the FP8 cast); the scale arithmetic
      (a division) stays eager on the small amax tensor.
    """
    global _COMPILED
    if _COMPILED is None:
        # each (block shape, dtype, layout) is a recompilation of the same two functions; a run uses a handful,
        # a benchmark of every recipe a few dozen, over dynamo's default limit of 8 (past which it runs eager)
        config = torch._dynamo.config
        limit_name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, limit_name, max(getattr(config, limit_name), 64))
        amax = torch.compile(block_amax, dynamic=True, fullgraph=True)
        cast = torch.compile(scaled_cast, dynamic=True, fullgraph=True)
        per_tensor = per_tensor_triton()

        def fast_amax(x: torch.Tensor, spec: BlockSpec) -> torch.Tensor:
            if per_tensor is not None and spec == TENSOR and x.is_cuda:
                return per_tensor.tensor_amax(x)
            return amax(x, spec)

        def fast_cast(x, scale, spec, dtype, transpose=False):
            if per_tensor is not None and spec == TENSOR and x.is_cuda:
                return per_tensor.tensor_cast(x, scale, dtype, transpose)
            return cast(x, scale, spec, dtype, transpose)

        _COMPILED = Kernels(fast_amax, fast_cast)
    return _COMPILED


_COMPILED: Kernels | None = None
KERNEL_NOTES: list[str] = []
"""What `compiled_kernels()` decided (for the startup log)."""
_PER_TENSOR: list[ModuleType | None] = []  # [the checked Triton module or None], once decided


def per_tensor_triton() -> ModuleType | None:
    """The Triton per-tensor kernels (`triton_kernels`) once they reproduced the eager bytes in this process (checked
    at the first call), else None (no GPU, no Triton, or different bytes)."""
    if not _PER_TENSOR:
        _PER_TENSOR.append(_checked_triton_kernels())
    return _PER_TENSOR[0]


def _same_fp8(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal NaN positions and equal bytes elsewhere (NaN's bit pattern is no part of the contract)."""
    nan_a, nan_b = torch.isnan(a.float()), torch.isnan(b.float())
    as_bits = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t  # noqa: E731
    bytes_a, bytes_b = as_bits(a), as_bits(b)
    return torch.equal(nan_a, nan_b) and torch.equal(bytes_a[~nan_a], bytes_b[~nan_b])


def _checked_triton_kernels():
    """The Triton module if it imports, a GPU is here, and its bytes equal the eager ones on a test tensor."""
    if not torch.cuda.is_available():
        return None
    from . import triton_kernels

    try:
        triton_kernels.build()
    except ImportError as exc:
        KERNEL_NOTES.append(f"per-tensor: torch.compile (Triton kernels unavailable: {exc})")
        return None
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 200, generator=gen, device="cuda")
    x = (x * torch.exp2(torch.linspace(-30, 12, 200, device="cuda"))).bfloat16()
    x[3, 4], x[5, 6], x[7, 8] = float("nan"), float("inf"), 0.0
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for x_in in (x[:, :150], x[:, 150:]):  # finite-only and NaN/inf-holding slices
            scale = scale_from_amax(block_amax(x_in, TENSOR), dtype)
            want, want_t = scaled_cast(x_in, scale, TENSOR, dtype, True)
            got, got_t = triton_kernels.tensor_cast(x_in, scale, dtype, True)
            same = _same_fp8(got, want) and _same_fp8(got_t, want_t)
            amax_same = _same_fp8(triton_kernels.tensor_amax(x_in), block_amax(x_in, TENSOR))
            if not (same and amax_same):
                KERNEL_NOTES.append(f"per-tensor: torch.compile (Triton kernels differ from eager for {dtype})")
                return None
    KERNEL_NOTES.append("per-tensor: Triton amax + fused cast-transpose kernels (checked against eager)")
    return triton_kernels


def block_scales(
    amax_blocks: torch.Tensor,
    dtype: torch.dtype,
    *,
    scale: torch.Tensor | None = None,
    power_of_two: bool = False,
    mx: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv) of each block from its amax, by the rules of the module docstring (arguments as in
    `quantize`): scale fp32 [blocks], scale_inv fp32 or, with mx, E8M0."""
    if mx:
        exponent = mx_exponent(amax_blocks, dtype)
        finite = torch.isfinite(amax_blocks)
        scale = torch.where(finite, torch.ldexp(torch.ones_like(amax_blocks), -exponent), torch.nan)
        scale_inv = torch.where(finite, exponent + 127, 255).to(torch.uint8).view(E8M0)  # 0xFF is E8M0's NaN
        return scale, scale_inv
    if scale is None:
        scale = scale_from_amax(amax_blocks, dtype, power_of_two)
    else:
        scale = scale.float().reshape(1, 1)
    return scale, scale.reciprocal()


def quantize(
    x: torch.Tensor,
    spec: BlockSpec,
    dtype: torch.dtype,
    *,
    scale: torch.Tensor | None = None,
    power_of_two: bool = False,
    mx: bool = False,
    transpose: bool = False,
    kernels: Kernels = EAGER,
) -> tuple[Fp8Tensor, Fp8Tensor | None]:
    """Quantize x [R, C] in blocks of `spec` (formulas in the module docstring).

    scale: a given fp32 scalar scale (delayed scaling) instead of one from the current amax.
    power_of_two: round scales down to powers of two. mx: MXFP8's E8M0 round-up rule (scale_inv stored as E8M0).
    transpose: also return the transpose, computed in the same pass (only meaningful for square or whole blocks).
    """
    if x.dim() != 2:
        raise ValueError(f"quantize expects a 2-D tensor, got shape {tuple(x.shape)}")
    amax_blocks = kernels.block_amax(x, spec)
    scale, scale_inv = block_scales(amax_blocks, dtype, scale=scale, power_of_two=power_of_two, mx=mx)
    data, data_t = kernels.scaled_cast(x, scale, spec, dtype, transpose)
    amax = amax_blocks.amax() if amax_blocks.numel() > 1 else amax_blocks.reshape(())
    block = resolve_block(spec, tuple(x.shape))
    q = Fp8Tensor(data, scale_inv, block, amax)
    q_t = None if data_t is None else Fp8Tensor(data_t, scale_inv.t().contiguous(), (block[1], block[0]), amax)
    return q, q_t
