"""Throughput benchmark: `pretrain_gpt.py` with mock data, for named model presets, precision configs and parallel
layouts (one GPU by default; several through torchrun on one host).

    python scripts/benchmark.py                                    # every preset x every config, one GPU
    python scripts/benchmark.py --presets llama-1b --configs te-bf16 te-delayed
    python scripts/benchmark.py --presets llama-1b --configs te-delayed --layouts 1gpu dp2 tp2 pp2
    python scripts/benchmark.py --presets llama-1b --configs te-bf16 te-delayed --cuda-graphs
    python scripts/benchmark.py --profile llama-1b te-bf16         # where the GPU time goes (torch.profiler)
    python scripts/benchmark.py --profile llama-1b te-delayed --layouts dp2   # ... on rank 0 of two GPUs
    python scripts/benchmark.py --presets llama-1b --configs te-delayed --cuda-graphs --bound   # against the bound
    python scripts/benchmark.py --list                              # the catalogue's configs and layouts, with flags

Configs and layouts are named by their axes (megatron/perf/rows.py). A config is engine-recipe[-FP8 options][-loss]
[-recompute-R]: `te-delayed-fp8params-recompute-block4` is Transformer Engine's layers, delayed scaling, FP8 weights,
the first 4 layers recomputed. A layout is [tpN_][ppN_][cpN_] then the data-parallel engine and its options:
`dp2_distopt`, `tp2_dp2`, `fsdp2_o2states_units400m`. Any composition runs, not only the catalogue's.

Every layout keeps the preset's global batch, so a layout's tokens/s per GPU against the one-GPU row is its scaling
efficiency on the same work (strong scaling; with data parallelism each rank runs fewer micro-batches per step).
`--weak-scaling` multiplies the global batch by the data-parallel size instead (each GPU runs as many micro-batches
per step as one GPU does). `--cuda-graphs` runs the Transformer Engine configs with their layers captured as CUDA
graphs (--cuda-graph-impl transformer_engine); those rows are named `<config>+graphs`.

Each (preset, config) is a separate `pretrain_gpt.py` process; the table reports the last Megatron log line's
tokens/s, TFLOP/s/GPU and MFU (an average over the final --log-interval iterations, so the first iterations' warm-up
(cuDNN plans, Triton and torch.compile kernels) is excluded) and the run's peak allocated memory. A config that fails
(no Transformer Engine, a recipe this GPU cannot run, an engine not built yet) becomes a row saying why.

`--bound` adds each row's lower bound (megatron/perf: every GEMM, attention, memory-bound pass and un-overlapped
collective at the rate measured on this GPU for its shape, cached in --probe-cache), measured / bound, and, from a
`--profile` pass of the row in its own process, the kernel time per category against the bound's
(docs/benchmarks.md, "Lower bound").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron import perf  # no torch at import
from megatron.perf.launch import ROOT, execute, failure_reason, launcher, relaunch, run_env
from megatron.perf.rows import (
    COMMON,
    CONFIGS,
    FSDP_ONLY_CONFIGS,
    GRAPHS,
    LAYOUTS,
    PRESETS,
    config_flags,
    layout_of,
    train_flags,
)
from megatron.perf.rows import config as parse_config
from megatron.perf.rows import layout as parse_layout
from megatron.perf.step_profile import host_profile, profile, profiled_name, short_kernel_name

# what other scripts use of this one (`import benchmark` from a script in scripts/)
__all__ = [
    "COMMON",
    "axes_type",
    "CONFIGS",
    "LAYOUTS",
    "PRESETS",
    "ROOT",
    "Result",
    "command",
    "environment",
    "execute",
    "failure_reason",
    "host_profile",
    "launcher",
    "parse_log",
    "profiled_name",
    "run",
    "run_env",
    "short_kernel_name",
    "table",
    "train_flags",
]

_FIELDS = {
    "ms_per_iter": r"elapsed time per iteration \(ms\): ([\d.]+)",
    "tflops": r"throughput per GPU \(TFLOP/s/GPU\): ([\d.]+)",
    "tokens_per_s": r"tokens/s: ([\d.]+)",
    "mfu": r"MFU: ([\d.]+)%",
    "loss": r"lm loss: ([\d.E+-]+)",
}


@dataclass
class Result:
    preset: str
    config: str
    layout: str = "1gpu"
    gpus: int = 1
    tokens_per_s: float | None = None
    tflops: float | None = None
    mfu: float | None = None
    ms_per_iter: float | None = None
    ms_min: float | None = None
    ms_max: float | None = None
    loss: float | None = None
    peak_gib: float | None = None
    error: str | None = None


def parse_log(text: str) -> dict[str, float]:
    """Numbers from the Megatron iteration lines and the peak-memory line of a pretrain_gpt.py log. Each iteration
    line averages its log interval; the first interval holds the first step's allocations, autotuning and lazily made
    communicators, so with two or more intervals the time per iteration is the mean of the later ones (`ms_min` and
    `ms_max` their range: one interval's hiccup on a shared host shows there instead of passing for the row's speed),
    and tokens/s, TFLOP/s and MFU are the last line's scaled to that mean. The loss is the last line's."""
    lines = [line for line in text.splitlines() if " iteration " in line and "tokens/s:" in line]
    out: dict[str, float] = {}
    if lines:
        for name, pattern in _FIELDS.items():
            match = re.search(pattern, lines[-1])
            if match:
                out[name] = float(match.group(1))
        intervals = [float(m.group(1)) for line in lines[1:] if (m := re.search(_FIELDS["ms_per_iter"], line))]
        if intervals and "ms_per_iter" in out:
            mean = sum(intervals) / len(intervals)
            for name in ("tokens_per_s", "tflops", "mfu"):
                if name in out:
                    out[name] *= out["ms_per_iter"] / mean
            out.update(ms_per_iter=mean, ms_min=min(intervals), ms_max=max(intervals))
    peak = re.search(r"peak memory allocated: ([\d.]+) GiB", text)
    if peak:
        out["peak_gib"] = float(peak.group(1))
    return out


def command(
    preset: str, config: str, iters: int, log_interval: int, layout: str = "1gpu", weak: bool = False, extra: str = ""
) -> list[str]:
    """The launch command of one benchmark run (see `train_flags`)."""
    flags = train_flags(preset, config, iters, log_interval, layout, weak, extra)
    return [*launcher(layout_of(layout)[0]), str(ROOT / "pretrain_gpt.py"), *flags]


def run(
    preset: str,
    config: str,
    iters: int,
    log_interval: int,
    timeout: int,
    log_dir: Path | None,
    layout: str = "1gpu",
    weak: bool = False,
    extra: str = "",
) -> Result:
    cmd = command(preset, config, iters, log_interval, layout, weak, extra)
    text, code = execute(cmd, timeout, run_env(layout))
    if log_dir is not None:
        name = f"{preset}.{config.replace(GRAPHS, '-graphs')}.{layout}.log"  # no '+' in file names
        (log_dir / name).write_text(" ".join(cmd) + "\n" + text)
    numbers = parse_log(text)
    gpus = layout_of(layout)[0]
    if code != 0 or "tokens_per_s" not in numbers:
        return Result(preset, config, layout, gpus, error=failure_reason(text, code))
    return Result(preset, config, layout, gpus, **numbers)


def table(results: list[Result]) -> str:
    """Markdown table. "vs bf16": against the same preset and layout's te-bf16 row (else local-bf16); "scaling":
    tokens/s per GPU against the same preset and config on one GPU."""
    rows = [
        "| preset | config | layout | tokens/s | tokens/s/GPU | TFLOP/s/GPU | MFU | vs bf16 | scaling | peak GiB"
        " | ms/iter | loss |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def find(preset: str, config: str, layout: str) -> Result | None:
        return next(
            (b for b in results if (b.preset, b.config, b.layout) == (preset, config, layout) and not b.error), None
        )

    for r in results:
        if r.error:
            rows.append(f"| {r.preset} | {r.config} | {r.layout} | failed: {r.error.replace('|', '/')} |" + " |" * 8)
            continue
        graphs = GRAPHS if r.config.endswith(GRAPHS) else ""  # like against like
        base = find(r.preset, "te-bf16" + graphs, r.layout) or find(r.preset, "local-bf16", r.layout)
        speedup = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base and base.tokens_per_s else ""
        single = find(r.preset, r.config, "1gpu")
        per_gpu = r.tokens_per_s / r.gpus
        scaling = f"{100 * per_gpu / single.tokens_per_s:.0f}%" if single and r.gpus > 1 else ""
        mfu = f"{r.mfu:.1f}%" if r.mfu is not None else ""
        rows.append(
            f"| {r.preset} | {r.config} | {r.layout} | {r.tokens_per_s / 1e3:.1f}k | {per_gpu / 1e3:.1f}k"
            f" | {r.tflops:.0f} | {mfu} | {speedup} | {scaling} | {r.peak_gib:.1f} | {_ms(r)}"
            f" | {r.loss:.3f} |"
        )
    return "\n".join(rows)


def _ms(r: Result) -> str:
    """The ms/iter cell: the mean of the intervals after the first, with their range where they differ by 1 ms or
    more (`parse_log`)."""
    if r.ms_min is None or r.ms_max - r.ms_min < 1:
        return f"{r.ms_per_iter:.0f}"
    return f"{r.ms_per_iter:.0f} ({r.ms_min:.0f}-{r.ms_max:.0f})"


def profile_run(
    result: Result, timeout: int, log_dir: Path | None, weak: bool = False, extra: str = ""
) -> tuple[dict | None, str]:
    """The `--profile` pass of a row in its own process (as its GPUs' only user): (its summary, "") or (None, why
    it failed)."""
    import tempfile

    graphs = ["--cuda-graphs"] if result.config.endswith(GRAPHS) else []
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "profile.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--profile",
            result.preset,
            result.config.removesuffix(GRAPHS),
        ]
        cmd += ["--layouts", result.layout, "--profile-json", str(out), *graphs, *(["--weak-scaling"] if weak else [])]
        cmd += [f"--extra-flags={extra}"] if extra else []
        text, code = execute(cmd, timeout, run_env(result.layout))
        if log_dir is not None:
            name = f"{result.preset}.{result.config.replace(GRAPHS, '-graphs')}.{result.layout}.profile.log"
            (log_dir / name).write_text(" ".join(cmd) + "\n" + text)
        if code != 0 or not out.exists():
            return None, failure_reason(text, code)
        return json.loads(out.read_text()), ""


def bound_row(result: Result, args: argparse.Namespace, probes: perf.Probes) -> perf.Row:
    """A row's lower bound (megatron/perf) beside its measured step and, unless --no-bound-profile, its profile.
    Any failure becomes a one-line note in the row, never an exception."""
    import torch

    from megatron.config import parse_args

    row = perf.Row(result.preset, result.config, result.layout, measured_ms=result.ms_per_iter)
    if result.error:
        row.errors.append(f"run failed: {result.error}")
    flags = train_flags(
        result.preset, result.config, args.iters, args.log_interval, result.layout, args.weak_scaling, args.extra_flags
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        cfg = parse_args(flags, world_size=result.gpus, device_type=device)
        row.bound = perf.lower_bound(cfg, probes, log=lambda line: print(f"bound: {line}", flush=True))
    except Exception as error:  # a configuration this machine cannot parse, a probe with no fallback, ...
        row.errors.append(f"no bound: {perf.one_line(error)}")
    if args.bound_profile and not result.error:
        summary, why = profile_run(result, args.timeout, args.log_dir, args.weak_scaling, args.extra_flags)
        if summary is None:
            row.errors.append(f"profile failed: {why}")
        else:
            row.profile = {**summary["categories"], perf.IDLE: summary["step_ms"] - summary["busy_ms"]}
    return row


def bound_report(rows: list[perf.Row]) -> str:
    """The bound table, then per row its categories and terms."""
    parts = ['Lower bound per iteration (docs/benchmarks.md, "Lower bound")', "", perf.bound_table(rows)]
    for row in rows:
        if row.bound is not None:
            parts += ["", perf.category_table(row), "", perf.terms_table(row.bound)]
            parts += [f"note: {line}" for line in row.bound.notes]
    return "\n".join(parts)


def environment() -> str:
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    try:
        import transformer_engine

        te = transformer_engine.__version__
    except Exception:  # not installed, or not importable here
        te = "not importable"
    return f"{device}, torch {torch.__version__}, Transformer Engine {te}, {time.strftime('%Y-%m-%d')}"


def axes_type(parse: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse type: a catalogue name, or any other name the axes compose (megatron/perf/rows.py)."""

    def check(name: str) -> str:
        if name not in CONFIGS and name not in LAYOUTS:
            try:
                parse(name)
            except ValueError as error:
                raise argparse.ArgumentTypeError(str(error)) from None
        return name

    return check


def catalogue() -> str:
    """The catalogue's configs and layouts with their flags (--list)."""
    lines = ["configs:", *(f"  {name}: {flags}" for name, flags in CONFIGS.items()), "layouts (GPUs):"]
    return "\n".join(lines + [f"  {name} ({gpus}): {flags}" for name, (gpus, flags) in LAYOUTS.items()])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["llama-1b", "llama-8b-4l"], choices=list(PRESETS))
    default_configs = [c for c in CONFIGS if c not in FSDP_ONLY_CONFIGS]
    configs = axes_type(parse_config)
    parser.add_argument("--configs", nargs="+", default=default_configs, type=configs, metavar="CONFIG", help="all")
    parser.add_argument("--layouts", nargs="+", default=["1gpu"], type=axes_type(parse_layout), metavar="LAYOUT")
    parser.add_argument("--list", action="store_true", help="print the catalogue's configs and layouts, then exit")
    parser.add_argument("--weak-scaling", action="store_true", help="global batch x data-parallel size")
    parser.add_argument("--cuda-graphs", action="store_true", help="TE configs with their layers as CUDA graphs")
    parser.add_argument("--iters", type=int, default=10, help="training iterations per run")
    parser.add_argument(
        "--log-interval", type=int, default=5, help="the reported numbers average the intervals after the first"
    )
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run before it counts as failed")
    parser.add_argument(
        "--extra-flags", default="", help="pretrain_gpt.py flags added to every run, e.g. '--manual-gc' (printed)"
    )
    parser.add_argument("--log-dir", type=Path, help="keep each run's full log here")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--profile", nargs=2, metavar=("PRESET", "CONFIG"), help="profile one run instead")
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument(
        "--profile-warmup", type=int, default=2, help="steps run before the profiled ones (a late window: 30)"
    )
    parser.add_argument("--profile-top", type=int, default=15, help="how many kernels the profile lists")
    parser.add_argument("--profile-json", type=Path, help="with --profile: also write its summary here (rank 0)")
    parser.add_argument(
        "--profile-host",
        type=int,
        default=0,
        metavar="N",
        help="with --profile: the N host functions taking the most of their own time (cProfile, after the GPU profile)",
    )
    parser.add_argument(
        "--profile-host-stats", type=Path, metavar="DIR", help="with --profile-host: each rank's whole cProfile there"
    )
    parser.add_argument(
        "--bound", action="store_true", help="print each row's lower bound, measured/bound and where the rest goes"
    )
    parser.add_argument(
        "--no-bound-profile", dest="bound_profile", action="store_false", help="--bound without the profile pass"
    )
    parser.add_argument(
        "--probe-cache",
        type=Path,
        default=Path.home() / ".cache" / "megatron-fp8" / "probes.json",
        help="--bound's microbenchmark results, per device and shape",
    )
    args = parser.parse_args()
    if args.list:
        print(catalogue())
        return 0
    if args.profile_host and not args.profile or args.profile_host_stats and not args.profile_host:
        parser.error("--profile-host N profiles a --profile run's host; --profile-host-stats DIR needs --profile-host")
    if args.profile:
        preset, config = args.profile
        try:
            config_flags(config)
        except ValueError as error:
            parser.error(str(error))
        if len(args.layouts) != 1:
            parser.error("--profile profiles one layout: pass one --layouts value")
        layout = args.layouts[0]
        # profile every rank under torchrun, report rank 0's
        if (code := relaunch(__file__, layout_of(layout)[0], layout)) is not None:
            return code
        config += GRAPHS if args.cuda_graphs else ""
        flags = train_flags(preset, config, 100, 100, layout, args.weak_scaling, args.extra_flags)
        report, summary = profile(
            flags,
            args.profile_steps,
            args.profile_warmup,
            args.profile_top,
            args.profile_host,
            args.profile_host_stats,
            environment(),
        )
        rank = os.environ.get("RANK", "0")
        if rank == "0":
            print(report)
            if args.profile_json:
                args.profile_json.write_text(json.dumps(summary, indent=1) + "\n")
        else:  # which rank is behind: the others' step, busy and gap lines, and host profile, marked
            print("\n".join(f"[rank {rank}] {line}" for line in [*report.splitlines()[1:4], *summary.get("host", [])]))
        return 0
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    results, rows = [], []
    probes = None
    if args.bound:
        import torch

        measure = perf.cuda_measure if torch.cuda.is_available() else None
        probes = perf.Probes(perf.device_name(), measure, args.probe_cache)
    for preset in args.presets:
        for config in args.configs:
            if args.cuda_graphs and config.startswith("te-"):
                config += GRAPHS
            for layout in args.layouts:
                result = run(
                    preset,
                    config,
                    args.iters,
                    args.log_interval,
                    args.timeout,
                    args.log_dir,
                    layout,
                    args.weak_scaling,
                    args.extra_flags,
                )
                results.append(result)
                print(json.dumps(asdict(result)), flush=True)
                if probes is not None:
                    rows.append(bound_row(result, args, probes))
                    print(perf.bound_table(rows[-1:]).splitlines()[-1], flush=True)  # progress, in case of a timeout
    print(f"\n{environment()}" + (f"; every run with {args.extra_flags}" if args.extra_flags else "") + "\n")
    print(table(results))
    if rows:
        print("\n" + bound_report(rows))
    if args.json:
        records = [asdict(r) for r in results]
        for record, row in zip(records, rows):  # rows exist with --bound only
            record["bound_ms"] = row.bound.total_ms if row.bound else None
            record["bound_categories"] = row.bound.by_category() if row.bound else None
            record["profile_categories"], record["bound_errors"] = row.profile, row.errors
        args.json.write_text(json.dumps(records, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
