"""Loss parity: does FP8 train as well as bf16? Trains the same model, data, seed and schedule in bf16 and with each
FP8 recipe, one `pretrain_gpt.py` process per run, and compares the validation losses with bf16's, and with the gap
between two bf16 runs that differ only in their seed (the noise floor).

    python scripts/loss_parity.py --preset tiny                 # CPU smoke test: local engine, every recipe
    python scripts/loss_parity.py --preset llama-150m --configs te-bf16 te-bf16@seed2 te-delayed
    python scripts/loss_parity.py --preset llama-150m --configs te-tensorwise te-blockwise   # merged into the same JSON
    python scripts/loss_parity.py --report-only --results runs/loss_parity/results.json --out docs/loss_parity.md

Runs are named `CONFIG[@seedN][+TAG]`:
  * CONFIG is one of scripts/benchmark.py's configs: te-bf16, te-delayed, te-tensorwise, te-blockwise (Transformer
    Engine, GPU only) and local-bf16, local-delayed, local-tensorwise, local-rowwise, local-blockwise, local-mxfp8
    (the local layers, which run every recipe, emulated where the hardware lacks it, CPU included);
  * `@seedN` trains with the N-th seed, --seed + N - 1 (`te-bf16@seed2`: the noise-floor run); every other run uses
    --seed itself, so that bf16 and the FP8 runs start from the same weights and read the same batches;
  * `+TAG` names a variant, whose flags `--config-flags` gives: `--configs te-delayed te-delayed+h16 --config-flags
    "te-delayed+h16=--fp8-amax-history-len 16 --fp8-amax-compute-algo max"`.
Default runs: the preset's engine (te for llama-150m, local for tiny), every recipe, and its bf16 a second time with
@seed2. Each run gets: the preset's flags, the data flags, the config's precision flags, --seed, the overrides
(--train-iters, --eval-interval, --eval-iters, --log-interval), --extra (every run; `--extra=--no-fp8-wgrad` for a
lone flag), --fp8-extra (the FP8 runs only, for flags that need FP8 on, e.g. "--fp8-stats-interval 100"), then the
run's --config-flags; a later flag wins over an earlier one.

Data: --data-path PREFIX (or a weighted blend) with the tokenizer flags it was preprocessed with (--tokenizer-type,
--vocab-file, --merge-file, --tokenizer-model, --vocab-size) and --split; --mock-data for the synthetic stream; neither:
the project's default corpus (Python's own documentation, built into --data-dir on first use, as
examples/quickstart.sh does) with --split 98,2,0 and the committed tokenizer. The default corpus holds 0.5-0.7M tokens
(by Python version), which llama-150m's 1000 iterations (33M tokens) read about 50 times over: it checks the
mechanics, not parity at scale.

Results: each run's command, exit status (and, for a failed run, why: a recipe the GPU cannot run, no Transformer
Engine, a timeout), the train lm loss of every log line (the mean over its --log-interval) and the validation loss of
every evaluation go to --results (default runs/loss_parity/results.json), which is saved after every run and merged
across invocations: a run replaces the run of the same name, others stay. So a GPU with a per-command time limit
runs a few configs per invocation, reusing the same --results file. Full logs go to --log-dir (default: `logs/`
beside the results). The report notes runs whose shared flags (preset, data, schedule, extras) differ.

Report (--out, default docs/loss_parity.md; --plot, default the same path with .png; --report-only rebuilds both from
--results without running anything):
  * gap to bf16 = 100 * (final validation loss - bf16's) / bf16's, in %, against the same engine's bf16 run
    (te-bf16 for te-*, local-bf16 for local-*) at the run's seed where that run exists (`te-delayed@seed2` against
    `te-bf16@seed2`: the same weights and batches), else at the first seed; positive = worse than bf16. --reference
    RUN compares every run with RUN instead (optimizer levels against fp32 states: --reference te-delayed-fp8params);
  * over seeds: a run measured at two seeds or more, each against the reference at its own seed, gets the mean,
    standard deviation, standard error and range of its gaps in a second table. Runs of one seed still drift apart
    over training (bf16 and FP8 arithmetic differ), so a single seed's gap is one sample of that drift;
  * largest gap = the gap of largest magnitude over the validation evaluations both runs made (validation batches are
    the same for runs of one seed, so this compares like with like at every evaluation; train losses are noisier);
  * within 0.5% (--tolerance): |final gap| <= 0.5%; within seed spread: |final gap| <= the seed-to-seed spread, the
    largest |gap| of the same engine's bf16 runs at other seeds (any engine's when that engine has none);
  * the PNG: train loss (trailing mean over --smooth iterations, default 5% of the run) and validation points, and
    the gap to bf16 in % of both, with the tolerance band; runs at another seed read other batches, so their gap is
    drawn from the validations alone. It needs matplotlib; without it the JSON and the table are still written.
The exit status is 1 when a run of this invocation failed (its row in the table says why) or was not started
(--deadline), else 0.

GPU commands with a time limit: pass --deadline (seconds) a little under the limit, so that the invocation stops a
run that would overrun it and skips the rest, and ends with everything finished saved. llama-150m on one H100
(ms per iteration, 1000 iterations): te-bf16 103, te-delayed 113, te-tensorwise 129, te-blockwise 115, i.e. about
2-2.5 minutes a run with start-up and evaluations; local-bf16 114, local-delayed 209, local-tensorwise 222,
local-rowwise 368, local-blockwise 455 (8 minutes), local-mxfp8 716 (emulated on Hopper: 12.5 minutes, more than a
10-minute command).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ is no package: find benchmark.py beside us

import benchmark  # noqa: E402

ROOT = benchmark.ROOT
CONFIGS = benchmark.CONFIGS

# Llama style, in every preset: RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases, untied embeddings, and no
# dropout (a source of run-to-run noise that Llama pretraining does not have, and that would blur small FP8 gaps).
LLAMA = (
    "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear"
    " --untie-embeddings-and-output-weights --group-query-attention --hidden-dropout 0 --attention-dropout 0"
    " --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0"
)
PRESETS = {
    # ~150M parameters with the default corpus's 8192-token vocabulary (135M in the transformer layers).
    "llama-150m": f"{LLAMA} --num-layers 12 --hidden-size 1024 --ffn-hidden-size 2816 --num-attention-heads 16"
    " --num-query-groups 4 --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 16"
    " --global-batch-size 32 --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 100 --bf16 --train-iters 1000"
    " --eval-interval 100 --eval-iters 10 --log-interval 10",
    # CPU smoke test, in fp32 (no --bf16: CPUs emulate bf16 slowly); widths are multiples of 16 for the FP8 GEMMs.
    "tiny": f"{LLAMA} --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4"
    " --num-query-groups 2 --seq-length 64 --max-position-embeddings 64 --micro-batch-size 8 --global-batch-size 8"
    " --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 3 --train-iters 30 --eval-interval 10 --eval-iters 2"
    " --log-interval 1",
}
RECIPES = ["delayed", "tensorwise", "rowwise", "blockwise", "mxfp8"]
DEFAULT_RUNS = {
    "llama-150m": ["te-bf16", "te-bf16@seed2", "te-delayed", "te-tensorwise", "te-blockwise"],
    "tiny": ["local-bf16", "local-bf16@seed2", *(f"local-{recipe}" for recipe in RECIPES)],
}
OVERRIDES = ["train_iters", "eval_interval", "eval_iters", "log_interval"]
# Data flags passed through to pretrain_gpt.py as they are: flag -> argparse nargs.
DATA_FLAGS = {
    "--data-path": "+",
    "--split": None,
    "--tokenizer-type": None,
    "--vocab-file": None,
    "--merge-file": None,
    "--tokenizer-model": None,
    "--vocab-size": None,
    "--data-cache-path": None,
}
MIN_START_S = 60  # --deadline: a run needs at least this long (start-up, a few steps, an evaluation)
DEFAULT_RESULTS = ROOT / "runs" / "loss_parity" / "results.json"
DEFAULT_OUT = ROOT / "docs" / "loss_parity.md"


# ---------------------------------------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class RunName:
    name: str
    config: str
    seed_index: int = 1
    tag: str | None = None

    @property
    def engine(self) -> str:
        """`te` or `local`: the prefix of the config name."""
        return self.config.split("-", 1)[0]

    @property
    def reference(self) -> str:
        """The run this one is compared with: the same engine's bf16 at the first seed."""
        return f"{self.engine}-bf16"

    @property
    def base(self) -> str:
        """The name without its seed: `CONFIG[+TAG]`."""
        return self.config + (f"+{self.tag}" if self.tag else "")

    def is_seed_of(self, reference: str) -> bool:
        """This run is `reference` (a first-seed name) at another seed: one sample of the noise floor."""
        return self.seed_index > 1 and self.base == reference

    def compared_with(self, runs: dict[str, Any], reference: str | None = None) -> str:
        """The run this one is compared with: `reference` (default: the engine's bf16) at this run's seed where
        that run exists, since the same seed starts from the same weights and reads the same batches, so that the
        gap is the precision's alone; else at the first seed. The reference's own other seeds compare with its
        first seed: that gap is the noise floor."""
        base = reference or self.reference
        paired = f"{base}@seed{self.seed_index}"
        if self.seed_index > 1 and not self.is_seed_of(base) and paired in runs:
            return paired
        return base


def parse_run_name(name: str) -> RunName:
    """`CONFIG[@seedN][+TAG]` -> its parts. Raises ValueError with the valid forms."""
    match = re.fullmatch(r"([a-z0-9-]+?)(?:@seed(\d+))?(?:\+([A-Za-z0-9_.-]+))?", name)
    if not match or match.group(1) not in CONFIGS:
        raise ValueError(f"{name!r}: expected CONFIG[@seedN][+TAG] with CONFIG one of {', '.join(CONFIGS)}")
    config, seed, tag = match.groups()
    seed_index = int(seed) if seed else 1
    if seed_index < 2 and seed is not None:
        raise ValueError(f"{name!r}: @seedN counts from 2 (the plain name is the first seed)")
    return RunName(name, config, seed_index, tag)


def is_fp8(config: str) -> bool:
    return "--fp8-format" in CONFIGS[config]


def run_flags(
    run: RunName, common: list[str], seed: int, fp8_extra: list[str], config_flags: dict[str, list[str]]
) -> list[str]:
    """pretrain_gpt.py's flags for one run: the shared flags, the config's precision flags, its seed, the FP8-only
    extras, then its own flags (argparse keeps the last value of a repeated flag, so the more specific wins)."""
    flags = [*common, *CONFIGS[run.config].split(), "--seed", str(seed + run.seed_index - 1)]
    if is_fp8(run.config):
        flags += fp8_extra
    return flags + config_flags.get(run.name, [])


def command(flags: list[str], nproc: int = 1) -> list[str]:
    """One run's launch: this Python, through torchrun on one host for `nproc` processes (GPUs)."""
    return [*benchmark.launcher(nproc), str(ROOT / "pretrain_gpt.py"), *flags]


_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*\d+ \|.*? \| lm loss: (\S+) \|")
_SKIPPED = re.compile(r"number of skipped iterations:\s*(\d+) \| number of nan iterations:\s*(\d+)")
_VALIDATION = re.compile(r"\bvalidation loss at iteration (\d+) \| lm loss value: (\S+) \|")


def parse_losses(text: str) -> dict[str, Any]:
    """From a pretrain_gpt.py log (megatron/training/logger.py's formats): `train`, [iteration, lm loss] of every
    progress line (the mean over its log interval); `valid`, [iteration, loss] of every validation; the skipped and
    NaN iteration counts of the last progress line. Non-finite losses are kept (logged as NAN / INF)."""
    train, valid, skipped, nans = [], [], None, None
    for line in text.splitlines():
        if match := _ITERATION.search(line):
            train.append([int(match.group(1)), float(match.group(2))])
            if counts := _SKIPPED.search(line):
                skipped, nans = int(counts.group(1)), int(counts.group(2))
        elif match := _VALIDATION.search(line):
            valid.append([int(match.group(1)), float(match.group(2))])
    return {"train": train, "valid": valid, "skipped_iterations": skipped, "nan_iterations": nans}


def flag_values(flags: list[str]) -> dict[str, str]:
    """`--a 1 --b --c x y` -> {"--a": "1", "--b": "", "--c": "x y"}; the last occurrence of a flag wins."""
    values: dict[str, str] = {}
    key = None
    for token in flags:
        if token.startswith("--"):
            key = token
            values[key] = ""
        elif key is not None:
            values[key] = f"{values[key]} {token}".strip()
    return values


def set_flag(flags: list[str], flag: str, value: str) -> list[str]:
    """`flags` with the value of a one-value `flag` replaced in place (appended when absent): commands stay readable
    with no flag twice."""
    if flag not in flags:
        return [*flags, flag, value]
    i = flags.index(flag)
    return [*flags[: i + 1], value, *flags[i + 2 :]]


def run_one(
    run: RunName, flags: list[str], setup: dict[str, Any], timeout: int, log_dir: Path | None, env_line: str
) -> dict[str, Any]:
    """Train one run and return its record for the results JSON."""
    cmd = command(flags, setup.get("nproc_per_node", 1))

    def echo(line: str) -> None:  # validations only: a 1000-iteration run stays readable
        if match := _VALIDATION.search(line):
            print(f"  [{run.name}] validation loss at iteration {match.group(1)}: {match.group(2)}", flush=True)

    print(f"{run.name}: {shlex.join(cmd)}", flush=True)
    start = time.time()
    text, code = benchmark.execute(cmd, timeout, benchmark.run_env("1gpu"), echo)
    wall = time.time() - start
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / f"{re.sub(r'[^A-Za-z0-9._-]', '_', run.name)}.log").write_text(shlex.join(cmd) + "\n" + text)
    losses = parse_losses(text)
    error = None
    if code != 0:
        error = benchmark.failure_reason(text, code)
    elif not losses["train"]:
        error = "no iteration lines in the log"
    seed = int(flag_values(flags)["--seed"])
    return {
        "name": run.name,
        "config": run.config,
        "seed": seed,
        "tag": run.tag,
        "setup": setup,
        "command": cmd,
        "returncode": code,
        "error": error,
        **losses,
        "wall_s": round(wall, 1),
        "environment": env_line,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def load_results(path: Path) -> dict[str, Any]:
    if path.exists():
        results = json.loads(path.read_text())
        results.setdefault("runs", {})
        return results
    return {"runs": {}}


def save_results(results: dict[str, Any], path: Path) -> None:
    """Written to a temporary file and renamed into place: a run killed mid-write leaves the previous file whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(tmp, path)


# -------------------------------------------------------------------------------------------------------- report


def gap_pct(loss: float, reference: float) -> float:
    """100 * (loss - reference) / reference: positive where `loss` is worse (higher)."""
    return 100.0 * (loss - reference) / reference


def final_loss(points: list[list[float]]) -> float | None:
    return points[-1][1] if points else None


def largest_gap(points: list[list[float]], reference: list[list[float]]) -> tuple[float, int] | None:
    """(gap %, iteration) of the largest |gap| over the iterations both series have; a non-finite loss counts as
    the largest. None without a common iteration."""
    ref = {int(it): loss for it, loss in reference}
    gaps = [(gap_pct(loss, ref[int(it)]), int(it)) for it, loss in points if int(it) in ref]
    if not gaps:
        return None
    return max(gaps, key=lambda g: math.inf if not math.isfinite(g[0]) else abs(g[0]))


def smooth(points: list[list[float]], window: int) -> list[list[float]]:
    """Trailing mean over the points within `window` iterations (an iteration-based window, so that runs logged at
    different intervals smooth alike); non-finite points are left out of the means."""
    out, first, total, count = [], 0, 0.0, 0
    for it, loss in points:
        if math.isfinite(loss):
            total, count = total + loss, count + 1
        while points[first][0] <= it - window:  # drop the points that left the window
            if math.isfinite(points[first][1]):
                total, count = total - points[first][1], count - 1
            first += 1
        out.append([it, total / count if count else math.nan])
    return out


def default_window(runs: dict[str, dict[str, Any]]) -> int:
    """5% of the longest run's iterations (at least 1)."""
    last = max((run["train"][-1][0] for run in runs.values() if run.get("train")), default=1)
    return max(1, last // 20)


@dataclass
class Row:
    name: str
    seed: int | None
    error: str | None = None
    final_valid: float | None = None
    final_train: float | None = None
    reference: str | None = None
    gap: float | None = None
    largest: tuple[float, int] | None = None
    spread: float | None = None
    role: str = ""  # "reference" (bf16, first seed), "seed" (bf16 at another seed) or "" (compared)
    skipped: int | None = None


def _order(name: str) -> tuple:
    """Table order: configs as scripts/benchmark.py lists them (te before local), then seed, then variant."""
    try:
        run = parse_run_name(name)
    except ValueError:
        return (len(CONFIGS), name, 0, "")
    return (list(CONFIGS).index(run.config), "", run.seed_index, run.tag or "")


def seed_spreads(runs: dict[str, dict[str, Any]], reference: str | None = None) -> dict[str, float]:
    """Per engine: the largest |final validation gap| between its reference runs (bf16, or `reference`) at other
    seeds and at the first seed."""
    spreads: dict[str, float] = {}
    for name, record in runs.items():
        try:
            run = parse_run_name(name)
        except ValueError:
            continue
        base = reference or run.reference
        ref = runs.get(base)
        if not run.is_seed_of(base) or record.get("error") or not ref or ref.get("error"):
            continue
        loss, ref_loss = final_loss(record["valid"]), final_loss(ref["valid"])
        if loss is None or ref_loss is None or not math.isfinite(gap := gap_pct(loss, ref_loss)):
            continue
        spreads[run.engine] = max(spreads.get(run.engine, 0.0), abs(gap))
    return spreads


def summarize(runs: dict[str, dict[str, Any]], reference: str | None = None) -> list[Row]:
    """One row per run, in table order, with its gaps to its reference (the same engine's bf16, or the run named
    `reference` for every run) and the noise floor that applies to it."""
    spreads = seed_spreads(runs, reference)
    rows = []
    for name in sorted(runs, key=_order):
        record = runs[name]
        row = Row(name, record.get("seed"), error=record.get("error"), skipped=record.get("skipped_iterations"))
        row.final_valid = final_loss(record.get("valid", []))
        row.final_train = final_loss(smooth(record.get("train", []), default_window({name: record})))
        try:
            run = parse_run_name(name)
        except ValueError:  # a name this version does not know: shown, not compared
            rows.append(row)
            continue
        row.spread = spreads.get(run.engine, max(spreads.values(), default=None))
        ref_name = run.compared_with(runs, reference)
        if name == ref_name:
            row.role = "reference"
        else:
            row.role = "seed" if run.is_seed_of(reference or run.reference) else ""
            ref = runs.get(ref_name)
            if ref and not ref.get("error") and not row.error:
                row.reference = ref_name
                ref_loss = final_loss(ref.get("valid", []))
                if row.final_valid is not None and ref_loss is not None:
                    row.gap = gap_pct(row.final_valid, ref_loss)
                row.largest = largest_gap(record.get("valid", []), ref.get("valid", []))
        rows.append(row)
    return rows


def _num(value: float | None, fmt: str = ".4f") -> str:
    if value is None:
        return ""
    return format(value, fmt) if math.isfinite(value) else str(value)


def _pct(value: float | None) -> str:
    return "" if value is None else (f"{value:+.2f}%" if math.isfinite(value) else str(value))


def format_table(rows: list[Row], tolerance: float = 0.5, reference: str | None = None) -> str:
    """Markdown table of `summarize`'s rows (`reference`: the run they were compared with, if not bf16)."""
    lines = [
        f"| run | seed | final valid loss | final train loss | gap to {reference or 'bf16'} | largest valid gap"
        " (iteration) |"
        f" within {tolerance:g}% | within seed spread | skipped steps |",
        "|---|---:|---:|---:|---:|---:|:---:|:---:|---:|",
    ]
    for r in rows:
        seed = "" if r.seed is None else str(r.seed)
        if r.error:
            reason = r.error.replace("|", "/").replace("\n", " ")
            lines.append(f"| {r.name} | {seed} | failed: {reason} |" + " |" * 6)
            continue
        largest = f"{_pct(r.largest[0])} ({r.largest[1]})" if r.largest else ""
        if r.role == "reference":
            gap, within, within_spread = "reference", "", ""
        elif r.gap is None:  # no reference run, or no validation
            gap, within, within_spread = "", "", ""
        else:
            gap = _pct(r.gap)
            finite = math.isfinite(r.gap)
            within = "yes" if finite and abs(r.gap) <= tolerance else "**no**"
            if r.role == "seed":
                within_spread = "(noise floor)"
            elif r.spread is None:
                within_spread = "no second seed"
            else:
                ok = finite and abs(r.gap) <= r.spread
                within_spread = f"{'yes' if ok else '**no**'} (±{r.spread:.2f}%)"
        skipped = "" if r.skipped is None else str(r.skipped)
        lines.append(
            f"| {r.name} | {seed} | {_num(r.final_valid)} | {_num(r.final_train)} | {gap} | {largest} | {within}"
            f" | {within_spread} | {skipped} |"
        )
    return "\n".join(lines)


def paired_gaps(rows: list[Row]) -> dict[str, list[float]]:
    """Per run without its seed (`CONFIG[+TAG]`): the final gaps of its runs that were compared with the reference
    at their own seed, in seed order. Runs at one seed diverge from each other chaotically over training, so one
    seed's gap is one sample; their mean over seeds is the measurement."""
    gaps: dict[str, list[float]] = {}
    for r in rows:
        if r.role or r.gap is None or r.reference is None:
            continue
        run, ref = parse_run_name(r.name), parse_run_name(r.reference)
        if run.seed_index == ref.seed_index:
            gaps.setdefault(run.base, []).append(r.gap)
    return gaps


def format_seed_table(rows: list[Row], tolerance: float = 0.5) -> str:
    """Markdown table of the mean gap over seeds of each run measured at two seeds or more; "" when none is."""
    lines = []
    for name, gaps in paired_gaps(rows).items():
        if len(gaps) < 2:
            continue
        mean, sd = statistics.fmean(gaps), statistics.stdev(gaps)
        finite = math.isfinite(mean)
        within = "yes" if finite and abs(mean) <= tolerance else "**no**"
        lines.append(
            f"| {name} | {len(gaps)} | {_pct(mean)} | {sd:.2f}% | {sd / math.sqrt(len(gaps)):.2f}% |"
            f" {_pct(min(gaps))} .. {_pct(max(gaps))} | {within} |"
        )
    if not lines:
        return ""
    header = [
        f"| run | seeds | mean gap | sd | standard error | lowest .. highest | mean within {tolerance:g}% |",
        "|---|---:|---:|---:|---:|---|:---:|",
    ]
    return "\n".join(header + lines)


def setup_notes(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Runs whose shared flags differ from the first reference run's (a forgotten override in one invocation would
    otherwise compare different schedules silently)."""
    names = sorted(runs, key=_order)
    base_name = next((n for n in names if runs[n].get("setup") and not runs[n].get("error")), None)
    if base_name is None:
        return []
    base = runs[base_name]["setup"]
    base_flags = flag_values(shlex.split(base.get("flags", "")))
    notes = []
    for name in names:
        setup = runs[name].get("setup")
        if not setup or setup == base:
            continue
        flags = flag_values(shlex.split(setup.get("flags", "")))
        diffs = []
        if setup.get("preset") != base.get("preset"):
            diffs.append(f"preset {setup.get('preset')} vs {base.get('preset')}")
        if setup.get("nproc_per_node", 1) != base.get("nproc_per_node", 1):
            diffs.append(f"{setup.get('nproc_per_node', 1)} vs {base.get('nproc_per_node', 1)} processes")
        for key in sorted(set(flags) | set(base_flags)):
            if flags.get(key) != base_flags.get(key):
                diffs.append(f"{key} {flags.get(key, '(absent)')} vs {base_flags.get(key, '(absent)')}")
        notes.append(f"{name} differs from {base_name}: {'; '.join(diffs[:6])}")
    return notes


def plot(
    runs: dict[str, dict[str, Any]],
    path: Path,
    tolerance: float = 0.5,
    window: int | None = None,
    reference: str | None = None,
) -> str | None:
    """Loss curves (smoothed train lines, validation points) and the gap to bf16 (or `reference`) in %; returns why
    no PNG was written, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on training machines
        import matplotlib.pyplot as plt
    except ImportError:
        return "the PNG needs matplotlib (pip install matplotlib)"
    ok = {name: runs[name] for name in sorted(runs, key=_order) if not runs[name].get("error") and runs[name]["train"]}
    if not ok:
        return "no successful run to plot"
    window = window or default_window(ok)
    last = max(run["train"][-1][0] for run in ok.values())
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    colors = [plt.get_cmap("tab10" if len(ok) <= 10 else "tab20")(i) for i in range(20)]
    visible, gaps_visible = [], [2 * tolerance]
    for i, (name, record) in enumerate(ok.items()):
        try:
            run: RunName | None = parse_run_name(name)
        except ValueError:
            run = None
        color = colors[i % len(colors)]
        noise_floor = run is not None and run.is_seed_of(reference or run.reference)
        style = "--" if noise_floor else "-"
        train = smooth(record["train"], window)
        top.plot([p[0] for p in train], [p[1] for p in train], style, color=color, lw=1.2, label=name)
        if record["valid"]:
            top.plot(*zip(*record["valid"]), "o", color=color, ms=4)
        # Focus the axes on the part of the run where the curves are close, not on the first steps' drop.
        visible += [loss for it, loss in train + record["valid"] if it >= 0.1 * last and math.isfinite(loss)]
        ref = ok.get(run.compared_with(ok, reference)) if run else None
        if ref is None or ref is record:
            continue
        ref_valid = dict((it, loss) for it, loss in ref["valid"])
        valid_gap = [(it, gap_pct(loss, ref_valid[it])) for it, loss in record["valid"] if it in ref_valid]
        train_gap = []
        if noise_floor:
            # Another seed reads other batches: its train-loss gap is mostly batch-to-batch noise, so the noise
            # floor is drawn from the validation evaluations alone.
            if valid_gap:
                bottom.plot(*zip(*valid_gap), "o--", color=color, ms=4, lw=1, label=f"{name} (valid, noise floor)")
        else:
            ref_train = {it: loss for it, loss in smooth(ref["train"], window)}
            train_gap = [(it, gap_pct(loss, ref_train[it])) for it, loss in train if it in ref_train]
            if train_gap:
                bottom.plot(*zip(*train_gap), style, color=color, lw=1.2, label=f"{name} (train, smoothed)")
            if valid_gap:
                bottom.plot(*zip(*valid_gap), "o", color=color, ms=4)
        gaps_visible += [abs(g) for it, g in train_gap + valid_gap if it >= 0.1 * last and math.isfinite(g)]
    if visible:
        low, high = min(visible), max(visible)
        top.set_ylim(low - 0.05 * (high - low + 1e-6), high + 0.05 * (high - low + 1e-6))
    limit = 1.15 * max(gaps_visible)
    bottom.set_ylim(-limit, limit)
    bottom.axhspan(-tolerance, tolerance, color="green", alpha=0.1, label=f"±{tolerance:g}%")
    bottom.axhline(0, color="black", lw=0.8)
    top.set_ylabel("lm loss")
    top.set_title(f"train loss (trailing mean over {window} iterations, lines) and validation loss (points)")
    top.legend(fontsize=8, ncol=2)
    top.grid(alpha=0.3)
    bottom.set_ylabel(f"gap to {reference or 'bf16'} (%)")
    bottom.set_xlabel("iteration")
    against = reference or "the same engine's bf16 run"
    bottom.set_title(f"gap to {against} (lines: smoothed train loss, points: validation)")
    bottom.legend(fontsize=7, ncol=2)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_report(
    results: dict[str, Any],
    out: Path,
    png: Path | None,
    tolerance: float = 0.5,
    window: int | None = None,
    reference: str | None = None,
) -> str:
    """Write the markdown report (and the PNG where matplotlib is there); returns the table. `reference`: the run
    every other is compared with (default: each engine's bf16 at the first seed)."""
    runs = results.get("runs", {})
    rows = summarize(runs, reference)
    table = format_table(rows, tolerance, reference)
    lines = ["# Loss parity: FP8 against bf16", ""]
    setups = [runs[r.name].get("setup") for r in rows if runs[r.name].get("setup")]
    if setups:
        setup = setups[0]
        lines.append(f"Preset `{setup.get('preset')}`; shared flags: `{setup.get('flags', '')}`.")
    environments = sorted({runs[r.name].get("environment") for r in rows if runs[r.name].get("environment")})
    if environments:
        lines.append("Environment: " + "; ".join(environments) + ".")
    lines += ["", table, ""]
    if seed_table := format_seed_table(rows, tolerance):
        lines += [
            "Over seeds: each run against the reference at its own seed (the same initial weights and batches).",
            "",
        ]
        lines += [seed_table, ""]
    lines += [f"Note: {note}" for note in setup_notes(runs)]
    gap = (
        f"Gap to {reference}: 100 x (final validation loss - {reference}'s at the run's seed, else at the first"
        f" seed) / {reference}'s"
        if reference
        else "Gap to bf16: 100 x (final validation loss - the same engine's bf16 run at the run's seed, else at the"
        " first seed) / bf16's"
    )
    lines += [
        "",
        f"{gap}; positive = worse. Largest valid gap: the gap of largest magnitude over the validation evaluations"
        " both runs made."
        f" Within {tolerance:g}%: |gap| <= {tolerance:g}%. Within seed spread: |gap| <= the largest |gap| of the"
        f" {'reference' if reference else 'bf16'} run at another seed (the noise floor, one sample per extra seed;"
        " other seeds also validate on other batches). Final train loss: the trailing mean over"
        " the last 5% of the run. Skipped steps: optimizer steps skipped for an inf/NaN (FP8 amax or gradient).",
        "",
    ]
    if png is not None:
        why_not = plot(runs, png, tolerance, window, reference)
        if why_not:
            lines.append(f"No plot: {why_not}.")
            print(f"no PNG: {why_not}", file=sys.stderr)
        else:
            lines.append(f"![loss curves and gap to {reference or 'bf16'}]({os.path.relpath(png, out.parent)})")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines).rstrip() + "\n")
    return table


# ---------------------------------------------------------------------------------------------------------- main


def data_flags(args: argparse.Namespace) -> list[str]:
    """The data flags of every run: the ones given, else mock data, else the default corpus (built on first use)."""
    given = []
    for flag in DATA_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            given += [flag, *(value if isinstance(value, list) else [value])]
    if args.mock_data:
        return ["--mock-data", *given]
    if args.data_path:
        return given
    sys.path.insert(0, str(ROOT))
    from megatron.data import default_corpus

    def relative(path: str) -> str:  # runs start in ROOT; relative paths keep the JSON and report readable
        absolute = Path(path).resolve()
        return str(absolute.relative_to(ROOT)) if absolute.is_relative_to(ROOT) else str(absolute)

    prefix = default_corpus.prepare(str(args.data_dir))
    flags = ["--data-path", relative(prefix), "--split", "98,2,0", "--tokenizer-type", "GPT2BPETokenizer"]
    flags += ["--vocab-file", relative(default_corpus.VOCAB_FILE), "--merge-file", relative(default_corpus.MERGE_FILE)]
    return flags + given  # after the defaults, so that a --split given wins


def parse_config_flags(entries: list[str]) -> dict[str, list[str]]:
    """`NAME=FLAGS` entries -> {NAME: [flags]}."""
    out: dict[str, list[str]] = {}
    for entry in entries:
        name, sep, flags = entry.partition("=")
        if not sep:
            raise ValueError(f"--config-flags {entry!r}: expected NAME=FLAGS, e.g. 'te-delayed+h16=--fp8-margin 1'")
        out[name.strip()] = shlex.split(flags)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=list(PRESETS))
    parser.add_argument("--configs", nargs="+", help="runs, CONFIG[@seedN][+TAG]; default: see above")
    parser.add_argument("--config-flags", action="append", default=[], metavar="NAME=FLAGS", help="flags of one run")
    parser.add_argument("--extra", default="", help="flags for every run, e.g. '--fp8-amax-history-len 16'")
    parser.add_argument("--fp8-extra", default="", help="flags for the FP8 runs only, e.g. '--fp8-stats-interval 100'")
    parser.add_argument("--seed", type=int, default=1234, help="seed of every run; @seedN runs use seed + N - 1")
    for name in OVERRIDES:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, help="overrides the preset's value")
    data = parser.add_argument_group("data (default: the project's default corpus)")
    for flag, nargs in DATA_FLAGS.items():
        data.add_argument(flag, nargs=nargs)
    data.add_argument("--mock-data", action="store_true", help="the synthetic token stream (with --vocab-size)")
    data.add_argument("--data-dir", type=Path, default=ROOT / "data", help="where the default corpus is built")
    out = parser.add_argument_group("output")
    out.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="results JSON, merged across invocations")
    out.add_argument("--log-dir", type=Path, help="full logs (default: logs/ beside --results)")
    out.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown report")
    out.add_argument("--plot", type=Path, help="PNG (default: --out with .png)")
    out.add_argument("--tolerance", type=float, default=0.5, help="parity threshold on |final gap|, in %%")
    out.add_argument("--smooth", type=int, help="train-loss smoothing window in iterations (default 5%% of the run)")
    out.add_argument(
        "--reference",
        metavar="RUN",
        help="compare every run with this one (e.g. te-delayed-fp8params for optimizer levels), not with bf16",
    )
    out.add_argument("--report-only", action="store_true", help="rebuild the report from --results, run nothing")
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        help="processes (GPUs) per run, through torchrun: data parallelism, or any layout --extra sets up",
    )
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per run before it counts as failed")
    parser.add_argument(
        "--deadline",
        type=int,
        help="seconds for this whole invocation: a run still going then is stopped (and fails), later ones are not"
        " started, so that a command under a time limit ends with its results saved",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    png = args.plot or args.out.with_suffix(".png")
    if args.report_only:
        if not args.results.exists():
            parser.error(f"--results {args.results}: no such file")
        print(write_report(load_results(args.results), args.out, png, args.tolerance, args.smooth, args.reference))
        print(f"wrote {args.out}" + (f" and {png}" if png.exists() else ""))
        return 0
    try:
        runs = [parse_run_name(name) for name in (args.configs or DEFAULT_RUNS[args.preset])]
        config_flags = parse_config_flags(args.config_flags)
    except ValueError as err:
        parser.error(str(err))
    unknown = set(config_flags) - {run.name for run in runs}
    if unknown:
        parser.error(f"--config-flags names runs not in --configs: {', '.join(sorted(unknown))}")
    if args.nproc_per_node < 1:
        parser.error(f"--nproc-per-node {args.nproc_per_node}: give 1 or more processes")
    if args.mock_data and args.data_path:
        parser.error("--mock-data and --data-path exclude each other")
    common = PRESETS[args.preset].split()
    for name in OVERRIDES:
        if (value := getattr(args, name)) is not None:
            common = set_flag(common, f"--{name.replace('_', '-')}", str(value))
    common += data_flags(args) + shlex.split(args.extra)
    setup = {"preset": args.preset, "flags": shlex.join(common)}
    if args.nproc_per_node > 1:  # absent for one process, so that earlier one-GPU results compare as the same setup
        setup["nproc_per_node"] = args.nproc_per_node
    fp8_extra = shlex.split(args.fp8_extra)
    if args.dry_run:
        for run in runs:
            flags = run_flags(run, common, args.seed, fp8_extra, config_flags)
            print(f"{run.name}: {shlex.join(command(flags, args.nproc_per_node))}")
        return 0
    results = load_results(args.results)
    log_dir = args.log_dir or args.results.parent / "logs"
    env_line = benchmark.environment()
    failed, not_started = [], []
    deadline = time.monotonic() + args.deadline if args.deadline else math.inf
    for i, run in enumerate(runs):
        left = deadline - time.monotonic()
        if left < MIN_START_S:  # it could not finish; starting it would only replace an earlier result by a failure
            not_started = [r.name for r in runs[i:]]
            print(f"--deadline: {left:.0f} s left, not started: {' '.join(not_started)}", flush=True)
            break
        flags = run_flags(run, common, args.seed, fp8_extra, config_flags)
        record = run_one(run, flags, setup, int(min(args.timeout, left)), log_dir, env_line)
        results["runs"][run.name] = record
        save_results(results, args.results)  # after every run: a killed invocation keeps the runs it finished
        if record["error"]:
            failed.append(run.name)
            print(f"{run.name}: failed ({record['wall_s']} s): {record['error']}", flush=True)
        else:
            final = final_loss(record["valid"]) if record["valid"] else final_loss(record["train"])
            print(f"{run.name}: done in {record['wall_s']} s, final loss {final}", flush=True)
    table = write_report(results, args.out, png, args.tolerance, args.smooth, args.reference)
    print(f"\n{env_line}\n\n{table}\n\nresults: {args.results}; report: {args.out}")
    for note in setup_notes(results["runs"]):
        print(f"note: {note}", file=sys.stderr)
    return 1 if failed or not_started else 0


if __name__ == "__main__":
    sys.exit(main())
