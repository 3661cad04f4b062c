"""loss_parity.py's runs: one `pretrain_gpt.py` process per run, --parallel at a time, each branch after the trunk
it starts from; their records in the results JSON, merged across invocations and across a run's parts."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import benchmark
import parity_report as report
from parity_report import parse_run_name

ROOT = benchmark.ROOT
TRACKER = "latest_checkpointed_iteration.txt"  # a checkpoint folder's pointer to its newest complete iteration
MIN_START_S = 60  # --deadline: a run needs at least this long (start-up, a few steps, an evaluation)


def flag_values(flags: list[str]) -> dict[str, str]:
    """`--a 1 --b --c x y` -> {"--a": "1", "--b": "", "--c": "x y"}; the last occurrence of a flag wins."""
    values: dict[str, str] = {}
    key = None
    for token in flags:
        if token.startswith("--"):
            key = token
            values[key] = ""
        elif key is not None:
            values[key] = f"{values[key]} {token}".strip()
    return values


ENV_ASSIGNMENT = re.compile(r"[A-Z][A-Z0-9_]*=.*")  # NAME=VALUE: a word of a run's environment


def split_environment(flags: list[str]) -> tuple[list[str], list[str]]:
    """(the NAME=VALUE assignments they start with, the rest) of a run's flags, as a shell reads a command line:
    --config-flags may set a run's environment, e.g. Transformer Engine's NVTE_* switches, which have no flag."""
    count = next((i for i, token in enumerate(flags) if not ENV_ASSIGNMENT.fullmatch(token)), len(flags))
    return flags[:count], flags[count:]


def command(flags: list[str], nproc: int = 1) -> list[str]:
    """One run's launch: this Python, through torchrun on one host for `nproc` processes (GPUs), under `env` where
    the flags set environment variables."""
    env, flags = split_environment(flags)
    return [*(["env", *env] if env else []), *benchmark.launcher(nproc), str(ROOT / "pretrain_gpt.py"), *flags]


def run_one(
    name: str, flags: list[str], setup: dict, timeout: float, log_dir: Path, env_line: str, launch: list[str]
) -> dict:
    """Train one run (`flags`, then this invocation's `launch` flags) and return its record for the results JSON."""
    cmd = command(flags, setup.get("nproc_per_node", 1))
    run = parse_run_name(name)

    def echo(line: str) -> None:  # validations only: a long run stays readable
        if "validation loss at iteration" in line and "|" in line:
            print(f"  [{name}] {line.strip().split('|')[0].strip()}: {line.split('|')[1].strip()}", flush=True)

    print(f"{name}: {shlex.join(cmd)}", flush=True)
    start = time.time()
    text, code = benchmark.execute([*cmd, *launch], timeout, benchmark.run_env("1gpu"), echo)
    wall = time.time() - start
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / f"{safe_name(name)}.log").write_text(shlex.join([*cmd, *launch]) + "\n" + text)
    losses = report.parse_losses(text)
    error = None
    if code != 0:
        error = benchmark.failure_reason(text, code)
    elif not losses["train"]:
        error = "no iteration lines in the log"
    last = losses["train"][-1][0] if losses["train"] else 0
    return {
        "name": name,
        "config": run.config,
        "seed": int(flag_values(flags)["--seed"]),
        "tag": run.tag,
        "setup": setup,
        "command": cmd,
        "returncode": code,
        "error": error,
        **losses,
        "wall_s": round(wall, 1),
        "environment": env_line,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "partial": error is None and last < int(flag_values(flags).get("--train-iters", last)),
        "parts": [{"iterations": [losses["train"][0][0], last] if losses["train"] else [], "wall_s": round(wall, 1)}],
    }


def out_of_memory(error: str | None) -> bool:
    """Whether a run's failure (the line `failure_reason` keeps) is torch's exception for want of GPU memory."""
    return "OutOfMemoryError" in (error or "")


def link_trunk(trunk: Path, folder: Path) -> None:
    """A branch's checkpoint folder, before its first part: hard links to its trunk's files (copies where the two
    are on different file systems). The branch's own saves then go beside them and never write into the trunk's
    files: a save writes new files and renames them into place. A folder with a checkpoint already is left alone."""
    if (folder / TRACKER).is_file():
        return
    for path in sorted(trunk.rglob("*")):
        if path == trunk / TRACKER:
            continue
        target = folder / path.relative_to(trunk)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except OSError:  # another file system
            shutil.copy2(path, target)
    if (trunk / TRACKER).is_file():  # last: a folder holding its pointer holds everything it points to
        shutil.copy2(trunk / TRACKER, folder / TRACKER)


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def merge_parts(earlier: dict[str, Any] | None, record: dict[str, Any]) -> dict[str, Any]:
    """A resumed run's record: the losses of its earlier parts, then this part's (which win where both logged an
    iteration), and every part's iterations and wall time."""
    if not earlier or not earlier.get("partial") or record.get("error"):
        return record
    merged = dict(record)
    for key in ("train", "valid"):
        points = {int(it): loss for it, loss in earlier.get(key, [])} | {int(it): loss for it, loss in record[key]}
        merged[key] = [[it, points[it]] for it in sorted(points)]
    merged["parts"] = earlier.get("parts", []) + record["parts"]
    merged["wall_s"] = round(sum(part["wall_s"] for part in merged["parts"]), 1)
    return merged


def finished_with(record: dict[str, Any] | None, flags: list[str]) -> bool:
    """`record` is a finished run of exactly these pretrain_gpt.py flags and environment assignments (wherever the
    checkout was)."""
    if not record or record.get("error") or record.get("returncode") != 0 or record.get("partial"):
        return False
    cmd = record.get("command", [])
    script = next((i for i, part in enumerate(cmd) if part.endswith("pretrain_gpt.py")), None)
    env, flags = split_environment(flags)
    given = split_environment(cmd[1:])[0] if cmd[:1] == ["env"] else []  # `command`'s prefix
    return script is not None and cmd[script + 1 :] == flags and given == env


def load_results(path: Path) -> dict[str, Any]:
    if path.exists():
        results = json.loads(path.read_text())
        results.setdefault("runs", {})
        return results
    return {"runs": {}}


def save_results(results: dict[str, Any], path: Path) -> None:
    """Written to a temporary file and renamed into place: a run killed mid-write leaves the previous file whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(tmp, path)


def train_all(
    plan: list[tuple[str, list[str]]],
    setup: dict,
    args: argparse.Namespace,
    results: dict,
    env_line: str,
    needs: dict[str, str] | None = None,
    complete: dict[str, Callable[[], bool]] | None = None,
    setup_first: dict[str, Callable[[], None]] | None = None,
) -> tuple[list[str], list[str]]:
    """Train `plan` ([(name, flags)]) --parallel at a time, each run after the run `needs` names for it (a trunk it
    starts from, when that is planned); `complete` tells, for a run that does not train to --train-iters, whether
    it ended where it should; `setup_first` prepares a run's folder before it starts. Returns (failed, not started
    or unfinished)."""
    needs, complete, setup_first = needs or {}, complete or {}, setup_first or {}
    log_dir = args.log_dir or args.results.parent / "logs"
    deadline = time.monotonic() + args.deadline if args.deadline else math.inf
    ready = threading.Condition()
    queue, planned, done = list(plan), {name for name, _ in plan}, set()
    failed: list[str] = []
    not_started: list[str] = []
    unfinished: list[str] = []
    retried: set[str] = set()
    live = [max(1, args.parallel)]  # workers not yet ended (in a list: they share it)

    def startable(name: str) -> bool:
        return needs.get(name) not in planned or needs[name] in done

    def take() -> tuple[str, list[str], float] | None:
        with ready:
            while queue:
                left = deadline - time.monotonic()
                if left < MIN_START_S:  # it could not finish: starting it would replace a result by a failure
                    not_started.extend(name for name, _ in queue)
                    queue.clear()
                    break
                for item in [item for item in queue if needs.get(item[0]) in {*failed, *unfinished}]:
                    queue.remove(item)
                    failed.append(item[0])
                    print(f"{item[0]}: not trained: its trunk {needs[item[0]]} did not finish", flush=True)
                if item := next((item for item in queue if startable(item[0])), None):
                    queue.remove(item)
                    return (*item, left)
                ready.wait(timeout=5)  # a trunk is still training
            ready.notify_all()
            return None

    def worker() -> None:
        while taken := take():
            name, flags, left = taken
            launch = []
            if args.checkpoints and math.isfinite(left):  # stop and save in time, to resume in the next command
                launch = ["--exit-duration-in-mins", str(max(1, int((left - MIN_START_S) // 60)))]
            if name in setup_first:
                setup_first[name]()
            record = run_one(name, flags, setup, min(args.timeout, left), log_dir, env_line, launch)
            if name in complete and record["error"] is None:
                record["partial"] = not complete[name]()
            with ready:
                if out_of_memory(record["error"]) and name not in retried and live[0] > 1:
                    # The card holds fewer runs than --parallel: this worker ends and the run goes back in the
                    # queue, for a worker still running to take when its run ends.
                    retried.add(name)
                    queue.append((name, flags))
                    live[0] -= 1
                    print(f"{name}: out of GPU memory beside other runs; again later, {live[0]} at a time", flush=True)
                    ready.notify_all()
                    return
                record = merge_parts(results["runs"].get(name), record)
                results["runs"][name] = record
                save_results(results, args.results)  # after every run: a killed invocation keeps the finished
                if record["error"]:
                    failed.append(name)
                    print(f"{name}: failed ({record['wall_s']} s): {record['error']}", flush=True)
                elif record["partial"]:
                    unfinished.append(name)
                    print(f"{name}: stopped before its last step (resumed by the next invocation)", flush=True)
                else:
                    done.add(name)
                    print(f"{name}: done in {record['wall_s']} s, final validation {record['valid'][-1:]}", flush=True)
                ready.notify_all()
        with ready:
            live[0] -= 1

    threads = [threading.Thread(target=worker) for _ in range(max(1, args.parallel))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if not_started:
        print(f"--deadline: not started: {' '.join(not_started)}", flush=True)
    return failed, not_started + unfinished
