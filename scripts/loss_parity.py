"""Loss parity: does FP8 train as well as bf16? Trains each FP8 configuration and its bf16 partner at every seed
(same initial weights, same data order, the same validation tokens at every evaluation), one `pretrain_gpt.py`
process per run, and reports the mean paired gap of the final validation loss over seeds with its 95% interval
(scripts/parity_report.py says how), and a verdict against --tolerance.

    python scripts/loss_parity.py --preset tiny --configs local-delayed --seeds 3          # CPU, a minute
    python tools/build_parity_corpus.py --output-dir data/parity                           # the real-text corpus
    python scripts/loss_parity.py --preset llama-150m --configs te-delayed te-blockwise --seeds 3 --noise-floor
    python scripts/loss_parity.py --model "--num-layers 24 ..." --data-path my_text_document \\
        --tokenizer-type ... --configs te-delayed --seeds 3 --tolerance 0.3                # your model: the gate
    python scripts/loss_parity.py --report-only --results runs/loss_parity/results.json --out parity.md

Runs are named `CONFIG[@seedN][+TAG]`: CONFIG is one of scripts/benchmark.py's configs (te-bf16, te-delayed,
te-tensorwise, te-blockwise, te-delayed-fp8params, te-delayed-all-fp8, te-delayed-fp8attn, ...; local-* for the
local layers, which run every recipe, emulated where the hardware lacks it, CPU included); `@seedN` trains at
--seed + N - 1; `+TAG` is a variant whose flags --config-flags gives (`te-delayed+h16=--fp8-amax-history-len 16`,
for every seed of it; NAME=VALUE words before them set the run's environment, for switches that have no flag:
`te-delayed-fp8attn+bwd16=NVTE_FP8_DPA_BWD=0`). `--seeds N` runs every configuration named without a seed at
seeds 1..N, and with it the reference (the engine's bf16, or --reference) at each of those seeds; `--noise-floor`
adds the reference with another micro-batch split (`te-bf16+noise`: the same function, rounded differently) at each
seed, whose interval is the smallest gap the runs resolve. Runs go seed by seed, so that a cut-off leaves whole pairs.

Each run gets: the preset's flags (or --model's), the data flags, `--full-validation`, the config's precision
flags, --seed, the overrides (--train-iters, --eval-interval, --log-interval), --extra (every run), --fp8-extra (the
FP8 runs only), then the run's --config-flags; a later flag wins.

Data: --data-path PREFIX (or a weighted blend) with its tokenizer flags and --split; --mock-data; neither: the
preset's corpus (llama-150m: the parity corpus of tools/build_parity_corpus.py under --data-dir,
docs/data.md; tiny: the project's default corpus, built on first use).

Results: each run's command, exit status (and why a run failed), train and validation losses go to --results (JSON,
saved after every run and merged across invocations: a run replaces the run of the same name, and a run that
--results holds finished with the same flags is not trained again unless --rerun), full logs to --log-dir.
--parallel K trains K runs at once (on one GPU they share it: small models leave it idle between kernels); a run
out of GPU memory beside others trains again once they end, one run fewer at a time.
--deadline (seconds) stops a run that would overrun a time limit and starts no later ones, so that a command under
a limit ends with everything finished saved. With --checkpoints DIR a run saves under DIR and stops in time instead
(--exit-duration-in-mins), and the next invocation resumes it: one run spans several commands, its record lists
each part.

--branch-at K (default: the preset's, half way; 0: none): the runs of a seed start from one trunk of that seed,
the reference trained to step K once (saved under --trunks DIR/RUN, kept for the next invocation), and each trains
on from it to --train-iters (with --checkpoints, from its own folder there, which starts as links to the trunk's
files). The partners then share their first K steps bit for bit, and the paired gap is what each precision adds
after step K: the chaotic drift of the early steps, the largest part of the noise floor, is shared instead of
sampled.

Exit status: 0 when every run finished and every configuration passes; 1 when a run failed or a configuration
fails; 2 when one is unresolved (its interval straddles the tolerance, or it has fewer than two seeds).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import benchmark
import parity_report as report
from parity_report import parse_run_name, run_name
from parity_runs import (
    TRACKER,
    command,
    finished_with,
    flag_values,
    link_trunk,
    load_results,
    merge_parts,
    safe_name,
    split_environment,
    train_all,
)

# the tests' names, re-exported
__all__ = ["TRACKER", "command", "finished_with", "flag_values", "merge_parts", "run_name"]

ROOT = benchmark.ROOT
CONFIGS = benchmark.CONFIGS

# Llama style, in every preset: RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases, untied embeddings, and no
# dropout (a source of run-to-run noise that Llama pretraining does not have, and that would blur small FP8 gaps).
LLAMA = (
    "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear"
    " --untie-embeddings-and-output-weights --group-query-attention --hidden-dropout 0 --attention-dropout 0"
    " --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0"
)
# Heads of 128, as Llama-3's (the head dim at which Hopper trains FP8 attention); 32k tokens a step, so that 300
# steps (9.8M tokens) stay well inside one epoch of the parity corpus's training split.
_GPU = " --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 16 --global-batch-size 32 --bf16"
PRESETS = {
    # ~150M parameters with the corpus's 8192-token vocabulary (134M in the transformer layers).
    "llama-150m": f"{LLAMA} --num-layers 12 --hidden-size 1024 --ffn-hidden-size 2816 --num-attention-heads 8"
    f" --num-query-groups 2{_GPU} --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 100 --train-iters 600"
    " --eval-interval 100 --eval-iters 1 --log-interval 10",
    # ~430M parameters for 2000 steps: the larger and longer check of the recommended recipe. Eight sequences a
    # step keep its 16.4M tokens inside one epoch of the parity corpus; the learning rate is lower for that batch.
    "llama-400m": f"{LLAMA} --num-layers 24 --hidden-size 1280 --ffn-hidden-size 3456 --num-attention-heads 10"
    " --num-query-groups 2 --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 8"
    " --global-batch-size 8 --bf16 --lr 1.5e-4 --min-lr 1.5e-5 --lr-warmup-iters 200 --train-iters 2000"
    " --eval-interval 250 --eval-iters 1 --log-interval 10",
    # CPU smoke test, in fp32 (no --bf16: CPUs emulate bf16 slowly); widths are multiples of 16 for the FP8 GEMMs.
    "tiny": f"{LLAMA} --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4"
    " --num-query-groups 2 --seq-length 64 --max-position-embeddings 64 --micro-batch-size 8 --global-batch-size 16"
    " --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 3 --train-iters 30 --eval-interval 10 --eval-iters 1"
    " --log-interval 1",
}
PARITY_CORPUS = "parity/parity_text_document"  # under --data-dir: tools/build_parity_corpus.py's output
# Where each preset's runs branch from their seed's bf16 trunk (docs/loss_parity.md, "Why a trunk"): half way.
PRESET_BRANCH = {"llama-150m": 300, "llama-400m": 1000}
PRESET_DATA = {"llama-150m": PARITY_CORPUS, "llama-400m": PARITY_CORPUS, "tiny": None}  # None: the default corpus
PARITY_SPLIT = "94,5,1"  # 1.06M validation tokens of the parity corpus
DEFAULT_CONFIGS = {
    "llama-150m": ["te-delayed", "te-tensorwise", "te-blockwise"],
    "llama-400m": ["te-delayed"],
    "tiny": ["local-delayed", "local-tensorwise", "local-rowwise", "local-blockwise", "local-mxfp8"],
}
OVERRIDES = ["train_iters", "eval_interval", "log_interval"]
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
DEFAULT_RESULTS = ROOT / "runs" / "loss_parity" / "results.json"
DEFAULT_OUT = ROOT / "runs" / "loss_parity" / "report.md"
DEFAULT_TRUNKS = ROOT / "runs" / "loss_parity" / "trunks"


# ---------------------------------------------------------------------------------------------------------- plan


def is_fp8(config: str) -> bool:
    return "--fp8-format" in CONFIGS[config]


def set_flag(flags: list[str], flag: str, value: str) -> list[str]:
    """`flags` with the value of a one-value `flag` replaced in place (appended when absent)."""
    if flag not in flags:
        return [*flags, flag, value]
    i = flags.index(flag)
    return [*flags[: i + 1], value, *flags[i + 2 :]]


def plan_runs(names: list[str], seeds: int, reference: str | None, noise_floor: bool) -> list[str]:
    """The runs to train, seed by seed: every name given with a seed as it is; every other at seeds 1..`seeds`,
    with its reference (and the reference's noise-floor variant) at each of them."""
    runs = [parse_run_name(name) for name in names]
    fixed = [r.name for r in runs if r.seed_index > 1]
    bases = [r.base for r in runs if r.seed_index == 1]
    references = [r.reference_base(reference) for r in runs if r.seed_index == 1]
    plan: list[str] = []
    for seed in range(1, seeds + 1):
        for ref in dict.fromkeys(references):
            plan.append(run_name(ref, seed))
            if noise_floor:
                plan.append(run_name(f"{ref}+{report.NOISE_TAG}", seed))
        plan += [run_name(base, seed) for base in bases]
    return list(dict.fromkeys(plan + fixed))


def noise_flags(common: list[str], nproc: int) -> list[str]:
    """The noise-floor variant's flags: the same global batch in micro-batches of half the size (twice the size
    where the micro-batch is odd). Raises ValueError when neither divides evenly."""
    values = flag_values(common)
    micro = int(values.get("--micro-batch-size", "1"))
    micro_batches = int(values.get("--global-batch-size", str(micro * nproc))) // (micro * nproc)
    if micro % 2 == 0:
        return ["--micro-batch-size", str(micro // 2)]
    if micro_batches % 2 == 0:
        return ["--micro-batch-size", str(micro * 2)]
    raise ValueError(
        f"--noise-floor splits the global batch into other micro-batches: --micro-batch-size {micro} with"
        f" {micro_batches} micro-batches per step allows neither half nor twice the size; make one of them even"
    )


def run_flags(
    name: str, common: list[str], seed: int, fp8_extra: list[str], config_flags: dict[str, list[str]]
) -> list[str]:
    """pretrain_gpt.py's flags for one run: the shared flags, the config's precision flags, its seed, the FP8-only
    extras, then its own flags (by run name, else by CONFIG+TAG; argparse keeps the last value of a flag). The
    environment assignments (NAME=VALUE) its own flags start with go first, as `command` expects them."""
    run = parse_run_name(name)
    env, own = split_environment(config_flags.get(name, config_flags.get(run.base, [])))
    flags = [*env, *common, *CONFIGS[run.config].split(), "--seed", str(seed + run.seed_index - 1)]
    if is_fp8(run.config):
        flags += fp8_extra
    return flags + own


# -------------------------------------------------------------------------------------------------------- branch


def branch_plan(
    plan: list[tuple[str, list[str]]],
    args: argparse.Namespace,
    common: list[str],
    fp8_extra: list[str],
    config_flags: dict[str, list[str]],
) -> tuple[list[tuple[str, list[str]]], dict[str, str]]:
    """--branch-at K: `plan` with one trunk per seed first (the seed's reference, stopped and saved at step K, and
    resumed from its folder when cut off) and every run loading its seed's trunk, or with --checkpoints its own
    folder (loss_parity's runs link the trunk into it first); returns it and {run: its trunk}."""
    trunks: dict[str, list[str]] = {}
    needs: dict[str, str] = {}
    branches = []
    for name, flags in plan:
        run = parse_run_name(name)
        reference = run_name(run.reference_base(args.reference), run.seed_index)
        trunk = run_name(f"{parse_run_name(reference).config}+{report.TRUNK_TAG}", run.seed_index)
        where = str(args.trunks / safe_name(trunk))
        if trunk not in trunks:
            step = str(args.branch_at)
            trunks[trunk] = run_flags(reference, common, args.seed, fp8_extra, config_flags)
            trunks[trunk] += ["--exit-interval", step, "--save", where, "--load", where, "--save-interval", step]
        needs[name] = trunk
        branches.append((name, flags if args.checkpoints else [*flags, "--load", where]))
    return [*trunks.items(), *branches], needs


def trunk_saved(flags: list[str], step: int) -> bool:
    """The trunk these flags save has its checkpoint of `step` on disk."""
    tracker = Path(flag_values(flags)["--save"]) / TRACKER
    return tracker.is_file() and tracker.read_text().strip() == str(step)


def needed_trunks(plan: list[tuple[str, list[str]]], needs: dict[str, str], args: argparse.Namespace) -> list:
    """`plan` without the trunks that are saved already or that no planned run still needs."""
    wanted = {needs[name] for name, _ in plan if name in needs}
    trunks = set(needs.values())
    return [
        (name, flags)
        for name, flags in plan
        if name not in trunks or (name in wanted and not trunk_saved(flags, args.branch_at))
    ]


# ---------------------------------------------------------------------------------------------------------- main


def data_flags(args: argparse.Namespace, preset: str | None) -> list[str]:
    """The data flags of every run: the ones given, else mock data, else the preset's corpus."""
    given = []
    for flag in DATA_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            given += [flag, *(value if isinstance(value, list) else [value])]
    if args.mock_data:
        return ["--mock-data", *given]
    if args.data_path:
        return given
    from megatron.data import default_corpus

    def relative(path: str | Path) -> str:  # runs start in ROOT; relative paths keep the JSON readable
        absolute = Path(path).resolve()
        return str(absolute.relative_to(ROOT)) if absolute.is_relative_to(ROOT) else str(absolute)

    tokenizer = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", relative(default_corpus.VOCAB_FILE)]
    tokenizer += ["--merge-file", relative(default_corpus.MERGE_FILE)]
    corpus = PRESET_DATA.get(preset) if preset else None
    if corpus:
        prefix = args.data_dir / corpus
        if not Path(f"{prefix}.bin").is_file():
            raise ValueError(
                f"{prefix}.bin: no parity corpus; build it with `python tools/build_parity_corpus.py --output-dir"
                f" {args.data_dir / 'parity'}` (docs/data.md), or give --data-path"
            )
        return ["--data-path", relative(prefix), "--split", PARITY_SPLIT, *tokenizer, *given]
    prefix = default_corpus.prepare(str(args.data_dir))
    return ["--data-path", relative(prefix), "--split", "99,1,0", *tokenizer, *given]  # a --split given wins


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
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--preset", choices=list(PRESETS), help="a named model and schedule (default: tiny)")
    model.add_argument("--model", help="your model's and schedule's pretrain_gpt.py flags, instead of a preset")
    parser.add_argument("--configs", nargs="+", help="runs, CONFIG[@seedN][+TAG]; default: the preset's recipes")
    parser.add_argument("--seeds", type=int, default=1, help="seeds of every configuration named without one")
    parser.add_argument("--noise-floor", action="store_true", help="add the reference with another micro-batch split")
    parser.add_argument("--config-flags", action="append", default=[], metavar="NAME=FLAGS", help="flags of a run")
    parser.add_argument("--extra", default="", help="flags for every run, e.g. '--fp8-amax-history-len 16'")
    parser.add_argument("--fp8-extra", default="", help="flags for the FP8 runs only, e.g. '--fp8-stats-interval 100'")
    parser.add_argument("--seed", type=int, default=1234, help="the first seed; @seedN runs use seed + N - 1")
    parser.add_argument("--reference", metavar="CONFIG", help="pair every run with this one, not with bf16")
    for name in OVERRIDES:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, help="overrides the preset's value")
    data = parser.add_argument_group("data (default: the preset's corpus)")
    for flag, nargs in DATA_FLAGS.items():
        data.add_argument(flag, nargs=nargs)
    data.add_argument("--mock-data", action="store_true", help="the synthetic token stream (with --vocab-size)")
    data.add_argument("--data-dir", type=Path, default=ROOT / "data", help="where the corpora are")
    out = parser.add_argument_group("output")
    out.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="results JSON, merged across invocations")
    out.add_argument("--log-dir", type=Path, help="full logs (default: logs/ beside --results)")
    out.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown report")
    out.add_argument("--plot", type=Path, help="PNG (default: --out with .png)")
    out.add_argument("--tolerance", type=float, default=0.5, help="the verdict's threshold on the paired gap, in %%")
    out.add_argument("--report-only", action="store_true", help="rebuild the report from --results, run nothing")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="processes (GPUs) per run, through torchrun")
    parser.add_argument("--parallel", type=int, default=1, help="runs trained at once")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per run before it counts as failed")
    parser.add_argument("--deadline", type=int, help="seconds for this invocation (see above)")
    parser.add_argument(
        "--checkpoints",
        type=Path,
        help="save each run under DIR/RUN and resume it from there: with --deadline a run stops and saves in time,"
        " and the next invocation trains it on (one run over several commands)",
    )
    parser.add_argument(
        "--branch-at",
        type=int,
        metavar="K",
        help="start every run of a seed from its bf16 trunk at step K (default: the preset's; 0: from step 0)",
    )
    parser.add_argument("--trunks", type=Path, default=DEFAULT_TRUNKS, help="where --branch-at's trunks are saved")
    parser.add_argument("--rerun", action="store_true", help="train runs that --results holds finished already")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return parser


def exit_status(comparisons: list[report.Comparison], tolerance: float, failed: bool) -> int:
    verdicts = {c.final.verdict(tolerance) if c.final.n else "unresolved" for c in comparisons if not c.noise_floor}
    if failed or "fail" in verdicts:
        return 1
    return 2 if "unresolved" in verdicts else 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    png = args.plot or args.out.with_suffix(".png")
    if args.report_only:
        if not args.results.exists():
            parser.error(f"--results {args.results}: no such file")
        table, comparisons = report.write_report(load_results(args.results), args.out, png, args.tolerance,
                                                 args.reference)  # fmt: skip
        print(f"{table}\n\nwrote {args.out}" + (f" and {png}" if png.exists() else ""))
        return exit_status(comparisons, args.tolerance, False)
    preset = None if args.model else args.preset or "tiny"
    for value, what in (
        (args.seeds, "--seeds"),
        (args.nproc_per_node, "--nproc-per-node"),
        (args.parallel, "--parallel"),
    ):
        if value < 1:
            parser.error(f"{what} {value}: give 1 or more")
    if args.branch_at is None:
        args.branch_at = PRESET_BRANCH.get(preset, 0)
    if args.branch_at < 0:
        parser.error(f"--branch-at {args.branch_at}: give a step >= 1, or 0 to train every run from step 0")
    if args.mock_data and args.data_path:
        parser.error("--mock-data and --data-path exclude each other")
    common = shlex.split(args.model) if args.model else PRESETS[preset].split()
    for name in OVERRIDES:
        if (value := getattr(args, name)) is not None:
            common = set_flag(common, f"--{name.replace('_', '-')}", str(value))
    try:
        names = plan_runs(args.configs or DEFAULT_CONFIGS[preset or "tiny"], args.seeds, args.reference,
                          args.noise_floor)  # fmt: skip
        config_flags = parse_config_flags(args.config_flags)
        common += data_flags(args, preset) + ["--full-validation"] + shlex.split(args.extra)
        if args.noise_floor:
            for name in names:
                if parse_run_name(name).tag == report.NOISE_TAG:
                    config_flags.setdefault(parse_run_name(name).base, noise_flags(common, args.nproc_per_node))
    except ValueError as err:
        parser.error(str(err))
    bases = {parse_run_name(n).base for n in names} | set(names)
    if unknown := set(config_flags) - bases:
        parser.error(f"--config-flags names runs not planned: {', '.join(sorted(unknown))}")
    iters = int(flag_values(common).get("--train-iters", "0"))
    if args.branch_at and args.branch_at >= iters:
        parser.error(f"--branch-at {args.branch_at}: branch before the last step (--train-iters {iters}), or give 0")
    setup = {"preset": preset or "custom", "flags": shlex.join(common)}
    if args.nproc_per_node > 1:
        setup["nproc_per_node"] = args.nproc_per_node
    fp8_extra = shlex.split(args.fp8_extra)
    plan = [(name, run_flags(name, common, args.seed, fp8_extra, config_flags)) for name in names]
    if args.checkpoints:
        at = {n: str(args.checkpoints / safe_name(n)) for n in names}
        plan = [(n, [*flags, "--save", at[n], "--load", at[n]]) for n, flags in plan]
    needs: dict[str, str] = {}
    complete: dict[str, Callable[[], bool]] = {}
    setup_first: dict[str, Callable[[], None]] = {}
    if args.branch_at:
        plan, needs = branch_plan(plan, args, common, fp8_extra, config_flags)
        complete = {n: partial(trunk_saved, flags, args.branch_at) for n, flags in plan if n in needs.values()}
        if args.checkpoints:  # a branch's first part starts from its trunk's files, linked into its own folder
            setup_first = {
                n: partial(link_trunk, args.trunks / safe_name(trunk), args.checkpoints / safe_name(n))
                for n, trunk in needs.items()
            }
        setup["branch_at"] = args.branch_at
    if args.dry_run:
        for name, flags in plan:
            print(f"{name}: {shlex.join(command(flags, args.nproc_per_node))}")
        return 0
    results = load_results(args.results)
    if not args.rerun:
        runs = results["runs"]
        done = [name for name, flags in plan if name not in complete and finished_with(runs.get(name), flags)]
        if done:
            print(f"already in {args.results} with the same flags (--rerun trains them again): {' '.join(done)}")
        plan = [(name, flags) for name, flags in plan if name not in done]
    plan = needed_trunks(plan, needs, args)
    env_line = benchmark.environment()
    failed, not_started = train_all(plan, setup, args, results, env_line, needs, complete, setup_first)
    table, comparisons = report.write_report(results, args.out, png, args.tolerance, args.reference)
    print(f"\n{env_line}\n\n{table}\n\nresults: {args.results}; report: {args.out}")
    planned = {parse_run_name(n).base for n in names}
    return exit_status([c for c in comparisons if c.base in planned], args.tolerance, bool(failed or not_started))


if __name__ == "__main__":
    sys.exit(main())
