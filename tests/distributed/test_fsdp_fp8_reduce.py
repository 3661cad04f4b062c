"""FSDP with --fp8-grad-reduce (O1) at DP=2: each unit's gradient reduce-scatter sends E4M3 bytes and block scales
in one all-to-all and sums in fp32 (megatron/parallel/fsdp/fp8_reduce_scatter.py). The comm FSDP2 calls gives, bit for
bit, the sum of each rank's chunk quantized and dequantized with the project's blockwise quantizer (rows padded to whole
blocks; fp32 and bf16, AVG and SUM). Over 20 steps (two micro-batches each) its losses stay within 1e-3 of the
distributed optimizer's with --fp8-grad-reduce, in bf16 and with the local FP8 linears (delayed), under
optim_grads_params and optim_grads, at lr 1e-3: the two quantize different blocks (FSDP each micro-batch's unit
chunks, the distributed optimizer the step's buckets), and at lr 1e-2 O1 alone moves this model's losses 4e-3 from
bf16's under either, so a tighter lr measures the layouts rather than FP8's noise (measured apart by 1.2e-4). Every
reduce-scatter moves at most 0.55x the bytes of the bf16 reduce-scatter FSDP2 runs for the same unit, in as many
collectives, and the FP8 counters the log reports count every gradient value of a step. --fp8-optimizer-level O2
runs O1 with the precision-aware states and bf16 gradient shards, within 1e-3 of the distributed optimizer's O2."""

import pytest
import torch
import torch.distributed as dist

from megatron.parallel.fp8_reduce import FP8_REDUCE_BLOCK, Fp8ReduceStats
from megatron.parallel.fsdp.fp8_reduce_scatter import Fp8ReduceScatter
from megatron.parallel.fsdp.fsdp2 import local_shard
from tests.dist_utils import run_distributed
from tests.distributed.test_fp8_reduce import _emulated
from tests.distributed.test_fsdp import DISTOPT, FLAGS, GRADS, PARAMS, _close, _run
from tests.distributed.test_parallel_layouts import FP8

O1 = "--fp8-grad-reduce"
# FSDP2's own reduce-scatter: reduce_scatter_single in torch 2.13, reduce_scatter_tensor before (the GPU image's 2.11)
REDUCE_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor")


def _counted(flags: str, world_size: int) -> tuple[list[float], list[int], list[int], object]:
    """Losses of a run, the bytes each rank put into every reduce-scatter (FSDP2's) and every all-to-all (the FP8
    reduce-scatter's: e4m3 bytes and scales), and the trainer."""
    scattered, exchanged = [], []
    originals = {name: getattr(dist, name) for name in (*REDUCE_SCATTERS, "all_to_all_single") if hasattr(dist, name)}

    def counting(name, collective):
        sent = exchanged if name == "all_to_all_single" else scattered

        def counted(output, input, *args, **kwargs):
            sent.append(input.numel() * input.element_size())
            return collective(output, input, *args, **kwargs)

        return counted

    for name, collective in originals.items():
        setattr(dist, name, counting(name, collective))
    try:
        losses, trainer = _run(flags, world_size)
    finally:
        for name, collective in originals.items():
            setattr(dist, name, collective)
    return losses, scattered, exchanged, trainer


def _comm_bits(rank, world_size):
    """FSDP2's call of the comm: rank r's reduced chunk is, bit for bit, `sum_r dequant(quant(chunk_r))` (rank order,
    fp32, then / dp for AVG) of the rows padded with zeros to whole blocks, in the input's dtype."""
    group = dist.group.WORLD
    stats = Fp8ReduceStats()
    comm = Fp8ReduceScatter(stats)
    for cols, dtype, op in ((200, torch.float32, dist.ReduceOp.AVG), (256, torch.bfloat16, dist.ReduceOp.SUM)):
        padded = -(-cols // FP8_REDUCE_BLOCK) * FP8_REDUCE_BLOCK
        xs = [torch.randn(world_size, cols, generator=torch.Generator().manual_seed(r)) * 10**r for r in range(2)]
        xs = [x.to(dtype) for x in xs]
        out = comm.allocate((cols,), dtype=dtype, device=torch.device("cpu"))
        assert (
            comm(
                out,
                comm.allocate((world_size * cols,), dtype=dtype, device=out.device).copy_(xs[rank].view(-1)),
                group,
                op,
            )
            is None
        )
        rows = [torch.nn.functional.pad(x[rank].float(), (0, padded - cols)) for x in xs]
        want = _emulated(rows, average=op == dist.ReduceOp.AVG, all_reduce=False)[:cols].to(dtype)
        assert torch.equal(out, want), (cols, dtype, (out.float() - want.float()).abs().max())
    assert stats.counts()["quantized"] == world_size * (256 + 256), stats.counts()
    with pytest.raises(ValueError, match="sums or averages"):
        comm(out, out.repeat(world_size), group, dist.ReduceOp.MAX)


def check_against_distributed_optimizer(flags: str, world_size: int, rel: dict[str, float]) -> None:
    """FSDP with --fp8-grad-reduce against the distributed optimizer with it, over `flags`' steps: within rel[recipe]
    per recipe ("" for bf16, FP8), under both strategies; then the bytes per reduce-scatter against bf16's, and O2
    within rel["O2"]. Shared with tests/gpu/test_te_fsdp_fp8_reduce.py."""
    sent = {}  # (recipe, layout): the bytes of each FP8 reduce-scatter's all-to-all
    for recipe in ("", FP8):
        want, _ = _run(f"{flags} {recipe} {O1} {DISTOPT}", world_size)
        for name, layout in (("optim_grads_params", PARAMS), ("optim_grads", GRADS)):
            got, scattered, sent[recipe, layout], trainer = _counted(f"{flags} {recipe} {O1} {layout}", world_size)
            _close(got, want, rel[recipe], f"FSDP {O1} {name} {recipe}")
            assert not scattered and sent[recipe, layout], (name, len(scattered), len(sent[recipe, layout]))
            # The last log reset the counters: one more step counts every gradient value at least once per
            # micro-batch (two; the padding to whole blocks counted too)
            trainer.train_step(iter(trainer.loader(trainer.datasets.train, 0)), 1e-3)
            counts = trainer.grad_buffers.fp8_stats.counts()
            numel = sum(local_shard(p).numel() for p in trainer.model.parameters())
            assert counts["quantized"] >= 2 * world_size * numel and counts["saturated"] == 0, (name, counts)
    # Bytes per reduce-scatter against FSDP2's own in bf16 (the same units, in the same order), the FP8 side's from
    # its run above (counted before the extra step)
    _, bf16_sent, none, _ = _counted(f"{flags} {FP8} --megatron-fsdp-grad-comm-dtype bf16 {PARAMS}", world_size)
    fp8_sent = sent[FP8, PARAMS]
    assert not none and len(fp8_sent) == len(bf16_sent) > 0, (len(fp8_sent), len(bf16_sent))
    assert all(a <= 0.55 * b for a, b in zip(fp8_sent, bf16_sent)), list(zip(fp8_sent, bf16_sent))[:4]
    # O2 = O1 + the precision-aware states (fp16 main weights, FP8 / fp16 moments) and bf16 gradient shards
    want, _ = _run(f"{flags} {FP8} --fp8-optimizer-level O2 {DISTOPT}", world_size)
    got, trainer = _run(f"{flags} {FP8} --fp8-optimizer-level O2 {PARAMS}", world_size)
    _close(got, want, rel["O2"], "FSDP O2")
    assert trainer.grad_buffers.fp8_stats is not None
    assert {p.main_grad.dtype for p in trainer.model.parameters()} == {torch.bfloat16}


def _body(rank, world_size):
    _comm_bits(rank, world_size)
    check_against_distributed_optimizer(f"{FLAGS} --bf16 --lr 1e-3", world_size, {"": 1e-3, FP8: 1e-3, "O2": 1e-3})


def test_fsdp_fp8_grad_reduce_matches_distributed_optimizer_in_half_the_bytes():
    run_distributed(_body, world_size=2)
