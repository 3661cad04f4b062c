"""Checkpoints in Megatron-LM's directory layout, written so that a crash never damages the previous one.

    SAVE_DIR/
      latest_checkpointed_iteration.txt      the iteration number of the newest complete checkpoint
      iter_0000010/
        metadata.json                        the parallel layout it was saved with (tp, pp, dp)
        mp_rank_00/model_optim_rng.pt        model, optimizer, scheduler, RNG, iteration, consumed samples, config
        mp_rank_01/...                       (tensor-parallel rank 1; mp_rank_TT_PPP with pipeline stages)
        mp_rank_00/optim_dp_rank_000.pt      with --use-distributed-optimizer: each data-parallel rank's optimizer
                                             shard (model_optim_rng.pt then holds no optimizer state)

Each tensor x pipeline shard is written by the first data-parallel replica that holds it.

Publication (docs/checkpoints.md says what each crash point leaves): a checkpoint is written into `iter_XXXXXXX.tmp`,
flushed to disk, renamed to `iter_XXXXXXX` (a re-save of an iteration first moves the old copy aside to
`iter_XXXXXXX.old`, which loads in its place until the new one is in), and only then is the `latest` pointer
replaced (written to a temporary file and renamed); the folder is flushed after each rename. The pointer's rename is
the commit: a crash at any point leaves the previous checkpoint and the pointer to it intact, and the next save
tidies what a killed one left (megatron/checkpoint/save_folder.py, which also keeps every write inside --save).

Verification (megatron/checkpoint/integrity.py): metadata.json records every file's size and CRC-32; loading checks
them and, when the checkpoint `latest` names is damaged, falls back to the newest older one that verifies (and says
so); with --verify-integrity it stops instead. After each successful save --save-retain-last N deletes all but
the newest N, --save-retain-interval K all but the multiples of K (with both: kept by either).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron.errors import UserError
from megatron.parallel.fsdp.fp8_gather_scales import shards_written
from megatron.untrusted import LimitExceeded, parse_json

from . import faults
from .integrity import (
    Retention,
    Unusable,
    apply_retention,
    gather_checksums,
    iterations,
    local_checksums,
    record_checksums,
    verify_checkpoint,
)
from .model_shape import mismatch_line
from .safe_load import first_line, load_own
from .save_folder import OLD, TMP, fsync_dir, fsync_tree, remove, tidy, write_atomically, write_new
from .te_state import TE_UNSAFE_PICKLE_ENV, UnsafeTePickle, te_pickles_allowed, verify_te_pickles

LATEST = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 1


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used for this run (missing, corrupt, or of another model shape)."""


def load_model_state(model: torch.nn.Module, state: dict[str, Any], root: str | os.PathLike) -> None:
    """`model.load_state_dict(state)`. Transformer Engine's pickled FP8 state is unpickled only once every pickle in
    `state` has been checked to hold nothing but that state (megatron/checkpoint/te_state.py)."""
    try:
        pickled = verify_te_pickles(state)
    except UnsafeTePickle as exc:
        raise CheckpointError(f"checkpoint {root} is not loaded: {exc}, not Transformer Engine's FP8 state") from exc
    try:
        with te_pickles_allowed(bool(pickled)):
            model.load_state_dict(state)
    except RuntimeError as exc:
        if TE_UNSAFE_PICKLE_ENV not in str(exc):
            raise
        raise CheckpointError(  # a pickle in a form the check does not read (TE 1.x's BytesIO)
            f"checkpoint {root} holds Transformer Engine FP8 state in a form TE loads only with"
            f" {TE_UNSAFE_PICKLE_ENV}=1 in the environment: set it if you trust the checkpoint"
        ) from exc
    shards_written(model)  # FSDP's FP8 all-gathers: scales agreed and shards cast again (fsdp/fp8_gather_scales.py)


def iteration_dir(root: str | os.PathLike, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def checkpoint_dir(root: str | os.PathLike, iteration: int) -> Path:
    """The folder that holds iteration `iteration`'s checkpoint: `iter_N`, or `iter_N.old` when a re-save of the
    iteration was killed between its two renames (the old copy moved aside, the new one not yet in place)."""
    final = iteration_dir(root, iteration)
    old = final.with_name(final.name + OLD)
    return old if not final.exists() and old.is_dir() and not old.is_symlink() else final


def model_parallel_name(tp_rank: int = 0, pp_rank: int = 0, pp_size: int = 1) -> str:
    """Megatron's per-rank folder name: mp_rank_TT (no pipeline) or mp_rank_TT_PPP."""
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def rng_state() -> dict[str, Any]:
    """Every generator's state as plain data (numpy's key array as a list, so the checkpoint holds no numpy
    object and loads weights-only)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (kind, keys.tolist(), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any], source: str = "the checkpoint") -> None:
    """Restore `rng_state()`'s generators (numpy's keys as a list, or as an array in checkpoints written before).
    CheckpointError, one line naming `source`, when the state is malformed."""
    try:
        random.setstate(tuple(state["python"]))
        np.random.set_state(tuple(state["numpy"]))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(
            f"{source}: its random-number generator state is malformed ({type(exc).__name__}: {first_line(exc)});"
            " restore the file, or add --no-load-rng"
        ) from None


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_first_rank() -> bool:
    """Rank 0 creates and renames the checkpoint folder and moves the `latest` pointer."""
    return not dist.is_initialized() or dist.get_rank() == 0


def save_checkpoint(
    root: str,
    iteration: int,
    state: dict[str, Any],
    writer: bool,
    shard: str = "mp_rank_00",
    layout: dict[str, int] | None = None,
    rank_files: dict[str, Any] | None = None,
    retain: Retention | int | None = None,
) -> Path:
    """Write `state` as iteration `iteration` under `root`. Only `writer` ranks write (one per model shard: the
    first data-parallel replica); every rank must call this, because of the barriers. `rank_files`: file name ->
    state that this rank writes into its shard's folder whether or not it is the writer (per-rank optimizer
    shards). `retain`: which older checkpoints stay (an int: --save-retain-last)."""
    layout = layout or {"tp": 1, "pp": 1, "dp": 1}
    root_path = Path(root)
    final = iteration_dir(root_path, iteration)
    tmp = final.with_name(final.name + TMP)
    try:
        if _is_first_rank():
            start_folder(root_path, tmp, {"layout": layout, "iteration": iteration})
        _barrier()
        if writer:
            (tmp / shard).mkdir(parents=True, exist_ok=True)
            payload = dict(state, iteration=iteration, checkpoint_version=CHECKPOINT_VERSION)
            faults.save(payload, tmp / shard / "model_optim_rng.pt")
        for name, rank_state in (rank_files or {}).items():
            (tmp / shard).mkdir(parents=True, exist_ok=True)
            faults.save(rank_state, tmp / shard / name)
        faults.point("save:written")
        _barrier()
        checksums = gather_checksums(tmp)
        if _is_first_rank():
            publish_checkpoint(root, tmp, final, iteration, checksums, retain)
    except (OSError, RuntimeError) as exc:  # a full disk, a lost mount (torch.save reports those as RuntimeError)
        if _is_first_rank():
            discard(tmp)
        raise save_failed(root, iteration, exc) from exc
    _barrier()
    return final


def start_folder(root: Path, tmp: Path, metadata: dict[str, Any]) -> None:
    """One rank, before a save's files are written: tidy `root` (what killed saves left) and create `tmp` with the
    checkpoint's metadata.json (its checksums are added once every file is written)."""
    root.mkdir(parents=True, exist_ok=True)
    tidy(root)
    remove(tmp)
    tmp.mkdir()
    write_new(tmp / "metadata.json", (json.dumps(metadata) + "\n").encode())


def discard(tmp: Path) -> None:
    """Remove a failed save's folder, as far as the file system lets (it is failing already)."""
    try:
        remove(tmp)
    except OSError:
        pass


def save_failed(root: str | os.PathLike, iteration: int, exc: BaseException) -> CheckpointError:
    """The one-line error of a save that could not be written."""
    cause: BaseException | None = exc
    while isinstance(cause, BaseException) and not isinstance(
        cause, OSError
    ):  # torch.save wraps the OSError of its file
        cause = cause.__context__
    if isinstance(cause, OSError) and cause.strerror:
        reason = cause.strerror
    else:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    previous = latest_iteration(str(root)) if (Path(root) / LATEST).exists() else None
    kept = f"the checkpoint at iteration {previous} is untouched" if previous is not None else "no checkpoint was kept"
    return CheckpointError(
        f"saving the checkpoint of iteration {iteration} to {root} failed ({reason}); {kept} and `latest` still names"
        " it: free space or fix the file system, then resume with --load"
    )


def publish_checkpoint(
    root: str | os.PathLike,
    tmp: Path,
    final: Path,
    iteration: int,
    checksums: dict[str, Any] | None = None,
    retention: Retention | int | None = None,
) -> None:
    """Make the complete checkpoint in `tmp` visible as `final` and point `latest` at it (one rank, after every
    rank's files are written). `checksums`: of `tmp`'s files, computed by all ranks together; None: computed here.
    `retention`: which older checkpoints stay (an int: --save-retain-last; None keeps every checkpoint)."""
    record_checksums(tmp, checksums if checksums is not None else local_checksums(tmp))
    faults.point("publish:checksummed")
    fsync_tree(tmp)
    old = final.with_name(final.name + OLD)
    if final.exists() or final.is_symlink():  # a re-save: the old copy moves aside (and loads in its place) until
        remove(old)  # the new one is in (checkpoint_dir), and is dropped after
        os.replace(final, old)
        fsync_dir(final.parent)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        remove(old)
    else:
        os.replace(tmp, final)
        fsync_dir(final.parent)
    faults.point("publish:renamed")
    write_atomically(Path(root) / LATEST, f"{iteration}\n")
    faults.point("publish:pointer")
    rule = Retention(last=retention) if isinstance(retention, int) else retention
    if rule is not None and rule.deletes:
        apply_retention(root, rule, iteration)


def latest_iteration(root: str) -> int | None:
    """The iteration the `latest` pointer names, or None when `root` holds no checkpoint."""
    pointer = Path(root) / LATEST
    if not pointer.exists():
        return None
    try:
        text = pointer.read_bytes()[:4096].decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{pointer} is corrupt or unreadable ({exc}): expected an iteration number") from None
    if not (text.isascii() and text.isdigit() and len(text) <= 12):
        raise CheckpointError(f"{pointer} is corrupt (holds {text[:40]!r}, expected an iteration number)")
    return int(text)


def read_metadata(folder: Path) -> dict[str, Any] | None:
    """A checkpoint folder's metadata.json (None when there is none); CheckpointError, one line, when it is not a
    JSON object with a well-formed layout."""
    path = folder / "metadata.json"
    if not path.exists():
        return None
    try:
        metadata = parse_json(path.read_bytes(), str(path))
    except (OSError, ValueError, LimitExceeded) as exc:
        raise CheckpointError(f"{path} is damaged (not JSON: {first_line(exc)}): restore the file") from None
    layout = metadata.get("layout") if isinstance(metadata, dict) else None
    if not isinstance(layout, dict) or not all(
        type(layout.get(k)) is int and layout[k] > 0 for k in ("tp", "pp", "dp")
    ):
        raise CheckpointError(f"{path} is damaged (no layout with positive tp, pp and dp): restore the file")
    if not isinstance(metadata.get("format", "torch"), str):
        raise CheckpointError(f"{path} is damaged (its format is not a name): restore the file")
    return metadata


def select_checkpoint(root: str, group: Any = None, strict: bool = False) -> int | None:
    """The iteration to load from `root`: the one `latest` names if it verifies, else the newest older one that
    does (logged); None when `root` holds no checkpoint. Raises CheckpointError (one line) when none verifies: a run
    never starts from scratch silently. `strict` (--verify-integrity): the one `latest` names must verify, and must
    have checksums to verify, or CheckpointError. Every rank of `group` calls this and gets the same answer."""
    latest = latest_iteration(root)
    if latest is None:
        return None
    first_problem = None
    for iteration in [latest] + [i for i in iterations(root) if i < latest]:
        try:
            verified = verify_checkpoint(checkpoint_dir(root, iteration), group)
        except Unusable as exc:
            if strict:
                raise CheckpointError(
                    f"--verify-integrity: the checkpoint at iteration {iteration} in {root} is refused: {exc};"
                    " restore the file, or drop --verify-integrity to fall back to an older checkpoint that verifies"
                ) from None
            _log(f"> checkpoint at iteration {iteration} fails verification: {exc}")
            first_problem = first_problem or str(exc)
            continue
        if iteration != latest:
            _log(
                f"> WARNING: falling back to the checkpoint at iteration {iteration} in {root}, the newest that"
                f" verifies (iteration {latest}, named by {LATEST}, is damaged)"
            )
        if not verified and strict:
            raise CheckpointError(
                f"--verify-integrity: the checkpoint at iteration {iteration} in {root} has no checksums (saved before"
                " they were recorded), so it cannot be verified; drop --verify-integrity to load it unverified"
            )
        if not verified:  # written before checksums (or by hand): read like any other, weights only (safe_load.py)
            _log(f"> checkpoint at iteration {iteration} in {root} predates checksums: loaded without verification")
        return iteration
    raise CheckpointError(
        f"no checkpoint in {root} verifies, so none can be resumed: {first_problem}; restore the files, or remove"
        " --load to start from scratch"
    )


def _log(message: str) -> None:
    if _is_first_rank():
        print(message, flush=True)


def load_checkpoint(
    root: str,
    shard: str = "mp_rank_00",
    layout: dict[str, int] | None = None,
    group: Any = None,
    iteration: int | None = None,
) -> dict[str, Any] | None:
    """The state of this rank's shard of the newest verified checkpoint under `root` (see `select_checkpoint`;
    `iteration`: one already selected), or None when there is none. A checkpoint saved with another tensor or
    pipeline parallel size is refused (the torch_dist format reshards); a different data-parallel size is fine
    (replicas are identical)."""
    if iteration is None:
        iteration = select_checkpoint(root, group)
    if iteration is None:
        return None
    folder = checkpoint_dir(root, iteration)
    metadata = read_metadata(folder)
    if metadata is not None and metadata.get("format", "torch") != "torch":
        raise CheckpointError(
            f"{folder} is a {metadata['format'][:40]} checkpoint: load it"
            " with --ckpt-format torch_dist or --auto-detect-ckpt-format"
        )
    if layout is not None and metadata is not None:
        saved = metadata["layout"]
        if (saved["tp"], saved["pp"]) != (layout["tp"], layout["pp"]):
            raise CheckpointError(
                f"checkpoint {root} (iteration {iteration}) was saved with tensor-parallel size {saved['tp']} and"
                f" pipeline-parallel size {saved['pp']}, this run uses {layout['tp']} and {layout['pp']}: relaunch"
                f" with --tensor-model-parallel-size {saved['tp']} --pipeline-model-parallel-size {saved['pp']}"
                " (--ckpt-format torch_dist checkpoints load under any layout)"
            )
    path = folder / shard / "model_optim_rng.pt"
    if not path.exists():
        raise CheckpointError(f"{path} is missing: the checkpoint was saved with another parallel layout or is damaged")
    state = load_own(path, str(path), CheckpointError)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} is not a checkpoint of this project (holds no dict): restore the file")
    return state


def load_rank_file(root: str, shard: str, name: str, iteration: int | None = None) -> Any:
    """A per-rank file (see `save_checkpoint`'s `rank_files`) of the checkpoint at `iteration` (default: the one
    `latest` names) under `root`."""
    if iteration is None:
        iteration = latest_iteration(root)
    path = checkpoint_dir(root, iteration if iteration is not None else 0) / shard / name
    if not path.exists():
        raise CheckpointError(
            f"{path} is missing: the checkpoint holds no distributed-optimizer shard for this rank (saved without"
            " --use-distributed-optimizer or with a smaller data-parallel size); relaunch with the saved run's"
            " settings, or add --no-load-optim to start the optimizer afresh from the saved weights"
        )
    state = load_own(path, str(path), CheckpointError)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} is not a rank file of this project (holds no dict): restore the file")
    return state


def check_train_state(state: dict[str, Any], source: str) -> dict[str, Any]:
    """The training position a checkpoint restores (what the trainer reads from it), checked: CheckpointError, one
    line naming `source`, unless the counters are non-negative integers."""
    for key in ("iteration", "consumed_samples", "consumed_valid_samples", "skipped_iters", "nan_iters"):
        value = state.get(key, 0)
        if type(value) is not int or value < 0:
            raise CheckpointError(f"{source} is malformed: its {key} is {str(value)[:40]!r}, not a count")
    if "consumed_samples" not in state or "iteration" not in state:
        raise CheckpointError(f"{source} is malformed: it holds no training position (iteration, consumed samples)")
    return state


def check_model_state(
    checkpoint: dict[str, torch.Tensor], model: dict[str, torch.Tensor], source: str, differ: list[str] | None = None
) -> None:
    """Raise CheckpointError listing every missing, unexpected and mis-shaped tensor, and `differ`: the shape flags
    that differ from the saved run's (model_shape.differing_flags)."""
    # Transformer Engine's `_extra_state` entries (pickled FP8 state whose size varies) exist only in TE models, and
    # GPTModel reconciles them on load; the weights must match key for key.
    checkpoint = {k: v for k, v in checkpoint.items() if not k.endswith("_extra_state")}
    model = {k: v for k, v in model.items() if not k.endswith("_extra_state")}
    problems = []
    missing = sorted(set(model) - set(checkpoint))
    unexpected = sorted(set(checkpoint) - set(model))
    if missing:
        problems.append(f"missing in checkpoint: {', '.join(missing)}")
    if unexpected:
        problems.append(f"not in model: {', '.join(unexpected)}")
    for key in sorted(set(model) & set(checkpoint)):
        if tuple(checkpoint[key].shape) != tuple(model[key].shape):
            problems.append(f"{key}: checkpoint {list(checkpoint[key].shape)} vs model {list(model[key].shape)}")
    if problems:
        raise CheckpointError(mismatch_line(source, differ or [], problems))
