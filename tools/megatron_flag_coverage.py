"""How many of the flags in Megatron-LM's dense-GPT functional-test configurations this project knows.

    python tools/megatron_flag_coverage.py --megatron-dir /path/to/Megatron-LM --commit SHA --out docs/megatron_flags.md

Reads DIR/tests/functional_tests/test_cases/gpt/*/model_config.yaml. A configuration is left out when its `MODE` is
`inference` or `rl`, its directory name contains `inference`, `grpo` or `moe`, or its MODEL_ARGS set
`--num-experts` (MoE, inference and RL are not what this project trains). Each flag key of a counted
configuration's MODEL_ARGS is one use. A use is known when the flag is in this project's CLI (read at run time from
megatron.config.cli, so the count follows the code); unknown flags are listed with the reason from REASONS below,
or as "not yet triaged".

Known uses are parsed as well: each counted configuration's known flags, with its values, go through
megatron.config.cli.parse_args (world size = tensor x pipeline x context parallel sizes; flags the configuration
leaves out are filled from a small working command line and from pretrain_gpt.py's GPT2BPETokenizer default). When
that raises ConfigError, the flag the one-line message names first is set aside and the rest parsed again. A flag
set aside is then parsed alone on that small command line, with the configuration's value: failing alone, it "fails
with a one-line error" (a flag of a feature not implemented yet, or a value this CLI rejects where Megatron-LM
accepts it: the report shows each error); passing alone, it fails only in that configuration's combination (often
because an unknown flag of that configuration was left out). The parse runs as on a CUDA
machine with Transformer Engine importable (neither is needed to validate flags), so TE-only flags are judged by
their own rules. `${VAR}` values are substituted as in SUBSTITUTIONS (paths need not exist to parse).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megatron.config.base import ConfigError
from megatron.config.cli import all_flags, parse_args

ROOT = Path(__file__).resolve().parents[1]

EXCLUDED_MODES = ("inference", "rl")
EXCLUDED_NAME_PARTS = ("inference", "grpo", "moe")
EXCLUDING_FLAGS = ("--num-experts",)

# The CI's environment variables; paths need not exist for flags to parse.
SUBSTITUTIONS = {"REPEAT": "1", "DATA_BLEND": "/ci/data/blend_text_document"}
PATH_PREFIX = "/ci"  # any other ${VAR} becomes /ci/<var in lower case>

# Flags the configurations leave to Megatron-LM's defaults but this CLI needs to build a run.
FILLERS = {
    "--num-layers": "8",  # splits evenly over 1, 2, 4 or 8 pipeline stages
    "--hidden-size": "64",
    "--num-attention-heads": "8",  # divisible by 1, 2, 4 or 8 tensor-parallel ranks
    "--seq-length": "64",
    "--micro-batch-size": "1",
}

# Why an unknown flag is left out. Reviewed by hand: add a line when a new flag shows up as "not yet triaged".
REASONS = {
    "--async-ckpt-use-cpu-shm": "distributed (torch_dist) checkpoint options: not implemented",
    "--rerun-mode": "Megatron-LM's rerun state machine (re-running steps to find faults): not implemented",
    "--error-injection-rate": "rerun state machine fault injection: not implemented",
    "--error-injection-type": "rerun state machine fault injection: not implemented",
    "--check-weight-hash-across-dp-replicas-interval": "replica weight-hash check (fault detection): not implemented",
    "--test-mode": "Megatron-LM's internal test mode: not applicable",
    **dict.fromkeys(
        ["--wandb-project", "--wandb-entity", "--wandb-exp-name", "--wandb-save-dir"],
        "Weights & Biases logging: not a dependency here (TensorBoard only)",
    ),
    "--expert-tensor-parallel-size": "MoE (expert parallelism): out of scope",
    **dict.fromkeys(
        [
            "--multi-latent-attention",
            "--q-lora-rank",
            "--kv-lora-rank",
            "--qk-head-dim",
            "--qk-pos-emb-head-dim",
            "--v-head-dim",
        ],
        "multi-latent attention (DeepSeek): another architecture",
    ),
    **dict.fromkeys(
        [
            "--experimental-attention-variant",
            "--dsa-indexer-n-heads",
            "--dsa-indexer-head-dim",
            "--dsa-indexer-topk",
            "--dsa-indexer-loss-coeff",
        ],
        "DeepSeek sparse attention: another architecture",
    ),
    "--rotary-interleaved": "interleaved rotary layout: not implemented",
    "--use-mup": "muP parametrization: not implemented",
    "--mup-base-hidden-size": "muP parametrization: not implemented",
    "--hierarchical-context-parallel-sizes": "hierarchical context parallelism: not implemented",
    **dict.fromkeys(
        ["--overlap-p2p-communication-warmup-flush"],
        "overlapped point-to-point communication in the pipeline's warm-up and flush: not implemented",
    ),
    "--use-tp-pp-dp-mapping": "alternative rank order of the process groups: not implemented",
    "--num-distributed-optimizer-instances": "several distributed-optimizer instances: not implemented",
    "--ddp-average-in-collective": "averaging inside the gradient all-reduce: not implemented",
    "--defer-embedding-wgrad-compute": "deferred embedding weight-gradient GEMM (pipeline): not implemented",
    "--wgrad-deferral-limit": "deferred embedding weight-gradient GEMM (pipeline): not implemented",
    "--overlap-param-gather-with-optimizer-step": "overlap with the interleaved pipeline's optimizer: not implemented",
    "--disable-gloo-process-groups": "gloo side groups switch: not implemented",
    "--eval-global-batch-size": "separate validation batch size: not implemented",
    **dict.fromkeys(["--fim-data", "--fim-rate", "--fim-spm-rate"], "fill-in-the-middle dataset: not implemented"),
    **dict.fromkeys(
        ["--export-te-mcore-model", "--export-kd-teacher-load", "--export-kd-cfg"],
        "NVIDIA ModelOpt distillation: not a dependency here",
    ),
    "--tp-comm-overlap-cfg": "Transformer Engine userbuffers YAML configuration: not implemented",
}


@dataclass
class Report:
    counted: list[str] = field(default_factory=list)
    excluded: dict[str, str] = field(default_factory=dict)  # config -> why
    uses: collections.Counter = field(default_factory=collections.Counter)  # flag -> configs using it
    works: collections.Counter = field(default_factory=collections.Counter)
    fails_alone: dict[str, list[str]] = field(default_factory=dict)  # flag -> distinct error lines
    fails_alone_uses: collections.Counter = field(default_factory=collections.Counter)
    fails_combined: collections.Counter = field(default_factory=collections.Counter)
    combined_errors: dict[str, str] = field(default_factory=dict)  # flag -> one example error
    unattributed: dict[str, str] = field(default_factory=dict)  # config -> error naming none of its flags


def exclusion(name: str, config: dict) -> str | None:
    """Why a configuration is left out, or None when it is counted."""
    if config.get("MODE") in EXCLUDED_MODES:
        return f"MODE: {config['MODE']}"
    for part in EXCLUDED_NAME_PARTS:
        if part in name:
            return f"name contains {part!r}"
    for flag in EXCLUDING_FLAGS:
        if flag in (config.get("MODEL_ARGS") or {}):
            return f"sets {flag}"
    return None


def substitute(text: str) -> str:
    def one(match: re.Match) -> str:
        var = match.group(1) or match.group(2)
        return SUBSTITUTIONS.get(var, f"{PATH_PREFIX}/{var.lower()}")

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, text)


def arguments(flag: str, value: object) -> list[str]:
    """A MODEL_ARGS entry as the CI's launcher passes it: `true` is the bare flag, `[a b]` several values."""
    if value is True:
        return [flag]
    text = substitute(str(value).strip())
    if text.startswith("[") and text.endswith("]"):
        return [flag, *text[1:-1].replace(",", " ").split()]
    return [flag, text]


@contextlib.contextmanager
def te_importable() -> Iterator[None]:
    """Validate as on a GPU machine with Transformer Engine: flag checks need neither."""
    from megatron.config import te_rules

    saved = te_rules.te_import_error
    te_rules.te_import_error = lambda: None
    try:
        yield
    finally:
        te_rules.te_import_error = saved


def fill(args: dict[str, list[str]]) -> list[str]:
    """The configuration's known flags plus what it leaves to Megatron-LM's defaults."""
    argv = [a for values in args.values() for a in values]
    for flag, value in FILLERS.items():
        if flag not in args:
            argv += [flag, value]
    if "--data-path" not in args:
        argv.append("--mock-data")
    if "--tokenizer-type" not in args:  # pretrain_gpt.py's default is GPT2BPETokenizer, which needs its files
        argv += ["--tokenizer-type", "GPT2BPETokenizer"] if "--vocab-file" in args else ["--vocab-size", "128"]
    return argv


def world_size(args: dict[str, list[str]]) -> int:
    size = 1
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size"):
        if flag in args and len(args[flag]) == 2 and args[flag][1].isdigit():
            size *= int(args[flag][1])
    return size


def try_parse(args: dict[str, list[str]]) -> str | None:
    """None when the flags parse, else the one-line error."""
    try:
        with te_importable():
            # check_files=False: the CI configurations name data and tokenizer files of NVIDIA's machines
            parse_args(fill(args), world_size=world_size(args), device_type="cuda", check_files=False)
    except ConfigError as err:
        return str(err)
    return None


def check_config(name: str, args: dict[str, list[str]], report: Report) -> None:
    """Classify each known flag use of one configuration: works, fails alone, or fails in this combination."""
    args = dict(args)
    while (error := try_parse(args)) is not None:
        named = [f for f in re.findall(r"--[a-z0-9][a-z0-9_-]*", error) if f in args]
        if not named:
            report.unattributed[name] = error
            return
        flag = named[0]
        alone = try_parse({flag: args.pop(flag)})
        if alone is None:
            report.fails_combined[flag] += 1
            report.combined_errors.setdefault(flag, f"{name}: {error}")
        else:
            report.fails_alone_uses[flag] += 1
            errors = report.fails_alone.setdefault(flag, [])
            if alone not in errors:
                errors.append(alone)
    report.works.update(args.keys())


def survey(megatron_dir: Path) -> Report:
    known = set(all_flags())
    report = Report()
    for path in sorted((megatron_dir / "tests/functional_tests/test_cases/gpt").glob("*/model_config.yaml")):
        name = path.parent.name
        config = yaml.safe_load(path.read_text()) or {}
        why = exclusion(name, config)
        if why:
            report.excluded[name] = why
            continue
        report.counted.append(name)
        model_args = config.get("MODEL_ARGS") or {}
        report.uses.update(model_args.keys())
        check_config(name, {f: arguments(f, v) for f, v in model_args.items() if f in known}, report)
    return report


def markdown(report: Report, commit: str, date: str) -> str:
    known = set(all_flags())
    total = sum(report.uses.values())
    known_uses = sum(n for f, n in report.uses.items() if f in known)
    works, alone, combined = (sum(c.values()) for c in (report.works, report.fails_alone_uses, report.fails_combined))
    unknown = sorted(((n, f) for f, n in report.uses.items() if f not in known), key=lambda t: (-t[0], t[1]))
    untriaged = [f for _, f in unknown if f not in REASONS]
    pct = lambda n: f"{100 * n / total:.1f}%" if total else "n/a"  # noqa: E731
    lines = [
        "# Megatron-LM flags: coverage of its functional-test configurations",
        "",
        f"Generated by `tools/megatron_flag_coverage.py` on {date} from Megatron-LM commit `{commit}`; rerun it",
        "after adding flags. Counted: the dense-GPT training configurations",
        "`tests/functional_tests/test_cases/gpt/*/model_config.yaml`. Left out: a configuration whose `MODE` is",
        f"{' or '.join(f'`{m}`' for m in EXCLUDED_MODES)}, whose directory name contains"
        f" {', '.join(f'`{p}`' for p in EXCLUDED_NAME_PARTS)}, or whose `MODEL_ARGS` set"
        f" {', '.join(f'`{f}`' for f in EXCLUDING_FLAGS)} (MoE, inference, RL).",
        "Each flag key of a configuration's `MODEL_ARGS` is one use.",
        "",
        f"- configurations counted: **{len(report.counted)}**, left out: {len(report.excluded)}",
        f"- flag uses: {total}, of {len(report.uses)} distinct flags",
        f"- **known flags: {known_uses} uses = {pct(known_uses)}**; unknown: {total - known_uses} uses ="
        f" {pct(total - known_uses)} ({len(unknown)} flags, {len(untriaged)} not yet triaged)",
        f"- of the known uses, parsed with the configuration's values: {works} work ({pct(works)});"
        f" {alone} fail with a one-line error even alone ({pct(alone)});"
        f" {combined} fail only in their configuration's combination ({pct(combined)})"
        + (
            f"; {len(report.unattributed)} configurations failed with an error naming none of their flags"
            if report.unattributed
            else ""
        ),
        "",
        "The target: at least 90% of the uses are known flags.",
        "",
        "How known flags are checked: each counted configuration's known flags and values go through this CLI's",
        "parser and validation (`megatron.config.cli.parse_args`; world size = tensor x pipeline (x context)",
        "parallel sizes; flags it leaves to Megatron-LM's defaults filled from"
        f" `{' '.join(f'{k} {v}' for k, v in FILLERS.items())}`, and",
        "GPT2BPETokenizer, pretrain_gpt.py's default tokenizer), as on a CUDA machine with Transformer Engine",
        "importable (validation needs neither). On a one-line error, the first of the configuration's flags the",
        "message names is set aside and parsed alone on that small command line with its value. `${VAR}` values: "
        + ", ".join(f"`{k}` -> `{v}`" for k, v in SUBSTITUTIONS.items())
        + f", any other `${{VAR}}` -> `{PATH_PREFIX}/<var in lower case>` (paths need not exist to parse).",
        "",
    ]
    if report.fails_alone:
        lines += [
            "## Known flags that fail with a one-line error",
            "",
            "Each parsed alone on a small working command line with the configuration's value. Expected here: flags",
            "of features not implemented yet. Anything else is a difference from Megatron-LM to look at.",
            "",
            "| flag | uses | error |",
            "|---|---|---|",
        ]
        for flag in sorted(report.fails_alone, key=lambda f: (-report.fails_alone_uses[f], f)):
            errors = "<br>".join(e.replace("|", "\\|") for e in report.fails_alone[flag])
            lines.append(f"| `{flag}` | {report.fails_alone_uses[flag]} | {errors} |")
        lines.append("")
    if report.fails_combined or report.unattributed:
        lines += [
            "## Known flags that fail in their configuration's combination",
            "",
            "They parse alone; the example shows the configuration and its error (an unknown flag of the",
            "configuration was left out of the parse, which can break a combination that needs it).",
            "",
            "| flag | uses | example |",
        ]
        lines.append("|---|---|---|")
        for flag, n in sorted(report.fails_combined.items(), key=lambda t: (-t[1], t[0])):
            lines.append(f"| `{flag}` | {n} | {report.combined_errors[flag].replace('|', chr(92) + '|')} |")
        for name, error in sorted(report.unattributed.items()):
            lines.append(f"| (configuration `{name}`) | - | {error.replace('|', chr(92) + '|')} |")
        lines.append("")
    lines += ["## Unknown flags", "", "| flag | uses | why it is left out |", "|---|---|---|"]
    lines += [f"| `{f}` | {n} | {REASONS.get(f, '**not yet triaged**')} |" for n, f in unknown]
    lines += ["", "## Configurations left out", ""]
    lines += [f"- `{name}`: {why}" for name, why in sorted(report.excluded.items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megatron-dir", type=Path, required=True, help="Megatron-LM checkout (read only)")
    parser.add_argument("--commit", default="unknown", help="the checkout's commit, printed in the report")
    parser.add_argument("--out", type=Path, help="write the Markdown report here (e.g. docs/megatron_flags.md)")
    parser.add_argument("--date", default=datetime.date.today().isoformat(), help="date printed in the report")
    args = parser.parse_args()
    report = survey(args.megatron_dir)
    text = markdown(report, args.commit, args.date)
    if args.out:
        args.out.write_text(text)
    print("\n".join(line for line in text.splitlines()[:16] if line.startswith("- ")))
    if args.out:
        print(f"-> {args.out}")


if __name__ == "__main__":
    main()
