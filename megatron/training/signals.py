"""--exit-signal-handler: a signal (Slurm's preemption or time-limit warning) asks the run to stop cleanly.

The handler does nothing but record the signal: Python runs it between bytecodes of the main thread, possibly in the
middle of a step, a collective or a checkpoint write, where nothing else is safe. The training loop reads the record
after each step (megatron/training/runtime.py), agrees with the other ranks and stops; the handler stays installed
until training is over, so further signals (a second `scancel --signal`, torchrun forwarding one more) during the
final save are recorded again and change nothing.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType


class ExitSignal:
    """Records `name` (e.g. "SIGTERM") from now until `release()`."""

    def __init__(self, name: str):
        self.name = name
        self.signum = signal.Signals[name]
        self.count = 0
        """How many times the signal arrived."""
        if threading.current_thread() is not threading.main_thread():
            # Python delivers signals to the main thread only, and only it may install a handler.
            raise RuntimeError(f"--exit-signal-handler: the trainer must run in the main thread to handle {name}")
        self._previous = signal.signal(self.signum, self._record)
        self._installed = True

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1

    @property
    def received(self) -> bool:
        return self.count > 0

    def release(self) -> None:
        """Give the signal its previous handler back (the process may go on: tests, notebooks)."""
        if self._installed:
            # None: the previous handler was not installed from Python; the default is the closest to it
            signal.signal(self.signum, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False
