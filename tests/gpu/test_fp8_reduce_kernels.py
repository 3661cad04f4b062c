"""The FP8 gradient reduction's Triton kernels (megatron/parallel/fp8_reduce_kernels.py) against its torch path, bit
for bit: the payload (e4m3 bytes and E8M0 scale bytes) and the saturated / flushed counts of the encode, and the
fp32 / bf16 outputs of the rank-order sum and of the per-row decode.

On a CUDA GPU (`pytest -m gpu tests/gpu/test_fp8_reduce_kernels.py`), or on the CPU with Triton's interpreter:
`TRITON_INTERPRET=1 pytest --noconftest tests/gpu/test_fp8_reduce_kernels.py` (tests/conftest.py skips tests/gpu on
machines without CUDA). The reduction's own tests (tests/distributed/test_fp8_reduce.py) check the torch path against
the exact sum.
"""

from __future__ import annotations

import struct

import pytest
import torch

from megatron.parallel import fp8_reduce
from megatron.parallel.fp8_reduce import FP8_REDUCE_BLOCK as B
from tests.gpu.marks import INTERPRET, TRITON_KERNEL

DEVICE = torch.device("cpu" if INTERPRET else "cuda")

pytestmark = TRITON_KERNEL


@pytest.fixture
def paths(monkeypatch):
    """(kernel path, torch path): call `run(fn)` under each."""
    monkeypatch.setattr(fp8_reduce, "INTERPRET_ON_CPU", INTERPRET)
    assert fp8_reduce._kernels(torch.empty(1, device=DEVICE)) is not None, "Triton is installed but not used here"

    def torch_path(fn):
        with monkeypatch.context() as m:
            m.setattr(fp8_reduce, "_kernels", lambda x: None)
            return fn()

    return (lambda fn: fn()), torch_path


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _blocks(dtype: torch.dtype, rows: int, with_non_finite: bool) -> torch.Tensor:
    """[rows, 24 * B]: blocks of every kind the scale rule distinguishes (magnitudes 1e-8..1e4, zeros, amax at and
    one ulp around 1.75 * 2^k, subnormal and near-fp32-max amax, values that flush), then inf / NaN blocks."""
    g = torch.Generator().manual_seed(0)
    blocks = []
    for exponent in (-8, -6, -3, -1, 0, 2, 4):
        blocks.append(torch.randn(B, generator=g) * 10.0**exponent)
    blocks.append(torch.zeros(B))
    for amax_bits in (0x3FE00000, 0x3FE00001, 0x3FDFFFFF, 0x00000F00, 0x00600000, 0x7F7FFFFF, 0x43E00000):
        block = torch.rand(B, generator=g) * 2 - 1
        block = block / block.abs().max() * _f32(amax_bits)  # in this order: never above the amax (no inf)
        block[5] = -_f32(amax_bits)
        blocks.append(block)
    wide = torch.randn(B, generator=g)  # one large value: its neighbours flush to zero
    wide[0] = 3e4
    blocks.append(wide)
    blocks += [torch.randn(B, generator=g) * 1e-3 for _ in range(8 - len(blocks) % 8)]
    if with_non_finite:
        for bad in (float("inf"), -float("inf"), float("nan"), -float("nan")):
            block = torch.randn(B, generator=g)
            block[7] = bad
            blocks.append(block)
    x = torch.cat(blocks).to(dtype)
    x = x[: x.numel() // rows * rows]
    return torch.stack([x.roll(r * B) for r in range(rows)]).to(DEVICE).contiguous()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit where a value is a number; NaN at the same places (NaN payloads may differ)."""
    nan = a.float().isnan()
    return bool(torch.equal(nan, b.float().isnan()) and torch.equal(a[~nan], b[~nan]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_encode_writes_the_torch_paths_bytes_and_counts(paths, dtype, rows):
    kernel, eager = paths
    x = _blocks(dtype, rows, with_non_finite=False)
    got_stats, want_stats = fp8_reduce.Fp8ReduceStats(), fp8_reduce.Fp8ReduceStats()
    got = kernel(lambda: fp8_reduce._encode(x, got_stats))
    want = eager(lambda: fp8_reduce._encode(x, want_stats))
    assert torch.equal(got, want)
    assert got_stats.counts() == want_stats.counts() and want_stats.counts()["flushed"] > 0


def test_encode_marks_non_finite_blocks_nan(paths):
    kernel, eager = paths
    x = _blocks(torch.float32, 1, with_non_finite=True)
    got = kernel(lambda: fp8_reduce._encode(x, None))
    want = eager(lambda: fp8_reduce._encode(x, None))
    cols = x.shape[1]
    assert torch.equal(got[:, cols:], want[:, cols:])  # every scale byte, 255 for the non-finite blocks
    finite = want[0, cols:] != 255
    assert int((~finite).sum()) == 4
    data_got, data_want = got[0, :cols].view(-1, B), want[0, :cols].view(-1, B)
    assert torch.equal(data_got[finite.to(DEVICE)], data_want[finite.to(DEVICE)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dp", [1, 2, 3, 4])
@pytest.mark.parametrize("average", [False, True])
def test_decode_sums_in_rank_order_as_the_torch_path(paths, dtype, dp, average):
    kernel, eager = paths
    g = torch.Generator().manual_seed(dp)
    cols = 16 * B
    payload = torch.randint(0, 256, (dp, cols + cols // B), generator=g, dtype=torch.uint8)
    payload[:, cols:] = torch.randint(100, 150, (dp, cols // B), generator=g, dtype=torch.uint8)
    payload[0, cols] = 0  # 2^-127, subnormal
    payload[-1, cols + 1] = 255  # a non-finite block
    payload = payload.to(DEVICE)
    outs = []
    for path in (kernel, eager):
        out = torch.full((cols,), 7.0, dtype=dtype, device=DEVICE)
        path(lambda out=out: fp8_reduce._decode_sum(payload, cols, out, average))
        outs.append(out)
    assert _same(*outs)
    rows = []
    for path in (kernel, eager):
        out = torch.empty(dp * cols, dtype=dtype, device=DEVICE)
        path(lambda out=out: fp8_reduce._decode_rows(payload, cols, out))
        rows.append(out)
    assert _same(*rows)
