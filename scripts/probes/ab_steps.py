"""Layouts' training steps alternated in one process per rank: their speed compared block by block, minutes of
machine drift cancelled.

    python3 scripts/probes/ab_steps.py --preset llama-1b --config te-delayed-fp8params \
        --layouts mfsdp2_optim_grads_bf16comm dp2_distopt --blocks 12 --block-steps 10

Separate benchmark rows of llama-1b on two H100s differ by 5-20% from run to run and within a run (docs/benchmarks.md),
more than a 3% difference between layouts, and each row pays ~55 s of start-up. Here each rank builds every layout's
trainer (benchmark.py's flags for each: the same preset, config and GPUs; all models in memory at once, ~20 GiB each on
llama-1b) and runs them in turn: `--block-steps` steps of each, the order reversed every block (A B C, C B A, ...), the
ranks meeting at a barrier before each layout's turn. A turn's time is its steps' wall time over the steps (each step
ends in the optimizer's norm, read on the host).
Rank 0 prints every block, each layout's median and mean ms per step, and the gap of each layout to the last one
(the reference) within each block (their turns in one block), with its median and mean, and on GPUs what the CUDA
caching allocator did during each layout's turns (memory taken from and given back to the device, retries after an
out-of-memory: each a device-wide synchronization, which a block's time would show as a spike), then one JSON line.
Peak memory is the process's, all models together: take it from benchmark.py's rows.

Under torchrun when launched without it (each layout's GPU count, which must agree).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

from megatron.perf.launch import relaunch  # no torch at import
from megatron.perf.rows import PRESETS
from megatron.perf.steps import build_trainers, meet, one_size

# the CUDA caching allocator's counters (torch.cuda.memory_stats) that `alternate` sums over each layout's turns
ALLOCATOR = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def allocator_counts() -> dict[str, int]:
    """The ALLOCATOR counters of the current GPU so far."""
    import torch

    stats = torch.cuda.memory_stats()
    return {key: stats.get(key, 0) for key in ALLOCATOR}


def alternate(
    steps: list[Callable[[], object]],
    blocks: int,
    block_steps: int,
    warmup: int,
    counts: Callable[[], dict[str, int]] | None = None,
) -> tuple[list[list[float]], list[dict[str, int]]]:
    """ms per step of each layout's step in each block ([block][layout]), the order swapped every block; and per
    layout how much `counts` (e.g. `allocator_counts`) grew during its turns (empty without it)."""
    for step in steps:
        for _ in range(warmup):
            step()
    times, grew = [], [{} for _ in steps]
    for block in range(blocks):
        order = range(len(steps)) if block % 2 == 0 else reversed(range(len(steps)))
        row = [0.0] * len(steps)
        for i in order:
            step = steps[i]
            meet()
            before = counts() if counts else {}
            start = time.perf_counter()
            for _ in range(block_steps):
                step()
            meet()
            row[i] = (time.perf_counter() - start) * 1e3 / block_steps
            if counts:
                for key, value in counts().items():
                    grew[i][key] = grew[i].get(key, 0) + value - before[key]
        times.append(row)
    return times, grew


def report(
    layouts: list[str], times: list[list[float]], grew: list[dict[str, int]] | None = None
) -> tuple[list[str], dict]:
    """The blocks, each layout's median and mean, and each other layout's gap to the last one (the reference) per
    block, with their median and mean; and what `grew` counted during each layout's turns (`alternate`)."""
    reference, others = layouts[-1], layouts[:-1]
    gaps = {layout: [100 * (row[i] / row[-1] - 1) for row in times] for i, layout in enumerate(others)}
    lines = [
        "| block | " + " | ".join(layouts) + " | " + " | ".join(f"{layout} gap" for layout in others) + " |",
        "|---:|" + "---:|" * (len(layouts) + len(others)),
    ]
    for block, row in enumerate(times):
        cells = [f"{ms:.1f}" for ms in row] + [f"{gaps[layout][block]:+.1f}%" for layout in others]
        lines.append(f"| {block + 1} | " + " | ".join(cells) + " |")
    summary = {"layouts": layouts, "blocks": times, "gaps_percent": gaps}
    for i, layout in enumerate(layouts):
        column = [row[i] for row in times]
        summary[layout] = {"median_ms": statistics.median(column), "mean_ms": statistics.fmean(column)}
        lines.append(f"{layout}: median {statistics.median(column):.1f} ms, mean {statistics.fmean(column):.1f} ms")
    for layout in others:
        median, mean = statistics.median(gaps[layout]), statistics.fmean(gaps[layout])
        summary[layout].update(gap_median=median, gap_mean=mean)
        lines.append(f"{layout} against {reference}: median {median:+.1f}%, mean {mean:+.1f}% over {len(times)} blocks")
    for layout, counted in zip(layouts, grew or []):
        if counted:
            summary[layout]["during_turns"] = counted
            lines.append(f"{layout} during its turns: " + ", ".join(f"{k} {v}" for k, v in counted.items()))
    return lines, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-1b", choices=sorted(PRESETS))
    parser.add_argument("--config", default="te-delayed-fp8params")
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=["mfsdp2_optim_grads_bf16comm", "dp2_distopt"],
        help="two or more: each compared with the last (every model in memory at once: three llama-1b fit 80 GB)",
    )
    parser.add_argument("--blocks", type=int, default=12, help="blocks: a turn of each layout, back to back")
    parser.add_argument("--block-steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=10, help="steps of each layout before the first block")
    parser.add_argument("--extra-flags", default="", help="pretrain_gpt.py flags added to every layout's run")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: gloo ranks (tests)")
    args = parser.parse_args(argv)
    if len(args.layouts) < 2:
        parser.error("--layouts takes at least two: each compared with the last")
    world = one_size(parser, args.layouts)
    if min(args.blocks, args.block_steps) < 1 or args.warmup < 0:
        parser.error("--blocks and --block-steps must be at least 1, --warmup at least 0")
    if (code := relaunch(__file__, world, args.layouts[0], argv)) is not None:
        return code
    steps = args.warmup + args.blocks * args.block_steps + 1  # the schedules' length: never reached
    runs = build_trainers(args.preset, args.config, args.layouts, args.extra_flags, steps, args.device)
    counts = allocator_counts if args.device == "cuda" else None
    times, grew = alternate([step for _, step in runs], args.blocks, args.block_steps, args.warmup, counts)
    if os.environ.get("RANK", "0") == "0":
        lines, summary = report(args.layouts, times, grew)
        print("\n".join(lines))
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
