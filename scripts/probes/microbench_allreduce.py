"""NCCL all-reduce time and bus bandwidth alone on the GPUs of one host, at the gradient buckets' sizes (fp32, 40M
and 10M elements, Megatron-LM's default bucket and a smaller one), summing and averaging. The reference for how much
longer the same all-reduces take beside the backward pass (docs/benchmarks.md).

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 2 scripts/probes/microbench_allreduce.py
"""

import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    world = dist.get_world_size()
    for numel in (40_000_000, 10_000_000):
        x = torch.ones(numel, device="cuda")
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            for _ in range(3):
                dist.all_reduce(x, op)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(20):
                dist.all_reduce(x, op)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - start) / 20 * 1e3
            bus_gbs = numel * 4 / ms / 1e6 * 2 * (world - 1) / world  # NCCL's bus bandwidth for all-reduce
            if rank == 0:
                print(f"{world} GPUs, {numel:,} fp32, {op}: {ms:.3f} ms, bus bandwidth {bus_gbs:.0f} GB/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
