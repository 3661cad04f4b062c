"""What the training loop does between and around steps, besides training: Python's garbage collection
(--manual-gc), returning cached GPU memory (--empty-unused-memory-level), the wall-clock budget
(--exit-duration-in-mins) and the exit signal (--exit-signal-handler), the step timers and the profiler window.
The trainer calls these hooks; each is a cheap no-op unless its flag is set.
"""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist

from megatron.config import Config

from .logger import TensorBoardWriter, print_rank_0
from .profiling import Profiler
from .signals import ExitSignal
from .timers import Timers

PROGRAM_START = time.time()
"""The budget of --exit-duration-in-mins counts from here: when the training package is first imported, at
program start (start-up, data and checkpoint loading count too, as in Megatron-LM)."""


def now() -> float:
    """The clock of the exit budget (tests replace it)."""
    return time.time()


class Runtime:
    def __init__(self, cfg: Config, rank: int, device: torch.device, start_time: float = PROGRAM_START):
        self.cfg, self.device = cfg, device
        self.train_cfg, self.log_cfg = cfg.training, cfg.logging
        self.start_time = start_time
        self.timers = Timers(self.log_cfg.timing_log_level, self.log_cfg.timing_log_option, device)
        self.profiler = Profiler(self.log_cfg, rank, device, self.timers)
        self._gc_was_enabled = gc.isenabled()
        self.exit_signal = ExitSignal(self.train_cfg.exit_signal) if self.train_cfg.exit_signal_handler else None
        for note in self._notes():
            if note not in cfg.notes:
                cfg.notes.append(note)  # printed with the arguments at start

    def _notes(self) -> list[str]:
        notes = []
        if self.device.type != "cuda":
            if self.log_cfg.profile and not self.log_cfg.use_pytorch_profiler:
                notes.append(
                    "--profile drives Nsight Systems, which records CUDA only: nothing to capture on a CPU (add"
                    " --use-pytorch-profiler for a torch.profiler trace)"
                )
            if self.log_cfg.log_memory_to_tensorboard:
                notes.append("--log-memory-to-tensorboard reports CUDA memory: nothing to report on a CPU")
        return notes

    # ------------------------------------------------------------------ training

    def start_training(self) -> None:
        if self.train_cfg.manual_gc:
            # Every rank collects at the same steps instead of whenever its own allocation counts say so: a
            # collection on one rank would otherwise stall the others at the next collective.
            gc.disable()
            gc.collect()

    def before_step(self, iteration: int) -> None:
        """`iteration`: steps completed so far."""
        self.profiler.before_step(iteration)

    def after_step(self, iteration: int) -> None:
        """`iteration`: steps completed, this one included."""
        self.profiler.after_step(iteration)
        interval = self.train_cfg.manual_gc_interval
        if self.train_cfg.manual_gc and interval and iteration % interval == 0:
            gc.collect()

    def end_training(self) -> None:
        self.profiler.stop()
        if self.train_cfg.manual_gc and self._gc_was_enabled:
            gc.enable()  # the process may go on (tests, notebooks): hand the collector back as it was
        if self.exit_signal is not None:  # after the final save: a signal during it must not kill the process
            self.exit_signal.release()

    def empty_cache(self, level: int) -> None:
        """Return the allocator's unused cached blocks to the device at --empty-unused-memory-level >= `level`
        (Megatron-LM's points: 1 after the forward-backward pass and after evaluation, 2 after the optimizer
        step too). Less fragmentation, at the price of new cudaMallocs. No cache on a CPU."""
        if self.train_cfg.empty_unused_memory_level >= level and self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ evaluation

    def before_evaluation(self) -> None:
        if self.train_cfg.manual_gc and self.train_cfg.manual_gc_eval:
            gc.collect()

    def after_evaluation(self) -> None:
        self.empty_cache(1)
        if self.train_cfg.manual_gc and self.train_cfg.manual_gc_eval:
            gc.collect(generation=0)  # what evaluation itself created

    # ------------------------------------------------------------------ exit

    def exit_requested(self, iteration: int) -> bool:
        """Whether to stop after this step: the --exit-duration-in-mins budget is spent or --exit-signal arrived, on
        any rank. Every rank must call it after the same step (`iteration`: steps completed): one all-reduce (max)
        of both conditions makes them agree although each reads its own clock and receives its own signals. No
        collective when neither flag is set."""
        budget = self.train_cfg.exit_duration_in_mins
        if not budget and self.exit_signal is None:
            return False
        minutes = (now() - self.start_time) / 60.0
        signalled = self.exit_signal is not None and self.exit_signal.received
        flags = torch.tensor([int(bool(budget) and minutes > budget), int(signalled)], dtype=torch.int32)
        flags = flags.to(self.device)
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        out_of_time, signalled = flags.tolist()
        if signalled:
            assert self.exit_signal is not None
            where = "" if self.exit_signal.received else " on another rank"
            print_rank_0(
                f"> exiting program at iteration {iteration} after receiving {self.exit_signal.name}{where}"
                " (--exit-signal-handler)"
            )
            return True
        if out_of_time:
            print_rank_0(f"> exiting program after {minutes:.2f} minutes (--exit-duration-in-mins {budget})")
            return True
        return False

    # ------------------------------------------------------------------ logging

    def report_timers(self, iteration: int, iterations: int, tensorboard: TensorBoardWriter) -> None:
        """Below the progress line: the step timers' block (levels 1 and 2), and their `<name>-time` scalars with
        --log-timers-to-tensorboard. A collective when a timer is logged: every rank calls it."""
        names = self.timers.logged()
        if not names:
            return
        block, scalars = self.timers.report(names, max(1, iterations))
        if block is not None:
            print_rank_0(block)
        if self.log_cfg.log_timers_to_tensorboard:
            tensorboard.scalars(scalars, iteration)
