"""Every FP8 quantizer against an independent float64 reference: equal scales and equal FP8 bytes.

The reference below rounds to FP8 by arithmetic on float64 numbers (no torch FP8 cast): exponent, quantum,
round-half-to-even, saturation. Products are rounded to fp32 first, as the quantizers specify.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron.fp8 import E4M3, E5M2, E8M0, quantize
from megatron.fp8.quantize import MX_BLOCK, ROW, TENSOR, BLOCK_128x128, TILE_1x128, tensor_amax

# (mantissa bits, smallest normal exponent, max finite) of each format
FORMATS = {E4M3: (3, -6, 448.0), E5M2: (2, -14, 57344.0)}
FP32_MAX = float(torch.finfo(torch.float32).max)


def ref_round_fp8(value: float, dtype: torch.dtype) -> float:
    """Saturating round-to-nearest-even of one float64 value into an FP8 format (value returned as float)."""
    mbits, emin, vmax = FORMATS[dtype]
    if math.isnan(value):
        return math.nan
    sign, a = math.copysign(1.0, value), min(abs(value), vmax)
    if a == 0:
        return sign * 0.0
    exponent = max(math.floor(math.log2(a)), emin)
    if 2.0**exponent > a:  # guard log2 rounding just below a power of two
        exponent -= 1
    exponent = max(exponent, emin)
    quantum = 2.0 ** (exponent - mbits)
    steps = a / quantum  # exact: a power-of-two division
    low = math.floor(steps)
    rest = steps - low
    n = low + (1 if rest > 0.5 or (rest == 0.5 and low % 2 == 1) else 0)
    return sign * min(n * quantum, vmax)


def to_fp32(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float32).to(torch.float64)


def ref_scale(amax: float, dtype: torch.dtype, power_of_two: bool) -> float:
    if amax == 0:
        return 1.0
    if math.isnan(amax):
        return math.nan
    scale = float(to_fp32(torch.tensor(FORMATS[dtype][2] / amax, dtype=torch.float64)))
    if math.isinf(scale):
        scale = FP32_MAX
    if power_of_two and 0 < scale < math.inf:
        scale = 2.0 ** math.floor(math.log2(scale))
        while scale * 2 <= float(to_fp32(torch.tensor(FORMATS[dtype][2] / amax, dtype=torch.float64))):
            scale *= 2
    return scale


def ref_mx_exponent(amax: float, dtype: torch.dtype) -> int | None:
    """Smallest e with amax <= fp8_max * 2^e (exact float64 comparisons), clamped to [-127, 127]; None if not finite."""
    if amax == 0:
        return -127
    if not math.isfinite(amax):
        return None
    vmax = FORMATS[dtype][2]
    e = math.floor(math.log2(amax / vmax))
    while vmax * 2.0**e < amax:
        e += 1
    while vmax * 2.0 ** (e - 1) >= amax:
        e -= 1
    return max(-127, min(127, e))


def ref_quantize(x: torch.Tensor, block: tuple[int, int], dtype, *, power_of_two=False, mx=False, scale=None):
    """(fp8 values as float64 [R, C], scale_inv grid as float64) computed element by element."""
    x64 = x.to(torch.float64)
    rows, cols = x64.shape
    br, bc = block
    grid_r, grid_c = -(-rows // br), -(-cols // bc)
    out = torch.empty(rows, cols, dtype=torch.float64)
    scale_inv = torch.empty(grid_r, grid_c, dtype=torch.float64)
    for i in range(grid_r):
        for j in range(grid_c):
            tile = x64[i * br : (i + 1) * br, j * bc : (j + 1) * bc]
            amax = float(tile.abs().max())
            if mx:
                e = ref_mx_exponent(amax, dtype)
                s, s_inv = (math.nan, math.nan) if e is None else (2.0**-e, 2.0**e)
            else:
                s = float(scale) if scale is not None else ref_scale(amax, dtype, power_of_two)
                s_inv = float(to_fp32(torch.tensor(1.0 / s, dtype=torch.float64))) if s != 0 else math.inf
            scale_inv[i, j] = s_inv
            product = to_fp32(tile * s)  # the quantizers form x * scale in fp32
            out[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = product.apply_(lambda v: ref_round_fp8(v, dtype))
    return out, scale_inv


def assert_same_bytes(data: torch.Tensor, ref_values: torch.Tensor) -> None:
    nan = torch.isnan(ref_values)
    assert torch.equal(torch.isnan(data.float()), nan), "NaN positions differ"
    ours = data.view(torch.uint8)[~nan]
    theirs = ref_values.to(data.dtype).view(torch.uint8)[~nan]  # exact: the values are representable
    assert torch.equal(ours, theirs), f"{int((ours != theirs).sum())} FP8 bytes differ"


def sample(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Normal values over many binades, with outlier rows/blocks, exact zeros, a zero row, and tiny values."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.exp2(torch.randint(-12, 8, (rows, 1), generator=gen).float())
    x[:, 5] *= 1000.0  # a column of outliers
    x[1] = 0.0  # an all-zero row (scale 1 / exponent -127)
    x[2, :7] = torch.tensor([0.0, -0.0, 1e-30, -3e-41, 2.0**-140, 65504.0, -1e6])  # zeros, fp32 subnormals, large
    return x


SPECS = [
    ("tensorwise", TENSOR, {}),
    ("rowwise", ROW, {}),
    ("blockwise 1x128 fp32", TILE_1x128, {}),
    ("blockwise 1x128 pow2", TILE_1x128, {"power_of_two": True}),
    ("blockwise 128x128 pow2", BLOCK_128x128, {"power_of_two": True}),
    ("blockwise 128x128 fp32", BLOCK_128x128, {}),
    ("mxfp8", MX_BLOCK, {"mx": True}),
]


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("name,spec,options", SPECS, ids=[s[0] for s in SPECS])
def test_quantizer_matches_float64_reference(name, spec, options, dtype):
    x = sample(130, 200)  # ragged against every block size: partial last blocks on both axes
    q, _ = quantize(x, spec, dtype, **options)
    block = tuple(n if b is None else b for b, n in zip(spec, x.shape))
    ref_values, ref_scale_inv = ref_quantize(x, block, dtype, **options)
    assert q.block == block and q.data.shape == x.shape
    assert_same_bytes(q.data, ref_values)
    if options.get("mx"):
        assert q.scale_inv.dtype == E8M0
        torch.testing.assert_close(q.scale_inv.float().double(), ref_scale_inv, rtol=0, atol=0, equal_nan=True)
        assert q.data.float().abs().max() <= FORMATS[dtype][2]  # the rounding-up rule: nothing saturates
    else:
        torch.testing.assert_close(q.scale_inv.double(), ref_scale_inv, rtol=0, atol=0, equal_nan=True)
    assert float(q.amax) == float(x.abs().max())


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_delayed_given_scale_saturates_and_reaches_subnormals(dtype):
    """A given (delayed) scale: values beyond fp8_max saturate, tiny ones land on FP8 subnormals or round to 0."""
    vmax = FORMATS[dtype][2]
    x = torch.tensor([[vmax * 3, -vmax * 1.01, vmax, 1.0, 2.0**-8, 2.0**-10, 2.0**-17, 3 * 2.0**-18, 2.0**-30, 0.0]])
    scale = torch.tensor(1.0)
    q, q_t = quantize(x, TENSOR, dtype, scale=scale, transpose=True)
    ref_values, _ = ref_quantize(x, tuple(x.shape), dtype, scale=1.0)
    assert_same_bytes(q.data, ref_values)
    assert q.data.float()[0, :3].tolist() == [vmax, -vmax, vmax]
    assert torch.equal(q_t.data.view(torch.uint8), q.data.t().contiguous().view(torch.uint8))
    assert float(q.amax) == vmax * 3 and float(q.scale_inv) == 1.0


@pytest.mark.parametrize("name,spec,options", SPECS, ids=[s[0] for s in SPECS])
def test_inf_and_nan_are_reported_not_hidden(name, spec, options):
    x = sample(64, 64)
    x[3, 3], x[40, 9] = float("inf"), float("nan")
    q, _ = quantize(x, spec, E4M3, **options)
    assert math.isnan(float(q.amax))  # NaN wins: the manager sees a non-finite amax and the step is skipped
    ref_values, _ = ref_quantize(x, q.block, E4M3, **options)
    assert_same_bytes(q.data, ref_values)
    x[40, 9] = 0.0
    q, _ = quantize(x, spec, E4M3, **options)
    assert math.isinf(float(q.amax))


def test_mx_rounding_rule_beats_the_ocp_floor_rule_at_the_edge():
    """amax = 0.95 * 2^3: OCP's floor(log2 amax) - 8 scales it to 486 > 448 (clipped); the round-up rule does not."""
    x = torch.full((1, 32), 0.01)
    x[0, 0] = 0.95 * 2.0**3
    q, _ = quantize(x, MX_BLOCK, E4M3, mx=True)
    exponent = int(q.scale_inv.view(torch.uint8)) - 127
    assert exponent == ref_mx_exponent(0.95 * 8, E4M3) == -5
    assert x[0, 0] * 2.0**-exponent <= 448 < x[0, 0] * 2.0 ** -(math.floor(math.log2(0.95 * 8)) - 8)
    assert float(q.dequantize()[0, 0]) == pytest.approx(7.6, rel=2**-4)


@pytest.mark.parametrize("spec,options", [(TENSOR, {}), (BLOCK_128x128, {"power_of_two": True})])
def test_transpose_of_whole_or_square_blocks_is_the_transposed_quantization(spec, options):
    x = sample(256, 384, seed=3)
    q, q_t = quantize(x, spec, E4M3, transpose=True, **options)
    direct, _ = quantize(x.t().contiguous(), spec, E4M3, **options)
    assert torch.equal(q_t.data.view(torch.uint8), direct.data.view(torch.uint8))
    assert torch.equal(q_t.scale_inv, direct.scale_inv)
    assert torch.equal(q.t().dequantize(), q_t.dequantize())


def test_dequantize_expands_block_scales():
    x = sample(130, 200, seed=5)
    for spec, options in [(TILE_1x128, {}), (BLOCK_128x128, {}), (MX_BLOCK, {"mx": True}), (ROW, {})]:
        q, _ = quantize(x, spec, E4M3, **options)
        values, scale_inv = ref_quantize(x, q.block, E4M3, **options)
        br, bc = q.block
        full = scale_inv.repeat_interleave(br, 0)[:130].repeat_interleave(bc, 1)[:, :200]
        torch.testing.assert_close(q.dequantize().double(), values * full, rtol=2**-23, atol=0)


def test_tensor_amax_is_abs_amax_in_one_read():
    """`tensor_amax` (the weights' per-step amax, without abs()'s temporary) gives abs().amax().float() bit for bit:
    fp32 and bf16, signed zeros and infinities, and NaN propagated."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4096, generator=gen).to(dtype)
        for special in (None, -0.0, float("-inf"), float("nan")):
            y = x.clone()
            if special is not None:
                y[17] = special
            want = y.abs().amax().float()
            got = tensor_amax(y)
            assert got.dtype == torch.float32 and got.shape == ()
            assert torch.equal(got, want) or (got.isnan() and want.isnan()), (dtype, special, got, want)
        assert torch.equal(tensor_amax(torch.full((3,), -0.0, dtype=dtype)), torch.zeros(()))
