"""A Megatron-LM run's whole training state, read for resuming it here (`pretrain_gpt.py --load MLM_DIR`).

`read_resume` gathers, from either format (torch_dist of both generations, or torch), in this project's names and
whole (layout-independent) tensors: the weights; Adam's fp32 main params and moments (mlm_optim.py: the distributed
optimizer's `dp_reshardable` and fully reshardable torch_dist layouts, the torch format's distrib_optim.pt, a
non-distributed optimizer's torch_dist state); Adam's step; the iteration, consumed samples and learning-rate
schedule (args and opt_param_scheduler); the fp16 loss scale; each (pipeline, tensor) rank's random-number
generators. What it cannot map stops with one line naming it and the flag that does without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron.config import ModelConfig
from megatron.config.optimizer import SCHEDULE_FIELDS
from megatron.config.pipeline_split import stage_layer_numbers

from .files import load_torch_file
from .mlm import _arg, read_mlm_folder, to_ours
from .mlm_dist import MegatronDist, is_megatron_dist, unstack
from .mlm_optim import (
    NO_OPTIM,
    STATE_KEYS,
    coalesced_buckets,
    dp_reshardable_keys,
    optimizer_step,
    rank_layout,
    split_buckets,
)
from .ours import find_iteration, merge_layout
from .state import ConvertError


@dataclass
class Resume:
    folder: Path
    iteration: int
    args: Any
    model: ModelConfig
    layout: tuple[int, int]
    """(tp, pp) it was saved with."""
    weights: dict[str, torch.Tensor]
    """This project's names, whole tensors (vocabulary rows as padded by Megatron-LM)."""
    optimizer: dict[str, dict[str, torch.Tensor]] | None = None
    """{"main" | "exp_avg" | "exp_avg_sq": {name: whole fp32 tensor}}; None: not read."""
    optimizer_format: str = ""
    step: int | None = None
    consumed_samples: int = 0
    consumed_valid_samples: int = 0
    schedule: dict[str, Any] = field(default_factory=dict)
    loss_scale: dict[str, Any] = field(default_factory=dict)
    rng: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    """(pp rank, tp rank) -> this project's rng_state() form."""
    notes: list[str] = field(default_factory=list)


def is_megatron_lm(root: str | Path) -> bool:
    """Whether `root`'s newest checkpoint is Megatron-LM's (either format) rather than this project's."""
    root = Path(root)
    try:
        _, folder = find_iteration(root)
    except ConvertError:
        return False
    if is_megatron_dist(folder):
        return True
    if (folder / "metadata.json").exists() or (folder / ".metadata").exists():
        return False  # this project's: its metadata.json names a format and layout
    files = sorted(folder.glob("mp_rank_*/model_optim_rng.pt"))
    if not files:
        return False
    state = load_torch_file(files[0], foreign=True)
    return "args" in state and "config" not in state


def _schedule(args: Any, scheduler: Any) -> dict[str, Any]:
    """This project's learning-rate schedule settings (SCHEDULE_FIELDS) of a Megatron-LM run, as its args give
    them, finalized as Megatron-LM does (--lr-decay-iters defaults to --train-iters)."""
    out = {name: getattr(args, name) for name in SCHEDULE_FIELDS if hasattr(args, name)}
    if isinstance(scheduler, dict) and scheduler.get("max_lr") is not None:
        out["lr"] = scheduler["max_lr"]
        out["min_lr"] = scheduler.get("min_lr", out.get("min_lr"))
    if out.get("lr_decay_samples") is None and out.get("lr_decay_iters") is None and _arg(args, "train_iters"):
        out["lr_decay_iters"] = args.train_iters
    return {k: v for k, v in out.items() if v is None or type(v) in (int, float, str)}


def _rng(saved: Any) -> dict[str, Any] | None:
    """Megatron-LM's rng_state (a list, one per data-parallel rank when --data-parallel-random-init; the first is
    what every rank restores otherwise) in this project's form."""
    state = saved[0] if isinstance(saved, list) and saved else saved
    if not isinstance(state, dict) or "torch_rng_state" not in state:
        return None
    out = {"python": state["random_rng_state"], "numpy": state["np_rng_state"], "torch": state["torch_rng_state"]}
    if state.get("cuda_rng_state") is not None:
        out["cuda"] = state["cuda_rng_state"]
    return out


def _stages(args: Any, cfg: ModelConfig) -> list[int]:
    pp = _arg(args, "pipeline_model_parallel_size", 1)
    first, last = _arg(args, "decoder_first_pipeline_num_layers"), _arg(args, "decoder_last_pipeline_num_layers")
    return [len(stage_layer_numbers(cfg.num_layers, pp, p, first, last)) for p in range(pp)]


def _merge(
    res: Resume, shards: dict[tuple[int, int], dict[str, dict[str, torch.Tensor]]]
) -> dict[str, dict[str, torch.Tensor]]:
    """Per-rank {kind: {stage-local Megatron-Core name: tensor}} -> {kind: {our name: whole tensor}}."""
    tp, pp = res.layout
    args = res.args
    first, last = _arg(args, "decoder_first_pipeline_num_layers"), _arg(args, "decoder_last_pipeline_num_layers")
    out = {}
    for kind in ("main", "exp_avg", "exp_avg_sq"):
        per_rank = {key: states.get(kind, {}) for key, states in shards.items()}
        out[kind] = to_ours(merge_layout(per_rank, res.model, tp, pp, first, last), res.model)
    return out


def _layout(res: Resume, pp_rank: int) -> Any:
    """The gradient-buffer layout of a rank of pipeline stage `pp_rank` (mlm_optim.rank_layout)."""
    local_spec = any(".input_layernorm." in k for k in res.weights) or _arg(res.args, "transformer_impl") == "local"
    layers = _stages(res.args, res.model)[pp_rank]
    return rank_layout(res.args, res.model, res.layout[0], pp_rank, layers, local_spec)


def _bucketed(
    res: Resume, buffers: dict[tuple[int, int], dict[int, dict[int, dict[str, torch.Tensor]]]], where: str
) -> dict[str, dict[str, torch.Tensor]]:
    """The distributed optimizer's flat states {(tp, pp rank): {buffer: {bucket: {state: flat}}}} by name."""
    shards = {}
    for (t, p), per_buffer in buffers.items():
        if set(per_buffer) != {0}:
            raise ConvertError(
                f"{where}: the distributed optimizer holds {len(per_buffer)} gradient buffers per rank (FP8 or"
                f" mixed-dtype parameters), which this reader does not lay out: {NO_OPTIM}"
            )
        shards[(t, p)] = split_buckets(_layout(res, p), per_buffer[0], f"{where} (tensor rank {t}, pipeline stage {p})")
    return _merge(res, shards)


def _read_dist_optimizer(res: Resume, ckpt: MegatronDist) -> None:
    keys = ckpt.tensor_keys()
    model_space = {k for k in keys if k.startswith("optimizer.state.")}
    buckets = dp_reshardable_keys(keys)
    common = ckpt.common()
    if model_space:
        state = {}
        for name, kind in STATE_KEYS.items():
            prefix = f"optimizer.state.{name}."
            tensors = ckpt.tensors([k for k in model_space if k.startswith(prefix)])
            if tensors:
                whole = unstack({k[len(prefix) :]: v for k, v in tensors.items()})
                state[kind] = to_ours(whole, res.model)
        res.optimizer, res.optimizer_format = state, "model-space (fully reshardable, or a non-distributed optimizer)"
        optimizer = common.get("optimizer")
    elif buckets:
        tp = res.layout[0]
        flat: dict[tuple[int, int], dict[int, dict[int, dict[str, torch.Tensor]]]] = {}
        for g, entries in buckets.items():
            rank = flat.setdefault((g % tp, g // tp), {})
            for (b, k), names in entries.items():
                rank.setdefault(b, {})[k] = ckpt.tensors(list(names.values()))
                rank[b][k] = {key.rsplit(".", 1)[1]: v for key, v in rank[b][k].items()}
        res.optimizer = _bucketed(res, flat, str(ckpt.folder))
        res.optimizer_format = "distributed optimizer, dp_reshardable"
        optimizer = {}
        for name in ("optimizer", "grad_scaler"):  # the first group's (the same in every group)
            found = ckpt.object_keys(f"optimizer.distributed.dp_group_idx_0.{name}")
            if found:
                optimizer[name] = ckpt.objects(found[:1])[found[0]]
    else:
        other = [k for k in ckpt.index if k.startswith("optimizer")] or (["optimizer"] if "optimizer" in common else [])
        if other:  # saved, but in a layout not read here: never resumed silently with a fresh optimizer
            raise ConvertError(
                f"{ckpt.folder}: its optimizer state ({other[0][:80]}, ...) is in a layout not read here: {NO_OPTIM}"
            )
        return
    res.step = optimizer_step(optimizer)
    if isinstance(optimizer, dict) and isinstance(optimizer.get("grad_scaler"), dict):
        res.loss_scale = optimizer["grad_scaler"]


def _read_dist(res: Resume) -> tuple[dict[str, Any], Callable[[], None]]:
    ckpt = MegatronDist(res.folder)
    common = ckpt.common()
    for key in ckpt.object_keys("rng_state"):
        offsets = key.rsplit("/shard_", 1)[1].split("_")[0].split(".")
        rng = _rng(ckpt.objects([key])[key])
        if rng is not None and len(offsets) == 2:
            res.rng[(int(offsets[0]), int(offsets[1]))] = rng
    return common, lambda: _read_dist_optimizer(res, ckpt)


def _read_legacy(res: Resume) -> tuple[dict[str, Any], Callable[[], None]]:
    tp, pp = res.layout
    folder = res.folder
    states = {}
    for p in range(pp):
        for t in range(tp):
            shard = folder / (f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}")
            states[(t, p)] = (shard, load_torch_file(shard / "model_optim_rng.pt", foreign=True))
    for (t, p), (_, state) in states.items():
        rng = _rng(state.get("rng_state"))
        if rng is not None:
            res.rng[(p, t)] = rng

    def optimizer() -> None:
        shard, first = states[(0, 0)]
        if "optimizer" not in first:
            return
        if not (shard / "distrib_optim.pt").exists():
            raise ConvertError(
                f"{folder}: the optimizer state of a Megatron-LM run without --use-distributed-optimizer (torch"
                f" format) is not read here: {NO_OPTIM}"
            )
        buffers = {}
        for (t, p), (path, _) in states.items():
            saved = load_torch_file(path / "distrib_optim.pt", foreign=True)
            layout = _layout(res, p)
            per_buffer = {}
            for b, by_dtype in ((k, v) for k, v in saved.items() if isinstance(k, int)):
                flat = next(iter(by_dtype.values()))
                per_buffer[b] = coalesced_buckets(layout, flat)
            buffers[(t, p)] = per_buffer
        res.optimizer = _bucketed(res, buffers, str(folder))
        res.optimizer_format = "distributed optimizer, torch format (distrib_optim.pt)"
        res.step = optimizer_step(first["optimizer"])
        if isinstance(first["optimizer"].get("grad_scaler"), dict):
            res.loss_scale = first["optimizer"]["grad_scaler"]

    return states[(0, 0)][1], optimizer


def _check_main_params(res: Resume) -> None:
    """The fp32 main params are the weights before their rounding to the weights' dtype: a state laid out on other
    parameters than the reader placed it (a bucket layout not rebuilt right) differs grossly, and stops here."""
    if res.optimizer is None:
        return
    for kind in ("main", "exp_avg", "exp_avg_sq"):  # Adam's (another optimizer, e.g. SGD, has other states)
        missing = sorted(set(res.weights) - set(res.optimizer.get(kind, {})))
        if missing:
            what = f"{kind} of {', '.join(missing[:2])}" + (f" and {len(missing) - 2} more" if len(missing) > 2 else "")
            optimizer = _arg(res.args, "optimizer", "adam")
            raise ConvertError(f"{res.folder}: its optimizer state ({optimizer}) lacks Adam's {what}: {NO_OPTIM}")
    mains = res.optimizer["main"]
    for name, main in mains.items():
        weight = res.weights[name].float()
        if main.shape != weight.shape or (main - weight).norm() > 1e-2 * weight.norm() + 1e-6:
            raise ConvertError(
                f"{res.folder}: the optimizer's main params of {name} are not its weights, so its optimizer layout"
                f" ({res.optimizer_format}) is not read right here: {NO_OPTIM}"
            )


def read_resume(root: str | Path, load_optim: bool = True) -> Resume:
    """The newest Megatron-LM checkpoint under `root` as a Resume (the optimizer state only with `load_optim`)."""
    root = Path(root)
    iteration, folder = find_iteration(root, "Megatron-LM checkpoint")
    args, cfg, weights, layout = read_mlm_folder(folder)
    res = Resume(folder, 0 if iteration == "release" else int(iteration), args, cfg, layout, weights)
    dist = (folder / ".metadata").exists() or is_megatron_dist(folder)
    common, read_optimizer = _read_dist(res) if dist else _read_legacy(res)
    if isinstance(common.get("iteration"), int) and iteration != "release":
        res.iteration = common["iteration"]
    scheduler = common.get("opt_param_scheduler")
    res.consumed_samples = int(_arg(args, "consumed_train_samples", 0) or 0)
    res.consumed_valid_samples = int(_arg(args, "consumed_valid_samples", 0) or 0)
    if not res.consumed_samples and isinstance(scheduler, dict) and scheduler.get("num_steps"):
        res.consumed_samples = int(scheduler["num_steps"])  # Megatron-LM's scheduler counts samples
    res.schedule = _schedule(args, scheduler)
    if load_optim and iteration != "release":
        read_optimizer()
        _check_main_params(res)
    if _arg(args, "fp8"):
        res.notes.append(
            "Megatron-LM's FP8 scaling state (Transformer Engine's _extra_state) is not carried over: the amax"
            " histories start afresh"
        )
    return res
