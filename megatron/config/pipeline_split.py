"""Which transformer layers each pipeline stage holds: the pure arithmetic that configuration validation, the model
builder, checkpoints and the converter share (megatron/parallel/pipeline.py runs the schedule over the stages).

Without a layout the layers split evenly over the pipeline stages, or --decoder-first/last-pipeline-num-layers fix
the first / last stage's count and the rest split evenly (`chunk_layer_numbers`, `stage_layer_numbers`).

`--pipeline-model-parallel-layout` is Megatron-LM's string for which layers each virtual pipeline stage holds.

Stages are separated by `|` and listed in model order (virtual stage s = chunk s // pp of pipeline rank s % pp);
in each, `E` is the embedding, `t` a transformer layer and `L` the output layer with the loss. `x*n` repeats a
character, `(...)*n` a group (which may contain `|`), and commas are cosmetic. The embedding opens the first stage
and the loss closes the last. The number of stages divided by --pipeline-model-parallel-size is the virtual
pipeline size. Llama-3-8B on two stages with the output layer's work (about two layers' worth) moved off the last
stage: `Et*4|t*4|t*5|t*4|t*4|t*4|t*4|t*3L` (rank 0: 4 + 5 + 4 + 4 layers, rank 1: 4 + 4 + 4 + 3 and the loss).

A stage may hold only the embedding or only the loss (Megatron-LM's "standalone" stages), not nothing at all.
Multi-token-prediction layers (`m`) do not exist in this project.

--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split are Megatron-LM's shorthand for a
layout: the embedding (loss) counts as one more layer, the layers are split evenly over the pipeline x virtual
stages, and the first (last) virtual stage builds one transformer layer fewer (`accounted_layout`).
"""

from __future__ import annotations

import re

from .base import ConfigError

_GROUP = re.compile(r"\(([^()]+)\)\*(\d+)")
_REPEAT = re.compile(r"(.)\*(\d+)")


def _error(layout: str, why: str) -> Exception:
    return ConfigError(f"--pipeline-model-parallel-layout {layout!r}: {why}")


def layout_stage_counts(layout: str, pp: int, num_layers: int) -> tuple[int, ...]:
    """Transformer layers of each virtual stage, in model order; ConfigError naming what is wrong with `layout`."""
    text = layout.replace(",", "").replace(" ", "")
    while _GROUP.search(text):
        text = _GROUP.sub(lambda m: m.group(1) * int(m.group(2)), text)
    text = _REPEAT.sub(lambda m: m.group(1) * int(m.group(2)), text)
    if bad := sorted(set(text) - set("EtL|")):
        extra = "; multi-token-prediction layers ('m') are not supported" if "m" in bad else ""
        raise _error(layout, f"unknown characters {' '.join(bad)} (E embedding, t layer, L loss, | stage){extra}")
    stages = text.split("|")
    if len(stages) % pp:
        raise _error(layout, f"{len(stages)} stages do not divide over --pipeline-model-parallel-size {pp}")
    if text.count("E") != 1 or not stages[0].startswith("E"):
        raise _error(layout, "the embedding (E) must open the first stage, once")
    if text.count("L") != 1 or not stages[-1].endswith("L"):
        raise _error(layout, "the loss (L) must close the last stage, once")
    if "" in stages:
        raise _error(layout, f"stage {stages.index('')} is empty; every stage holds E, t or L")
    counts = tuple(stage.count("t") for stage in stages)
    if sum(counts) != num_layers:
        raise _error(layout, f"{sum(counts)} transformer layers (t), but --num-layers is {num_layers}")
    return counts


def accounted_layout(num_layers: int, pp: int, vpp: int, embedding: bool, loss: bool) -> str:
    """The layout of --account-for-embedding/loss-in-pipeline-split: (num_layers + embedding + loss) layers split
    evenly over pp x vpp virtual stages, the embedding and the loss each standing in for one layer of the first and
    last virtual stage. ConfigError where they do not split evenly (Megatron-LM's rule)."""
    flags = " and ".join(
        f"--account-for-{what}-in-pipeline-split" for what, on in (("embedding", embedding), ("loss", loss)) if on
    )
    total = num_layers + embedding + loss
    if total % (pp * vpp):
        raise ConfigError(
            f"{flags}: --num-layers {num_layers} plus the {int(embedding) + int(loss)} counted as layers ({total})"
            f" must divide evenly over the {pp} x {vpp} pipeline x virtual stages"
        )
    counts = [total // (pp * vpp)] * (pp * vpp)
    counts[0] -= embedding
    counts[-1] -= loss
    if min(counts) < 0:
        raise ConfigError(f"{flags}: too few layers for {pp} x {vpp} pipeline x virtual stages")
    stages = ["t" * c for c in counts]
    stages[0], stages[-1] = "E" + stages[0], stages[-1] + "L"
    return "|".join(stages)


def _stage_layer_counts(num_layers: int, pp: int, first: int | None, last: int | None) -> list[int]:
    """Transformer layers of each pipeline stage: `first` / `last` on the first / last stage when given, the rest
    split evenly over the other stages (ConfigError naming the flags when they cannot be)."""
    counts = [None] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    rest = num_layers - sum(c for c in counts if c is not None)
    free = counts.count(None)
    if rest < 0 or (free and rest % free) or (not free and rest):
        raise ConfigError(
            f"--num-layers ({num_layers}) cannot be split over --pipeline-model-parallel-size ({pp}) with"
            f" --decoder-first-pipeline-num-layers {first} and --decoder-last-pipeline-num-layers {last}:"
            " the layers left must divide evenly over the other stages"
        )
    counts = [c if c is not None else rest // free for c in counts]
    if min(counts) < 1:
        raise ConfigError(
            f"--num-layers ({num_layers}) leaves an empty pipeline stage with --pipeline-model-parallel-size ({pp})"
        )
    return counts


def chunk_layer_numbers(
    num_layers: int,
    pp: int,
    pp_rank: int,
    vpp: int = 1,
    first: int | None = None,
    last: int | None = None,
    layout: str | None = None,
) -> tuple[tuple[int, ...], ...]:
    """Global (1-based) layer numbers of each of the `vpp` model chunks of pipeline stage `pp_rank`, as Megatron-LM
    assigns them: each stage's layers (see `_stage_layer_counts`) are divided evenly over its chunks, and chunk c of
    stage r is virtual stage c * pp + r, so the model runs chunk 0 of every stage, then chunk 1 of every stage, ...
    With 8 layers, pp 2, vpp 2: stage 0 holds [1, 2] and [5, 6], stage 1 [3, 4] and [7, 8]. `layout`
    (--pipeline-model-parallel-layout) gives every virtual stage's layer count instead."""
    if layout is not None:
        per_stage = layout_stage_counts(layout, pp, num_layers)
        starts = [sum(per_stage[:s]) for s in range(len(per_stage))]
        return tuple(
            tuple(range(starts[s] + 1, starts[s] + per_stage[s] + 1)) for s in range(pp_rank, len(per_stage), pp)
        )
    counts = _stage_layer_counts(num_layers, pp, first, last)
    if any(c % vpp for c in counts):
        raise ConfigError(
            f"pipeline stages of {counts} layers cannot be divided into {vpp} virtual stages each: every stage's"
            " layers (--num-layers, --decoder-first/last-pipeline-num-layers) must be a multiple of"
            " --num-virtual-stages-per-pipeline-rank"
        )
    per_chunk = [c // vpp for c in counts]
    start = sum(per_chunk[:pp_rank])
    return tuple(
        tuple(range(c * sum(per_chunk) + start + 1, c * sum(per_chunk) + start + per_chunk[pp_rank] + 1))
        for c in range(vpp)
    )


def stage_layer_numbers(
    num_layers: int,
    pp: int,
    pp_rank: int,
    first: int | None = None,
    last: int | None = None,
    layout: str | None = None,
) -> tuple[int, ...]:
    """Global (1-based) layer numbers of pipeline stage `pp_rank`, all its chunks: `first` / `last` layers on the
    first / last stage when given, the remaining layers split evenly over the other stages, or what `layout` places
    there. Raises ConfigError naming the flags when the layers cannot be split that way."""
    chunks = chunk_layer_numbers(num_layers, pp, pp_rank, 1, first, last, layout)
    return tuple(n for chunk in chunks for n in chunk)


def layout_line(layout: str, pp: int, num_layers: int) -> str:
    """The startup line of a layout: each pipeline rank's chunks, in running order, as transformer-layer counts.
    `Et*4|t*4|t*5|t*3L` on 2 ranks: 'rank 0: embedding + 4, 5 layers; rank 1: 4, 3 layers + loss'."""
    counts = layout_stage_counts(layout, pp, num_layers)
    ranks = []
    for rank in range(pp):
        chunks = ", ".join(str(c) for c in counts[rank::pp])
        first = "embedding + " if rank == 0 else ""
        last = " + loss" if rank == pp - 1 else ""
        ranks.append(f"rank {rank}: {first}{chunks} layers{last}")
    return f"pipeline layout {layout}: " + "; ".join(ranks)


def layer_ranges(numbers: list[int] | tuple[int, ...]) -> str:
    """Layer numbers as runs, for messages: [1, 2, 3, 7, 8] -> '1-3, 7-8', [1, 3] -> '1, 3'."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and runs[-1][1] == n - 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)
