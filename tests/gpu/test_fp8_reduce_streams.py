"""The FP8 reduce-scatter waited for on another stream than the one that started it, as the flat-bucket engine does
(megatron/parallel/fsdp/flat_shards.py waits on its reduce stream), on 2 GPUs (NCCL).

The handle drops its send buffer at `wait()`. If the buffer's memory went back to the starting stream while the
all-to-all could still be reading it, the next allocation there would take it over and overwrite it before it was
sent: the receiving rank would sum garbage (an intermittent loss blow-up on llama-1b). Here rank 1 holds its
all-to-all back for about a second (a sleeping kernel), so rank 0's all-to-all is still waiting to send when rank 0
drops the handle and fills new buffers of the send buffer's size on its compute stream; each rank's shard must still
be bit for bit the one a same-stream wait gives."""

import torch

from megatron.parallel.fp8_reduce import FP8_REDUCE_BLOCK, start_fp8_reduce_scatter
from tests.dist_utils import run_distributed
from tests.gpu.marks import TWO_GPUS

pytestmark = TWO_GPUS

# 32M fp32 elements: a 34 MB payload, far more than NCCL can stage before the peer's kernel starts
NUMEL = 1 << 25
SLEEP_CYCLES = 2_000_000_000  # ~1 s at H100 clocks


def _reduce(flat: torch.Tensor, other_stream: torch.cuda.Stream | None, hold_back: bool) -> torch.Tensor:
    if hold_back:
        torch.cuda._sleep(SLEEP_CYCLES)  # this rank's all-to-all starts ~1 s after the peer's
    handle = start_fp8_reduce_scatter(flat, None, average=True)
    send_bytes = flat.numel() + flat.numel() // FP8_REDUCE_BLOCK  # its e4m3 bytes and scale bytes
    with torch.cuda.stream(other_stream):  # None: the current stream
        handle.wait()
    # what the compute stream allocates and writes next (0x7E: e4m3's 448, and a huge scale byte)
    scribbles = [torch.full((send_bytes,), 0x7E, dtype=torch.uint8, device=flat.device) for _ in range(4)]
    if other_stream is not None:
        torch.cuda.current_stream().wait_stream(other_stream)
    shard = flat.view(2, -1)[torch.distributed.get_rank()].clone()
    del scribbles
    return shard


def _body(rank, world_size):
    g = torch.Generator(device="cuda").manual_seed(rank)
    inputs = torch.randn(NUMEL, device="cuda", generator=g)
    want = _reduce(inputs.clone(), None, hold_back=False)
    torch.distributed.barrier()
    got = _reduce(inputs.clone(), torch.cuda.Stream(), hold_back=rank == 1)
    torch.cuda.synchronize()
    bad = (got != want).sum().item()
    assert bad == 0, f"rank {rank}: {bad} of {got.numel()} reduced values differ from a same-stream wait"


def test_fp8_reduce_scatter_waited_on_another_stream():
    run_distributed(_body, world_size=2, backend="nccl")
