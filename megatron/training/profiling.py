"""--profile: a window of training steps for a profiler, Megatron-LM's flags and step numbering.

The window holds the steps run while the completed-step count goes from --profile-step-start to
--profile-step-end: iterations start+1 .. end as the progress line numbers them (defaults 10 and 12: iterations 11
and 12). Only the ranks in --profile-ranks profile (all ranks when it is empty).

Nsight Systems (the default): cudaProfilerStart at the window's first step and cudaProfilerStop after its last, for
`nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop ...`; inside the window each step is an NVTX
range "iteration N" and its phases (the timers' names, megatron/training/timers.py) nested NVTX ranges.

--use-pytorch-profiler: a torch.profiler trace of the window's steps (CPU, and CUDA kernels on a GPU), with the
same ranges, written by `tensorboard_trace_handler` into --tensorboard-dir as `rank<R>.<id>.pt.trace.json`
(TensorBoard's profiler plugin or https://ui.perfetto.dev open it).

Outside the window nothing is on: no NVTX call, no profiler, no synchronization (the timers' annotate hook is unset).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.config.training import LoggingConfig

from .timers import Timers


class _Nvtx:
    def push(self, name: str) -> None:
        torch.cuda.nvtx.range_push(name)

    def pop(self) -> None:
        torch.cuda.nvtx.range_pop()


class _TorchRanges:
    """record_function ranges, opened and closed by name like NVTX's push/pop."""

    def __init__(self) -> None:
        self._open: list[Any] = []

    def push(self, name: str) -> None:
        scope = torch.autograd.profiler.record_function(name)
        scope.__enter__()
        self._open.append(scope)

    def pop(self) -> None:
        self._open.pop().__exit__(None, None, None)


def cuda_profiler_start() -> None:
    torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())


def cuda_profiler_stop() -> None:
    torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())


class Profiler:
    """Opens and closes the window around the steps; `before_step`/`after_step` take the completed-step count."""

    def __init__(self, cfg: LoggingConfig, rank: int, device: torch.device, timers: Timers):
        self.cfg, self.rank, self.device, self.timers = cfg, rank, device, timers
        self.enabled = cfg.profile and (not cfg.profile_ranks or rank in cfg.profile_ranks)
        # Nsight Systems captures CUDA only: a CPU run has nothing for it to record (the runtime notes it at start).
        if not cfg.use_pytorch_profiler and device.type != "cuda":
            self.enabled = False
        self.active = False
        self._ranges: _Nvtx | _TorchRanges | None = None
        self._torch: torch.profiler.profile | None = None

    def before_step(self, iteration: int) -> None:
        if not self.enabled:
            return
        if iteration == self.cfg.profile_step_start and not self.active:
            self._start()
        if self.active:
            assert self._ranges is not None
            self._ranges.push(f"iteration {iteration + 1}")

    def after_step(self, iteration: int) -> None:
        if not self.active:
            return
        assert self._ranges is not None
        self._ranges.pop()
        if iteration >= self.cfg.profile_step_end:
            self.stop()

    def _start(self) -> None:
        if self.cfg.use_pytorch_profiler:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._torch = torch.profiler.profile(
                activities=activities,
                on_trace_ready=torch.profiler.tensorboard_trace_handler(
                    self.cfg.tensorboard_dir, worker_name=f"rank{self.rank}"
                ),
            )
            self._torch.start()
            self._ranges = _TorchRanges()
        else:
            cuda_profiler_start()
            self._ranges = _Nvtx()
        self.timers.annotator = self._ranges
        self.active = True

    def stop(self) -> None:
        """Close the window (also when training ends inside it): the trace is written here."""
        if not self.active:
            return
        self.timers.annotator = None
        self.active = False
        self._ranges = None
        if self._torch is not None:
            self._torch.stop()  # calls the trace handler
            self._torch = None
        else:
            cuda_profiler_stop()
