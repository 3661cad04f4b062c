"""Each benchmark row's gap to a reference layout's row of its config, pass by pass, and its median and mean.

    python3 scripts/row_gaps.py --reference dp2_distopt OUT/summary.txt

Reads the result lines that scripts/benchmark.py prints (one JSON object per row: preset, config, layout,
ms_per_iter, peak_gib), in the order they were run, from any text that holds them (a summary, a log). A pass ends
where a (preset, config, layout) row comes again, so `ROWS` run `PASSES` times in turn (scripts/probes/fsdp_rows.sh
zero2-1b) make one pass each. A row is compared with the reference row of its preset and config in the same pass:
rows run minutes apart in one device call, because calls, and runs within a call, differ by 5-10% on llama-1b
(docs/benchmarks.md), more than the 3% a comparison may need to show.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

Key = tuple[str, str, str]  # preset, config, layout


def rows(text: str) -> list[dict]:
    """The benchmark result lines in `text` that timed a run (errors and rows without a time left out)."""
    found = []
    for line in text.splitlines():
        line = line.strip()
        if not (line.startswith("{") and '"ms_per_iter"' in line):
            continue
        row = json.loads(line)
        if row.get("ms_per_iter") and not row.get("error"):
            found.append(row)
    return found


def passes(found: list[dict]) -> list[dict[Key, dict]]:
    """`found` split into passes: a new one starts where a row's (preset, config, layout) is already in the current."""
    out: list[dict[Key, dict]] = []
    for row in found:
        key = (row["preset"], row["config"], row["layout"])
        if not out or key in out[-1]:
            out.append({})
        out[-1][key] = row
    return out


def gaps(found: list[dict], reference: str) -> dict[Key, list[float]]:
    """Per non-reference row: its time's gap (%, positive = slower) to the same pass's reference row of its preset
    and config, one entry per pass that ran both."""
    return _gaps(passes(found), reference)


def _gaps(per_pass: list[dict[Key, dict]], reference: str) -> dict[Key, list[float]]:
    out: dict[Key, list[float]] = {}
    for group in per_pass:
        for (preset, config, layout), row in group.items():
            base = group.get((preset, config, reference))
            if layout != reference and base is not None:
                gap = 100.0 * (row["ms_per_iter"] / base["ms_per_iter"] - 1.0)
                out.setdefault((preset, config, layout), []).append(gap)
    return out


def table(found: list[dict], reference: str) -> str:
    """A markdown table: each compared row's gaps per pass, their median and mean, and its peak memory against the
    reference's (the last pass's). Both averages: runs within a call differ by 10% and more, so the median resists
    one slow run, while the mean is what a user's runs get on average."""
    per_pass = passes(found)
    lines = [
        f"| preset, config, layout | gap to {reference} per pass | median | mean | peak GiB (reference) |",
        "|---|---|---:|---:|---:|",
    ]
    for (preset, config, layout), values in _gaps(per_pass, reference).items():
        last = next(g for g in reversed(per_pass) if (preset, config, layout) in g and (preset, config, reference) in g)
        peak, base_peak = last[(preset, config, layout)]["peak_gib"], last[(preset, config, reference)]["peak_gib"]
        lines.append(
            f"| {preset}, {config}, `{layout}` | {', '.join(f'{v:+.1f}%' for v in values)}"
            f" | {statistics.median(values):+.1f}% | {statistics.fmean(values):+.1f}% | {peak} ({base_peak}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="text holding benchmark.py's result lines, in run order")
    parser.add_argument("--reference", default="dp2_distopt", help="the layout every other row is compared with")
    args = parser.parse_args(argv)
    found = rows("\n".join(path.read_text() for path in args.files))
    if not gaps(found, args.reference):
        print(f"row_gaps.py: error: no row has a {args.reference} row of its config in its pass", file=sys.stderr)
        return 1
    print(table(found, args.reference))
    return 0


if __name__ == "__main__":
    sys.exit(main())
