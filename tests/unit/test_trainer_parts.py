"""The trainer's parts outside trainer.py, tested on their own: the counters of a step
(train_state.py), the log interval (progress.py), when delayed scaling is calibrated (warmup.py), a data loader's
workers ended on request (data_loading.py)."""

from __future__ import annotations

import multiprocessing
import re

import torch
from torch.utils.data import TensorDataset

from megatron.config import parse_args
from megatron.optim.loss_scaler import build_loss_scaler
from megatron.parallel import ParallelDims
from megatron.training.data_loading import build_loader, close_loader
from megatron.training.logger import TensorBoardWriter
from megatron.training.progress import Progress
from megatron.training.train_state import TrainState

TINY = "--mock-data --vocab-size 128 --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32"


def test_record_step_counts_samples_skips_and_nan_iterations():
    state = TrainState(iteration=1)
    state.record_step(5.0, 8, stepped=True, nan=False)
    state.iteration += 1
    state.record_step(float("nan"), 16, stepped=False, nan=True)
    assert (state.consumed_samples, state.skipped_iters, state.nan_iters) == (24, 1, 1)
    assert state.losses[1] == 5.0 and len(state.losses) == 2


class _Stats:
    def report(self):
        return ["num zeros: 7"], {"num-zeros": 7}


class _Runtime:
    def __init__(self):
        self.reports = []

    def report_timers(self, iteration, iterations, tensorboard):
        self.reports.append((iteration, iterations))


class _Buffers:
    fp8_stats = None


def test_the_progress_line_comes_at_each_log_interval_and_at_the_last_step(capsys):
    cfg = parse_args(f"{TINY} --micro-batch-size 2 --global-batch-size 8 --train-iters 5 --log-interval 2".split())
    runtime = _Runtime()
    progress = Progress(
        cfg,
        ParallelDims.single(),
        torch.device("cpu"),
        128,
        5,
        loss_scaler=build_loss_scaler(cfg.precision),
        grad_buffers=_Buffers(),
        stats=_Stats(),
        runtime=runtime,
        tensorboard=TensorBoardWriter(None),
    )
    state = TrainState()
    losses = [4.0, float("inf"), 3.0, 2.0, 1.0]
    for i, loss in enumerate(losses):
        state.iteration += 1
        state.record_step(loss, 8 * (i + 1), stepped=True, nan=False)  # a growing batch: rates over samples
        progress.add_step(0.5, loss, 8 * (i + 1))
        progress.log_if_due(state, 8 * (i + 1), 1e-3, 0.5)
    lines = [line for line in capsys.readouterr().out.splitlines() if "iteration" in line]
    assert [int(re.search(r"iteration\s+(\d+)/", line).group(1)) for line in lines] == [2, 4, 5]
    # iteration 2: the finite losses of the interval (4.0; inf left out); 4: (3 + 2) / 2; 5: 1.0 alone
    assert [re.search(r"lm loss: (\S+)", line).group(1) for line in lines] == [
        "4.000000E+00",
        "2.500000E+00",
        "1.000000E+00",
    ]
    # tokens/s over the interval's samples: iterations 3 and 4 are 24 + 32 samples of 32 tokens in 1 s
    assert "tokens/s: 1792" in lines[1] and "num zeros: 7" in lines[1]
    assert runtime.reports == [(2, 2), (4, 2), (5, 1)]


def test_only_delayed_scaling_has_a_calibration_pass():
    delayed = parse_args(f"{TINY} --fp8-format hybrid --fp8-recipe delayed".split())
    assert delayed.precision.fp8_calibration and delayed.precision.calibration_pass
    off = parse_args(f"{TINY} --fp8-format hybrid --fp8-recipe delayed --no-fp8-calibration".split())
    assert not off.precision.calibration_pass
    tensorwise = parse_args(f"{TINY} --fp8-format hybrid --fp8-recipe tensorwise".split())
    assert not tensorwise.precision.calibration_pass
    assert not parse_args(TINY.split()).precision.calibration_pass


def test_close_loader_ends_the_worker_processes():
    dataset = TensorDataset(torch.arange(64).view(32, 2))
    loader = build_loader(dataset, 4, 2, 1, ParallelDims.single(), torch.device("cpu"))
    batches = iter(loader)
    first = next(batches)
    assert first[0].tolist() == [[8, 9], [10, 11]]  # from the 4 consumed samples on
    assert multiprocessing.active_children()
    close_loader(batches)
    assert not multiprocessing.active_children()
    close_loader(batches)  # twice: nothing more to end
    close_loader(iter(build_loader(dataset, 0, 2, 0, ParallelDims.single(), torch.device("cpu"))))
