"""Induced SwiGLU outliers on llama-150m with Transformer Engine on one GPU: whether --smooth-swiglu keeps
delayed-scaling FP8 at bf16's loss where plain delayed scaling does not, and when the FP8 monitor and guard notice.

fp8_failures.py's `outliers` injection (four channels of the linear_fc1 gate and up rows of each --layer, fp32 main
copies included, times --factor per step for N steps from --start: those channels' SwiGLU output grows by
factor^(2N)) on loss_parity.py's llama-150m preset, corpus and tokenizer, with --train-iters --iters. A bf16 trunk
trains to step --start - 1 and saves; every run then branches from it, one process each, --parallel at a time:

    bf16, delayed, smooth, balanced  uninjected: TE in bf16, FP8 with delayed scaling (hybrid), that with
                                     --smooth-swiglu, and with --smooth-swiglu-migration 0.5 too
    bf16 xN, delayed xN, smooth xN,  injected for N steps, for each N of --growths
    balanced xN
    auto-bf16 xN                     delayed + --fp8-auto-bf16, injected for the largest N
    auto-bf16, intervals 1 xN        that with --fp8-guard-intervals 1 (the guard acts on the first flagged step)

--kind rescaled-outliers (--engine local) injects fp8_failures.py's function-preserving form instead: the channels of
linear_fc2's input times K = factor^n at the n-th step (at most N), its weight's columns divided by K; it trains bf16,
delayed and smooth uninjected, delayed xN and smooth xN per N, and bf16 and both auto-bf16 runs at the largest N.
--runs trains only the runs named (bf16 among them), to fit a shorter device call.
--plot PNG draws the largest growth's timeline (fp8_failures.draw); --replot draws it from --out's results.json.

FP8 runs watch every --stats-interval'th step (the guard only names layers, except with --fp8-auto-bf16). Per N one
table: each run's final validation loss (the whole validation split) and mean training loss over the last --tail
steps (every run trains on the same batches), both as gaps to the injected bf16 run; the first step the monitor
flags, the first the guard acts (and the layers it moved), and the first training loss 1% away from the uninjected
bf16 run's. Results: docs/fp8.md, "Induced outliers at llama-150m".

    PYTHONPATH=.:scripts python scripts/probes/fp8_outliers_gpu.py --out runs/fp8_outliers   # about 5 min on one H200
    PYTHONPATH=.:scripts python scripts/probes/fp8_outliers_gpu.py --preset tiny --engine local --layer 2 --iters 30 \
        --start 10 --growths 3 --tail 5 --parallel 2   # a CPU check of the script
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import fp8_failures as failures  # its sibling probe: a script's own folder is on sys.path

from megatron.perf.launch import failure_reason
from megatron.perf.rows import config_flags

try:
    import loss_parity  # scripts/: on the path through PYTHONPATH (see above)
    import parity_runs
except ModuleNotFoundError as err:
    raise SystemExit("fp8_outliers_gpu.py needs scripts/ on the path: PYTHONPATH=.:scripts python ...") from err

ROOT = Path(__file__).resolve().parents[2]


def run_flags(args: argparse.Namespace) -> dict[str, tuple[str, int]]:
    """{run: (precision flags, injected steps; 0: uninjected)}."""
    bf16 = config_flags(f"{args.engine}-bf16")
    delayed = f"{config_flags(f'{args.engine}-delayed')} --fp8-stats-interval {args.stats_interval}"
    smooth = f"{delayed} --smooth-swiglu"
    balanced = f"{smooth} --smooth-swiglu-migration 0.5"
    if args.kind == "rescaled-outliers":  # bf16 computes the uninjected run's losses: one injected run checks it
        runs = {"bf16": (bf16, 0), "delayed": (delayed, 0), "smooth": (smooth, 0)}
        for n in args.growths:
            runs |= {f"delayed x{n}": (delayed, n), f"smooth x{n}": (smooth, n)}
        top = max(args.growths)
        runs |= {f"bf16 x{top}": (bf16, top)}
        return runs | recovery(delayed, top)
    runs = {"bf16": (bf16, 0), "delayed": (delayed, 0), "smooth": (smooth, 0), "balanced": (balanced, 0)}
    for n in args.growths:
        runs |= {f"bf16 x{n}": (bf16, n), f"delayed x{n}": (delayed, n)}
        runs |= {f"smooth x{n}": (smooth, n), f"balanced x{n}": (balanced, n)}
    return runs | recovery(delayed, max(args.growths))


def recovery(delayed: str, n: int) -> dict[str, tuple[str, int]]:
    """--fp8-auto-bf16 runs injected for N steps: the guard acting on its default three watched steps, and on one."""
    auto = f"{delayed} --fp8-auto-bf16"
    return {f"auto-bf16 x{n}": (auto, n), f"auto-bf16, intervals 1 x{n}": (f"{auto} --fp8-guard-intervals 1", n)}


def selected(args: argparse.Namespace) -> list[str]:
    """The runs to train: --runs, or all of run_flags."""
    runs = list(run_flags(args))
    if not args.runs:
        return runs
    unknown = [name for name in args.runs if name not in runs]
    if unknown or "bf16" not in args.runs:
        raise SystemExit(f"--runs {args.runs}: give bf16 and some of {runs} (the tables measure against bf16)")
    return args.runs


def model_flags(args: argparse.Namespace) -> list[str]:
    """The preset's flags with --iters steps, its corpus and tokenizer, and a whole-split final validation."""
    parity = loss_parity.build_parser().parse_args(["--preset", args.preset, "--data-dir", str(args.data_dir)])
    flags = loss_parity.set_flag(loss_parity.PRESETS[args.preset].split(), "--train-iters", str(args.iters))
    return [*flags, *loss_parity.data_flags(parity, args.preset), "--full-validation", "--seed", str(args.seed)]


def injection(args: argparse.Namespace, steps: int) -> failures.Injection:
    first, *more = args.layer
    return failures.Injection(args.kind, args.start, steps, args.factor, first, more_layers=tuple(more))


def branch(args: argparse.Namespace) -> None:
    """One run (--branch), from the trunk, in this process: its fp8_failures Result as JSON (--json)."""
    flags, steps = run_flags(args)[args.branch]
    result = failures.train(
        f"{flags} --load {args.out / 'trunk'}",
        injection(args, steps) if steps else None,
        args.branch,
        model=" ".join(model_flags(args)),
    )
    Path(args.json).write_text(json.dumps(dataclasses.asdict(result)))


def run_file(args: argparse.Namespace, name: str, suffix: str) -> Path:
    """A run's log or results JSON in --out."""
    return args.out / f"{name.replace(' ', '_')}.{suffix}"


def launch(args: argparse.Namespace, argv: list[str]) -> dict[str, failures.Result]:
    """The trunk, then every run --parallel at a time; each one's log in --out."""
    chosen = selected(args)
    args.out.mkdir(parents=True, exist_ok=True)
    trunk = args.out / "trunk"
    if not (trunk / "latest_checkpointed_iteration.txt").is_file():  # a checkpoint folder's pointer
        step = str(args.start - 1)
        cmd = [sys.executable, "pretrain_gpt.py", *model_flags(args), *config_flags(f"{args.engine}-bf16").split()]
        cmd += ["--exit-interval", step, "--save", str(trunk), "--save-interval", step]
        with open(args.out / "trunk.log", "w") as log:
            subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    names, running, failed, retried = list(chosen), {}, {}, set()
    started, parallel = time.time(), args.parallel
    while names or running:
        while names and len(running) < parallel:
            name = names.pop(0)
            cmd = [sys.executable, __file__, *argv, "--branch", name, "--json", str(run_file(args, name, "json"))]
            log = open(run_file(args, name, "log"), "w")
            running[name] = (subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log)
        for name, (proc, log) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                del running[name]
                print(f"{name}: exit {proc.returncode} at {time.time() - started:.0f} s", flush=True)
                if not proc.returncode:
                    continue
                reason = failure_reason(run_file(args, name, "log").read_text(), proc.returncode)
                if parity_runs.out_of_memory(reason) and name not in retried and running:
                    retried.add(name)  # the card holds fewer runs: again later, one fewer at a time
                    names.append(name)
                    parallel = max(1, len(running))
                    print(f"{name}: out of GPU memory; again later, {parallel} at a time", flush=True)
                else:
                    failed[name] = reason
        time.sleep(2)
    if failed:
        causes = "; ".join(f"{name}: {reason}" for name, reason in failed.items())  # what a device run keeps
        raise SystemExit(f"runs failed (their logs in {args.out}): {causes}")
    results = {}
    for name in chosen:
        saved = json.loads(run_file(args, name, "json").read_text())
        results[name] = failures.Result.from_json(saved)
    return results


def gap(a: float, b: float) -> float:
    return 100 * (a / b - 1)


def table(args: argparse.Namespace, results: dict[str, failures.Result], n: int) -> str:
    """The runs of growth N (and the uninjected ones) against the injected bf16 run."""
    ref, clean = results.get(f"bf16 x{n}", results["bf16"]), results["bf16"]
    last = max(ref.losses)
    tail = [i for i in sorted(ref.losses) if i > last - args.tail]

    def mean(r: failures.Result) -> float:
        return sum(r.losses[i] for i in tail) / len(tail)

    growth = args.factor ** (n if args.kind == "rescaled-outliers" else 2 * n)
    lines = [
        f"{args.kind} grown for {n} steps from step {args.start} (SwiGLU output x{growth:.3g}),"
        f" layer{'s' if len(args.layer) > 1 else ''} {', '.join(map(str, args.layer))}; gaps against `{ref.name}`:",
        "| run | final validation loss | gap | training loss, last "
        f"{args.tail} steps | gap | monitor flags | guard acts (moved) | 1% from uninjected bf16 |",
        "|---|---:|---:|---:|---:|---|---|---|",
    ]
    names = [k for k in results if " x" not in k or k.endswith(f" x{n}")]
    for name in names:
        r = results[name]
        valid, ref_valid = r.valid[max(r.valid)], ref.valid[max(ref.valid)]
        moved = f" ({', '.join(map(str, r.bf16_layers))})" if r.bf16_layers else ""
        guard = failures.first(r.guard)
        lines.append(
            f"| {name} | {valid:.4f} | {gap(valid, ref_valid):+.3f}% | {mean(r):.4f} | {gap(mean(r), mean(ref)):+.3f}%"
            f" | {failures.first(r.flags) or '-'} | {guard or '-'}{moved}"
            f" | {failures.departure(r.losses, clean.losses) or '-'} |"
        )
    return "\n".join(lines)


def marks(
    args: argparse.Namespace, results: dict[str, failures.Result]
) -> tuple[failures.Result, dict[str, int | None]]:
    """The run whose monitor values the plot shows (delayed xN, N the largest growth) and the plot's marks: the step
    it is first flagged, the step its loss departs 1% from the uninjected bf16 run's, and each auto-bf16 run's guard."""
    n = max(args.growths)
    watched = results.get(f"delayed x{n}") or next(r for r in results.values() if r.series)
    found = {
        "flagged": failures.first(watched.flags),
        "departs 1%": failures.departure(watched.losses, results["bf16"].losses),
    }
    for name, label in ((f"auto-bf16 x{n}", "guard"), (f"auto-bf16, intervals 1 x{n}", "guard, intervals 1")):
        if name in results:
            found[label] = failures.first(results[name].guard)
    return watched, found


def plot(args: argparse.Namespace, results: dict[str, failures.Result], path: Path) -> None:
    """fp8_failures.draw for the largest growth N: every injected run's training loss against the uninjected bf16
    run's, with delayed xN's monitor values for the first injected layer and `marks`."""
    n = max(args.growths)
    runs = {name: r.losses for name, r in results.items() if name != "bf16" and name.endswith(f" x{n}")}
    watched, found = marks(args, results)
    layers = ", ".join(map(str, args.layer))
    title = f"{args.kind} x{n} in layer{'s' * (len(args.layer) > 1)} {layers}: {args.preset}, --engine {args.engine}"
    window = (args.start, args.start + n)
    failures.draw(
        str(path), title, results["bf16"].losses, runs, window, watched.series, found, "uninjected bf16",
        f"{watched.name}: layer {args.layer[0]} fc2 input",
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=["llama-150m", "tiny"], default="llama-150m", help="loss_parity's")
    parser.add_argument("--engine", choices=["te", "local"], default="te", help="te: Transformer Engine (a GPU)")
    parser.add_argument(
        "--kind",
        choices=["outliers", "rescaled-outliers"],
        default="outliers",
        help="fp8_failures.py's injection (rescaled-outliers: --engine local)",
    )
    parser.add_argument(
        "--layer",
        type=int,
        nargs="+",
        default=[6],
        help="the injected layers (1-based; the first is bf16 in FP8 runs); the tables follow the first",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "fp8_outliers", help="trunk, logs, results")
    parser.add_argument("--data-dir", type=Path, default=ROOT / "data", help="holds parity/ (loss_parity.py's)")
    parser.add_argument("--iters", type=int, default=400, help="training steps of every run")
    parser.add_argument("--start", type=int, default=150, help="first injected step (the trunk ends before it)")
    parser.add_argument("--growths", type=int, nargs="+", default=[6, 9], help="injected steps, one study each")
    parser.add_argument("--factor", type=float, default=2.0, help="the rows' growth per injected step")
    parser.add_argument("--stats-interval", type=int, default=10, help="the FP8 runs' --fp8-stats-interval")
    parser.add_argument("--tail", type=int, default=50, help="training steps averaged at the end")
    parser.add_argument(
        "--parallel",
        type=int,
        default=9,
        help="runs training at once (llama-150m: ~14 GB each; one out of memory trains again later, fewer at a time)",
    )
    parser.add_argument("--runs", nargs="+", help="train only these runs (bf16 among them); default: all")
    parser.add_argument("--seed", type=int, default=failures.SEED)
    parser.add_argument("--verbose", action="store_true", help="the trainers' logs in each run's log")
    parser.add_argument("--plot", type=Path, help="draw the largest growth's timeline here (a .png; matplotlib)")
    parser.add_argument("--replot", action="store_true", help="draw --plot from --out's results.json, not training")
    parser.add_argument("--branch", help=argparse.SUPPRESS)  # one run, launched by this script
    parser.add_argument("--json", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if not 1 < args.start < args.iters - args.tail:
        raise SystemExit(f"--start {args.start}: give a step in 2 .. {args.iters - args.tail - 1} (before --tail)")
    if args.kind == "rescaled-outliers" and args.engine != "local":
        raise SystemExit("--kind rescaled-outliers rescales the local Linear's input: give --engine local")
    if args.branch:
        failures.QUIET = not args.verbose
        return branch(args)
    if args.replot:
        if not args.plot:
            raise SystemExit("--replot draws --plot: give --plot PNG")
        saved = json.loads((args.out / "results.json").read_text())
        return plot(args, {k: failures.Result.from_json(v) for k, v in saved.items()}, args.plot)
    results = launch(args, argv)
    report = "\n\n".join(table(args, results, n) for n in args.growths)
    (args.out / "report.md").write_text(report + "\n")
    (args.out / "results.json").write_text(json.dumps({k: dataclasses.asdict(v) for k, v in results.items()}))
    print(report)
    if args.plot:
        plot(args, results, args.plot)


if __name__ == "__main__":
    main()
