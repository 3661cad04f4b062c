"""Host microseconds of the torch calls a gradient engine makes per bucket, each in a hot loop: on the main thread,
and inside a gradient hook (the autograd engine's thread, where the engines' hooks run).

    python3 scripts/probes/host_costs.py              # two GPUs (NCCL)
    python3 scripts/probes/host_costs.py --device cpu # two gloo ranks: the calls that need no GPU

megatron/parallel/fsdp/flat_shards.py's calls were chosen by these numbers: a stream context against
setting the stream directly, the current stream asked for by device object or index, a reduce-scatter launched
asynchronously and waited for against one issued synchronously on a side stream, one copy per gradient against one
`_foreach_copy_` a bucket, views made per allocation against a storage resized under views made once. A hot loop
is faster than the same call inside a training step, whose caches are cold: scripts/probes/engine_timers.py measures the
engines' calls there, 2-4x these; what this script gives is their relative cost. Rank 0 prints a table: median and
mean us a call, main thread and hook. Under torchrun when launched without it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

from megatron.perf.launch import relaunch  # no torch at import
from megatron.perf.steps import meet


def calls(device: str, elements: int) -> list[tuple[str, Callable[[], object]]]:
    """(label, call) for each timed call; the process group is started. `elements`: a bucket's elements (bf16)."""
    import torch

    from megatron.parallel.data_parallel import _reduce_scatter  # the engines' call, under torch's name of the day

    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    bucket = torch.zeros(elements, dtype=torch.bfloat16, device=dev)
    half = bucket[: elements // 2]
    shard = torch.zeros(elements // 2, dtype=torch.float32, device=dev)
    grads = [torch.randn(2048, dtype=torch.bfloat16, device=dev) for _ in range(8)]
    main_grads = [torch.empty(2048, dtype=torch.bfloat16, device=dev) for _ in range(8)]
    sizes = [elements // 100] * 100
    shapes = [torch.empty(elements // 100, device="meta") for _ in range(100)]
    resizable = torch.empty(elements, dtype=torch.bfloat16, device=dev)
    storage = resizable.untyped_storage()
    leaf = torch.ones(4, device=dev, requires_grad=True)

    def copies():
        for dst, src in zip(main_grads, grads):
            dst.copy_(src)

    def adds():
        for dst, src in zip(main_grads, grads):
            dst.add_(src)

    def views():
        for view, meta in zip(bucket.split(sizes), shapes):
            view.view_as(meta)

    def resize():
        storage.resize_(0)
        storage.resize_(elements * 2)

    def rs_async():
        _reduce_scatter(half, bucket, group=None, async_op=True).wait()

    def hook_registered():
        with torch.enable_grad():  # as in a forward (a gradient hook runs without grad mode)
            (leaf * 2).register_hook(lambda grad: None)

    table = [
        ("reduce-scatter, async_op, then wait", rs_async),
        ("8 x copy_ (2048 bf16 each)", copies),
        ("_foreach_copy_ of the same 8", lambda: torch._foreach_copy_(main_grads, grads)),
        ("8 x add_", adds),
        ("shard add_: fp32 += bf16, half the bucket", lambda: shard.add_(half)),
        ("split into 100 views + view_as each", views),
        ("torch.empty(bucket), dropped", lambda: torch.empty(elements, dtype=torch.bfloat16, device=dev)),
        ("storage resize_ to none and back", resize),
        ("x * 2, then register_hook on it", hook_registered),
    ]
    if device != "cuda":
        return table
    side = torch.cuda.Stream(dev)
    context = torch.cuda.stream(side)
    event = torch.cuda.Event()
    index = dev.index

    def enter_exit():
        with context:
            pass

    def set_twice():
        current = torch.cuda.current_stream(index)
        torch.cuda.set_stream(side)
        torch.cuda.set_stream(current)

    def rs_on_side_stream():
        side.wait_stream(torch.cuda.current_stream(index))
        with context:
            _reduce_scatter(half, bucket, group=None)

    def allocate_record_free():
        block = torch.empty(elements, dtype=torch.bfloat16, device=dev)
        block.record_stream(side)
        del block

    def record_wait():
        event.record()
        side.wait_event(event)

    return table + [
        ("reduce-scatter synchronous, on a side stream", rs_on_side_stream),
        ("stream context: enter + exit", enter_exit),
        ("current_stream(index) + set_stream twice", set_twice),
        ("current_stream(device object)", lambda: torch.cuda.current_stream(dev)),
        ("current_stream(index)", lambda: torch.cuda.current_stream(index)),
        ("torch.empty(bucket) + record_stream + free", allocate_record_free),
        ("event record + wait_event", record_wait),
        ("wait_stream", lambda: side.wait_stream(torch.cuda.current_stream(index))),
    ]


def time_calls(table: list[tuple[str, Callable[[], object]]], repeats: int, warmup: int) -> dict[str, list[float]]:
    """us per call of each, `repeats` times after `warmup` (the ranks meet before and after each call's loop: the
    collectives in the table run together)."""
    got = {}
    for label, call in table:
        for _ in range(warmup):
            call()
        meet()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            times.append(1e6 * (time.perf_counter() - start))
        meet()
        got[label] = times
    return got


def in_hook(
    table: list[tuple[str, Callable[[], object]]], repeats: int, warmup: int, device: str
) -> dict[str, list[float]]:
    """`time_calls` run inside a gradient hook, on the autograd engine's thread (that of `device`)."""
    import torch

    got: dict[str, list[float]] = {}
    x = torch.ones(4, device=device, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: got.update(time_calls(table, repeats, warmup)))
    y.sum().backward()
    return got


def report(main: dict[str, list[float]], hook: dict[str, list[float]]) -> list[str]:
    """The table: each call's median and mean us, on the main thread and in the hook."""
    lines = [
        "| call | main thread: median us | mean | in a gradient hook: median us | mean |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, times in main.items():
        cells = [f"{f(t):.1f}" for t in (times, hook[label]) for f in (statistics.median, statistics.fmean)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: two gloo ranks")
    parser.add_argument("--elements", type=int, default=40_000_000, help="a bucket's elements (Megatron-LM's 40M)")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args(argv)
    if args.elements < 200 or args.elements % 200 or args.repeats < 1 or args.warmup < 0:
        parser.error("--elements must be a positive multiple of 200, --repeats at least 1, --warmup at least 0")
    if (code := relaunch(__file__, 2, "dp2_distopt", argv)) is not None:
        return code
    import os

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    if args.device == "cuda":
        if torch.cuda.device_count() < 2:
            print("host_costs.py: needs two GPUs (or --device cpu)", file=sys.stderr)
            return 2
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo")
    try:
        table = calls(args.device, args.elements)
        main_thread = time_calls(table, args.repeats, args.warmup)
        hook = in_hook(table, args.repeats, args.warmup, args.device)
        if rank == 0:
            print("\n".join(report(main_thread, hook)), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
