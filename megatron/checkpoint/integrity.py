"""Verified checkpoints: every file's size and CRC-32 recorded in `metadata.json` at save, checked at load, and the
newest checkpoint that verifies chosen when the one `latest` names is damaged.

    metadata.json  {"layout": ..., "iteration": N, "checksums": {"mp_rank_00/model_optim_rng.pt":
                                                                 {"size": 123, "crc32": "89abcdef"}, ...}}

Why CRC-32 (zlib): the threat is torn writes, bit rot and truncation, not an adversary, and it is the cheapest check
that catches them (measured on a 100 MB file: reading alone 0.02 s, CRC-32 0.06 s, SHA-256 0.11 s, BLAKE2b 0.25 s);
the recorded size catches truncation outright. Files are hashed in 8 MiB chunks, and the work is split over the
ranks (file i by rank i mod world size), so each file is read once per save and once per load whatever the scale.

`metadata.json` is not in its own list: it is rewritten, with the checksums, by the rank that publishes the checkpoint,
after every other file is complete. A checkpoint from before checksums (no "checksums" entry) loads unverified, and
the log says so.
"""

from __future__ import annotations

import json
import math
import os
import re
import zlib
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from megatron.untrusted import LimitExceeded, read_json

from . import faults
from .save_folder import TMP, remove, write_new

METADATA = "metadata.json"
CHUNK = 8 << 20
_ITER = re.compile(r"^iter_(\d{7})$")


class Unusable(Exception):
    """A checkpoint folder that cannot be loaded; its message is one line naming the file."""


def file_checksum(path: str | os.PathLike) -> str:
    """CRC-32 of a file's bytes, as 8 hex digits."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _files(directory: Path) -> list[str]:
    names = (p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
    return sorted(n for n in names if n != METADATA)


def _rank_and_size(group: Any) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _gather(value: Any, group: Any) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def gather_checksums(directory: Path, group: Any = None) -> dict[str, dict[str, Any]]:
    """Checksums of every file under `directory` (each rank hashes its share; all ranks call this, after every
    file is written)."""
    rank, size = _rank_and_size(group)
    mine = {
        n: {"size": (directory / n).stat().st_size, "crc32": file_checksum(directory / n)}
        for n in _files(directory)[rank::size]
    }
    merged: dict[str, dict[str, Any]] = {}
    for part in _gather(mine, group):
        merged.update(part)
    return merged


def local_checksums(directory: Path) -> dict[str, dict[str, Any]]:
    """Checksums of every file under `directory`, computed by this process alone (--async-save's publish)."""
    return {
        n: {"size": (directory / n).stat().st_size, "crc32": file_checksum(directory / n)} for n in _files(directory)
    }


def record_checksums(directory: Path, checksums: dict[str, dict[str, Any]]) -> None:
    """Add `checksums` to the folder's metadata.json (one rank, before the folder is published)."""
    path = directory / METADATA
    metadata = json.loads(path.read_text()) if path.exists() else {}
    metadata["checksums"] = checksums
    write_new(path, (json.dumps(metadata) + "\n").encode())


def _check_recorded(recorded: Any, meta_path: Path) -> None:
    """Unusable unless `recorded` maps relative file names inside the folder to {"size": int, "crc32": str}."""
    if not isinstance(recorded, dict):
        raise Unusable(f"{meta_path} is damaged: its checksums are not a mapping of file names")
    for name, want in recorded.items():
        inside = isinstance(name, str) and name and not name.startswith("/") and ".." not in name.split("/")
        if not inside or "\0" in name:
            raise Unusable(f"{meta_path} is damaged: its checksums name {str(name)[:60]!r}, not a file of the folder")
        if not (isinstance(want, dict) and type(want.get("size")) is int and isinstance(want.get("crc32"), str)):
            raise Unusable(f"{meta_path} is damaged: the checksum of {name[:60]} is not a size and a CRC-32")


def _problems(directory: Path, names: list[str], recorded: dict[str, dict[str, Any]]) -> list[str]:
    problems = []
    for name in names:
        path, want = directory / name, recorded[name]
        if not path.is_file():
            problems.append(f"{path} is missing")
            continue
        size = path.stat().st_size
        if size != want["size"]:
            problems.append(f"{path} is damaged: {size} bytes, {want['size']} were written")
        elif file_checksum(path) != want["crc32"]:
            problems.append(f"{path} is damaged: its CRC-32 differs from the one recorded at save")
    return problems


def verify_checkpoint(directory: Path, group: Any = None) -> bool:
    """Raise Unusable (one line naming the first bad file) unless every recorded file matches its checksum; return
    False for a checkpoint saved before checksums (nothing to check). Every rank calls this and gets the same
    answer (one all-gather)."""
    problem, legacy = None, False
    try:
        if not directory.is_dir():
            raise Unusable(f"{directory} is missing")
        meta_path = directory / METADATA
        if not meta_path.exists():
            legacy = True
            recorded: dict[str, dict[str, Any]] = {}
        else:
            try:
                metadata = read_json(meta_path)
            except (ValueError, LimitExceeded) as exc:  # not JSON, not UTF-8, nested or sized past the limits
                raise Unusable(f"{meta_path} is damaged: {str(exc).splitlines()[0]}") from None
            recorded = metadata.get("checksums") if isinstance(metadata, dict) else {}
            if recorded is None:
                legacy, recorded = True, {}
            _check_recorded(recorded, meta_path)
        rank, size = _rank_and_size(group)
        names = sorted(recorded)[rank::size]
        problems = _problems(directory, names, recorded)
        if problems:
            problem = problems[0]
    except Unusable as exc:
        problem = str(exc)
    except OSError as exc:
        problem = f"{directory} cannot be read: {exc}"
    verdicts = [p for p in _gather(problem, group) if p is not None]
    if verdicts:
        raise Unusable(verdicts[0])
    return not legacy


def iterations(root: str | os.PathLike) -> list[int]:
    """Iterations of the complete checkpoint folders under `root`, newest first."""
    root_path = Path(root)
    if not root_path.is_dir():
        return []
    found = (_ITER.match(p.name) for p in root_path.iterdir() if p.is_dir())
    return sorted((int(m.group(1)) for m in found if m), reverse=True)


class Retention(NamedTuple):
    """Which checkpoints a save keeps: the newest `last` (--save-retain-last) and every multiple of `interval`
    (--save-retain-interval); None for both keeps all."""

    last: int | None = None
    interval: int | None = None

    @property
    def deletes(self) -> bool:
        return self.last is not None or self.interval is not None


def retention(ckpt_cfg: Any) -> Retention:
    """The retention rule of a CheckpointConfig."""
    return Retention(ckpt_cfg.save_retain_last, ckpt_cfg.save_retain_interval)


def apply_retention(root: str | os.PathLike, rule: Retention, current: int, log: Any = print) -> None:
    """Delete the checkpoint folders up to `current` (the one `latest` names now, never deleted) that `rule` does
    not keep. Folders newer than `current` (left by a run that was resumed from an older checkpoint) are not this
    save's to judge and stay."""
    older = [i for i in iterations(root) if i <= current]
    kept = set(older[: rule.last]) if rule.last is not None else set()
    why = " and ".join(
        f"--save-retain-{name} {value}" for name, value in (("last", rule.last), ("interval", rule.interval)) if value
    )
    for iteration in older:
        if iteration == current or iteration in kept or (rule.interval and iteration % rule.interval == 0):
            continue
        faults.point("retain:delete")
        # renamed first, so that a kill while deleting leaves no half-deleted `iter_N` (a fall-back candidate) but
        # an `iter_N.tmp`, which the next save removes
        folder = Path(root) / f"iter_{iteration:07d}"
        doomed = folder.with_name(folder.name + TMP)
        remove(doomed)
        os.replace(folder, doomed)
        remove(doomed)
        log(f"  deleted checkpoint at iteration {iteration} ({why})")


def all_finite(tensors: list[torch.Tensor], group: Any = None) -> bool:
    """Whether every tensor is finite on every rank: one fused max-abs over the tensors (NaN propagates, inf stays
    inf), then one all-reduce."""
    tensors = [t.detach() for t in tensors if t is not None and t.numel() and t.is_floating_point()]
    device = tensors[0].device if tensors else torch.device("cpu")
    flag = torch.ones((), device=device)
    if tensors:
        by_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault((t.device, t.dtype), []).append(t)
        maxima = [m.float().to(device) for group_ in by_dtype.values() for m in torch._foreach_norm(group_, math.inf)]
        flag = torch.isfinite(torch.stack(maxima)).all().float()
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def checkpoint_is_finite(model: torch.nn.Module, optimizer: Any, group: Any = None) -> bool:
    """Whether the model's weights and the optimizer's fp32 state (main copies, moments) are finite on every rank
    of `group` (default: all). FP8 weights are skipped: their main copies are checked."""
    from megatron.fp8.params import is_fp8_param
    from megatron.parallel.fsdp.fsdp2 import local_shard

    tensors = [local_shard(p) for p in model.parameters() if not is_fp8_param(p)]  # FSDP: this rank's shard
    fp32 = optimizer.fp32_state()
    for key in ("masters", "exp_avg", "exp_avg_sq"):
        tensors += [t for t in fp32[key] if t is not None]
    return all_finite(tensors, group)
