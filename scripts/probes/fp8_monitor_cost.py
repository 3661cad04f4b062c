"""The FP8 monitor's cost per training step on fp8_failures.py's tiny Llama (CPU): the monitor off, on every step,
and on without the peak/RMS sums, each with the time spent recording the statistics. Prints docs/fp8.md's table.

    PYTHONPATH=. python scripts/probes/fp8_monitor_cost.py
"""

from __future__ import annotations

import contextlib
import io
import time
from typing import Any

import torch
from fp8_failures import FP8, TINY, data_flags  # its sibling probe: a script's own folder is on sys.path

from megatron.config import parse_args
from megatron.training import Trainer

COST_ROWS = {  # cost's variants: (precision flags, peak/RMS sums on), and their rows in docs/fp8.md's table
    "monitor off": (FP8.replace("--fp8-stats-interval 1", ""), True, "monitor off (`--fp8-stats-interval 0`)"),
    "monitor on": (FP8, True, "monitor on, every step"),
    "monitor on, no peak/RMS": (FP8, False, "monitor on, without the peak/RMS sums"),
}


def cost(data: str, steps: int = 12, blocks: int = 3) -> dict[str, tuple[float, float | None]]:
    """{variant: (median ms per training step, median ms of it spent recording the statistics; None with the
    monitor off)} for the monitor off, on, and on without the peak/RMS sums. The variants' trainers step in turn,
    block by block, so that the machine's drift falls on all alike; every step runs at the peak learning rate."""
    from megatron.fp8 import stats

    squares, record = stats._squares, stats.Fp8StatsCollector.record
    trainers, batches = {}, {}
    times: dict[str, list[float]] = {k: [] for k in COST_ROWS}
    recording: dict[str, list[float]] = {k: [] for k in COST_ROWS}
    for name, (flags, _, _) in COST_ROWS.items():
        with contextlib.redirect_stdout(io.StringIO()):
            trainers[name] = Trainer(parse_args(f"{TINY} {flags} {data}".split()))
        batches[name] = iter(trainers[name].loader(trainers[name].datasets.train, 0))
    try:
        for _ in range(blocks):
            for name, (_, peak, _) in COST_ROWS.items():
                t, spent = trainers[name], recording[name]
                stats._squares = squares if peak else lambda x: None  # type: ignore[assignment]

                def timed(self: Any, *args: Any, _spent: list[float] = spent, **kwargs: Any) -> None:
                    start = time.perf_counter()
                    record(self, *args, **kwargs)
                    _spent[-1] += time.perf_counter() - start

                stats.Fp8StatsCollector.record = timed  # type: ignore[method-assign]
                # the schedule starts at 0: a step at lr 0 would leave the weights (and their casts) as they are
                lrs = t.lr_schedule.at(t.lr_schedule.warmup)
                for _ in range(steps):
                    spent.append(0.0)
                    start = time.perf_counter()
                    with t.fp8_monitor.watch(1) as watched:
                        t.train_step(batches[name], lrs)
                    if watched is not None:
                        t.fp8_monitor.report(watched, 1, lambda line: None, lambda values, step: None)
                    times[name].append(time.perf_counter() - start)
    finally:
        stats._squares, stats.Fp8StatsCollector.record = squares, record  # type: ignore[method-assign]

    def median(values: list[float]) -> float:
        return 1000 * sorted(values)[len(values) // 2]

    off = COST_ROWS["monitor off"][0]
    return {k: (median(times[k]), median(recording[k]) if COST_ROWS[k][0] != off else None) for k in COST_ROWS}


def cost_table(measured: dict[str, tuple[float, float | None]]) -> str:
    """docs/fp8.md's cost table of `cost`'s result."""
    lines = ["| | ms per step | of which recording the statistics |", "|---|---:|---:|"]
    for name, (step, spent) in measured.items():
        lines.append(f"| {COST_ROWS[name][2]} | {step:.1f} |{'' if spent is None else f' {spent:.2f}'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(cost_table(cost(data_flags())))
