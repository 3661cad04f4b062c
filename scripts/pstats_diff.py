"""Two host profiles compared function by function: where one layout's host spends more of a step than another's.

    python3 scripts/pstats_diff.py OUT/flat/rank0.pstats OUT/distopt/rank0.pstats --steps 4

Reads the cProfile files that `scripts/benchmark.py --profile ... --profile-host N --profile-host-stats DIR` writes
(one per rank, over `--profile-steps` steps) and prints the functions whose own time per step differs most, with
their calls per step on each side. On a host-bound step (the GPU idle in gaps) the first file's extra rows are
what its engine costs the host beyond the second's; a call that waits for the GPU (a synchronization, a kernel
launch into a full queue) takes own time too, so large rows of launches and syncs on one side mean its host was
ahead of the GPU, not slower.
"""

from __future__ import annotations

import argparse
import pstats
from pathlib import Path

from megatron.perf.step_profile import profiled_name  # no torch at import

Entry = tuple[float, float]  # calls and own seconds, over the profiled steps


def functions(path: Path) -> dict[str, Entry]:
    """Each function of a cProfile file, named as benchmark.py's host profile names it (`profiled_name`)."""
    return {profiled_name(key): (calls, own) for key, (_, calls, own, _, _) in pstats.Stats(str(path)).stats.items()}


def diff_lines(first: dict[str, Entry], second: dict[str, Entry], steps: int, top: int) -> list[str]:
    """The `top` functions with the most own time per step more in `first` than in `second`, then the `top` with the
    most less (ms per step; calls per step on each side)."""
    rows = []
    for name in first.keys() | second.keys():
        (calls_a, own_a), (calls_b, own_b) = first.get(name, (0, 0.0)), second.get(name, (0, 0.0))
        rows.append(((own_a - own_b) * 1e3 / steps, name, calls_a / steps, calls_b / steps))
    rows.sort(key=lambda row: -row[0])
    total = [sum(own for _, own in side.values()) * 1e3 / steps for side in (first, second)]
    calls = [sum(count for count, _ in side.values()) / steps for side in (first, second)]
    lines = [
        f"own time per step: {total[0]:.1f} against {total[1]:.1f} ms; calls per step: {calls[0]:.0f} against"
        f" {calls[1]:.0f}",
        "",
        "| function | own ms/step more | calls/step (first, second) |",
        "|---|---:|---:|",
    ]
    for delta, name, calls_a, calls_b in rows[:top] + rows[max(top, len(rows) - top) :]:  # each row once
        lines.append(f"| {name[:100]} | {delta:+.2f} | {calls_a:.0f}, {calls_b:.0f} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument("--steps", type=int, default=1, help="steps the profiles span (benchmark.py --profile-steps)")
    parser.add_argument("--top", type=int, default=30, help="rows of each sign")
    args = parser.parse_args()
    for path in (args.first, args.second):
        if not path.is_file():
            parser.error(f"{path}: no such profile (benchmark.py --profile-host-stats DIR writes DIR/rank<r>.pstats)")
    print("\n".join(diff_lines(functions(args.first), functions(args.second), args.steps, args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
