"""Crash points of a save, enumerated (run by tests/e2e/test_crash_points.py; by hand:
`python tests/e2e/crash_points.py --workdir DIR`).

SQLite's and ALICE's method on a tiny model: a save runs once with every file-system call it makes recorded (file
creations and writes, torch.save, fsync, rename, unlink, rmdir, mkdir, links), then once per recorded call k in a
forked child that dies (os._exit, as kill -9 leaves the disk) just before call k. After each death a fresh child
loads the folder and must get the checkpoint `latest` names (the previous one before the pointer's rename, the new
one after: never an older one when a newer one survived), with the train state of one of the saves of that
iteration; then a later save and load must work and leave no `.tmp` or `.old` folder behind. The complete trace is
also checked for the flushes a power loss needs: every file and folder of a checkpoint flushed before the folder is
renamed, and the --save folder flushed after each rename in it before `latest` moves.

Scenarios, each in the torch format, torch_dist, and torch_dist with --async-save: a first save into a missing
folder; a next save that --save-retain-last deletes an older one after; a re-save of the iteration `latest` names.
Prints one JSON line: {"crash points": N, "failures": [...], "ops": {scenario: count}}.
"""

from __future__ import annotations

import argparse
import builtins
import io
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
torch.set_num_threads(1)  # before any op: no intra-op thread pool exists when children are forked

from megatron.checkpoint import select_checkpoint  # noqa: E402
from megatron.config import parse_args  # noqa: E402
from megatron.training import Trainer  # noqa: E402

TINY = (
    "--mock-data --vocab-size 32 --num-layers 1 --hidden-size 8 --num-attention-heads 2 --seq-length 8"
    " --micro-batch-size 1 --global-batch-size 1 --lr 1e-3 --train-iters 100 --eval-iters 0 --log-interval 100"
    " --save-retain-last 2"
)
LATEST = "latest_checkpointed_iteration.txt"
DIED = 77
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class Recorder:
    """Wraps the file-system calls of os, open and torch.save: records each (kind, path) and, when `die_at` is
    reached, ends the process before the call runs."""

    def __init__(self, die_at: int | None = None) -> None:
        self.ops: list[tuple[str, str, str]] = []
        self.die_at = die_at
        self.real: dict[tuple[Any, str], Callable] = {}

    def _op(self, kind: str, path: Any, other: Any = "") -> None:
        if self.die_at is not None and len(self.ops) == self.die_at:
            os._exit(DIED)
        self.ops.append((kind, os.fsdecode(path) if path is not None else "", os.fsdecode(other) if other else ""))

    def _wrap(self, owner: Any, name: str, record: Callable[..., tuple | None]) -> None:
        real = getattr(owner, name)
        self.real[(owner, name)] = real

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            op = record(*args, **kwargs)
            if op is not None:
                self._op(*op)
            return real(*args, **kwargs)

        setattr(owner, name, wrapper)

    def install(self) -> None:
        def at(path: Any, dir_fd: int | None = None) -> str:
            path = os.fsdecode(path) if not isinstance(path, int) else _fd_path(path)
            return os.path.join(_fd_path(dir_fd), path) if dir_fd is not None else path

        def os_open(path: Any, flags: int, *a: Any, dir_fd: int | None = None, **k: Any) -> tuple | None:
            return ("create", at(path, dir_fd)) if flags & _WRITE_FLAGS else None

        def py_open(file: Any, mode: str = "r", *a: Any, **k: Any) -> tuple | None:
            if isinstance(file, int) or not any(c in mode for c in "wax+"):
                return None
            return ("create", os.fsdecode(file))

        for owner, name in ((os, "rename"), (os, "replace")):
            self._wrap(owner, name, lambda src, dst, *a, n=name, **k: (n, at(src), at(dst)))
        for name in ("unlink", "remove", "rmdir"):
            self._wrap(os, name, lambda p, *a, n=name, dir_fd=None, **k: (n, at(p, dir_fd)))
        self._wrap(os, "mkdir", lambda p, *a, dir_fd=None, **k: ("mkdir", at(p, dir_fd)))
        for name in ("symlink", "link"):
            self._wrap(os, name, lambda src, dst, *a, n=name, **k: (n, at(dst), at(src)))
        self._wrap(os, "truncate", lambda p, *a, **k: ("truncate", at(p)))
        self._wrap(os, "fsync", lambda fd: ("fsync", _fd_path(fd if isinstance(fd, int) else fd.fileno())))
        self._wrap(os, "write", lambda fd, data: ("write", _fd_path(fd)))
        self._wrap(os, "open", os_open)
        self._wrap(builtins, "open", py_open)
        self._wrap(io, "open", py_open)
        self._wrap(torch, "save", lambda obj, f, *a, **k: ("torch.save", f) if not hasattr(f, "write") else None)

    def uninstall(self) -> None:
        for (owner, name), real in self.real.items():
            setattr(owner, name, real)


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"fd {fd}"


class Scenario:
    """A save of `iteration` into a copy of `base` (None: a missing folder) by the trainer of `fmt`."""

    def __init__(self, name: str, fmt: str, async_save: bool, base: Path | None, iteration: int, before: int | None):
        self.name, self.fmt, self.async_save, self.base = name, fmt, async_save, base
        self.iteration, self.before = iteration, before  # `before`: the iteration `latest` names in `base`


def save(trainer: Trainer, root: Path, iteration: int, samples: int, async_save: bool) -> None:
    """Save the trainer's state as `iteration` into `root`; `samples` (its consumed samples) tells the saves apart."""
    trainer.cfg.checkpoint.save = str(root)
    trainer.cfg.checkpoint.async_save = async_save
    trainer.state.iteration, trainer.state.consumed_samples = iteration, samples
    trainer.checkpoints.save()
    trainer.checkpointer.finalize()


def in_child(work: Callable[[], Any], log: Path) -> tuple[int, Any]:
    """Run `work` in a forked child; (exit code, its JSON-able result or the error text)."""
    out = log.with_suffix(".json")
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            result = work()
            out.write_text(json.dumps(result))
            code = 0
        except BaseException as exc:  # noqa: BLE001  (reported to the parent)
            out.write_text(json.dumps(f"{type(exc).__name__}: {exc}"))
        finally:
            sys.stdout.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return code, json.loads(out.read_text()) if out.exists() else None


def prepare(scenario: Scenario, root: Path) -> None:
    if root.exists():
        shutil.rmtree(root)
    if scenario.base is not None:
        shutil.copytree(scenario.base, root, symlinks=True)


def trace(trainer: Trainer, scenario: Scenario, work: Path) -> list[tuple[str, str, str]]:
    root = work / "trace"
    prepare(scenario, root)

    def recorded() -> list:
        recorder = Recorder()
        recorder.install()
        save(trainer, root, scenario.iteration, samples(scenario.iteration, 1), scenario.async_save)
        recorder.uninstall()
        return recorder.ops

    code, ops = in_child(recorded, work / "trace.log")
    assert code == 0, f"{scenario.name}: the recorded save failed: {ops}: {(work / 'trace.log').read_text()[-2000:]}"
    return [tuple(op) for op in ops]


def samples(iteration: int, version: int) -> int:
    return iteration * 100 + version


def crash(trainer: Trainer, scenario: Scenario, work: Path, k: int, pointer_op: int) -> str | None:
    """Die before call k, then check what the folder loads. None, or what went wrong."""
    root = work / f"crash{k}"
    prepare(scenario, root)

    def dying() -> None:
        Recorder(die_at=k).install()
        save(trainer, root, scenario.iteration, samples(scenario.iteration, 1), scenario.async_save)

    code, _ = in_child(dying, work / f"crash{k}.log")
    if code != DIED:
        return f"the save did not reach call {k} (exit {code}): {(work / f'crash{k}.log').read_text()[-600:]}"
    text = (root / LATEST).read_text().strip() if (root / LATEST).exists() else None
    named = int(text) if text else None
    expect = scenario.before if k <= pointer_op else scenario.iteration
    if named != expect:
        return f"`latest` names {named}, expected {expect} (the pointer's rename is call {pointer_op})"
    later = max(scenario.iteration, scenario.before or 0) + 2
    try:  # here, in the worker: each crash point's child is forked from it, with the state it sets itself
        loaded = trainer.checkpointer.load(str(root))
        first = None if loaded is None else [loaded["iteration"], loaded["consumed_samples"]]
        save(trainer, root, later, samples(later, 1), False)  # synchronous: no background thread here, for forks
        again = select_checkpoint(str(root))  # the later save verifies (the first load read a whole checkpoint)
    except Exception as exc:  # noqa: BLE001  (a failed load is what this reports)
        return f"the load or the later save after the crash failed: {type(exc).__name__}: {exc}"
    leftovers = sorted(p.name for p in root.iterdir() if re.search(r"\.(tmp|old)$", p.name))
    versions = {scenario.before: [samples(scenario.before, 0)] if scenario.before else []}
    versions[scenario.iteration] = versions.get(scenario.iteration, []) + [samples(scenario.iteration, 1)]
    if expect is None and first is not None:
        return f"a checkpoint loaded from a folder that `latest` never named: {first}"
    if expect is not None and (first is None or first[0] != expect):
        return f"loaded {first}, expected iteration {expect}"
    if expect is not None and first[1] not in versions[expect]:
        return f"loaded the train state {first}, none of iteration {expect}'s saves ({versions[expect]})"
    if again != later or leftovers:
        return f"the later save: {again} selected, {leftovers} left"
    return None


def flush_problems(ops: list[tuple[str, str, str]], root: Path) -> list[str]:
    """What a power loss could undo in this trace: a file or folder of a checkpoint not flushed before the folder's
    rename, or a folder's rename in --save not flushed before `latest` moves."""
    dirty: set[str] = set()  # files and folders written since their last flush
    renamed = False  # a checkpoint folder renamed in --save since its last flush
    problems = []
    top = str(root)
    for kind, path, other in ops:
        if kind in ("create", "torch.save", "write", "mkdir", "truncate"):
            dirty |= {path, os.path.dirname(path)}
        elif kind == "fsync":
            dirty.discard(path)
            renamed = renamed and path != top
        elif kind in ("unlink", "remove", "rmdir"):
            dirty.discard(path)
            dirty.add(os.path.dirname(path))
        elif kind in ("rename", "replace") and other.endswith("/" + LATEST):
            if renamed:
                problems.append(f"`latest` moved before the rename in {top} was flushed")
        elif kind in ("rename", "replace"):
            if os.path.dirname(path) == top and path.endswith(".tmp"):
                unflushed = sorted(d for d in dirty if d == path or d.startswith(path + "/"))
                if unflushed:
                    problems.append(f"{path} renamed with {unflushed[:3]} not flushed")
            renamed = renamed or os.path.dirname(other) == top
            moved = {d for d in dirty if d == path or d.startswith(path + "/")}
            dirty = (dirty - moved) | {other + d[len(path) :] for d in moved}
    return problems


def run_scenario(trainer: Trainer, scenario: Scenario, work: Path, jobs: int) -> tuple[int, list[str]]:
    work.mkdir(parents=True)
    ops = trace(trainer, scenario, work)
    pointer = [i for i, (kind, _, dst) in enumerate(ops) if kind == "replace" and dst.endswith("/" + LATEST)]
    failures = [f"{scenario.name}: {p}" for p in flush_problems(ops, work / "trace")]
    if len(pointer) != 1:
        return len(ops), failures + [f"{scenario.name}: {len(pointer)} renames onto `latest` in {ops}"]
    failures += run_crashes(trainer, scenario, work, ops, pointer[0], jobs)
    return len(ops), failures


def run_crashes(
    trainer: Trainer, scenario: Scenario, work: Path, ops: list[tuple[str, str, str]], pointer: int, jobs: int
) -> list[str]:
    """Every crash point of `ops`, shared out over `jobs` forked workers (each takes every jobs-th point)."""

    def worker(first: int) -> list[str]:
        fd = os.open(work / f"worker{first}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        found = []
        for k in range(first, len(ops), jobs):
            problem = crash(trainer, scenario, work, k, pointer)
            if problem:
                found.append(f"{scenario.name}, killed before call {k} {ops[k][:2]}: {problem}")
        return found

    failures = []
    pids = {}
    for first in range(jobs):
        out = work / f"worker{first}.json"
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                out.write_text(json.dumps(worker(first)))
                code = 0
            finally:
                os._exit(code)
        pids[pid] = out
    for pid, out in pids.items():
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0 or not out.exists():
            failures.append(f"{scenario.name}: a crash-point worker failed (exit {os.waitstatus_to_exitcode(status)})")
            continue
        failures += json.loads(out.read_text())
    return failures


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args(argv)
    work = Path(args.workdir)
    began = time.perf_counter()
    counts, failures = {}, []
    for fmt in ("torch", "torch_dist"):
        trainer = Trainer(parse_args(f"{TINY} --ckpt-format {fmt} --save {work / fmt / 'config'}".split()))
        bases = work / fmt / "bases"
        save(trainer, bases / "two", 2, samples(2, 0), False)
        save(trainer, bases / "two", 4, samples(4, 0), False)
        for async_save in (False, True) if fmt == "torch_dist" else (False,):
            mode = f"{fmt}{' --async-save' if async_save else ''}"
            for name, base, iteration, before in (
                ("first save", None, 2, None),
                ("next save, retention deletes iteration 2", bases / "two", 6, 4),
                ("re-save of iteration 4", bases / "two", 4, 4),
            ):
                scenario = Scenario(f"{mode}, {name}", fmt, async_save, base, iteration, before)
                tag = re.sub(r"\W+", "-", scenario.name)
                counts[scenario.name], found = run_scenario(trainer, scenario, work / "runs" / tag, args.jobs)
                failures += found
    result = {"crash points": sum(counts.values()), "failures": failures, "ops": counts}
    result["seconds"] = round(time.perf_counter() - began, 1)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
