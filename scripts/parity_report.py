"""The loss-parity harness's statistics and report (scripts/loss_parity.py runs the trainings).

A run is named `CONFIG[@seedN][+TAG]` (scripts/benchmark.py's CONFIG; `@seedN` the N-th seed; `+TAG` a variant with
flags of its own). A run is paired with its reference at the same seed index: the same engine's bf16 run
(`te-bf16@seed2` for `te-delayed@seed2`), or the configuration --reference names. Partners share the initial
weights, the data order and, under --full-validation, every validation token, so their gap is the precision's
alone. Runs of one seed still drift apart over training (their arithmetic differs and training amplifies any
difference), so one seed's gap is one sample; the measurement is the mean over seeds with its 95% interval.

    paired gap (%) = 100 * (validation loss - the partner's) / the partner's        positive: worse than the partner
    interval       = mean +- t(0.975, n - 1) * sd / sqrt(n) over the n seeds

A configuration that is its reference with a variant (`te-bf16+noise`: bf16 with another micro-batch split, the
same function rounded differently) measures the noise floor: its interval is the smallest gap the harness resolves.
Verdict against a tolerance T (%), one-sided, as a user asks "is FP8 at most T% worse?": pass when the interval's
upper end is <= T, fail when its lower end is > T, unresolved otherwise (more seeds narrow the interval).
"""

from __future__ import annotations

import math
import os
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import benchmark

CONFIGS = benchmark.CONFIGS
NOISE_TAG = "noise"
"""The tag of the reference's noise-floor variant (loss_parity.py gives it its flags)."""
TRUNK_TAG = "trunk"
"""The tag of a seed's trunk under --branch-at: the reference's first steps, shared by every run of the seed."""

# Two-sided 95% quantiles of Student's t by degrees of freedom; above 30, the Cornish-Fisher expansion.
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131]
_T95 += [2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t95(df: int) -> float:
    """Student's t quantile at 0.975 with `df` degrees of freedom (>= 1)."""
    if df <= len(_T95):
        return _T95[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


# ---------------------------------------------------------------------------------------------------- run names


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
    def base(self) -> str:
        """The name without its seed: `CONFIG[+TAG]`, the configuration it measures."""
        return self.config + (f"+{self.tag}" if self.tag else "")

    def reference_base(self, reference: str | None = None) -> str:
        """The configuration this one is paired with: `reference`, else the same engine's bf16."""
        return reference or f"{self.engine}-bf16"


def run_name(base: str, seed_index: int) -> str:
    """`CONFIG[+TAG]` at seed index `seed_index`: `CONFIG[@seedN][+TAG]`."""
    if seed_index == 1:
        return base
    config, plus, tag = base.partition("+")
    return f"{config}@seed{seed_index}{plus}{tag}"


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


# ---------------------------------------------------------------------------------------------------------- logs

_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*\d+ \|.*? \| lm loss: (\S+) \|")
_SKIPPED = re.compile(r"number of skipped iterations:\s*(\d+) \| number of nan iterations:\s*(\d+)")
_VALIDATION = re.compile(r"\bvalidation loss at iteration (\d+)(?: on validation set)? \| lm loss value: (\S+) \|")


def parse_losses(text: str) -> dict[str, Any]:
    """From a pretrain_gpt.py log (megatron/training/logger.py's formats): `train`, [iteration, lm loss] of every
    progress line (the mean over its log interval); `valid`, [iteration, loss] of every validation (one per
    iteration: the evaluation after training repeats the last one's); the skipped and NaN iteration counts of the
    last progress line. Non-finite losses are kept (logged as NAN / INF)."""
    train, valid, skipped, nans = [], {}, None, None
    for line in text.splitlines():
        if match := _ITERATION.search(line):
            train.append([int(match.group(1)), float(match.group(2))])
            if counts := _SKIPPED.search(line):
                skipped, nans = int(counts.group(1)), int(counts.group(2))
        elif match := _VALIDATION.search(line):
            valid.setdefault(int(match.group(1)), float(match.group(2)))
    return {"train": train, "valid": [[it, loss] for it, loss in valid.items()], "skipped_iterations": skipped,
            "nan_iterations": nans}  # fmt: skip


# ------------------------------------------------------------------------------------------------------- pairing


def gap_pct(loss: float, reference: float) -> float:
    """100 * (loss - reference) / reference: positive where `loss` is worse (higher)."""
    return 100.0 * (loss - reference) / reference


@dataclass
class Interval:
    """Mean of paired gaps over seeds, with its 95% interval (None below two seeds)."""

    gaps: list[float]

    @property
    def n(self) -> int:
        return len(self.gaps)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.gaps)

    @property
    def sd(self) -> float | None:
        if self.n < 2:
            return None
        return statistics.stdev(self.gaps) if all(map(math.isfinite, self.gaps)) else math.nan

    @property
    def half_width(self) -> float | None:
        return t95(self.n - 1) * self.sd / math.sqrt(self.n) if self.n > 1 else None

    def verdict(self, tolerance: float) -> str:
        """pass / fail / unresolved against `tolerance` (%), one-sided (see the module docstring)."""
        if not all(map(math.isfinite, self.gaps)):
            return "fail"  # a diverged run
        if self.half_width is None:
            return "unresolved"
        if self.mean + self.half_width <= tolerance:
            return "pass"
        return "fail" if self.mean - self.half_width > tolerance else "unresolved"


@dataclass
class Comparison:
    """One configuration against its reference, over the seeds where both finished."""

    base: str
    reference: str
    seed_indices: list[int] = field(default_factory=list)
    final: Interval = field(default_factory=lambda: Interval([]))
    by_iteration: dict[int, Interval] = field(default_factory=dict)
    skipped: int = 0
    missing: list[str] = field(default_factory=list)
    """Runs of this configuration (or their partners) that failed or are absent."""

    @property
    def noise_floor(self) -> bool:
        """A variant of the reference itself: bf16 against bf16."""
        return self.base.partition("+")[0] == self.reference.partition("+")[0]

    def largest(self) -> tuple[int, Interval] | None:
        """The evaluation whose mean paired gap is largest in magnitude (a non-finite one counts as largest)."""
        if not self.by_iteration:
            return None

        def size(item: tuple[int, Interval]) -> float:
            mean = item[1].mean
            return math.inf if not math.isfinite(mean) else abs(mean)

        return max(self.by_iteration.items(), key=size)


def _valid(record: dict[str, Any] | None) -> dict[int, float] | None:
    """A finished run's validation losses by iteration (None for a failed, partial or absent run)."""
    if not record or record.get("error") or record.get("partial") or not record.get("valid"):
        return None
    return {int(it): loss for it, loss in record["valid"]}


def compare(runs: dict[str, dict[str, Any]], reference: str | None = None) -> list[Comparison]:
    """Every configuration in `runs` against its reference at each seed, in table order (the reference itself
    has no row)."""
    parsed = {}
    for name in runs:
        try:
            parsed[name] = parse_run_name(name)
        except ValueError:  # a name this version does not know: in the per-run table only
            continue
    comparisons: dict[str, Comparison] = {}
    for name in sorted(parsed, key=_order):
        run = parsed[name]
        ref_base = run.reference_base(reference)
        if run.base == ref_base or run.tag == TRUNK_TAG:
            continue
        comparison = comparisons.setdefault(run.base, Comparison(run.base, ref_base))
        ref_name = run_name(ref_base, run.seed_index)
        mine, theirs = _valid(runs[name]), _valid(runs.get(ref_name))
        if mine is None or theirs is None:
            comparison.missing.append(name if mine is None else ref_name)
            continue
        last = max(mine)
        if last not in theirs:
            comparison.missing.append(f"{ref_name} (no evaluation at iteration {last})")
            continue
        comparison.seed_indices.append(run.seed_index)
        comparison.final.gaps.append(gap_pct(mine[last], theirs[last]))
        comparison.skipped += runs[name].get("skipped_iterations") or 0
        for it in sorted(set(mine) & set(theirs)):
            comparison.by_iteration.setdefault(it, Interval([])).gaps.append(gap_pct(mine[it], theirs[it]))
    for comparison in comparisons.values():  # an iteration counts when every paired seed evaluated it
        n = comparison.final.n
        comparison.by_iteration = {it: iv for it, iv in comparison.by_iteration.items() if iv.n == n}
    return list(comparisons.values())


def _order(name: str) -> tuple:
    """Table order: configs as scripts/benchmark.py lists them (te before local), then variant, then seed."""
    try:
        run = parse_run_name(name)
    except ValueError:
        return (len(CONFIGS), name, "", 0)
    return (list(CONFIGS).index(run.config), "", run.tag or "", run.seed_index)


# -------------------------------------------------------------------------------------------------------- tables


def _pct(value: float | None, sign: str = "+") -> str:
    if value is None:
        return ""
    return f"{value:{sign}.3f}%" if math.isfinite(value) else str(value)


def format_comparisons(comparisons: list[Comparison], tolerance: float) -> str:
    """The paired table: one row per configuration."""
    lines = [
        "| configuration | against | seeds | mean paired gap | 95% interval | sd | largest mean gap (iteration) |"
        f" verdict at +{tolerance:g}% | skipped steps |",
        "|---|---|---:|---:|---|---:|---:|:---:|---:|",
    ]
    for c in comparisons:
        if not c.final.n:
            lines.append(f"| {c.base} | {c.reference} | 0 | no finished pair: {', '.join(c.missing)} |" + " |" * 5)
            continue
        iv = c.final
        interval = (
            "" if iv.half_width is None else f"{_pct(iv.mean - iv.half_width)} .. {_pct(iv.mean + iv.half_width)}"
        )
        largest = c.largest()
        at = f"{_pct(largest[1].mean)} ({largest[0]})" if largest else ""
        verdict = "(noise floor)" if c.noise_floor else iv.verdict(tolerance)
        if c.noise_floor and iv.half_width is not None:
            verdict = f"(noise floor: ±{iv.half_width:.3f}%)"
        seeds = f"{iv.n}" + (f" ({len(c.missing)} missing)" if c.missing else "")
        lines.append(
            f"| {c.base} | {c.reference} | {seeds} | {_pct(iv.mean)} | {interval} | {_pct(iv.sd, '')} | {at} |"
            f" {verdict} | {c.skipped} |"
        )
    return "\n".join(lines)


def format_runs(runs: dict[str, dict[str, Any]]) -> str:
    """Every run: its seed, final validation loss, last logged train loss, or why it failed."""
    lines = [
        "| run | seed | final valid loss | last train loss | skipped steps | wall (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in sorted(runs, key=_order):
        record = runs[name]
        seed = record.get("seed", "")
        if record.get("error"):
            lines.append(
                f"| {name} | {seed} | failed: {record['error'].replace('|', '/').replace(chr(10), ' ')} | | | |"
            )
            continue
        valid = record.get("valid") or [[None, math.nan]]
        train = record.get("train") or [[None, math.nan]]
        lines.append(
            f"| {name} | {seed} | {valid[-1][1]:.4f} | {train[-1][1]:.4f} | {record.get('skipped_iterations', '')} |"
            f" {record.get('wall_s', '')} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------- plot


def plot(runs: dict[str, dict[str, Any]], comparisons: list[Comparison], path: Path, tolerance: float) -> str | None:
    """Validation loss of the first seed's runs (top) and each configuration's mean paired gap over the
    evaluations with its 95% band (bottom); returns why no PNG was written, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on training machines
        import matplotlib.pyplot as plt
    except ImportError:
        return "the PNG needs matplotlib (pip install matplotlib)"
    shown = [c for c in comparisons if c.by_iteration]
    if not shown:
        return "no finished pair to plot"
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 8), sharex=True, gridspec_kw={"height_ratios": [2, 3]})
    colors = [plt.get_cmap("tab10" if len(shown) < 10 else "tab20")(i) for i in range(20)]
    for base in sorted({c.reference for c in shown}):
        if valid := _valid(runs.get(base)):
            top.plot(list(valid), list(valid.values()), "k-", lw=1.5, label=base)
        trunk = runs.get(f"{base.partition('+')[0]}+{TRUNK_TAG}") or {}
        if trunk.get("valid") and not trunk.get("error"):  # the shared first steps, and where the runs branch
            its, losses = zip(*trunk["valid"])
            top.plot(its, losses, "k:", lw=1.5, label=f"{base} trunk (shared)")
            for axis in (top, bottom):
                axis.axvline(its[-1], color="gray", ls=":", lw=1)
    magnitudes = [tolerance]
    for i, c in enumerate(shown):
        color, style = colors[i % len(colors)], "--" if c.noise_floor else "-"
        if valid := _valid(runs.get(c.base)):
            top.plot(list(valid), list(valid.values()), style, color=color, lw=1, label=c.base)
        its = sorted(c.by_iteration)
        means = [c.by_iteration[it].mean for it in its]
        widths = [c.by_iteration[it].half_width or 0.0 for it in its]
        bottom.plot(its, means, style, marker="o", ms=3, color=color, label=f"{c.base} ({c.final.n} seeds)")
        bottom.fill_between(its, [m - w for m, w in zip(means, widths)], [m + w for m, w in zip(means, widths)],
                            color=color, alpha=0.15)  # fmt: skip
        magnitudes += [abs(m) + w for it, m, w in zip(its, means, widths) if it >= 0.2 * its[-1] and math.isfinite(m)]
    limit = 1.2 * max(magnitudes)
    bottom.set_ylim(-limit, limit)
    bottom.axhspan(-tolerance, tolerance, color="green", alpha=0.08, label=f"±{tolerance:g}%")
    bottom.axhline(0, color="black", lw=0.8)
    top.set_ylabel("validation loss")
    top.set_title("validation loss, first seed (every evaluation reads the same tokens)")
    top.legend(fontsize=7, ncol=2)
    top.grid(alpha=0.3)
    bottom.set_ylabel("paired gap to the reference (%)")
    bottom.set_xlabel("iteration")
    bottom.set_title("mean paired gap over seeds, with its 95% interval")
    bottom.legend(fontsize=7, ncol=2)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# -------------------------------------------------------------------------------------------------------- report


def write_report(
    results: dict[str, Any], out: Path, png: Path | None, tolerance: float = 0.5, reference: str | None = None
) -> tuple[str, list[Comparison]]:
    """Write the markdown report (and the PNG where matplotlib is there); returns the paired table and the
    comparisons."""
    runs = results.get("runs", {})
    comparisons = compare(runs, reference)
    table = format_comparisons(comparisons, tolerance)
    lines = ["# Loss parity: paired gaps to bf16", ""]
    setups = {json_key(runs[n].get("setup")) for n in runs if runs[n].get("setup")}
    if len(setups) == 1:
        setup = next(runs[n]["setup"] for n in runs if runs[n].get("setup"))
        lines.append(f"Preset `{setup.get('preset')}`; shared flags: `{setup.get('flags', '')}`.")
        if setup.get("branch_at"):
            lines.append(f"Every run starts from its seed's trunk (`{TRUNK_TAG}`: the reference) at step"
                         f" {setup['branch_at']}: the gaps are what each precision adds after it.")  # fmt: skip
    elif setups:
        lines.append(f"Note: the runs have {len(setups)} different shared setups; each row pairs runs of its own.")
    environments = sorted({runs[n].get("environment") for n in runs if runs[n].get("environment")})
    if environments:
        lines.append("Environment: " + "; ".join(environments) + ".")
    lines += ["", table, "", format_runs(runs), ""]
    lines.append(
        "Paired gap: 100 x (final validation loss - the reference's at the same seed) / the reference's; positive ="
        " worse. 95% interval: mean ± t(0.975, n-1) x sd / sqrt(n) over the n seeds. Largest mean gap: the"
        f" evaluation where the mean paired gap is largest in magnitude. Verdict at +{tolerance:g}%: pass when the"
        " interval's upper end is at most the tolerance, fail when its lower end is above it, else unresolved."
        " Noise floor: bf16 against bf16 with another micro-batch split (the same function, rounded differently):"
        " its half-width is the smallest gap these runs resolve."
    )
    lines.append("")
    if png is not None:
        why_not = plot(runs, comparisons, png, tolerance)
        lines.append(f"No plot: {why_not}." if why_not else f"![paired gaps]({os.path.relpath(png, out.parent)})")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines).rstrip() + "\n")
    return table, comparisons


def json_key(value: Any) -> str:
    """A hashable form of a setup dict."""
    return repr(sorted(value.items())) if isinstance(value, dict) else repr(value)
