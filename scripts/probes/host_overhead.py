"""Host (CPU-side) work per training step of FSDP against the distributed optimizer, without a GPU (on
two H100s llama-1b's FSDP step left the GPU idle ~150 ms more per step than the distributed optimizer's, the host
behind). Runs a llama-like model of tiny widths on 2 gloo processes, so that the step's time is the host's: Python,
autograd, the dispatcher and the hooks, the kernels themselves next to nothing. Reports per layout, on rank 0:

  * host ms per step (median of the timed steps) and the main thread's CPU ms (without the time it waits for gloo's
    collectives); 2 CPU cores shared with other work make both noisy: compare layouts within a run;
  * aten ops dispatched per step (torch.profiler CPU events): each is a kernel launch or more on a GPU, and the
    dispatcher's fixed cost per op is what the host pays regardless of the tensors' size;
  * Python's garbage collections per step (full ones apart) and their time: the automatic collector runs by the
    count of objects allocated, so an engine that makes more objects per step pays more collections (--manual-gc);
  * the main thread's CPU ms in the first and the last quarter of the timed steps, and the Python objects the
    collector tracks, gained per step: whether the host's work or its heap grows during a run (--steps 60);
  * Python calls per step (cProfile: Python functions and the C functions they call), the most stable of the
    numbers, by where the function lives (FSDP2, megatron/..., torch); --cprofile N lists the top N functions
    (--sort ncalls|tottime|cumulative), --ranges the CPU time of FSDP2's hooks (its profiler ranges).

    python scripts/probes/host_overhead.py                       # distopt vs FSDP optim_grads, bf16, 16 layers, 4 micro
    python scripts/probes/host_overhead.py --layouts fsdp_optim_grads --cprofile 30 --sort ncalls
    python scripts/probes/host_overhead.py --layouts distopt fsdp_optim_grads fsdp_optim_grads_units4
    python scripts/probes/host_overhead.py --extra "--fp8-format hybrid --fp8-recipe delayed"   # local FP8 layers

A gloo all-reduce or reduce-scatter blocks the host until it completes (NCCL's do not): the collectives' time is in
the numbers here, small at these widths.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import re
import statistics
import tempfile
import time
from pathlib import Path

from megatron.perf.rows import COMMON  # no torch at import
from megatron.perf.rows import LAYOUTS as BENCHMARK_LAYOUTS

# benchmark.py's llama-1b where it sets the host's work (16 layers, GQA, SwiGLU, RMSNorm, rope, untied embeddings,
# 4 micro-batches per rank at DP=2), every width tiny, local layers
MODEL = (
    f"{COMMON} --num-layers 16 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --num-query-groups 2"
    " --seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 16 --vocab-size 255"
    " --transformer-impl local --train-iters 100"
)
LAYOUTS = {
    name: BENCHMARK_LAYOUTS[benchmark_name][1]
    for name, benchmark_name in (
        ("distopt", "dp2_distopt"),
        ("fsdp_optim_grads", "fsdp2_optim_grads"),
        ("mfsdp_optim_grads", "mfsdp2_optim_grads"),  # the flat-buffer engine (megatron/parallel/fsdp/flat_shards.py)
        ("fsdp", "fsdp2"),
    )
}
# units of four layers (about 37k parameters each here), as benchmark.py's *_units200m layouts make them on llama-1b
LAYOUTS["fsdp_optim_grads_units4"] = LAYOUTS["fsdp_optim_grads"] + " --suggested-communication-unit-size 140000"


def _measure(argv: list[str], steps: int, cprofile_top: int, sort: str) -> dict:
    """Build the trainer for `argv` (this process is one gloo rank), warm up, then time, count and profile steps."""
    import torch

    from megatron.config import parse_args
    from megatron.training.trainer import Trainer

    trainer = Trainer(parse_args(argv, world_size=2, device_type="cpu"))
    batches = iter(trainer.loader(trainer.datasets.train, 0))
    lr = trainer.cfg.optimizer.lr
    for _ in range(3):
        trainer.train_step(batches, lr)
    times, cpu_times = [], []
    gc_stats = [0, 0, 0.0]  # collections, of them full (generation 2), seconds, over the timed steps
    gc_start = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_stats[0] += 1
            gc_stats[1] += info["generation"] == 2
            gc_stats[2] += time.perf_counter() - gc_start[0]

    gc.callbacks.append(on_gc)
    objects_before = len(gc.get_objects())
    for _ in range(steps):
        start, cpu_start = time.perf_counter(), time.thread_time()
        trainer.train_step(batches, lr)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.thread_time() - cpu_start)
    gc.callbacks.remove(on_gc)
    objects_after = len(gc.get_objects())
    quarter = max(1, steps // 4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        trainer.train_step(batches, lr)
    ops = sum(1 for e in prof.events() if e.name.startswith("aten::"))
    # ops the dispatcher runs on behalf of another op (aten::copy_ inside aten::to) count once, at the top
    top_ops = sum(1 for e in prof.events() if e.name.startswith("aten::") and not _under_aten(e))
    ranges: dict[str, list[float]] = {}  # the profiler's named ranges (FSDP2's hooks): [count, CPU ms]
    for event in prof.events():
        if not event.name.startswith(("aten::", "[")) and event.cpu_parent is None or "FSDP::" in event.name:
            entry = ranges.setdefault(re.sub(r" \(.*|\(.*", "", event.name)[:80], [0, 0.0])
            entry[0] += 1
            entry[1] += event.cpu_time_total / 1e3
    result = {
        "ms": statistics.median(times) * 1e3,
        # whether the host's work grows during a run: the first and the last quarter of the timed steps
        "cpu_ms_first": statistics.median(cpu_times[:quarter]) * 1e3,
        "cpu_ms_last": statistics.median(cpu_times[-quarter:]) * 1e3,
        "objects_per_step": (objects_after - objects_before) / steps,
        "cpu_ms": statistics.median(cpu_times) * 1e3,
        "ops": ops,
        "top_ops": top_ops,
        "ranges": ranges,
        "gc_per_step": gc_stats[0] / steps,
        "gc_full_per_step": gc_stats[1] / steps,
        "gc_ms_per_step": gc_stats[2] * 1e3 / steps,
    }
    profiler = cProfile.Profile()
    profiler.enable()
    trainer.train_step(batches, lr)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    result["calls"] = stats.total_calls  # Python functions and C functions called from Python
    result["by_source"] = _by_source(stats)
    if cprofile_top:
        stats.sort_stats(sort).print_stats(cprofile_top)
        result["cprofile"] = out.getvalue()
    result["micro"] = trainer.cfg.num_micro_batches
    return result


def _by_source(stats: pstats.Stats) -> dict[str, tuple[int, float]]:
    """cProfile's calls and own time (ms) summed by where the function lives: FSDP2, c10d (the collectives: gloo
    blocks the host here, NCCL does not), megatron's packages, torch's Python, and C functions (ops on the CPU)."""
    groups: dict[str, tuple[int, float]] = {}
    for (path, _, name), (_, calls, tottime, _, _) in stats.stats.items():
        if "fsdp/_fully_shard" in path:
            key = "torch FSDP2"
        elif "distributed_c10d" in path or "c10d" in name:
            key = "c10d collectives"
        elif "/megatron/" in path:
            key = "megatron/" + path.split("/megatron/")[1].split("/")[0]
        elif "site-packages/torch" in path:
            key = "torch (other Python)"
        elif path == "~":
            key = "C functions (ops, autograd engine)"
        else:
            key = "other"
        count, ms = groups.get(key, (0, 0.0))
        groups[key] = (count + calls, ms + tottime * 1e3)
    return groups


def _under_aten(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def _rank(rank: int, store_path: str, argv: list[str], steps: int, top: int, sort: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        result = _measure(argv, steps, top, sort)
        if rank == 0:
            import json

            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run(layout: str, extra: str, steps: int, top: int, sort: str) -> dict:
    import json

    import torch.multiprocessing as mp

    argv = f"{MODEL} {LAYOUTS[layout]} {extra}".split()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_rank, args=(os.path.join(tmp, "store"), argv, steps, top, sort, out), nprocs=2)
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=["distopt", "fsdp_optim_grads"], choices=sorted(LAYOUTS))
    parser.add_argument("--extra", default="", help="more flags for every layout (an FP8 recipe, unit sizes)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cprofile", type=int, default=0, metavar="N", help="print cProfile's top N functions")
    parser.add_argument("--sort", default="tottime", help="cProfile's order (tottime, cumulative, ncalls)")
    parser.add_argument("--ranges", action="store_true", help="print the CPU time of FSDP2's hooks (profiler ranges)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for layout in args.layouts:
        result = run(layout, args.extra, args.steps, args.cprofile, args.sort)
        if "cprofile" in result:
            print(f"=== {layout}: cProfile of one step ({result['calls']} calls)\n{result['cprofile']}")
        print(f"=== {layout}: calls and own time of one step (cProfile) by where the function lives")
        for key, (calls, ms) in sorted(result["by_source"].items(), key=lambda kv: -kv[1][0]):
            print(f"{calls:7d} calls {ms:9.1f} ms  {key}")
        if args.ranges:
            print(f"=== {layout}: profiler ranges of one step (count, CPU ms including what runs inside)")
            for name, (count, ms) in sorted(result["ranges"].items(), key=lambda kv: -kv[1][1])[:40]:
                print(f"{count:6d} {ms:9.2f}  {name}")
        rows.append((layout, result))
    print(
        f"| layout | host ms/step | main thread CPU ms/step | CPU ms/micro-batch | aten ops/step | top-level aten"
        f" ops/step | calls/step | GC runs/step (full) | GC ms/step | CPU ms first/last quarter | objects gained/step"
        f" |  ({args.extra or 'bf16'})"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for layout, r in rows:
        print(
            f"| {layout} | {r['ms']:.1f} | {r['cpu_ms']:.1f} | {r['cpu_ms'] / r['micro']:.1f} | {r['ops']}"
            f" | {r['top_ops']} | {r['calls']} | {r['gc_per_step']:.1f} ({r['gc_full_per_step']:.2f})"
            f" | {r['gc_ms_per_step']:.1f} | {r['cpu_ms_first']:.1f} / {r['cpu_ms_last']:.1f}"
            f" | {r['objects_per_step']:.1f} |"
        )


if __name__ == "__main__":
    main()
