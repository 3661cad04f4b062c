"""The FP8 monitor's cost per training step: the monitor off, on every step, and on without the peak/RMS sums, each
with the time spent recording the statistics, on fp8_failures.py's tiny Llama (CPU) or loss_parity.py's llama-150m
(one GPU; the local or Transformer Engine layers). Prints docs/fp8.md's table.

    PYTHONPATH=. python scripts/probes/fp8_monitor_cost.py
    PYTHONPATH=.:scripts python scripts/probes/fp8_monitor_cost.py --preset llama-150m --engine local   # one GPU

On a GPU every timed span ends in a device synchronize, so the recording time includes its kernels (and the wait
for the work queued before it: an upper bound).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from fp8_failures import FP8, TINY, data_flags  # its sibling probe: a script's own folder is on sys.path

from megatron.config import parse_args
from megatron.perf.rows import config_flags
from megatron.training import Trainer

WATCH = "--fp8-stats-interval 1"  # the FP8 flags' watch on every step (as in FP8); the monitor-off variant drops it
COST_ROWS = {  # cost's variants: (monitor on, peak/RMS sums on), and their rows in docs/fp8.md's table
    "monitor off": (False, True, "monitor off (`--fp8-stats-interval 0`)"),
    "monitor on": (True, True, "monitor on, every step"),
    "monitor on, no peak/RMS": (True, False, "monitor on, without the peak/RMS sums"),
}


def cost(
    data: str, steps: int = 12, blocks: int = 3, model: str = TINY, fp8: str = FP8
) -> dict[str, tuple[float, float | None]]:
    """{variant: (median ms per training step, median ms of it spent recording the statistics; None with the
    monitor off)} for the monitor off, on, and on without the peak/RMS sums of `model` with the FP8 flags `fp8`
    (which watch every step). The variants' trainers step in turn, block by block, so that the machine's drift falls
    on all alike; every step runs at the peak learning rate."""
    from megatron.fp8 import stats

    sync: Callable[[], None] = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None

    squares, record = stats._squares, stats.Fp8StatsCollector.record
    trainers, batches = {}, {}
    times: dict[str, list[float]] = {k: [] for k in COST_ROWS}
    recording: dict[str, list[float]] = {k: [] for k in COST_ROWS}
    for name, (on, _, _) in COST_ROWS.items():
        flags = fp8 if on else fp8.replace(WATCH, "")
        with contextlib.redirect_stdout(io.StringIO()):
            trainers[name] = Trainer(parse_args(f"{model} {flags} {data}".split()))
        batches[name] = iter(trainers[name].loader(trainers[name].datasets.train, 0))
        progress(f"built {name}")
    try:
        for block in range(blocks):
            progress(f"block {block + 1} of {blocks}")
            for name, (_, peak, _) in COST_ROWS.items():
                t, spent = trainers[name], recording[name]
                stats._squares = squares if peak else lambda x: None  # type: ignore[assignment]

                def timed(self: Any, *args: Any, _spent: list[float] = spent, **kwargs: Any) -> None:
                    sync()
                    start = time.perf_counter()
                    record(self, *args, **kwargs)
                    sync()
                    _spent[-1] += time.perf_counter() - start

                stats.Fp8StatsCollector.record = timed  # type: ignore[method-assign]
                # the schedule starts at 0: a step at lr 0 would leave the weights (and their casts) as they are
                lrs = t.lr_schedule.at(t.lr_schedule.warmup)
                for _ in range(steps):
                    spent.append(0.0)
                    sync()
                    start = time.perf_counter()
                    with t.fp8_monitor.watch(1) as watched:
                        t.train_step(batches[name], lrs)
                    if watched is not None:
                        t.fp8_monitor.report(watched, 1, lambda line: None, lambda values, step: None)
                    sync()
                    times[name].append(time.perf_counter() - start)
    finally:
        stats._squares, stats.Fp8StatsCollector.record = squares, record  # type: ignore[method-assign]

    def median(values: list[float]) -> float:
        return 1000 * sorted(values)[len(values) // 2]

    return {k: (median(times[k]), median(recording[k]) if COST_ROWS[k][0] else None) for k in COST_ROWS}


def progress(line: str) -> None:
    """To stderr, at once: what a run cut short by a time limit got to."""
    print(f"{time.strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)


def cost_table(measured: dict[str, tuple[float, float | None]]) -> str:
    """docs/fp8.md's cost table of `cost`'s result."""
    lines = ["| | ms per step | of which recording the statistics |", "|---|---:|---:|"]
    for name, (step, spent) in measured.items():
        lines.append(f"| {COST_ROWS[name][2]} | {step:.1f} |{'' if spent is None else f' {spent:.2f}'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=["tiny", "llama-150m"], default="tiny", help="tiny: CPU; llama-150m: a GPU")
    parser.add_argument("--engine", choices=["local", "te"], default="local", help="llama-150m's layers")
    parser.add_argument("--data-dir", default="data", help="holds parity/ (loss_parity.py's), for llama-150m")
    parser.add_argument("--steps", type=int, default=12, help="steps per block and variant")
    parser.add_argument("--blocks", type=int, default=3)
    args = parser.parse_args()
    if args.preset == "tiny":
        torch.set_num_threads(1)
        print(cost_table(cost(data_flags(), args.steps, args.blocks)))
        return
    try:
        import loss_parity  # scripts/: on the path through PYTHONPATH (see above)
    except ModuleNotFoundError as err:
        raise SystemExit("--preset llama-150m needs scripts/ on the path: PYTHONPATH=.:scripts python ...") from err
    parity = loss_parity.build_parser().parse_args(["--preset", args.preset, "--data-dir", args.data_dir])
    data = " ".join(loss_parity.data_flags(parity, args.preset))
    fp8 = f"{config_flags(f'{args.engine}-delayed')} {WATCH}"
    print(cost_table(cost(data, args.steps, args.blocks, loss_parity.PRESETS[args.preset], fp8)))


if __name__ == "__main__":
    main()
