"""Step timers (--timing-log-level) and the profiler window (--profile): what runs at which level, what the
window turns on, and that nothing is on outside it."""

import pytest
import torch

from megatron.config import ConfigError, parse_args
from megatron.training import profiling
from megatron.training.profiling import Profiler
from megatron.training.timers import Timers

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 0.001  # every reading one millisecond later
        return self.t


def test_level_0_has_no_timers_and_no_syncs(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(a))
    timers = Timers(0, "minmax", CUDA)  # a GPU's timers synchronize: level 0 must not
    for name, level in [("forward-backward", 1), ("forward-compute", 2)]:
        t = timers(name, level)
        t.start()
        t.stop()
    assert syncs == [] and timers.logged() == []
    assert timers("forward-backward", 1) is timers("optimizer", 1)  # the shared no-op


def test_level_1_times_once_per_step_phases_and_syncs_only_those(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(a))
    timers = Timers(1, "minmax", CUDA, clock=FakeClock())
    for _ in range(3):
        timers("forward-backward", 1).start()
        timers("forward-compute", 2).start()  # level 2: off
        timers("forward-compute", 2).stop()
        timers("forward-backward", 1).stop()
    assert len(syncs) == 6  # start and stop of the three level-1 runs
    assert timers.logged() == ["forward-backward", "all-grads-sync", "optimizer"]
    # gather() would move values to the device; one process needs no collective
    monkeypatch.setattr(timers, "device", CPU)
    block, scalars = timers.report(timers.logged(), normalizer=3)
    assert block.splitlines() == [
        "(min, max) time across ranks (ms):",
        f"    {'forward-backward '.ljust(48, '.')}: (1.00, 1.00)",
    ]
    assert scalars == {"forward-backward-time": pytest.approx(1.0)}
    assert timers.report(timers.logged(), normalizer=1) == (None, {})  # reset by the report


@pytest.mark.parametrize(
    "option, expected",
    [
        ("max", ["max time across ranks (ms):", f"    {'optimizer '.ljust(48, '.')}: 2.00"]),
        ("all", ["times across ranks (ms):", "  optimizer:", "     rank  0: 2.00"]),
    ],
)
def test_report_options(option, expected):
    timers = Timers(2, option, CPU, clock=FakeClock())
    timers("optimizer", 1).start()
    timers("optimizer", 1).stop()
    assert timers.report(["optimizer", "forward-compute"], normalizer=0.5)[0].splitlines() == expected


def test_timer_misuse_is_an_error():
    timers = Timers(2, "minmax", CPU)
    with pytest.raises(RuntimeError, match="stopped without being started"):
        timers("optimizer", 1).stop()
    with pytest.raises(ValueError, match="level"):
        timers("optimizer", 2)


class Recorder:
    def __init__(self):
        self.calls = []


def _nsys_profiler(monkeypatch, flags: str, rank: int = 0):
    rec = Recorder()
    monkeypatch.setattr(profiling, "cuda_profiler_start", lambda: rec.calls.append("start"))
    monkeypatch.setattr(profiling, "cuda_profiler_stop", lambda: rec.calls.append("stop"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: rec.calls.append(f"push {name}"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: rec.calls.append("pop"))
    cfg = parse_args(f"--mock-data --vocab-size 64 --profile {flags}".split())
    timers = Timers(0, "minmax", CUDA)
    return Profiler(cfg.logging, rank, CUDA, timers), timers, rec


def _run_steps(profiler, timers, rec, steps: int) -> dict[int, list[str]]:
    """Each step's calls into the profiler APIs, by iteration number (1-based, as the log line counts)."""
    by_step = {}
    for done in range(steps):
        before = len(rec.calls)
        profiler.before_step(done)
        timers("forward-backward", 1).start()
        timers("forward-compute", 2).start()
        timers("forward-compute", 2).stop()
        timers("forward-backward", 1).stop()
        profiler.after_step(done + 1)
        by_step[done + 1] = rec.calls[before:]
    return by_step


def test_nsys_window_is_megatrons_and_nothing_runs_outside_it(monkeypatch):
    profiler, timers, rec = _nsys_profiler(monkeypatch, "")  # defaults: start 10, end 12
    by_step = _run_steps(profiler, timers, rec, 15)
    ranges = ["push forward-backward", "push forward-compute", "pop", "pop"]
    assert by_step[11] == ["start", "push iteration 11", *ranges, "pop"]
    assert by_step[12] == ["push iteration 12", *ranges, "pop", "stop"]
    assert all(by_step[i] == [] for i in by_step if i not in (11, 12))
    assert timers.annotator is None and not profiler.active


def test_profile_ranks_and_cpu_leave_the_profiler_off(monkeypatch):
    profiler, timers, rec = _nsys_profiler(monkeypatch, "--profile-ranks 1 2", rank=0)
    _run_steps(profiler, timers, rec, 15)
    assert rec.calls == []
    profiler, timers, rec = _nsys_profiler(monkeypatch, "--profile-ranks 0 --profile-step-start 0 --profile-step-end 1")
    _run_steps(profiler, timers, rec, 3)
    assert rec.calls[0] == "start" and rec.calls[-1] == "stop"
    cfg = parse_args("--mock-data --vocab-size 64 --profile".split())
    assert not Profiler(cfg.logging, 0, CPU, Timers(0, "minmax", CPU)).enabled  # nsys records CUDA only


def test_training_ending_inside_the_window_closes_it(monkeypatch):
    profiler, timers, rec = _nsys_profiler(monkeypatch, "--profile-step-start 1 --profile-step-end 5")
    _run_steps(profiler, timers, rec, 3)
    profiler.stop()
    assert rec.calls[-1] == "stop" and timers.annotator is None


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--use-pytorch-profiler --tensorboard-dir x", "add --profile"),
        ("--profile --profile-step-start 5 --profile-step-end 5", "--profile-step-start < --profile-step-end"),
        ("--profile --use-pytorch-profiler", "add --tensorboard-dir"),
        ("--timing-log-level 3", "invalid choice"),
    ],
)
def test_profiling_flag_errors(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(f"--mock-data --vocab-size 64 {flags}".split())
