"""Why a checkpoint's tensors have other shapes than this run's model: the model flags that differ from the saved
run's (its config, saved with every checkpoint), named in the one line that refuses the load.

One difference is not a mismatch: the vocabulary's padding. The embedding and output layer hold the tokenizer's
vocabulary rounded up to a multiple of --make-vocab-size-divisible-by x the tensor-parallel size, so a checkpoint
saved under another tensor-parallel size holds the same vocabulary in another number of rows; those rows load
(`vocab_rows_fit`). Two paddings of one vocabulary differ by fewer rows than the larger multiple, so a larger
difference, or a --vocab-size that differs, is another vocabulary: refused, never truncated.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.config.base import flag_name

SHAPE_FLAGS = {
    "model": (
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "max_position_embeddings",
        "position_embedding_type",
        "normalization",
        "swiglu",
        "disable_bias_linear",
        "qk_layernorm",
        "untie_embeddings_and_output_weights",
    ),
    "data": ("vocab_size", "tokenizer_type", "vocab_file", "tokenizer_model", "make_vocab_size_divisible_by"),
}
"""The flags (by config section) that decide the shapes of the model's tensors."""
MEGATRON_LM_DIVISIBLE_BY = 128
"""Megatron-LM's default --make-vocab-size-divisible-by."""


def differing_flags(saved: Any, cfg: Any) -> list[str]:
    """'--hidden-size 32 (checkpoint: 64)' for each shape flag whose value differs from the saved run's config;
    [] when the checkpoint holds no config (saved by another program, or converted)."""
    if not isinstance(saved, dict):
        return []
    found = []
    for section, names in SHAPE_FLAGS.items():
        theirs, ours = saved.get(section), getattr(cfg, section)
        if not isinstance(theirs, dict):
            continue
        fields = {f.name: f for f in dataclasses.fields(ours)}
        for name in names:
            if name in theirs and name in fields and theirs[name] != getattr(ours, name):
                flag = flag_name(fields[name])
                found.append(f"{_value(flag, getattr(ours, name))} (checkpoint: {_value(flag, theirs[name])})")
    return found


def _value(flag: str, value: Any) -> str:
    if isinstance(value, bool):
        return flag if value else f"no {flag}"
    return f"{flag} {value}"


def vocab_rows_fit(saved_rows: int, rows: int, saved: Any, saved_tp: int, cfg: Any) -> bool:
    """Whether a vocabulary tensor of `saved_rows` rows in the checkpoint and `rows` here can be two paddings of one
    vocabulary (which loads: the rows both have, the rest being padding)."""
    data = saved.get("data") if isinstance(saved, dict) else None
    data = data if isinstance(data, dict) else {}
    ours = cfg.data.vocab_size
    if ours is not None and data.get("vocab_size") not in (None, ours):
        return False
    divisible = data.get("make_vocab_size_divisible_by")
    if not (type(divisible) is int and divisible > 0):  # not recorded: this run's, or Megatron-LM's default
        divisible = max(cfg.data.make_vocab_size_divisible_by, MEGATRON_LM_DIVISIBLE_BY)
    slack = max(divisible * saved_tp, cfg.data.make_vocab_size_divisible_by * cfg.parallel.tensor_model_parallel_size)
    return abs(saved_rows - rows) < slack


def mismatch_line(source: str, differ: list[str], problems: list[str]) -> str:
    """The one line refusing a checkpoint whose tensors do not fit the model."""
    if differ:
        why = f"it was saved with other model flags: this run has {', '.join(differ)}"
        fix = "relaunch with the saved run's model flags"
    else:
        why = "the model flags differ from the saved run's"
        fix = "relaunch with the saved run's model flags (--vocab-size or the tokenizer, --hidden-size, ...)"
    return f"checkpoint {source} does not match the model: {why}; {fix}. Tensors: " + "; ".join(problems)
