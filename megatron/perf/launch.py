"""Launching benchmark runs: `pretrain_gpt.py` or a script in fresh processes (through torchrun on one host for
several GPUs), their output read back, and the one line that says why a run failed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from .rows import layout_of

ROOT = Path(__file__).resolve().parents[2]  # the checkout holding this package: pretrain_gpt.py, scripts/


def launcher(gpus: int) -> list[str]:
    """This Python, through torchrun on one host for several GPUs."""
    if gpus == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}"]


def run_env(layout: str) -> dict[str, str]:
    """The environment of a run: NVLink SHARP (multicast) off, as some hosts lend GPUs without it configured (NCCL
    then hangs at start-up; TE's userbuffers follow it); CUDA_DEVICE_MAX_CONNECTIONS=1 for --tp-comm-overlap, as
    Megatron-LM runs it."""
    env = {"NCCL_NVLS_ENABLE": "0", **os.environ, "PYTHONUNBUFFERED": "1"}
    if "--tp-comm-overlap" in layout_of(layout)[1]:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    return env


def failure_reason(text: str, returncode: int) -> str:
    """The one line that says why a run failed: our one-line error, else the exception line of a traceback."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("pretrain_gpt.py: error:"):
            return line.removeprefix("pretrain_gpt.py: error:").strip()
    for line in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception)\b", line):
            return line
    return f"exit code {returncode}: {lines[-1] if lines else 'no output'}"[:300]


def execute(
    cmd: list[str], timeout: float, env: dict[str, str], echo: Callable[[str], None] | None = None
) -> tuple[str, int]:
    """Run `cmd` in the repository root with stdout and stderr merged, and return (output, exit code); after `timeout`
    seconds the run is stopped and counts as exit code -1, keeping the output so far. `echo` is called with each line
    as it arrives (progress of long runs)."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", env=env, cwd=ROOT
    )
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if echo is not None:
                echo(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        # SIGTERM first: torchrun passes it on to its ranks, which a SIGKILL of torchrun alone would leave running
        # (holding the GPUs and the output pipe).
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    finally:  # also on Ctrl-C or any other error here: the run does not outlive the caller
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=30)  # a rank that ignored the signals may hold the pipe open; do not wait for it forever
    text = "".join(lines)
    if timed_out:
        return text + f"\ntimed out after {timeout} s", -1
    return text, proc.returncode


def relaunch(script: str, gpus: int, layout: str, argv: list[str] | None = None) -> int | None:
    """Run `script` again under torchrun with `gpus` ranks when started without it, and return its exit code; None
    where this process is already a rank (or one GPU is asked for): the caller goes on."""
    if gpus == 1 or "LOCAL_RANK" in os.environ:
        return None
    cmd = [*launcher(gpus), str(Path(script).resolve()), *(sys.argv[1:] if argv is None else argv)]
    return subprocess.run(cmd, env=run_env(layout), cwd=ROOT).returncode
