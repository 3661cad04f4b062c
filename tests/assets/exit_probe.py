"""pretrain_gpt.py's main, then the names of the threads still running in this process (Linux: the kernel's
names, which C++ threads set too: gloo's `gloo_tcp_loop`, `pt_gloo_runloop`, NCCL's `pt_nccl_*`). The exit tests
(tests/e2e/test_exit.py) launch it like pretrain_gpt.py; it exits with main's return value."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pretrain_gpt


def thread_names() -> list[str]:
    tasks = Path("/proc/self/task")
    return sorted((task / "comm").read_text().strip() for task in tasks.iterdir()) if tasks.is_dir() else []


if __name__ == "__main__":
    code = pretrain_gpt.main(sys.argv[1:])
    # One write with its newline: the ranks share torchrun's pipe, and print's separate write of the newline let two
    # ranks' lines run together.
    sys.stdout.write(f"threads after main, rank {os.environ.get('RANK', '0')}: {thread_names()}\n")
    sys.stdout.flush()
    sys.exit(code)
