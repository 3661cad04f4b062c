"""This project's checkpoints <-> FullModel, under any tensor x pipeline layout.

Reading merges the per-rank files of the newest checkpoint (`--ckpt-format torch`: iter_XXXXXXX/mp_rank_TT[_PPP]/
model_optim_rng.pt); writing cuts a FullModel into the files a run at --target-tensor-parallel-size x
--target-pipeline-parallel-size loads with `--load DIR --finetune` (or `--no-load-optim --no-load-rng`, which keeps
the source's iteration count). The written checkpoint holds the weights, the run configuration and
`converted_from`, no optimizer or RNG state. A new on-disk format plugs in by adding a reader to `READERS` and a
writer to `WRITERS`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatron.checkpoint.checkpointing import (
    CHECKPOINT_VERSION,
    LATEST,
    checkpoint_dir,
    iteration_dir,
    model_parallel_name,
)
from megatron.checkpoint.safe_load import SafeLoadPlanner, SafeReader, first_line
from megatron.checkpoint.sharding import global_name
from megatron.config import Config, DataConfig, ModelConfig
from megatron.config.pipeline_split import stage_layer_numbers
from megatron.data.tokenizers import build_tokenizer, padded_vocab_size
from megatron.errors import UserError
from megatron.untrusted import parse_json, read_json, require_file

from .files import load_torch_file
from .state import (
    ConvertError,
    FullModel,
    check_complete,
    merge_tp,
    model_config,
    own_storage,
    pad_vocab,
    split_tp,
    unpad_vocab,
)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def find_iteration(root: Path, what: str = "checkpoint") -> tuple[int | str, Path]:
    """The newest complete iteration under `root` (its `latest` pointer) and its folder; one-line errors for a
    folder that holds none, or only a half-written one."""
    if not root.is_dir():
        raise ConvertError(f"--load-dir {root} does not exist")
    if root.name.endswith(".partial") or root.name.endswith(".tmp"):
        raise ConvertError(f"{root} is a half-written output (an interrupted save or conversion): use the finished one")
    pointer = root / LATEST
    if not pointer.exists():
        unfinished = sorted(p.name for p in root.glob("iter_*.tmp"))
        if unfinished:
            raise ConvertError(
                f"{root} holds only a half-written {what} ({unfinished[0]}, no {LATEST}): the save was interrupted"
            )
        raise ConvertError(f"{root} holds no {what} (no {LATEST})")
    try:
        text = (
            require_file(pointer, "the pointer", "restore the checkpoint's").read_bytes()[:4096].decode("ascii").strip()
        )
    except UnicodeDecodeError:
        raise ConvertError(f"{pointer} is corrupt (not text): expected an iteration number") from None
    if text == "release":  # Megatron-LM's name for converted checkpoints
        return text, root / "release"
    if not (text.isdigit() and len(text) <= 12):
        raise ConvertError(f"{pointer} is corrupt (holds {text[:40]!r}, expected an iteration number)")
    folder = checkpoint_dir(root, int(text))  # iter_N, or its .old copy (a re-save killed between its renames)
    if not folder.is_dir():
        raise ConvertError(f"{pointer} names iteration {text} but {folder.name} is missing: the checkpoint is damaged")
    return int(text), folder


def detect_layout(folder: Path) -> tuple[int, int]:
    """(tp, pp) from the mp_rank_TT[_PPP] folder names."""
    tp = pp = 0
    for shard in folder.glob("mp_rank_*"):
        parts = shard.name.split("_")[2:]
        tp = max(tp, int(parts[0]) + 1)
        pp = max(pp, int(parts[1]) + 1 if len(parts) > 1 else 1)
    if not tp:
        raise ConvertError(f"{folder} holds no mp_rank_* folders: not a --ckpt-format torch checkpoint")
    return tp, pp


def merge_layout(
    shards: dict[tuple[int, int], dict[str, torch.Tensor]],
    cfg: ModelConfig,
    tp: int,
    pp: int,
    first: int | None,
    last: int | None,
    rename: Callable[[str], str | None] = lambda name: name,
    layer_numbers: dict[int, list[int]] | None = None,
) -> dict[str, torch.Tensor]:
    """One single-process state dict from per-rank ones keyed (tp_rank, pp_rank): layers renumbered from
    stage-local to global indices, tensor-parallel shards joined. `rename` maps a source name to ours (None: drop).
    `layer_numbers`: each stage's global layer numbers where the checkpoint records them (a virtual pipeline's
    stages hold layers apart); otherwise the contiguous split that `first` / `last` give."""
    merged: dict[str, torch.Tensor] = {}
    for pp_rank in range(pp):
        numbers = (layer_numbers or {}).get(pp_rank) or stage_layer_numbers(cfg.num_layers, pp, pp_rank, first, last)
        names: dict[str, str] = {}
        for name in shards[(0, pp_rank)]:
            ours = rename(name) if not name.endswith("_extra_state") else None
            if ours is None:
                continue
            match = _LAYER.match(ours)
            if match:
                if int(match.group(1)) >= len(numbers):
                    raise ConvertError(f"{name} on pipeline stage {pp_rank}: that stage holds {len(numbers)} layers")
                ours = global_name(ours, numbers)  # the torch_dist format's renumbering
            elif ours.startswith("embedding.") and pp_rank > 0:
                continue  # the last stage's copy of tied word embeddings
            names[name] = ours
        for name, ours in names.items():
            try:
                pieces = [shards[(t, pp_rank)][name] for t in range(tp)]
            except KeyError:
                raise ConvertError(f"missing tensors: {name} is absent from some tensor-parallel shards") from None
            merged[ours] = merge_tp(ours, pieces, cfg)
    return merged


def _true_vocab_size(config: dict[str, Any], true_vocab_size: int | None, saved: int | None) -> int:
    if true_vocab_size is not None:
        return true_vocab_size
    if saved is not None:
        return saved
    known = {f.name for f in dataclasses.fields(DataConfig)}
    try:
        return build_tokenizer(DataConfig(**{k: v for k, v in config.get("data", {}).items() if k in known})).vocab_size
    except (UserError, OSError, TypeError) as exc:
        raise ConvertError(
            f"cannot tell the vocabulary size without padding (the run's tokenizer does not load here: {exc});"
            " pass --true-vocab-size"
        ) from None


def read_torch(root: Path, true_vocab_size: int | None = None) -> FullModel:
    """A `--ckpt-format torch` checkpoint as a FullModel."""
    iteration, folder = find_iteration(root)
    tp, pp = detect_layout(folder)
    metadata = folder / "metadata.json"
    if metadata.exists():
        saved = read_json(metadata)["layout"]
        if (saved["tp"], saved["pp"]) != (tp, pp):
            raise ConvertError(
                f"{folder} is incomplete: metadata.json names tensor x pipeline {saved['tp']} x {saved['pp']}, the"
                f" folder holds mp_rank_* folders for {tp} x {pp}"
            )
    states = {
        (t, p): load_torch_file(folder / model_parallel_name(t, p, pp) / "model_optim_rng.pt")
        for p in range(pp)
        for t in range(tp)
    }
    first = states[(0, 0)]
    if "config" not in first or "model" not in first:
        raise ConvertError(f"{folder} is not a checkpoint of this project (no model config); try --loader mcore")
    config = first["config"]
    cfg = model_config(**config["model"])
    par = config.get("parallel", {})
    source = f"checkpoint {root} (iteration {iteration})"
    state = merge_layout(
        {key: s["model"] for key, s in states.items()},
        cfg,
        tp,
        pp,
        par.get("decoder_first_pipeline_num_layers"),
        par.get("decoder_last_pipeline_num_layers"),
        layer_numbers={p: states[(0, p)].get("layer_numbers") for p in range(pp)},
    )
    vocab = _true_vocab_size(config, true_vocab_size, first.get("vocab_size"))
    unpad_vocab(state, vocab, source)
    data = {k: v for k, v in config.get("data", {}).items() if k in _TOKENIZER_FIELDS}
    iteration, consumed = int(first.get("iteration", 0)), first.get("consumed_samples", 0)
    valid = int(first.get("consumed_valid_samples", 0))
    full = FullModel(cfg, vocab, state, source, iteration, consumed, data, (tp, pp), valid)
    check_complete(full)
    return full


_TOKENIZER_FIELDS = ("tokenizer_type", "vocab_size", "vocab_file", "merge_file", "tokenizer_model")


def shard_state(
    full: FullModel, tp: int, pp: int, padded: int, first: int | None = None, last: int | None = None
) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """The per-rank state dicts, keyed (tp_rank, pp_rank), of a run at tp x pp with a `padded` vocabulary."""
    cfg, tied = full.model, not full.model.untie_embeddings_and_output_weights
    out: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    splits: dict[str, list[torch.Tensor]] = {}

    def shards_of(name: str) -> list[torch.Tensor]:
        if name not in splits:
            tensor = full.state[name]
            if name.endswith("word_embeddings.weight") or name == "output_layer.weight":
                tensor = pad_vocab(tensor, padded)
            splits[name] = split_tp(name, tensor, cfg, tp)
        return splits[name]

    for p in range(pp):
        numbers = stage_layer_numbers(cfg.num_layers, pp, p, first, last)
        is_first, is_last = p == 0, p == pp - 1
        names: list[tuple[str, str]] = []
        for name in full.state:
            match = _LAYER.match(name)
            if match:
                number = int(match.group(1)) + 1
                if number in numbers:
                    names.append((name, f"decoder.layers.{numbers.index(number)}.{match.group(2)}"))
            elif name.startswith("embedding.word_embeddings") and (is_first or (tied and is_last)):
                names.append((name, name))
            elif name.startswith("embedding.") and is_first:
                names.append((name, name))
            elif (name.startswith("decoder.final_layernorm") or name == "output_layer.weight") and is_last:
                names.append((name, name))
        for t in range(tp):
            out[(t, p)] = {ours: shards_of(name)[t] for name, ours in names}
    return out


def run_config(full: FullModel, tp: int, pp: int, divisible_by: int) -> dict[str, Any]:
    """The run configuration written into the checkpoint (what `--load` reads back as the saved run's)."""
    cfg = Config()
    cfg.model = full.model
    cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size = tp, pp
    cfg.data.make_vocab_size_divisible_by = divisible_by
    for key, value in full.data.items():
        setattr(cfg.data, key, value)
    cfg.world_size = tp * pp
    return cfg.to_dict()


def write_torch(full: FullModel, out: Path, tp: int, pp: int, divisible_by: int = 128) -> None:
    """`full` as a `--ckpt-format torch` checkpoint at tp x pp in the (empty, temporary) folder `out`."""
    padded = padded_vocab_size(full.vocab_size, divisible_by, tp)
    shards = shard_state(full, tp, pp, padded)
    layout = {"tp": tp, "pp": pp, "dp": 1}
    folder = iteration_dir(out, full.iteration)
    folder.mkdir(parents=True)
    (folder / "metadata.json").write_text(json.dumps({"layout": layout, "iteration": full.iteration}) + "\n")
    config = run_config(full, tp, pp, divisible_by)
    for (t, p), model in shards.items():
        shard = folder / model_parallel_name(t, p, pp)
        shard.mkdir()
        payload = {
            "model": {name: own_storage(tensor) for name, tensor in model.items()},
            "config": config,
            "layout": layout,
            "layer_numbers": list(stage_layer_numbers(full.model.num_layers, pp, p)),
            "iteration": full.iteration,
            "consumed_samples": full.consumed_samples,
            "consumed_valid_samples": full.consumed_valid_samples,
            "checkpoint_version": CHECKPOINT_VERSION,
            "vocab_size": full.vocab_size,
            "converted_from": full.source,
        }
        torch.save(payload, shard / "model_optim_rng.pt")
    (out / LATEST).write_text(f"{full.iteration}\n")


def detect_format(root: Path) -> str:
    """`torch` (per-rank files) or `torch_dist` (DCP: a .metadata file in the iteration folder)."""
    _, folder = find_iteration(root)
    return "torch_dist" if (folder / ".metadata").exists() else "torch"


def read_torch_dist(root: Path, true_vocab_size: int | None = None) -> FullModel:
    """A `--ckpt-format torch_dist` checkpoint as a FullModel: its weights are stored whole under global layer
    numbers (docs/checkpoints.md), so one process reads them with DCP whatever layout saved them; the optimizer's
    entries are not read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    iteration, folder = find_iteration(root)
    reader = SafeReader(str(folder))
    try:
        entries = reader.read_metadata().state_dict_metadata
    except Exception as exc:  # DCP raises what its unpickler or the file system raised
        raise ConvertError(
            f"{folder}: cannot read the torch_dist metadata ({type(exc).__name__}: {first_line(exc)})"
        ) from None
    if "train_state" not in entries:
        raise ConvertError(f"{folder} is not a torch_dist checkpoint of this project (no train_state)")
    state: dict[str, Any] = {
        name: torch.empty(meta.size, dtype=meta.properties.dtype)
        for name, meta in entries.items()
        if name.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    state["train_state"] = None
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in a single process: that is the intent
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(folder), no_dist=True)
    except (CheckpointException, Exception) as exc:  # DCP's failure report is a BaseException
        raise ConvertError(
            f"{folder}: the torch_dist checkpoint does not load ({type(exc).__name__}: {first_line(exc)})"
        ) from None
    train_state = state.pop("train_state")
    if isinstance(train_state, str):  # JSON since safe_load
        train_state = parse_json(train_state, f"{folder}'s train_state")
    config = train_state["config"]
    cfg = model_config(**config["model"])

    # Stacked matrices split separately over tensor-parallel ranks are stored with a leading parts axis (SwiGLU's
    # fc1 [gate; up] as [2, ffn, hidden], its bias [2, ffn]): one axis more than a weight (2) or a bias (1) has.
    def whole(name: str, t: torch.Tensor) -> torch.Tensor:
        return t.flatten(0, 1) if t.dim() == (3 if name.endswith("weight") else 2) else t

    weights = {name.removeprefix("model."): whole(name, t) for name, t in state.items()}
    source = f"checkpoint {root} (iteration {iteration})"
    vocab = _true_vocab_size(config, true_vocab_size, None)
    unpad_vocab(weights, vocab, source)
    data = {k: v for k, v in config.get("data", {}).items() if k in _TOKENIZER_FIELDS}
    par = config.get("parallel", {})
    layout = (par.get("tensor_model_parallel_size", 1), par.get("pipeline_model_parallel_size", 1))
    consumed, valid = int(train_state.get("consumed_samples", 0)), int(train_state.get("consumed_valid_samples", 0))
    iteration = int(train_state.get("iteration", iteration))
    full = FullModel(cfg, vocab, weights, source, iteration, consumed, data, layout, valid)
    check_complete(full)
    return full


READERS: dict[str, Callable[..., FullModel]] = {"torch": read_torch, "torch_dist": read_torch_dist}
WRITERS: dict[str, Callable[..., None]] = {"torch": write_torch}


def read_ours(root: str | Path, true_vocab_size: int | None = None) -> FullModel:
    """The newest checkpoint under `root`, whatever its format and layout, as a FullModel."""
    root = Path(root)
    return READERS[detect_format(root)](root, true_vocab_size)
