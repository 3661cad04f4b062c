"""FP8 gradient reduction (megatron/parallel/fp8_reduce.py) on 2 and 4 gloo ranks: reduce-scatter and all-reduce,
sum and average, fp32 and bf16, against the exact fp64 sum within the module's stated bound (computed here from the
inputs alone) and bit for bit against `sum_r dequant(quant(x_r))` built with the project's blockwise quantizer;
inputs spanning 1e-8..1e4 (and all-zero and 1e-37 blocks) never give inf/NaN; all-reduce leaves the same bits on
every rank; the stats count flushes; a non-finite input poisons only its block; bad buckets fail in one line."""

import pytest
import torch
import torch.distributed as dist

from megatron.fp8.formats import E4M3
from megatron.fp8.quantize import TILE_1x128, quantize
from megatron.parallel.fp8_reduce import (
    FP8_REDUCE_ALIGN,
    FP8_REDUCE_BLOCK,
    Fp8ReduceStats,
    start_fp8_all_reduce,
    start_fp8_reduce_scatter,
)
from tests.dist_utils import run_distributed

B = FP8_REDUCE_BLOCK
BLOCKS_PER_CHUNK = 8


def _inputs(kind: str, r: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank r's bucket, the same on every process (each rank rebuilds every rank's input for the exact sum)."""
    g = torch.Generator().manual_seed(1000 * r + len(kind))
    sign = torch.randint(0, 2, (n,), generator=g, dtype=torch.float64) * 2 - 1
    if kind == "loguniform":  # every element's magnitude log-uniform in [1e-8, 1e4]
        x = sign * 10 ** (torch.rand(n, generator=g, dtype=torch.float64) * 12 - 8)
        blocks = x.view(-1, B)
        if r % 2 == 0:
            blocks[0::BLOCKS_PER_CHUNK] = 0  # an all-zero block in each chunk (scale 1)
        # a block of 1e-37..2e-37: 448 / amax overflows fp32 (the scale is clamped); sums stay fp32/bf16-normal
        blocks[1::BLOCKS_PER_CHUNK] = blocks[1::BLOCKS_PER_CHUNK].sign() * (1 + torch.rand(B, generator=g)) * 1e-37
    else:  # "gaussian": gradients whose blocks differ in magnitude (1e-6..1e2)
        per_block = 10 ** (torch.rand(n // B, 1, generator=g, dtype=torch.float64) * 8 - 6)
        x = (torch.randn(n // B, B, generator=g, dtype=torch.float64) * per_block).view(-1)
    return x.to(dtype)


def _roundtrip(x: torch.Tensor) -> torch.Tensor:
    """dequant(quant(x)) with the project's 1x128 power-of-two quantizer, in fp32."""
    q, _ = quantize(x.float().view(-1, B), TILE_1x128, E4M3, power_of_two=True)
    return q.dequantize().view(-1)


def _emulated(xs: list[torch.Tensor], average: bool, all_reduce: bool) -> torch.Tensor:
    acc = _roundtrip(xs[0])
    for x in xs[1:]:
        acc = acc + _roundtrip(x)  # rank order, fp32
    if average:
        acc = acc / len(xs)
    return _roundtrip(acc) if all_reduce else acc


def _flush_threshold(absx: torch.Tensor) -> torch.Tensor:
    """t = 2^-10 / s <= max(amax * 2^-9 / 448, 2^-137) of each element's 128-block, per element (last dim)."""
    amax = absx.unflatten(-1, (-1, B)).amax(-1, keepdim=True)
    return (amax * 2**-9 / 448).clamp(min=2**-137).expand(*amax.shape[:-1], B).flatten(-2)


def _bound(xs: torch.Tensor, average: bool, dtype: torch.dtype, all_reduce: bool) -> torch.Tensor:
    """The module docstring's per-element bound on |result - exact|, in fp64, from the inputs xs [dp, n]."""
    dp = xs.shape[0]
    k = dp if average else 1
    absx = xs.abs()
    t = _flush_threshold(absx)
    bound = (torch.maximum(2**-4 * absx, t).sum(0) + dp * 2**-23 * (absx + t).sum(0)) / k
    if all_reduce:  # one more rounding of the reduced value A, |A| <= |exact| + bound, with fresh block scales
        a = xs.sum(0).abs() / k + bound
        return bound + torch.maximum(2**-4 * a, _flush_threshold(a))
    if dtype == torch.bfloat16:
        bound = bound + 2**-7 * (absx + t).sum(0) / k
    return bound


def _check(rank, group, kind, dtype, average, all_reduce, n_per_rank=BLOCKS_PER_CHUNK * B):
    dp, me = dist.get_world_size(group), dist.get_rank(group)
    n = dp * n_per_rank
    xs = [_inputs(kind, r, n, dtype) for r in range(dp)]
    flat = xs[me].clone()
    start = start_fp8_all_reduce if all_reduce else start_fp8_reduce_scatter
    handle = start(flat, group, average=average)
    handle.wait()
    handle.wait()  # a second wait does nothing
    where = f"rank {rank}, {kind}, {dtype}, average={average}, all_reduce={all_reduce}, dp={dp}"
    assert flat.dtype == dtype
    mine = slice(None) if all_reduce else slice(me * n_per_rank, (me + 1) * n_per_rank)
    got = flat[mine]
    assert torch.isfinite(got).all(), where
    exact = torch.stack([x.double() for x in xs])
    k = dp if average else 1
    err = (got.double() - exact.sum(0)[mine] / k).abs()
    bound = _bound(exact, average, dtype, all_reduce)[mine]
    assert (err <= bound).all(), f"{where}: worst err / bound {(err / bound).nan_to_num(0).max():.3f}"
    assert err.max() > 0, where  # FP8 really rounded something
    want = _emulated(xs, average, all_reduce).to(dtype)[mine]
    assert torch.equal(got, want), f"{where}: {int((got != want).sum())} elements differ from the emulation"
    if all_reduce:  # the same bits on every rank
        raw = flat.view(torch.uint8)
        everyone = raw.new_empty(dp * raw.numel())
        dist.all_gather_into_tensor(everyone, raw, group=group)
        assert all(torch.equal(other, raw) for other in everyone.view(dp, -1)), where


def _check_stats(rank, dp):
    n = dp * 4 * B
    flat = torch.ones(n) * (rank + 1)
    chunks = flat.view(dp, -1)
    chunks[:, 0], chunks[:, 1] = 1e4, 1e-8  # block scale 2^-5: 1e-8 * 2^-5 is far below e4m3's 2^-9, it flushes
    stats = Fp8ReduceStats()
    assert stats.fractions() == {"saturated": 0.0, "flushed": 0.0}
    start_fp8_reduce_scatter(flat.clone(), None, average=False, stats=stats).wait()
    assert stats.counts() == {"quantized": n, "saturated": 0, "flushed": dp}
    assert stats.fractions() == {"saturated": 0.0, "flushed": dp / n}
    line, values = stats.report()  # the trainer's log line and TensorBoard scalars, then a reset
    assert values == {"fp8-grad-reduce/saturated": 0.0, "fp8-grad-reduce/flushed": dp / n}
    assert f"{100 * dp / n:.4f}% of values flushed to zero" in line, line
    assert stats.counts()["quantized"] == 0
    start_fp8_reduce_scatter(flat.clone(), None, average=False, stats=stats).wait()
    stats.reset()
    assert stats.counts() == {"quantized": 0, "saturated": 0, "flushed": 0}
    # all-reduce: rank 0's first blocks hold 1e-8 only (no flush), the others' 1e4 beside zeros; the reduced block
    # holds both, so phase 2 (this rank's shard, quantized again) flushes its 127 sums of 1e-8
    flat = torch.ones(n)
    first = flat.view(dp, -1, B)[:, 0]
    first[:] = 1e-8 if rank == 0 else 0
    if rank > 0:
        first[:, 0] = 1e4
    start_fp8_all_reduce(flat, None, average=False, stats=stats).wait()
    assert stats.counts() == {"quantized": n + n // dp, "saturated": 0, "flushed": B - 1}
    assert (first[:, 1:] == 0).all() and torch.isfinite(flat).all()


def _check_non_finite(rank, dp):
    flat = torch.ones(dp * 2 * B)
    if rank == 0:
        flat.view(dp, -1)[:, 0] = float("inf")  # in the first block of every chunk
    for start in (start_fp8_reduce_scatter, start_fp8_all_reduce):
        out = flat.clone()
        start(out, None, average=True).wait()
        first, rest = out.view(dp, 2, B)[:, 0], out.view(dp, 2, B)[:, 1]
        if start is start_fp8_all_reduce:
            assert first.isnan().all() and (rest == 1).all()
        else:
            assert first[rank].isnan().all() and (rest[rank] == 1).all()


def _check_errors(dp):
    with pytest.raises(ValueError, match=r"contiguous 1-D bucket, got shape \(2, 256\); pass bucket.view\(-1\)"):
        start_fp8_reduce_scatter(torch.zeros(2, 256), None, average=True)
    with pytest.raises(ValueError, match="reduces fp32 or bf16 buckets, got torch.int32"):
        start_fp8_all_reduce(torch.zeros(dp * B, dtype=torch.int32), None, average=True)
    with pytest.raises(ValueError, match=f"pad the bucket to a multiple of dp \\* FP8_REDUCE_ALIGN = {dp * 128}"):
        start_fp8_reduce_scatter(torch.zeros(dp * B + B // 2), None, average=True)
    assert FP8_REDUCE_ALIGN == 128


def _body(rank, world_size):
    for kind in ("loguniform", "gaussian"):
        for all_reduce in (False, True):
            for average in (False, True):
                _check(rank, None, kind, torch.float32, average, all_reduce)
            _check(rank, None, kind, torch.bfloat16, True, all_reduce)
    _check_stats(rank, world_size)
    _check_non_finite(rank, world_size)
    _check_errors(world_size)
    # a data-parallel group that is not the world: group ranks, not global ranks, pick the shards
    pairs = [dist.new_group([0, 1])] if world_size == 2 else [dist.new_group([0, 1]), dist.new_group([2, 3])]
    singles = [dist.new_group([r]) for r in range(world_size)]  # dp = 1: a round trip through FP8, no collective
    for group in (pairs[rank // 2], singles[rank]):
        for all_reduce in (False, True):
            _check(rank, group, "gaussian", torch.float32, True, all_reduce)


@pytest.mark.parametrize("world_size", [2, 4])
def test_fp8_reduction_matches_the_exact_sum_within_the_bound(world_size):
    run_distributed(_body, world_size=world_size)
