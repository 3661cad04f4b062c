"""Checkpoint load time of two versions of this project on one checkpoint, alternating (A B A B ...).

    git archive 1d946b9 megatron pretrain_gpt.py | (mkdir -p .old && tar x -C .old)   # the version to compare with
    python scripts/bench_load_ab.py --old .old --presets llama-1b --configs te-delayed --formats torch_dist torch \
        --repeats 3

For each format, each version writes a checkpoint (scripts/bench_checkpoint.py's saving run; the versions' formats
may differ), then the two load their own in turn, `--repeats` times each, each load a fresh process that loads and
trains one iteration (bench_checkpoint's loading run). The first pass warms the page cache for both checkpoints: it
is printed but left out of the medians.
Prints one line per load and a table of medians.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path

import bench_checkpoint  # scripts/, beside this script
import benchmark

ROOT = Path(__file__).resolve().parent.parent


def run_with(cmd: list[str], tree: Path, timeout: int, step: str) -> str:
    """Run a pretrain_gpt.py command with `tree`'s pretrain_gpt.py and megatron package; its output."""
    cmd = [str(tree.resolve() / "pretrain_gpt.py") if c.endswith("pretrain_gpt.py") else c for c in cmd]
    env = benchmark.run_env("1gpu")
    env["PYTHONPATH"] = f"{tree.resolve()}:{env.get('PYTHONPATH', '')}"
    text, code = benchmark.execute(cmd, timeout, env)
    if code != 0:
        raise SystemExit(f"{step} with {tree} failed ({benchmark.failure_reason(text, code)})")
    return text


def load_seconds(cmd: list[str], tree: Path, timeout: int) -> float:
    """The load line's seconds of one loading run with `tree`."""
    times = bench_checkpoint.parse_times(run_with(cmd, tree, timeout, "load"))
    if "load_s" not in times:
        raise SystemExit(f"load with {tree}: no load line in its log")
    return times["load_s"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, required=True, help="the other version's tree (megatron/, pretrain_gpt.py)")
    parser.add_argument("--presets", nargs="+", default=["llama-1b"], choices=sorted(bench_checkpoint.PRESETS))
    parser.add_argument("--configs", nargs="+", default=["te-delayed"], choices=sorted(benchmark.CONFIGS))
    parser.add_argument("--formats", nargs="+", default=["torch_dist", "torch"], choices=["torch_dist", "torch"])
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="loads per version and format")
    parser.add_argument("--timeout", type=int, default=900)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as scratch:
        for preset in args.presets:
            for config in args.configs:
                for fmt in args.formats:
                    # each version loads a checkpoint it wrote itself (formats may differ between versions)
                    loads = {}
                    for name, tree in (("old", args.old), ("new", ROOT)):
                        ckpt = Path(scratch) / f"{name}.{preset}.{config}.{fmt}"
                        save, loads[name] = bench_checkpoint.commands(preset, config, fmt, args.iters, ckpt)
                        run_with(save, tree, args.timeout, "save")
                    times: dict[str, list[float]] = {"old": [], "new": []}
                    for i in range(args.repeats + 1):
                        for name, tree in (("old", args.old), ("new", ROOT)):
                            seconds = load_seconds(loads[name], tree, args.timeout)
                            print(f"{preset} {config} {fmt} load {i} {name}: {seconds:.2f} s", flush=True)
                            if i > 0:  # the first pass warms the page cache
                                times[name].append(seconds)
                    rows.append((preset, config, fmt, times))
                    for name in loads:
                        shutil.rmtree(Path(scratch) / f"{name}.{preset}.{config}.{fmt}", ignore_errors=True)
    print("| preset | config | format | old loads s | new loads s | median old / new |")
    print("|---|---|---|---|---|---:|")
    for preset, config, fmt, t in rows:
        old, new = (", ".join(f"{x:.2f}" for x in t[k]) for k in ("old", "new"))
        ratio = statistics.median(t["old"]) / statistics.median(t["new"])
        print(f"| {preset} | {config} | {fmt} | {old} | {new} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
