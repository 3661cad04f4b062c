"""Where a run's start-up goes, in the log.

Megatron-LM's lines first, with its words and at its points (megatron/training/training.py's `pretrain`), so that
logs of both read alike:

    time to initialize megatron (seconds): X          process groups, seeds and tokenizer ready (X: from program
    [after megatron is initialized] datetime: ...     start, the earliest rank's, as Megatron-LM counts it)
    [after model, optimizer, and learning rate scheduler are built] datetime: ...
    [after dataloaders are built] datetime: ...
    done with setup ...
    (min, max) time across ranks (ms):                the two timers `model-and-optimizer-setup` and
        model-and-optimizer-setup ...: (a, b)         `train/valid/test-data-iterators-setup` (--timing-log-option
        train/valid/test-data-iterators-setup ...     picks the block's form, as for the step timers)
    training ...
    [before the start of training step] datetime: ...

Each datetime line waits for every rank first (a barrier, as Megatron-LM's `print_datetime`). Then our own finer
phases, one table after "done with setup ...": the model's construction (its weights drawn on the CPU), its move to
the device, FSDP's sharding, the gradient buffers, the optimizer, the checkpoint, the datasets, delayed scaling's
calibration pass and the CUDA graphs' capture, each as (min, max) seconds across ranks. And after the second step,
the first step's extra time (its allocations, first kernel launches and autotuning, lazily made communicators), when
it took longer than the second.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime

import torch
import torch.distributed as dist

from .logger import print_rank_0
from .runtime import PROGRAM_START
from .timers import Timers

MODEL_AND_OPTIMIZER = "model-and-optimizer-setup"
DATA_ITERATORS = "train/valid/test-data-iterators-setup"
CHECKPOINT_LOADED = "checkpoint loaded"


def print_datetime(label: str) -> None:
    """Megatron-LM's `[label] datetime: ...` line, once every rank got here."""
    if dist.is_initialized():
        dist.barrier()
    print_rank_0(f"[{label}] datetime: {datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')} ")


class StartupTimes:
    """The start-up's timers of one process: Megatron-LM's two setup timers and our phases (level-0 timers, which
    synchronize the GPU at their start and stop), gathered over the ranks once, by `done`."""

    def __init__(self, timing_log_option: str, device: torch.device, program_start: float = PROGRAM_START):
        self.timers = Timers(0, timing_log_option, device)
        self.program_start = program_start
        self.phases: dict[str, str] = {}  # timer name -> its row's label, in the order first timed
        self.step_seconds: list[float] = []

    def initialized(self) -> None:
        """Process groups, seeds and tokenizer are ready: Megatron-LM's `initialize_megatron` is done."""
        start = torch.tensor([self.program_start], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:  # the earliest rank's start, as Megatron-LM's
            start = start.to(self.timers.device)
            dist.all_reduce(start, op=dist.ReduceOp.MIN)
        print_rank_0(f"time to initialize megatron (seconds): {time.time() - float(start):.3f}")
        print_datetime("after megatron is initialized")

    @contextmanager
    def setup(self, name: str, done_label: str) -> Iterator[None]:
        """One of Megatron-LM's setup timers (`name`) around the block, and its datetime line after it."""
        if dist.is_initialized():
            dist.barrier()  # Megatron-LM starts these timers with barrier=True
        with self._timed(name):
            yield
        print_datetime(done_label)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """One row of our table: the seconds of the block (every rank must time the same phases, in any order)."""
        self.phases.setdefault(name, name)
        with self._timed(name):
            yield

    def relabel(self, name: str, label: str) -> None:
        """What phase `name`'s row says, where the outcome differs from its name (no checkpoint to load)."""
        self.phases[name] = label

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        timer = self.timers(name, 0)
        timer.start()
        try:
            yield
        finally:
            timer.stop()

    def done(self) -> None:
        """Megatron-LM's "done with setup ..." and its timers' block, then our phases' table (two collectives)."""
        print_rank_0("done with setup ...")
        block, _ = self.timers.report([MODEL_AND_OPTIMIZER, DATA_ITERATORS], normalizer=1.0)
        if block is not None:
            print_rank_0(block)
        seconds = self.timers.gather(list(self.phases))
        width = max([len(label) for label in self.phases.values()], default=0) + 2
        print_rank_0(
            f"> start-up: {time.time() - self.program_start:.2f} s from program start to here (this rank's); its"
            " phases, (min, max) seconds across ranks:"
        )
        for i, label in enumerate(self.phases.values()):
            low, high = float(seconds[:, i].min()), float(seconds[:, i].max())
            print_rank_0(f">   {(label + ' ').ljust(width, '.')}: ({low:.2f}, {high:.2f})")

    def training(self) -> None:
        print_rank_0("training ...")

    def before_first_step(self) -> None:
        print_datetime("before the start of training step")

    def after_step(self, seconds: float) -> None:
        """This run's first steps' seconds (this rank's): after its second, the first one's extra time."""
        if len(self.step_seconds) >= 2:
            return
        self.step_seconds.append(seconds)
        if len(self.step_seconds) == 2:
            print_rank_0(first_steps_line(*self.step_seconds))


def first_steps_line(first: float, second: float) -> str:
    """The first two steps' seconds, and the first one's extra time where it took longer (on a busy or small
    machine the second can take longer: then there is no warm-up cost to name, only the two times)."""
    line = f"> first step {first:.2f} s, second {second:.2f} s"
    if round(first - second, 2) <= 0:
        return f"{line}: the first took no longer than the second (no warm-up cost measured)"
    return (
        f"{line}: the first one's extra time {first - second:.2f} s (its allocations, first kernel launches and"
        " autotuning, lazily made communicators)"
    )
