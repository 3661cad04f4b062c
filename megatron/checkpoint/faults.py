"""Fault points for the fault-injection tests (tests/e2e/test_checkpoint_faults.py); inert unless the environment
variable MEGATRON_FAULT is set, so a normal run only pays an environment look-up per save stage.

    MEGATRON_FAULT=<point>[@N]   kill -9 this process the N-th time (default 1st) it reaches `point`: save:written
                                 (this rank's files written), publish:checksummed (metadata complete, folder not yet
                                 renamed), publish:renamed (renamed, `latest` not yet moved), publish:pointer
                                 (`latest` moved), retain:delete (before deleting an old checkpoint)
    MEGATRON_FAULT=kill-bytes:K  kill -9 once K bytes of torch-format checkpoint files have been written
    MEGATRON_FAULT=enospc-bytes:K  fail that write with ENOSPC ("No space left on device") instead
"""

from __future__ import annotations

import errno
import os
import signal
from typing import Any

import torch

ENV = "MEGATRON_FAULT"
_reached: dict[str, int] = {}
_written = 0


def _spec() -> tuple[str, int] | None:
    value = os.environ.get(ENV)
    if not value:
        return None
    if "@" in value:
        name, _, count = value.partition("@")
        return name, int(count)
    if value.startswith(("kill-bytes:", "enospc-bytes:")):
        name, _, count = value.partition(":")
        return name, int(count)
    return value, 1


def point(name: str) -> None:
    """A stage of saving: dies here when MEGATRON_FAULT names it."""
    spec = _spec()
    if spec is None or spec[0] != name:
        return
    _reached[name] = _reached.get(name, 0) + 1
    if _reached[name] == spec[1]:
        os.kill(os.getpid(), signal.SIGKILL)


class FaultyFile:
    """A binary file that dies (or runs out of space) after the process has written `limit` bytes in all."""

    def __init__(self, path: Any, kind: str, limit: int) -> None:
        self.file, self.kind, self.limit = open(path, "wb"), kind, limit

    def write(self, data: Any) -> int:
        global _written
        view = memoryview(data).cast("B")
        room = self.limit - _written
        if len(view) >= room:
            self.file.write(view[: max(room, 0)])
            self.file.flush()
            _written = self.limit
            if self.kind == "kill-bytes":
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.file.name))
        _written += len(view)
        return self.file.write(view)

    def __getattr__(self, name: str) -> Any:  # tell, fileno, flush, close, ...: the real file's
        return getattr(self.file, name)

    def __enter__(self) -> FaultyFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.file.close()


def save(obj: Any, path: Any) -> None:
    """torch.save, through a faulty file when MEGATRON_FAULT asks for one."""
    spec = _spec()
    if spec is None or spec[0] not in ("kill-bytes", "enospc-bytes"):
        torch.save(obj, path)
        return
    f = FaultyFile(path, *spec)
    try:
        torch.save(obj, f)
    finally:
        f.close()
