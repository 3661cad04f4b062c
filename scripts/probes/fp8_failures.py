"""Induced FP8 failures on a tiny Llama (local layers, FP8 delayed scaling emulated on CPU), and when the FP8 monitor,
the guard and the training loss notice them. Each failure starts at --start (default step 10) of a 30-step run:

    outliers     a few channels of one layer's linear_fc1 gate and up rows (and their fp32 main copies) scaled by
                 --factor per step for --steps steps (Fishman et al. 2024): the SwiGLU output of those channels grows
                 by factor^2 a step, so that linear_fc2's input amax grows by orders of magnitude
    rescaled-outliers  the same channels of linear_fc2's input times K and its weight's columns divided by K inside
                 its forward, K = --factor^n at the n-th step from --start on, at most --steps: in exact arithmetic
                 the model and its training are the uninjected ones (K a power of two), while the FP8 casts see the
                 channels' range K apart, the disparity one per-tensor scale cannot cover and Smooth-SwiGLU removes
    lr-spike     the learning rate times --factor for --steps steps
    amax-group   DP=2 on 2 gloo processes: rank 1 reduces one layer's FP8 amaxes over itself alone (the wrong
                 process group) from --start on, so the replicas' delayed scales disagree

Every run has the seed and data of the uninjected one. Per failure it trains: the uninjected FP8 run (ref), the
injected FP8 run (monitor on every step, guard naming only), the same with --fp8-auto-bf16 (recovery), the
uninjected and injected high-precision runs (FP8 off; fp32 on CPU), for outliers the injected run with
--smooth-swiglu, for lr-spike one with --fp8-guard-intervals 2. It prints, per failure, one table row per FP8 run:
the first step the monitor flags a tensor (a guard condition over its threshold: the summary line's conditions), the
first step the guard acts (and with --fp8-auto-bf16 the layers it moved), and the first step whose training loss is
1% away from the uninjected FP8 run's and from the same run's in high precision; under the table, per FP8 run, the
largest saturated fraction and the first step one is over 10x the guard's threshold, and the largest update/weight
ratio of the layer's linears (an optimizer-step signal, for the lr-spike). --seeds N repeats everything at seeds
1234 .. 1233 + N and ends each failure with one table of every column as min..max over the seeds.
--json writes every run's losses and flags, --plot DIR one figure per failure (the first seed; matplotlib;
--replot JSON draws them from a --json file). The monitor's cost per step: fp8_monitor_cost.py. The injections are
hooks this script installs on a built Trainer (`install`), not flags: tests and fp8_outliers_gpu.py use them too.
Results: docs/fp8.md, "Induced failures".

    PYTHONPATH=. python scripts/probes/fp8_failures.py --seeds 3 --json runs/fp8_failures.json --plot docs/fp8
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fp8_injections import Injection, install  # noqa: F401  (its sibling: a script's own folder is on sys.path)

from megatron.config import PrecisionConfig, parse_args
from megatron.data import default_corpus
from megatron.training import Trainer

# scripts/loss_parity.py's `tiny` preset, without its evaluations: a 2-layer Llama whose second layer runs in FP8
TINY = (
    "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear"
    " --untie-embeddings-and-output-weights --group-query-attention --hidden-dropout 0 --attention-dropout 0"
    " --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --num-layers 2 --hidden-size 64"
    " --ffn-hidden-size 128 --num-attention-heads 4 --num-query-groups 2 --seq-length 64"
    " --max-position-embeddings 64 --micro-batch-size 8 --global-batch-size 16 --lr 3e-3 --min-lr 3e-4"
    " --lr-warmup-iters 3 --train-iters 30 --eval-iters 0 --log-interval 1000"
)
# A margin of 1 (a factor 2 of headroom): at margin 0 the uninjected run's own linear_fc2 input saturates 0.2-0.8%
# on steps 6-10 (the delayed scale lags the early growth of its amax) and the guard acts at step 8 with no failure
FP8 = "--fp8-format hybrid --fp8-recipe delayed --fp8-margin 1 --fp8-stats-interval 1"
DEPARTURE = 0.01
# A saturated fraction this many times the guard's default threshold on one watched step: where a guard acting on a
# single such step (no streak) would act; measured, not a guard rule (docs/fp8.md, "lr-spike")
FAR_OVER = 10
LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # a transformer layer's FP8 linears
QUIET = True  # the trainers' own logs off (--verbose: on)
SEED = 1234  # the trainers' default --seed; --seeds N trains SEED, SEED + 1, ...
DEFAULTS = {  # (start, steps, factor) of each failure
    "outliers": (10, 6, 2.0),
    "rescaled-outliers": (10, 8, 4.0),
    "lr-spike": (10, 3, 30.0),
    "amax-group": (10, 21, 0.0),
}


def data_flags(data_dir: str = "data") -> str:
    """The default corpus (built on first use) and its tokenizer, as loss_parity's tiny preset trains on."""
    prefix = default_corpus.prepare(data_dir)
    return (
        f"--data-path {prefix} --tokenizer-type GPT2BPETokenizer --vocab-file {default_corpus.VOCAB_FILE}"
        f" --merge-file {default_corpus.MERGE_FILE}"
    )


@dataclass
class Result:
    """One run: its losses and what the monitor and the guard said, by iteration."""

    name: str
    losses: dict[int, float] = field(default_factory=dict)
    flags: dict[int, list[str]] = field(default_factory=dict)
    """The tensors over a guard condition on each watched step (e.g. `layers.1.mlp.linear_fc2 input saturated`)."""
    guard: dict[int, list[str]] = field(default_factory=dict)
    series: dict[str, dict[int, float]] = field(default_factory=dict)
    """Per-step monitor values of the injected layer's linear_fc2 input (for the plots); `weight saturated`: the
    largest saturated fraction of that layer's FP8 weights; `max saturated`: the largest of any FP8 tensor."""
    bf16_layers: list[int] = field(default_factory=list)
    valid: dict[int, float] = field(default_factory=dict)  # validation losses by iteration
    updates: dict[int, float] = field(default_factory=dict)
    """Per step, the largest |W_after - W_before| / |W_before| (Frobenius) of the injected layer's linears: the
    optimizer step's size relative to the weight."""

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Result:
        """A Result read back from JSON (`dataclasses.asdict`), whose keys are strings: integer iterations again."""
        value = dict(value)
        for key in ("losses", "flags", "guard", "updates", "valid"):
            value[key] = {int(i): v for i, v in value[key].items()}
        value["series"] = {k: {int(i): x for i, x in s.items()} for k, s in value["series"].items()}
        return cls(**value)


def train(
    flags: str, injection: Injection | None, name: str = "", world_size: int = 1, extra: str = "", model: str = TINY
) -> Result:
    """Train one run of `model` in this process (a rank of `world_size`; on the GPU where there is one) and record
    what the monitor reported; `extra` flags come last (and win)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with contextlib.redirect_stdout(io.StringIO()) if QUIET else contextlib.nullcontext():
        trainer = Trainer(parse_args(f"{model} {flags} {extra}".split(), world_size=world_size, device_type=device))
    result = Result(name)
    if injection is not None:
        install(trainer, injection)
    layer = injection.layer if injection else 2
    block = trainer.model.decoder.layers[layer - 1]
    weights = [m.weight for n, m in block.named_modules() if n.endswith(LINEARS)]
    step = trainer.train_step

    def measured_step(batches: Any, lrs: Any, num_micro: int | None = None) -> tuple[float, float, bool]:
        before = [w.detach().clone() for w in weights]
        out = step(batches, lrs, num_micro)
        ratios = [float((w.detach() - b).norm() / b.norm()) for w, b in zip(weights, before)]
        result.updates[trainer.state.iteration + 1] = max(ratios, default=0.0)
        return out

    trainer.train_step = measured_step  # type: ignore[method-assign]
    monitor = trainer.fp8_monitor
    if monitor is not None:
        report = monitor.report
        guard = monitor.guard

        def recording(collector: Any, iteration: int, log: Callable, scalars: Callable) -> Any:
            lines: list[str] = []
            rows = report(collector, iteration, lambda line: (lines.append(line), log(line)), scalars)
            result.flags[iteration] = [f"{r.describe()} {c}" for r in rows for c in guard.conditions(r)]
            result.guard[iteration] = [line for line in lines if line.startswith("FP8 guard")]
            for r in rows:
                if r.layer_number == layer and r.describe().endswith("fc2 input"):
                    for key in ("saturated", "underflow", "amax", "peak_ratio", "scale_spread"):
                        result.series.setdefault(key, {})[iteration] = float(getattr(r, key))
            saturated = [r.saturated for r in rows if r.layer_number == layer and r.tensor == "weight"]
            result.series.setdefault("weight saturated", {})[iteration] = max(saturated, default=0.0)
            result.series.setdefault("max saturated", {})[iteration] = max((r.saturated for r in rows), default=0.0)
            return rows

        monitor.report = recording  # type: ignore[method-assign]
    with contextlib.redirect_stdout(io.StringIO()) if QUIET else contextlib.nullcontext():
        state = trainer.train()
    result.losses, result.valid = dict(state.losses), dict(state.valid_losses)
    result.bf16_layers = list(monitor.guard.bf16_layers) if monitor is not None else []
    return result


def first(steps: dict[int, list[str]]) -> int | None:
    return min((i for i, v in steps.items() if v), default=None)


def departure(losses: dict[int, float], reference: dict[int, float]) -> int | None:
    """The first step whose loss is DEPARTURE (relative) away from the reference's."""
    return next((i for i in sorted(losses) if abs(losses[i] / reference[i] - 1) > DEPARTURE), None)


def runs_of(kind: str) -> dict[str, tuple[str, bool]]:
    """{run: (precision flags, injected)} for a failure."""
    runs = {
        "ref fp8": (FP8, False),
        "ref hp": ("", False),
        "fp8": (FP8, True),
        "fp8 auto-bf16": (f"{FP8} --fp8-auto-bf16", True),
        "hp": ("", True),
    }
    if kind in ("outliers", "rescaled-outliers"):
        runs["fp8 smooth-swiglu"] = (f"{FP8} --smooth-swiglu", True)
    if kind == "lr-spike":  # the spike's flags last two watched steps: a guard acting on two
        runs["fp8 auto-bf16, intervals 2"] = (f"{FP8} --fp8-auto-bf16 --fp8-guard-intervals 2", True)
    if kind == "amax-group":  # FP8 off, the injection does nothing: the injected high-precision run is the reference
        del runs["hp"]
    return runs


def study(injection: Injection, data: str, world_size: int = 1) -> dict[str, Result]:
    results = {}
    for name, (flags, injected) in runs_of(injection.kind).items():
        results[name] = train(f"{flags} {data}", injection if injected else None, name, world_size)
    results.setdefault("hp", results["ref hp"])
    return results


def _rank(rank: int, world_size: int, store: str, injection: Injection, data: str, out: str) -> None:
    os.environ.update(OMP_NUM_THREADS="1", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank, world_size=world_size)
    results = study(injection, data, world_size)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({k: dataclasses.asdict(v) for k, v in results.items()}, f)
    dist.destroy_process_group()


def study_dp2(injection: Injection, data: str) -> dict[str, Result]:
    """`study` on 2 gloo processes (data parallel)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        args = (2, os.path.join(tmp, "store"), injection, data, out)
        mp.start_processes(_rank, args=args, nprocs=2, start_method="spawn")
        with open(out) as f:
            loaded = json.load(f)
    return {k: Result.from_json(v) for k, v in loaded.items()}


def timeline(results: dict[str, Result]) -> list[dict[str, Any]]:
    """Per FP8 run: first flagged step (and what), first guard step (and moved layers), departure from the
    reference FP8 run and from the same run in high precision, final loss and its gap to both high-precision runs."""
    ref, ref_hp, hp = results["ref fp8"], results["ref hp"], results["hp"]
    last = max(ref.losses)
    rows = []
    for name, r in results.items():
        if name in ("ref hp", "hp"):
            continue
        flagged, acted = first(r.flags), first(r.guard)
        rows.append(
            {
                "run": name,
                "flagged": flagged,
                "what": r.flags[flagged][:2] if flagged else [],
                "guard": acted,
                "moved": r.bf16_layers,
                "departs vs ref fp8": departure(r.losses, ref.losses),
                "departs vs same in hp": departure(r.losses, (same := hp if name != "ref fp8" else ref_hp).losses),
                "final": r.losses[last],
                "final vs ref hp %": 100 * (r.losses[last] / ref_hp.losses[last] - 1),
                "final vs same in hp %": 100 * (r.losses[last] / same.losses[last] - 1),
                "far over": first({i: [x] for i, x in r.series["max saturated"].items() if x > FAR_OVER * SATURATION}),
                "max saturated": _largest(r.series["max saturated"]),
                "max weight saturated": _largest(r.series["weight saturated"]),
                "max update": _largest(r.updates),
            }
        )
    rows.append({"run": "hp (injected, FP8 off)", "departs vs ref fp8": departure(hp.losses, ref.losses)})
    return rows


SATURATION = PrecisionConfig.fp8_guard_saturation  # the guard's default threshold, which the study runs at


def _largest(values: dict[int, float]) -> tuple[float, int]:
    """(the largest value, its first step)."""
    step = max(sorted(values), key=lambda i: values[i])
    return values[step], step


def markdown(kind: str, rows: list[dict[str, Any]]) -> str:
    head = (
        "| run | monitor flags | guard acts (moved) | loss departs 1% (vs ref FP8 / vs same in fp32) |"
        " final vs fp32 ref / same in fp32 |"
    )
    lines = [head, "|---|---|---|---|---|"]
    for r in rows:
        if "flagged" not in r:
            lines.append(f"| {r['run']} | | | {r['departs vs ref fp8'] or '-'} | |")
            continue
        what = "; ".join(r["what"])
        moved = f" ({', '.join(map(str, r['moved']))})" if r["moved"] else ""
        lines.append(
            f"| {r['run']} | {r['flagged'] or '-'}{f' ({what})' if what else ''} | {r['guard'] or '-'}{moved} |"
            f" {r['departs vs ref fp8'] or '-'} / {r['departs vs same in hp'] or '-'} |"
            f" {r['final vs ref hp %']:+.2f}% / {r['final vs same in hp %']:+.2f}% |"
        )
    for r in rows:
        if "flagged" in r:
            (sat, i), (wsat, j), (update, k) = r["max saturated"], r["max weight saturated"], r["max update"]
            lines.append(
                f"  {r['run']}: largest saturated {100 * sat:.3g}% (step {i}), over {FAR_OVER}x the threshold first"
                f" at {r['far over'] or '-'}; layer's weights {100 * wsat:.3g}% (step {j});"
                f" largest update/weight {update:.3g} (step {k})"
            )
    return f"{kind}:\n" + "\n".join(lines)


def span(values: list[Any], fmt: str = "{}") -> str:
    """Values over seeds as `min..max` (one value: itself); None (never) counted apart: `12..14, - in 1 of 3`."""
    known = sorted(v for v in values if v is not None)
    text = "-" if not known else fmt.format(known[0])
    if known and known[-1] != known[0]:
        text += ".." + fmt.format(known[-1])
    if known and len(known) < len(values):
        text += f", - in {len(values) - len(known)} of {len(values)}"
    return text


def summary(kind: str, per_seed: dict[int, list[dict[str, Any]]]) -> str:
    """One table row per run: each timeline column over the seeds (`span`), the layers moved and in how many."""
    seeds = list(per_seed)
    lines = [
        f"{kind}, seeds {', '.join(map(str, seeds))}:",
        "| run | monitor flags | guard acts (moved) | loss departs 1% (vs ref FP8 / vs same in fp32) |"
        f" final vs fp32 ref / same in fp32 | over {FAR_OVER}x saturation |",
        "|---|---|---|---|---|---|",
    ]
    for index, first_row in enumerate(per_seed[seeds[0]]):
        rows = [per_seed[seed][index] for seed in seeds]

        def col(key: str, rows: list[dict[str, Any]] = rows) -> list[Any]:
            return [r.get(key) for r in rows]

        if "flagged" not in first_row:
            lines.append(f"| {first_row['run']} | | | {span(col('departs vs ref fp8'))} | | |")
            continue
        moved = [tuple(r["moved"]) for r in rows if r["moved"]]
        layers = f" (layer {', '.join(map(str, moved[0]))} in {len(moved)} of {len(rows)})" if moved else ""
        lines.append(
            f"| {first_row['run']} | {span(col('flagged'))} | {span(col('guard'))}{layers} |"
            f" {span(col('departs vs ref fp8'))} / {span(col('departs vs same in hp'))} |"
            f" {span(col('final vs ref hp %'), '{:+.2f}%')} / {span(col('final vs same in hp %'), '{:+.2f}%')} |"
            f" {span(col('far over'))} |"
        )
    return "\n".join(lines)


def plot(kind: str, injection: Injection, results: dict[str, Result], rows: list[dict[str, Any]], path: str) -> None:
    """`draw` against the uninjected FP8 run, with the injected FP8 run's monitor values for layer 2's
    linear_fc2 input and its flagged, guard and departure steps."""
    ref = results["ref fp8"].losses
    runs = {
        name: r.losses
        for name, r in results.items()
        if name != "ref fp8" and not (name == "hp" and r.losses == results["ref hp"].losses)
    }
    row = next(x for x in rows if x["run"] == "fp8")
    marks = {"flagged": row["flagged"], "guard": row["guard"], "departs 1%": row["departs vs ref fp8"]}
    window = (injection.start, min(injection.start + injection.steps, max(ref) + 1))
    draw(path, f"{kind}: FP8 delayed, tiny Llama (CPU, 2 cores)", ref, runs, window, results["fp8"].series, marks)


def draw(
    path: str,
    title: str,
    ref: dict[int, float],
    runs: dict[str, dict[int, float]],
    window: tuple[int, int],
    series: dict[str, dict[int, float]],
    marks: dict[str, int | None],
    reference: str = "uninjected FP8",
    watched: str = "injected FP8 run: fc2 input",
) -> None:
    """Top: each run's training loss against `ref`'s (%, the 1% band shaded, the injected steps `window` [start,
    end) tinted); bottom: one run's monitor `series` (log scale); dashed on both: `marks` ({label: step or None})."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    for name, losses in runs.items():
        steps = sorted(i for i in losses if i in ref)
        top.plot(steps, [100 * (losses[i] / ref[i] - 1) for i in steps], label=name, lw=1.2)
    top.axhspan(-100 * DEPARTURE, 100 * DEPARTURE, color="0.92")
    top.axvspan(window[0] - 0.5, window[1] - 0.5, color="C0", alpha=0.06)
    top.set_ylabel(f"loss vs {reference} (%)")
    top.legend(fontsize=7)
    for key in ("saturated", "underflow", "amax"):
        s = {i: v for i, v in series.get(key, {}).items() if v > 0}
        bottom.semilogy(sorted(s), [s[i] for i in sorted(s)], label=key, lw=1.2)
    spread = {i: v - 1 for i, v in series.get("scale_spread", {}).items() if v > 1}
    if spread:
        bottom.semilogy(sorted(spread), [spread[i] for i in sorted(spread)], "o", ms=3, label="scale spread - 1")
    labels: dict[int, list[str]] = {}  # marks on one step share one label
    for (label, step), color in zip(marks.items(), ("C1", "C2", "C3", "C4")):
        if step:
            for ax in (top, bottom):
                ax.axvline(step, color=color, ls="--", lw=0.8)
            labels.setdefault(step, []).append(label)
    for k, (step, names) in enumerate(sorted(labels.items())):  # staggered: neighbouring steps' labels overlap
        top.annotate(", ".join(names), (step, 1.01 + 0.055 * (k % 3)), xycoords=("data", "axes fraction"), fontsize=7)
    bottom.set_xlabel("iteration")
    bottom.set_ylabel(watched)
    bottom.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--failures", nargs="+", choices=list(DEFAULTS), default=list(DEFAULTS))
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help=f"train every run at N seeds ({SEED}, {SEED + 1}, ...): each timeline per"
        " seed, then each column as min..max over them",
    )
    parser.add_argument("--json", help="write every run's losses, flags and guard messages here")
    parser.add_argument("--plot", help="a folder for one figure per failure (fp8_failure_<kind>.png; the first seed)")
    parser.add_argument("--verbose", action="store_true", help="the trainers' logs too")
    parser.add_argument("--replot", help="draw --plot's figures from a --json file instead of training")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")
    global QUIET
    QUIET = not args.verbose
    data = data_flags()
    torch.set_num_threads(1)
    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        os.makedirs(args.plot or ".", exist_ok=True)
        for kind, entry in saved.items():
            entry = next(iter(entry["seeds"].values()))
            runs = {k: Result.from_json(v) for k, v in entry["runs"].items()}
            runs.setdefault("hp", runs["ref hp"])
            path = os.path.join(args.plot or ".", f"fp8_failure_{kind}.png")
            plot(kind, Injection(kind, *DEFAULTS[kind]), runs, entry["rows"], path)
        return
    everything: dict[str, Any] = {}
    for kind in args.failures:
        start, steps, factor = DEFAULTS[kind]
        injection = Injection(kind, start, steps, factor)
        per_seed, entry = {}, everything.setdefault(kind, {"seeds": {}})
        for seed in range(SEED, SEED + args.seeds):
            flags = f"{data} --seed {seed}"
            results = study_dp2(injection, flags) if kind == "amax-group" else study(injection, flags)
            rows = per_seed[seed] = timeline(results)
            print(markdown(f"{kind}, seed {seed}", rows), flush=True)
            entry["seeds"][seed] = {"rows": rows, "runs": {k: dataclasses.asdict(v) for k, v in results.items()}}
            if args.plot and seed == SEED:
                os.makedirs(args.plot, exist_ok=True)
                plot(kind, injection, results, rows, os.path.join(args.plot, f"fp8_failure_{kind}.png"))
        if args.seeds > 1:
            entry["summary"] = summary(kind, per_seed)
            print(entry["summary"], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1)


if __name__ == "__main__":
    main()
