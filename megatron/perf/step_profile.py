"""Where a benchmark row's step goes: GPU kernel time by the lower bound's categories (report.py), the top kernels,
how much of the step the GPU was busy, the communication no kernel hid, and optionally the host's functions under
cProfile (scripts/benchmark.py --profile)."""

from __future__ import annotations

import bisect
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

from .report import COMMUNICATION, kernel_category
from .steps import meet, trainer_step


def short_kernel_name(name: str) -> str:
    """A kernel's name without the namespaces and `void` that fill the first 110 characters of PyTorch's templated
    kernels (the foreach kernels then show their functor: CopyFunctor, LpNormFunctor, ZeroFunctor)."""
    for noise in ("void ", "at::native::", "(anonymous namespace)::", "at::", "c10::"):
        name = name.replace(noise, "")
    return name


def profile(
    argv: list[str],
    steps: int,
    warmup: int = 2,
    top: int = 15,
    host_top: int = 0,
    host_stats: Path | None = None,
    header: str = "",
) -> tuple[str, dict]:
    """Build the trainer for `argv`, time `steps` optimizer steps, then profile as many with torch.profiler, and
    report GPU kernel time by category (the lower bound's, megatron/perf/report.py), the top kernels, and how much
    of the step the GPU was busy; also as a dict (step, busy and kernel ms per step, ms per category). Under
    torchrun every rank profiles and the report is rank 0's. `host_top`: then as many steps again under cProfile,
    and the host functions taking the most of their own time (where a step whose GPU idles in gaps spends it);
    `host_stats`: and the whole cProfile of each rank written there (`rank<r>.pstats`). `header`: the report's first
    line begins with it (the machine), then `argv`."""
    import torch

    _, step = trainer_step(argv)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    kernels: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type == cuda:
            time_us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
            kernels[event.key] = kernels.get(event.key, 0.0) + time_us / 1e3 / steps
    total = sum(kernels.values())
    spans = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type == cuda]
    busy = _length(_union([(a, b) for a, b, _ in spans])) / 1e3 / steps
    idle_long, idle_short = _idle_between_kernels(spans)
    by_category: dict[str, float] = {}
    for name, ms in kernels.items():
        category = kernel_category(name)
        by_category[category] = by_category.get(category, 0.0) + ms
    lines = [
        f"{header}; {' '.join(argv)}",
        f"step {wall_ms:.1f} ms (unprofiled), GPU busy {busy:.1f} ms per step ({100 * busy / wall_ms:.1f}%),"
        f" kernels {total:.1f} ms (more than busy where kernels run concurrently)",
        f"GPU idle between kernels (profiled steps): {idle_long / steps:.1f} ms per step in gaps over 20 us (the host"
        f" behind), {idle_short / steps:.1f} ms in shorter ones (launch latency)",
    ]
    if by_category.get("communication"):
        exposed = {name: us / 1e3 / steps for name, us in _exposed_communication(spans).items()}
        lines.append(
            f"communication: {by_category['communication']:.1f} ms of kernels and copies per step,"
            f" {sum(exposed.values()):.1f} ms of it with no other kernel running (exposed): "
            + ", ".join(f"{name} {ms:.1f}" for name, ms in sorted(exposed.items(), key=lambda kv: -kv[1])[:4])
        )
    lines += ["", "| category | ms/step | share of kernel time |", "|---|---:|---:|"]
    for category, ms in sorted(by_category.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {category} | {ms:.1f} | {100 * ms / total:.1f}% |")
    lines += ["", "| top kernels | ms/step |", "|---|---:|"]
    for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {short_kernel_name(name)[:110]} | {ms:.1f} |")
    summary = {"step_ms": wall_ms, "busy_ms": busy, "kernel_ms": total, "categories": by_category}
    if host_top:
        summary["host"] = host_profile(step, steps, host_top, host_stats)
        lines += ["", *summary["host"]]
    return "\n".join(lines), summary


def host_profile(step: Callable[[], object], steps: int, top: int, stats_dir: Path | None = None) -> list[str]:
    """`steps` calls of `step` under cProfile: the `top` functions by their own time per step (cProfile's overhead
    inflates Python-heavy functions; the ranking is what it is for). A step that waits for the GPU spends it in the
    call that waits (a synchronization, or a tensor read on the host). `stats_dir`: the whole profile is written
    there as `rank<RANK>.pstats` (`python -m pstats`, or two layouts' files compared function by function)."""
    import cProfile
    import pstats

    import torch

    meet()  # every rank's window starts together (their reports took unequal time)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    profiler.disable()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    if stats_dir is not None:
        stats_dir.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(stats_dir / f"rank{os.environ.get('RANK', '0')}.pstats")
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (primitive calls, calls, own s, cumulative s, ...)
    calls = sum(entry[1] for entry in stats.values()) / steps
    lines = [
        f"host (cProfile, rank's main thread): {wall_ms:.1f} ms per step, {calls:.0f} calls per step",
        "",
        "| host function | calls/step | own ms/step | cumulative ms/step |",
        "|---|---:|---:|---:|",
    ]
    for key, (_, ncalls, own, cumulative, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]:
        lines.append(
            f"| {profiled_name(key)[:100]} | {ncalls / steps:.0f} | {own * 1e3 / steps:.1f} |"
            f" {cumulative * 1e3 / steps:.1f} |"
        )
    return lines


def profiled_name(key: tuple[str, int, str]) -> str:
    """A cProfile entry's (file, line, function) as `file:line function` (a C function by its name alone): how
    host_profile and scripts/pstats_diff.py name a function."""
    file, line, name = key
    return name if file == "~" else f"{Path(file).name}:{line} {name}"


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted intervals covering `spans`."""
    merged: list[tuple[float, float]] = []
    for start, stop in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(stop - start for start, stop in intervals)


def _exposed_communication(spans: list[tuple[float, float, str]]) -> dict[str, float]:
    """Time (us) in which a communication kernel or copy runs and no other kernel does, by communication kernel:
    what overlapping the communication with computation has not hidden. Where communication kernels overlap each
    other, the time counts once, for the one that started first."""
    communication, other = [], []
    for span in spans:
        (communication if re.search(COMMUNICATION, span[2], re.IGNORECASE) else other).append(span)
    compute = _union([(a, b) for a, b, _ in other])  # disjoint and sorted: starts and ends both ascending
    compute_ends = [b for _, b in compute]
    exposed: dict[str, float] = {}
    covered = 0.0  # communication time already attributed (a later kernel's overlap with it is not counted again)
    for start, stop, name in sorted(communication):
        start = max(start, covered)
        if start >= stop:
            continue
        covered = stop
        hidden = 0.0
        i = bisect.bisect_right(compute_ends, start)  # the first compute interval ending after `start`
        while i < len(compute) and compute[i][0] < stop:
            hidden += min(stop, compute[i][1]) - max(start, compute[i][0])
            i += 1
        key = re.sub(r"\(.*", "", name).strip()[:60]
        exposed[key] = exposed.get(key, 0.0) + (stop - start) - hidden
    return exposed


def _idle_between_kernels(spans: list[tuple[float, float, str]]) -> tuple[float, float]:
    """GPU idle time (ms) inside the profiled window: gaps between one kernel's end and the next one's start, split
    at 20 us. Long gaps are the GPU waiting on the host (a synchronization, slow launches); short ones are the
    latency between back-to-back kernels, which only fewer kernels reduce."""
    intervals = _union([(a, b) for a, b, _ in spans])
    long_us = short_us = 0.0
    for (_, end), (start, _) in zip(intervals, intervals[1:]):
        gap = start - end
        if gap > 20:
            long_us += gap
        else:
            short_us += gap
    return long_us / 1e3, short_us / 1e3
