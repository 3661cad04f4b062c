"""Named timers for the phases of a training step (--timing-log-level, --timing-log-option), Megatron-LM's levels:

    0  only the iteration time of the progress line: no timer here runs, so timing adds no synchronization
    1  phases run about once per step: forward-backward, gradient all-reduces, optimizer
    2  phases run once per micro-batch: forward-compute, backward-compute

A timer above the chosen level is a shared no-op object, so a call costs a dictionary lookup. On a GPU a running
timer synchronizes the device at start and stop (it measures the GPU's work, not the host's launch time); that is
why the levels exist. At each log interval the elapsed times are gathered from every rank (one all-gather) and
printed below the progress line as "(min, max) time across ranks (ms)", averaged per iteration.

While the profiler's window is open (megatron/training/profiling.py), every phase, timed or not, is also an
annotated range of the trace: the `annotate` hook.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

OPTIONS = ("max", "minmax", "all")
STEP_TIMERS = {
    "forward-backward": 1,
    "all-grads-sync": 1,
    "optimizer": 1,
    "forward-compute": 2,
    "backward-compute": 2,
}
"""The timers a training step starts, with their levels and Megatron-LM's names. all-grads-sync is every gradient
reduction between the backward pass and the optimizer (tied embedding, data parallel, sequence-parallel norms);
forward-compute and backward-compute are timed without pipeline parallelism (the schedule interleaves them)."""


class Annotator(Protocol):
    """Opens and closes named ranges in a profiler trace (NVTX, torch.profiler)."""

    def push(self, name: str) -> None: ...

    def pop(self) -> None: ...


class _NullTimer:
    """Timers above the log level (and outside a profiling window)."""

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


_NULL = _NullTimer()


class _Range:
    """An untimed phase inside the profiling window: only its trace range."""

    def __init__(self, name: str, annotator: Annotator):
        self.name, self.annotator = name, annotator

    def start(self) -> None:
        self.annotator.push(self.name)

    def stop(self) -> None:
        self.annotator.pop()


class Timer:
    """Accumulates the time between start() and stop() calls until read."""

    def __init__(self, name: str, owner: Timers):
        self.name = name
        self._owner = owner
        self._elapsed = 0.0
        self._started: float | None = None
        self._annotator: Annotator | None = None  # the one that opened this run's range closes it

    def start(self) -> None:
        if self._started is not None:
            raise RuntimeError(f"timer {self.name!r} started twice")
        self._owner._sync()
        self._annotator = self._owner.annotator
        if self._annotator is not None:
            self._annotator.push(self.name)
        self._started = self._owner.clock()

    def stop(self) -> None:
        if self._started is None:
            raise RuntimeError(f"timer {self.name!r} stopped without being started")
        self._owner._sync()
        self._elapsed += self._owner.clock() - self._started
        self._started = None
        if self._annotator is not None:
            self._annotator.pop()
            self._annotator = None

    def elapsed(self, reset: bool = True) -> float:
        """Seconds accumulated (a running timer is not counted until it stops)."""
        value = self._elapsed
        if reset:
            self._elapsed = 0.0
        return value


class Timers:
    """The timers of one process. `timers(name, level)` returns the timer to start and stop."""

    def __init__(
        self,
        log_level: int,
        log_option: str,
        device: torch.device,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if log_level not in (0, 1, 2):
            raise ValueError(f"timing log level must be 0, 1 or 2, got {log_level}")
        if log_option not in OPTIONS:
            raise ValueError(f"timing log option must be one of {OPTIONS}, got {log_option!r}")
        self.log_level, self.log_option = log_level, log_option
        self.device = device
        self.clock = clock
        self.annotator: Annotator | None = None
        """Set by the profiler while its window is open."""
        self._timers: dict[str, Timer] = {}
        self._levels: dict[str, int] = {}

    def __call__(self, name: str, level: int) -> Timer | _NullTimer | _Range:
        if level > self.log_level:
            return _NULL if self.annotator is None else _Range(name, self.annotator)
        if name not in self._timers:
            self._timers[name] = Timer(name, self)
            self._levels[name] = level
        elif self._levels[name] != level:
            raise ValueError(f"timer {name!r} used at level {level} and {self._levels[name]}")
        return self._timers[name]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def gather(self, names: list[str], reset: bool = True) -> torch.Tensor:
        """Seconds of each named timer on every rank, [world size, len(names)] (0 where a rank has no such timer).
        Every rank must call it with the same names: one all-gather over the default group."""
        values = torch.tensor(
            [self._timers[n].elapsed(reset) if n in self._timers else 0.0 for n in names], dtype=torch.float64
        )
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return values.unsqueeze(0)
        # NCCL gathers only device tensors; gloo the CPU ones.
        values = values.to(self.device)
        out = [torch.empty_like(values) for _ in range(dist.get_world_size())]
        dist.all_gather(out, values)
        return torch.stack(out).cpu()

    def logged(self) -> list[str]:
        """The step's timers at or below the log level, in Megatron-LM's order (the same list on every rank)."""
        return [name for name, level in STEP_TIMERS.items() if level <= self.log_level]

    def report(self, names: list[str], normalizer: float, reset: bool = True) -> tuple[str | None, dict[str, float]]:
        """The timing block for stdout (None when no timer ran) and, for TensorBoard, `<name>-time`: the maximum
        over ranks in ms per iteration. `normalizer`: iterations since the last report."""
        table = self.gather(names, reset) * (1000.0 / normalizer)  # ms per iteration
        per_name = {n: [float(v) for v in table[:, i] if v > 0] for i, n in enumerate(names)}
        per_name = {n: v for n, v in per_name.items() if v}
        scalars = {f"{n}-time": max(v) for n, v in per_name.items()}
        if not per_name:
            return None, scalars
        if self.log_option == "all":
            lines = ["times across ranks (ms):"]
            for i, name in enumerate(names):
                if name in per_name:
                    lines.append(f"  {name}:")
                    lines += [f"     rank {r:2d}: {float(v):.2f}" for r, v in enumerate(table[:, i]) if v > 0]
        elif self.log_option == "max":
            lines = ["max time across ranks (ms):"]
            lines += [f"    {(n + ' ').ljust(48, '.')}: {max(v):.2f}" for n, v in per_name.items()]
        else:
            lines = ["(min, max) time across ranks (ms):"]
            lines += [f"    {(n + ' ').ljust(48, '.')}: ({min(v):.2f}, {max(v):.2f})" for n, v in per_name.items()]
        return "\n".join(lines), scalars
