"""FP8 data-parallel gradient reduction (`--fp8-grad-reduce`): FP8 bytes on the wire, sums in fp32.

Algorithm. A bucket `flat` (1-D fp32 or bf16, n elements, n a multiple of dp * FP8_REDUCE_ALIGN) is split into dp
equal chunks, chunk j destined for data-parallel rank j (chunk j is rank j's shard, `flat.view(dp, -1)[j]`):

1. every rank quantizes all of `flat` to e4m3 (`float8_e4m3fn`) in blocks of B = FP8_REDUCE_BLOCK = 128 contiguous
   elements, each with its own power-of-two scale (below); chunks are whole blocks, so each chunk carries its own
   scales. The bytes of chunk j and its scales (one E8M0 byte per block) travel to rank j in one
   `all_to_all_single` of uint8, started asynchronously (`start_*` returns a handle; its `wait()` does the rest,
   so the handle can stand in for the `dist.Work` of a bucket);
2. in `wait()` rank j dequantizes the dp chunks it received (exactly, see below) and adds them up in fp32 in rank
   order 0, 1, ..., dp-1 (deterministic, and nothing is ever summed in FP8), divides by dp when averaging, and
   writes its shard in `flat`'s dtype (reduce-scatter: the rest of `flat` is left stale);
3. all-reduce only: rank j quantizes its reduced fp32 shard again with fresh block scales and the dp FP8 shards are
   all-gathered (uint8, again with their scales); every rank, the owner included, writes the dequantized values
   into all of `flat`, so every rank holds the same bits. This second rounding is of the *final* value (one
   rounding more, not a sum in FP8); sending the shards in flat's dtype instead would cost 4 (fp32) bytes per
   element in this phase, more than a whole bf16 ring all-reduce.

A rank's own chunk goes through FP8 too: every contribution is rounded the same way, so the result depends only on
the dp inputs and the rank order, not on which rank owns which shard, and equals `sum_r dequant(quant(x_r))`
computed anywhere (the tests compare bits with the project's blockwise quantizer).

Scales. Per block b of rank r's input, with amax_b = max |x| over the block (megatron.fp8.quantize's power-of-two
rule): s_b = 2^floor(log2(448 / amax_b)) in fp32, 1 where amax_b = 0 and at most 2^127 (a tiny amax: 448 / amax
overflowing fp32 is clamped), so s_b is finite and nonzero for every finite block and amax_b * s_b <= 448 exactly:
nothing saturates (the stats count it anyway). x * s_b and q / s_b are exact in fp32 (powers of two), so the only
roundings are the e4m3 cast (round to nearest even), the fp32 additions, the division by dp, and the final cast
to flat's dtype. The scale 1 / s_b = 2^k, k in [-127, 120], is sent as its E8M0 byte (NaN for a non-finite block).

Error bound. Per element i of block b, with x_r the rank-r input, X = sum_r x_r the exact sum, k = dp when averaging
(else 1) and t_rb = 2^-10 / s_rb <= max(amax_rb * 2^-9 / 448, 2^-137) the flush threshold of rank r's block (half
e4m3's smallest subnormal 2^-9, unscaled): e4m3 has 3 mantissa bits, so one quantization errs by at most
max(2^-4 |x|, t) (relative half-ulp 2^-4 for normal codes, 2^-10 absolute in the subnormal range; values with
|x| <= t flush to zero). Then, barring fp32 over/underflow of the result,

    reduce-scatter, fp32 out:
        |R_i - X_i / k| <= (1/k) [ sum_r max(2^-4 |x_ri|, t_rb) + dp 2^-23 sum_r (|x_ri| + t_rb) ]
    bf16 out: add 2^-7 (1/k) sum_r (|x_ri| + t_rb)                      (one bf16 rounding of the fp32 result)
    all-reduce: the fp32 reduce-scatter bound + max(2^-4 |A_i|, t'_b)   (A = the fp32 reduced value, t'_b <=
                max(amax'_b * 2^-9 / 448, 2^-137) with amax'_b = max |A| over the block; no bf16 term: the
                output values are e4m3 values times powers of two, exact in bf16)

(the dp 2^-23 term covers the dp - 1 fp32 additions and the division). Finite inputs whose partial sums stay within
fp32 range never give inf or NaN; a non-finite input makes its whole block NaN on the owner (and, for all-reduce,
everywhere), so the trainer's inf/NaN check still fires.

Bytes on the wire per bucket element, per rank: B = 128 makes the scales 1/128 byte per element (0.8%), so
reduce-scatter sends (dp-1)/dp * (1 + 1/128) ~= 1.008 (dp-1)/dp bytes, vs 4 (dp-1)/dp for an fp32 and 2 (dp-1)/dp for
a bf16 reduce-scatter (0.25x and 0.50x); all-reduce sends twice that, 2.016 (dp-1)/dp, vs a ring all-reduce's
8 (dp-1)/dp in fp32 and 4 (dp-1)/dp in bf16 (again 0.25x and 0.50x). Transient memory: the send and receive byte
buffers (n * (1 + 1/128) bytes each), an fp32 temporary of n elements during quantization and one fp32 chunk.

Why B = 128: it equals data_parallel's shard alignment (sharded buckets need no extra padding), it is the 1x128
tile of the blockwise FP8 recipes, the scale costs under 1% of the bytes, and a block that small keeps the flush
threshold local: a value flushes only when its block (its 127 neighbours) holds one over 2^17.8 times larger.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.distributed as dist

from megatron.fp8.formats import E4M3, E8M0, fp8_max
from megatron.fp8.quantize import scale_from_amax

# torch 2.13 renamed the single-tensor collective; the device image's torch 2.11 has the old name only.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: Elements per scaling block.
FP8_REDUCE_BLOCK = 128
#: A bucket's numel must be a multiple of dp * FP8_REDUCE_ALIGN (whole blocks in every chunk).
FP8_REDUCE_ALIGN = FP8_REDUCE_BLOCK

_FP8_MAX = fp8_max(E4M3)
_E8M0_NAN = 255
#: Set by tests under TRITON_INTERPRET=1 to run the Triton kernels on CPU tensors; off otherwise, so that CPU runs
#: keep the torch path whatever the environment says.
INTERPRET_ON_CPU = False


@functools.cache
def _triton_kernels() -> ModuleType | None:
    from . import fp8_reduce_kernels

    try:
        fp8_reduce_kernels.build()
    except ImportError:  # no Triton: the torch path, the same bits
        return None
    return fp8_reduce_kernels


def _kernels(x: torch.Tensor) -> ModuleType | None:
    """fp8_reduce_kernels for CUDA tensors (one pass over memory instead of the torch path's twenty), None for the
    torch path."""
    if x.is_cuda or (INTERPRET_ON_CPU and x.device.type == "cpu"):
        return _triton_kernels()
    return None


class Fp8ReduceStats:
    """Counters of this rank's quantizations, kept as device tensors so that counting never syncs the host:
    values quantized, values saturated (|x| * scale > 448 before the clamp; 0 with these amax-derived scales) and
    values flushed to zero (x != 0 whose e4m3 code is +-0). All-reduce counts its second quantization (this rank's
    reduced shard) too. Per rank: sum over ranks for global numbers. Read with `fractions()` at log intervals only."""

    def __init__(self) -> None:
        self.quantized: torch.Tensor | None = None  # int64 scalars, created on the first quantization's device
        self.saturated: torch.Tensor | None = None
        self.flushed: torch.Tensor | None = None

    def _add(self, device: torch.device, quantized: int, saturated: torch.Tensor, flushed: torch.Tensor) -> None:
        if self.quantized is None:
            self.quantized, self.saturated, self.flushed = (
                torch.zeros((), dtype=torch.int64, device=device) for _ in range(3)
            )
        self.quantized.add_(quantized)
        self.saturated.add_(saturated)
        self.flushed.add_(flushed)

    def _count(self, x: torch.Tensor, scaled: torch.Tensor, q_bytes: torch.Tensor) -> None:
        flushed = ((x != 0) & (q_bytes & 0x7F == 0)).sum()  # 0x80 is e4m3's -0
        self._add(x.device, x.numel(), scaled.abs().gt(_FP8_MAX).sum(), flushed)

    def counts(self) -> dict[str, int]:
        """{"quantized", "saturated", "flushed"} as ints (one host sync)."""
        if self.quantized is None:
            return {"quantized": 0, "saturated": 0, "flushed": 0}
        quantized, saturated, flushed = torch.stack([self.quantized, self.saturated, self.flushed]).tolist()
        return {"quantized": quantized, "saturated": saturated, "flushed": flushed}

    def fractions(self) -> dict[str, float]:
        """{"saturated", "flushed"}: fractions of the values quantized since the last reset (0.0 if none)."""
        counts = self.counts()
        total = max(counts["quantized"], 1)
        return {"saturated": counts["saturated"] / total, "flushed": counts["flushed"] / total}

    def reset(self) -> None:
        for counter in (self.quantized, self.saturated, self.flushed):
            if counter is not None:
                counter.zero_()

    def report(self) -> tuple[str, dict[str, float]]:
        """The log line and the TensorBoard scalars (`fp8-grad-reduce/...`) of the fractions since the last report
        (this rank's), then a reset."""
        fractions = self.fractions()
        self.reset()
        line = (
            f" fp8 grad reduce (rank {dist.get_rank() if dist.is_initialized() else 0}, since the last log):"
            f" {100 * fractions['flushed']:.4f}% of values flushed to zero, {100 * fractions['saturated']:.4f}%"
            " saturated"
        )
        return line, {f"fp8-grad-reduce/{key}": value for key, value in fractions.items()}


def _encode(x: torch.Tensor, stats: Fp8ReduceStats | None) -> torch.Tensor:
    """x [rows, cols] (cols a multiple of the block) -> uint8 [rows, cols + cols / B]: each row's e4m3 bytes, then
    the E8M0 bytes of its block scales, so that one collective moves both."""
    rows, cols = x.shape
    if (kernels := _kernels(x)) is not None:
        payload, counts = kernels.encode(x, FP8_REDUCE_BLOCK)
        if stats is not None:
            saturated, flushed = counts.sum(dim=0, dtype=torch.int64)
            stats._add(x.device, x.numel(), saturated, flushed)
        return payload
    blocks = x.reshape(-1, FP8_REDUCE_BLOCK)
    amax = blocks.abs().amax(dim=1).float()
    scale = scale_from_amax(amax, E4M3, power_of_two=True)
    scaled = blocks * scale[:, None]  # fp32 (bf16 promotes), exact: a power-of-two scale
    payload = torch.empty(rows, cols + cols // FP8_REDUCE_BLOCK, dtype=torch.uint8, device=x.device)
    q_bytes = payload[:, :cols]
    q_bytes.view(E4M3).copy_(scaled.clamp(-_FP8_MAX, _FP8_MAX).view(rows, cols))  # round to nearest even
    # the decode scale 2^k as its E8M0 byte k + 127; frexp(2^k) = (0.5, k + 1). NaN (255) for a non-finite block.
    scale_inv = scale.reciprocal()
    exponent = torch.frexp(scale_inv).exponent
    ok = torch.isfinite(scale_inv) & (scale_inv > 0)
    payload[:, cols:] = torch.where(ok, exponent + 126, _E8M0_NAN).to(torch.uint8).view(rows, -1)
    if stats is not None:
        stats._count(blocks, scaled, q_bytes.reshape(-1, FP8_REDUCE_BLOCK))
    return payload


def _dequantized(row: torch.Tensor, cols: int) -> torch.Tensor:
    """One row of a payload back to fp32 [cols / B, B]: e4m3 value times a power of two, exact."""
    q = row[:cols].view(E4M3).float().view(-1, FP8_REDUCE_BLOCK)
    return q.mul_(row[cols:].view(E8M0).float().unsqueeze(1))


def _decode_sum(payload: torch.Tensor, cols: int, out: torch.Tensor, average: bool) -> None:
    """out (cols elements, fp32 or bf16) = the rows' dequantized values summed in fp32 in row order (rank order),
    divided by the number of rows when `average`. One fp32 chunk of temporary memory; each addition rounds once."""
    if (kernels := _kernels(payload)) is not None:
        kernels.decode_sum(payload, cols, FP8_REDUCE_BLOCK, out, average)
        return
    acc = _dequantized(payload[0], cols)
    for r in range(1, payload.shape[0]):
        acc.add_(_dequantized(payload[r], cols))
    if average:  # by a tensor: torch divides by a scalar as a product with its reciprocal on CUDA, not exactly
        acc.div_(torch.full((1,), payload.shape[0], dtype=acc.dtype, device=acc.device))
    out.copy_(acc.view(-1))


def _decode_rows(payload: torch.Tensor, cols: int, out: torch.Tensor) -> None:
    """Row r of payload dequantized into out.view(rows, cols)[r]."""
    if (kernels := _kernels(payload)) is not None:
        kernels.decode_rows(payload, cols, FP8_REDUCE_BLOCK, out)
        return
    for r, shard in enumerate(out.view(payload.shape[0], cols)):
        shard.copy_(_dequantized(payload[r], cols).view(-1))


class Fp8ReduceHandle:
    """An FP8 reduction in flight; `wait()` completes it (a second call does nothing)."""

    def __init__(
        self,
        flat: torch.Tensor,
        group: dist.ProcessGroup | None,
        dp: int,
        rank: int,
        average: bool,
        stats: Fp8ReduceStats | None,
        all_reduce: bool,
        out: torch.Tensor | None = None,
    ):
        self._flat, self._group, self._dp, self._rank = flat, group, dp, rank
        self._average, self._stats, self._all_reduce = average, stats, all_reduce
        self._cols = flat.numel() // dp
        self._out = flat.view(dp, -1)[rank] if out is None else out
        self._send = _encode(flat.view(dp, -1), stats)
        self._recv = self._send if dp == 1 else torch.empty_like(self._send)
        self._work = None if dp == 1 else dist.all_to_all_single(self._recv, self._send, group=group, async_op=True)
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        if self._work is not None:
            self._work.wait()
        if self._recv.is_cuda:  # waited for on another stream than they were allocated on (fsdp/flat_shards.py's)
            # Both buffers: the all-to-all may still be reading `_send` when the host gets here; dropped below without
            # this, its memory would go back to the allocating stream, which could overwrite it before the collective
            # is done. Recorded on the stream that waited, the block is reused only after that stream passes this point.
            stream = torch.cuda.current_stream(self._recv.device)
            self._send.record_stream(stream)
            self._recv.record_stream(stream)
        if not self._all_reduce:
            _decode_sum(self._recv, self._cols, self._out, self._average)
        else:
            acc = torch.empty(self._cols, dtype=torch.float32, device=self._flat.device)
            _decode_sum(self._recv, self._cols, acc, self._average)
            mine = _encode(acc.view(1, -1), self._stats)
            gathered = mine
            if self._dp > 1:
                gathered = mine.new_empty(self._dp, mine.shape[1])
                _all_gather(gathered, mine, group=self._group)
            _decode_rows(gathered, self._cols, self._flat)  # the owner too: the same bits on every rank
        self._send = self._recv = self._work = None
        self._done = True


def _check(flat: torch.Tensor, dp: int, what: str) -> None:
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"{what} needs a contiguous 1-D bucket, got shape {tuple(flat.shape)}; pass bucket.view(-1)")
    if flat.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{what} reduces fp32 or bf16 buckets, got {flat.dtype}; keep the gradient buckets in either")
    if flat.numel() % (dp * FP8_REDUCE_ALIGN) or flat.numel() == 0:
        raise ValueError(
            f"{what}: {flat.numel()} elements do not split into {dp} chunks of whole {FP8_REDUCE_BLOCK}-element "
            f"blocks; pad the bucket to a multiple of dp * FP8_REDUCE_ALIGN = {dp * FP8_REDUCE_ALIGN}"
        )


def _start(
    flat: torch.Tensor,
    group: dist.ProcessGroup | None,
    average: bool,
    stats: Fp8ReduceStats | None,
    all_reduce: bool,
    out: torch.Tensor | None = None,
) -> Fp8ReduceHandle:
    what = "FP8 all-reduce" if all_reduce else "FP8 reduce-scatter"
    dp = dist.get_world_size(group)
    _check(flat, dp, what)
    if out is not None and (out.numel() != flat.numel() // dp or not out.is_contiguous()):
        raise ValueError(f"{what}: out has {out.numel()} elements, the shard {flat.numel() // dp}; pass one shard")
    return Fp8ReduceHandle(flat, group, dp, dist.get_rank(group), average, stats, all_reduce, out)


def start_fp8_reduce_scatter(
    flat: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    average: bool,
    stats: Fp8ReduceStats | None = None,
    out: torch.Tensor | None = None,
) -> Fp8ReduceHandle:
    """Start reducing `flat` over `group` in FP8 (module docstring). After `wait()`, this rank's shard
    `flat.view(dp, -1)[rank]` (or `out`, contiguous, numel / dp elements of fp32 or bf16, where given) holds the sum
    (average if `average`) of every rank's shard, accumulated in fp32 and written in its dtype; the rest of `flat` is
    stale. numel must be a multiple of dp * FP8_REDUCE_ALIGN."""
    return _start(flat, group, average, stats, all_reduce=False, out=out)


def fp8_reduce_scatter_chunks(
    chunks: torch.Tensor,
    out: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    average: bool,
    stats: Fp8ReduceStats | None = None,
) -> None:
    """The FP8 reduce-scatter for a caller that lays its input out itself (FSDP2's, megatron/parallel/
    parallel/fsdp/fp8_reduce_scatter.py), run to completion: `chunks` [dp, cols] (contiguous, fp32 or bf16), row j
    destined for rank j; `out` (cols elements, fp32 or bf16) receives this rank's sum, as `start_fp8_reduce_scatter`'s
    shard. Any cols: rows that do not end on a whole block are zero-padded into a copy first (the padding quantizes to
    zeros, adds nothing, and counts among the stats' quantized values)."""
    dp, cols = chunks.shape
    padded = -(-cols // FP8_REDUCE_ALIGN) * FP8_REDUCE_ALIGN
    if padded == cols:
        start_fp8_reduce_scatter(chunks.view(-1), group, average=average, stats=stats, out=out.view(-1)).wait()
        return
    chunks = torch.nn.functional.pad(chunks, (0, padded - cols))
    start_fp8_reduce_scatter(chunks.view(-1), group, average=average, stats=stats).wait()
    out.view(-1).copy_(chunks[dist.get_rank(group), :cols])


def start_fp8_all_reduce(
    flat: torch.Tensor, group: dist.ProcessGroup | None, *, average: bool, stats: Fp8ReduceStats | None = None
) -> Fp8ReduceHandle:
    """Start an FP8 all-reduce of `flat` over `group`: the reduce-scatter above, then an FP8 all-gather of the
    reduced shards with fresh scales. After `wait()`, all of `flat` holds the sum (average if `average`), the same
    bits on every rank. numel must be a multiple of dp * FP8_REDUCE_ALIGN."""
    return _start(flat, group, average, stats, all_reduce=True)
