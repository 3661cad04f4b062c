"""Fault-injection driver for checkpoints (run by tests/e2e/test_checkpoint_faults.py; by hand:
`python tests/e2e/checkpoint_faults.py --trials 24 --seed 0`).

Each run is a forked child of this process (torch and the project are imported once; one intra-op thread, so the
fork is safe), so a trial costs a tiny model's training, not a Python start-up. Faults:
  kill -9   at a random time of a run (training or saving), at a named stage of a save (megatron/checkpoint/faults.py)
            or after a random number of checkpoint bytes: the restart must resume from the checkpoint `latest` named
            when the process died and then reproduce the uninterrupted run's losses exactly;
  damage    20 flipped bytes or a truncation in a random file of the newest checkpoint: the restart falls back to
            the previous checkpoint, names the file in one line, and reproduces the losses;
  ENOSPC    a disk that fills during a save: one-line error, `latest` unchanged, and the restart reproduces the losses.
Prints one JSON line of counts: faults injected, runs recovered, iterations lost beyond the last good save, silent
failures (a wrong loss, a wrong resume point, or a failure without its one line).

--jobs N keeps up to N trials' runs alive at once (each child trains on one thread; the test passes 2 on its two
cores). The faults are drawn in the order a serial pass draws them (the kill trials' before any run, the damage trials'
one trial after the other), so a seed injects the same faults at any --jobs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
torch.set_num_threads(1)  # before any op: no intra-op thread pool exists when children are forked

from megatron.checkpoint import faults  # noqa: E402
from megatron.config import parse_args  # noqa: E402
from megatron.errors import UserError  # noqa: E402
from megatron.training import Trainer  # noqa: E402

ITERS, INTERVAL = 8, 2
TINY = (
    "--mock-data --vocab-size 64 --num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 16"
    f" --micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --lr-warmup-iters 2 --log-interval 100 --eval-iters 0"
    f" --train-iters {ITERS}"
)
STAGES = ["save:written", "publish:checksummed", "publish:renamed", "publish:pointer", "retain:delete"]


Result = tuple[int, str, int | None, dict[int, float] | None]


@dataclass
class Run:
    """One training run of a trial, in a forked child: its log and result files are `name`.log / .json in `workdir`."""

    workdir: Path
    name: str
    flags: str
    fault: str | None = None
    kill_after: float | None = None
    dcp_enospc: int | None = None


# A trial: a generator that yields its runs one after the other and is sent each one's Result
Trial = Generator[Run, Result, None]


def run(
    workdir: Path,
    name: str,
    flags: str,
    fault: str | None = None,
    kill_after: float | None = None,
    dcp_enospc: int | None = None,
) -> Result:
    """Train in a forked child; returns its exit status (code, or -signal), its log, and unless it failed: the
    iteration it started from and its losses."""
    spec = Run(workdir, name, flags, fault, kill_after, dcp_enospc)
    _, status = os.waitpid(start(spec), 0)
    return collect(spec, status)


def start(spec: Run) -> int:
    """Fork the child that trains `spec`; returns its pid."""
    workdir, name, flags, fault = spec.workdir, spec.name, spec.flags, spec.fault
    kill_after, dcp_enospc = spec.kill_after, spec.dcp_enospc
    log, result = workdir / f"{name}.log", workdir / f"{name}.json"
    pid = os.fork()
    if pid == 0:  # the child never returns
        code = 3
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            if fault:
                os.environ[faults.ENV] = fault
            if dcp_enospc is not None:
                _fill_disk_in_dcp(dcp_enospc)
            if kill_after is not None:
                threading.Timer(kill_after, os.kill, (os.getpid(), signal.SIGKILL)).start()
            trainer = Trainer(parse_args(f"{TINY} {flags}".split()))
            start = trainer.state.iteration  # the checkpoint's iteration, 0 from scratch
            losses = trainer.train().losses
            result.write_text(json.dumps({"start": start, "losses": {str(k): v for k, v in losses.items()}}))
            code = 0
        except UserError as exc:
            print(f"error: {exc}")
            code = 2
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def collect(spec: Run, status: int) -> Result:
    """The Result of `spec`'s child, which ended with wait `status`."""
    log, result = spec.workdir / f"{spec.name}.log", spec.workdir / f"{spec.name}.json"
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        return code, log.read_text(), None, None
    saved = json.loads(result.read_text())
    return code, log.read_text(), saved["start"], {int(k): v for k, v in saved["losses"].items()}


def run_trials(trials: list[Trial], jobs: int) -> None:
    """Advance the trials with up to `jobs` runs alive at once, taking them in order: a trial's next run starts when
    its previous one ended (a trial's steps stay sequential; only separate trials overlap)."""
    waiting, alive = list(trials), {}

    def advance(trial: Trial, result: Result | None) -> None:
        try:
            spec = trial.send(result)  # None starts a fresh trial
        except StopIteration:
            return
        alive[start(spec)] = (trial, spec)

    while waiting or alive:
        while waiting and len(alive) < jobs:
            advance(waiting.pop(0), None)
        if alive:
            pid, status = os.wait()
            trial, spec = alive.pop(pid)
            advance(trial, collect(spec, status))


def _fill_disk_in_dcp(limit: int) -> None:
    """DCP writes its files through FileSystem.create_stream: make them fail with ENOSPC after `limit` bytes."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    real = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):  # noqa: ANN001
        if mode != "wb":
            with real(self, path, mode) as stream:
                yield stream
            return
        with faults.FaultyFile(path, "enospc-bytes", limit) as stream:
            yield stream

    FileSystem.create_stream = create_stream


def pointer(save: Path) -> int | None:
    path = save / "latest_checkpointed_iteration.txt"
    return int(path.read_text()) if path.exists() else None


class Tally:
    def __init__(self, reference: dict[int, float]) -> None:
        self.reference = reference
        self.counts = {"faults injected": 0, "runs recovered": 0, "iterations lost": 0, "silent failures": 0}
        self.failures: list[str] = []

    def resume(
        self, workdir: Path, save: Path, fmt: str, expect: int | None, what: str, note: str | None = None
    ) -> Trial:
        """Restart from `save`: it must load `expect` and reproduce the reference losses from there."""
        flags = f"--ckpt-format {fmt} --load {save} --save {save} --save-interval {INTERVAL} --save-retain-last 2"
        code, log, loaded, losses = yield Run(workdir, "resume", flags)
        self.counts["faults injected"] += 1
        if losses is None:
            self.counts["silent failures"] += 1
            self.failures.append(f"{what}: the restart failed (exit {code}): {log[-400:]}")
            return
        lost = (expect or 0) - loaded
        self.counts["iterations lost"] += max(lost, 0)
        problems = []
        if loaded != (expect or 0):
            problems.append(f"resumed from {loaded}, `latest` named {expect}")
        if any(losses[i] != self.reference[i] for i in losses) or set(losses) != set(range(loaded + 1, ITERS + 1)):
            problems.append("losses differ from the uninterrupted run's")
        if note is not None and sum(note in line for line in log.splitlines()) != 1:
            problems.append(f"no single log line names {note}")
        if problems:
            self.counts["silent failures"] += 1
            self.failures.append(f"{what}: {'; '.join(problems)}")
        else:
            self.counts["runs recovered"] += 1


def kill_trials(tally: Tally, base: Path, rng: random.Random, trials: int, duration: float, nbytes: int) -> list[Trial]:
    """The kill trials, each drawn here (before any of them runs)."""
    drawn = []
    for trial in range(trials):
        fmt = "torch" if trial % 3 else "torch_dist"
        kind = rng.choice(["time", "stage", "bytes"] if fmt == "torch" else ["time", "stage"])
        fault, kill_after = None, None
        if kind == "time":
            kill_after = rng.uniform(0.0, duration)
        elif kind == "stage":
            fault = f"{rng.choice(STAGES)}@{rng.randint(1, ITERS // INTERVAL - 1)}"
        else:
            fault = f"kill-bytes:{rng.randint(1, nbytes)}"
        drawn.append(_kill_trial(tally, base / f"kill{trial}", trial, fmt, fault, kill_after))
    return drawn


def _kill_trial(
    tally: Tally, workdir: Path, trial: int, fmt: str, fault: str | None, kill_after: float | None
) -> Trial:
    save = workdir / "ckpt"
    workdir.mkdir()
    flags = f"--ckpt-format {fmt} --save {save} --save-interval {INTERVAL} --save-retain-last 2"
    code, log, _, _ = yield Run(workdir, "faulty", flags, fault, kill_after)
    what = f"kill trial {trial} ({fmt}, {fault or f'after {kill_after:.2f} s'})"
    if code != -signal.SIGKILL:  # finished before the fault point: nothing was injected
        if code != 0:
            tally.counts["silent failures"] += 1
            tally.failures.append(f"{what}: exit {code} without a fault: {log[-400:]}")
        return
    yield from tally.resume(workdir, save, fmt, pointer(save), what)


def damage_trials(tally: Tally, base: Path, rng: random.Random) -> Trial:
    """Flipped bytes, a truncation (each format) and a full disk (each format): the previous checkpoint serves. One
    trial after the other: each draws from `rng` after its first run, in this order."""
    for fmt in ("torch", "torch_dist"):
        for damage in ("flip", "truncate", "enospc"):
            workdir = base / f"{damage}-{fmt}"
            save = workdir / "ckpt"
            workdir.mkdir()
            flags = f"--ckpt-format {fmt} --save {save} --save-interval {INTERVAL}"
            what = f"{damage} ({fmt})"
            if damage == "enospc":
                yield Run(workdir, "first", f"{flags} --exit-interval 4")
                limit = rng.randint(1, 2000)
                fault = f"enospc-bytes:{limit}" if fmt == "torch" else None
                code, log, _, _ = yield Run(
                    workdir, "full", f"{flags} --load {save}", fault, dcp_enospc=None if fault else limit
                )
                lines = [x for x in log.splitlines() if "No space left on device" in x]
                if code != 2 or len(lines) != 1 or "Traceback" in log or pointer(save) != 4:
                    tally.counts["silent failures"] += 1
                    tally.failures.append(f"{what}: exit {code}, latest {pointer(save)}: {log[-600:]}")
                yield from tally.resume(workdir, save, fmt, 4, what)
                continue
            yield Run(workdir, "first", f"{flags} --exit-interval 6")
            files = sorted(p for p in (save / "iter_0000006").rglob("*") if p.is_file() and p.name != "metadata.json")
            victim = rng.choice(files)
            data = bytearray(victim.read_bytes())
            if damage == "flip":
                for offset in rng.sample(range(len(data)), min(20, len(data))):
                    data[offset] ^= 0xFF
            else:
                data = data[: rng.randrange(len(data))]
            victim.write_bytes(bytes(data))
            yield from tally.resume(workdir, save, fmt, 4, f"{what} of {victim.name}", note=str(victim))


def main(argv: list[str] | None = None) -> dict[str, int]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--jobs", type=int, default=1, help="trials' runs alive at once (each on one thread)")
    args = parser.parse_args(argv)
    base, rng = Path(args.workdir), random.Random(args.seed)
    ref_dir = base / "reference"
    ref_dir.mkdir(parents=True)
    began = time.perf_counter()
    # torch format: its files' bytes are what the kill-bytes trials count. Alone: the timed kills are drawn within
    # its duration, which a run sharing the cores with another one (one each) takes too.
    flags = f"--ckpt-format torch --save {ref_dir / 'ckpt'} --save-interval {INTERVAL}"
    code, log, _, reference = run(ref_dir, "reference", flags)
    duration = time.perf_counter() - began
    assert reference is not None, log
    nbytes = (ITERS // INTERVAL) * sum(p.stat().st_size for p in (ref_dir / "ckpt" / f"iter_{ITERS:07d}").rglob("*.pt"))
    tally = Tally(reference)
    kills = kill_trials(tally, base, rng, args.trials, duration, nbytes)
    # The damage trials' chain first: it runs beside the kill trials from the start, not alone at the end
    run_trials([damage_trials(tally, base, rng), *kills], args.jobs)
    for failure in tally.failures:
        print(f"FAILURE {failure}")
    print(json.dumps(tally.counts), flush=True)
    return tally.counts


if __name__ == "__main__":
    main()
