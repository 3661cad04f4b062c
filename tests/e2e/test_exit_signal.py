"""--exit-signal-handler on tiny CPU runs: a SIGTERM mid-run (from outside, as Slurm sends it) saves the step it
stopped at and exits 0, and resuming gives the uninterrupted run's losses; a signal that reaches one rank stops every
rank after the same step; a second signal during the save changes nothing."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

import pretrain_gpt
from megatron.checkpoint import latest_iteration, torch_format
from megatron.config import ConfigError, parse_args
from megatron.training import Trainer, runtime
from tests.assets.data_helpers import ROOT
from tests.dist_utils import run_distributed

TINY = (
    "--mock-data --vocab-size 128 --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32"
    " --micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --lr-warmup-iters 2 --eval-iters 1"
    " --eval-interval 100000"
)
LONG = 3000  # iterations the interrupted run would take: it is stopped long before


def test_sigterm_mid_run_saves_exits_zero_and_resumes_exactly(tmp_path):
    save = tmp_path / "ckpt"
    argv = f"{TINY} --train-iters {LONG} --log-interval 1 --exit-signal-handler --save {save} --save-interval 100000"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-u", str(ROOT / "pretrain_gpt.py"), *argv.split()],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if re.search(r"iteration\s+3/", line):
            proc.send_signal(signal.SIGTERM)
            break
    lines += proc.stdout.readlines()
    out = "".join(lines)
    assert proc.wait(timeout=120) == 0, out
    stopped = int(re.search(r"exiting program at iteration (\d+) after receiving SIGTERM", out).group(1))
    assert 3 <= stopped < LONG, out
    assert latest_iteration(str(save)) == stopped
    assert "validation loss" not in out  # like the time limit: no final evaluation
    printed = {int(i): float(x) for i, x in re.findall(r"iteration\s+(\d+)/.*?lm loss: ([\d.E+-]+)", out)}

    # The uninterrupted run, and the resumed one, to three steps past the stop (same --train-iters: same schedule)
    end = f"--train-iters {LONG} --exit-interval {stopped + 3} --log-interval 100"
    whole = Trainer(parse_args(f"{TINY} {end}".split())).train().losses
    resumed = Trainer(parse_args(f"{TINY} {end} --load {save}".split())).train().losses
    assert sorted(resumed) == [stopped + 1, stopped + 2, stopped + 3]
    assert all(resumed[i] == whole[i] for i in resumed), (resumed, whole)
    assert all(printed[i] == pytest.approx(whole[i], rel=1e-5) for i in printed)


def test_second_signal_during_the_save_is_recorded_and_ignored(tmp_path, monkeypatch, capsys):
    before = signal.getsignal(signal.SIGUSR1)
    real_after_step, real_save = runtime.Runtime.after_step, torch_format.save_checkpoint
    saves = []

    def after_step(self, iteration):
        real_after_step(self, iteration)
        if iteration == 3:
            os.kill(os.getpid(), signal.SIGUSR1)

    def save_checkpoint(*args, **kwargs):
        saves.append(args[1])
        os.kill(os.getpid(), signal.SIGUSR1)  # mid-save, twice: recorded, no second save, no exit
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)  # let Python run the handler while the save is under way
        return real_save(*args, **kwargs)

    monkeypatch.setattr(runtime.Runtime, "after_step", after_step)
    monkeypatch.setattr(torch_format, "save_checkpoint", save_checkpoint)
    # the torch format's writer is the one slowed down here (a torch_dist save: test_sigterm_mid_run_...)
    argv = f"{TINY} --train-iters 20 --exit-signal-handler --exit-signal SIGUSR1 --save {tmp_path} --save-interval 100"
    argv += " --ckpt-format torch"
    assert pretrain_gpt.main(argv.split()) == 0
    out = capsys.readouterr().out
    assert "exiting program at iteration 3 after receiving SIGUSR1 (--exit-signal-handler)" in out
    assert saves == [3] and latest_iteration(str(tmp_path)) == 3
    assert signal.getsignal(signal.SIGUSR1) == before  # handed back after training
    state = Trainer(parse_args(f"{TINY} --train-iters 20 --exit-interval 4 --load {tmp_path}".split())).train()
    assert list(state.losses) == [4]


def test_without_a_signal_the_run_goes_to_the_end():
    before = signal.getsignal(signal.SIGUSR2)
    cfg = parse_args(f"{TINY} --train-iters 4 --exit-signal-handler --exit-signal SIGUSR2".split())
    assert Trainer(cfg).train().iteration == 4
    assert signal.getsignal(signal.SIGUSR2) == before
    with pytest.raises(ConfigError):
        parse_args(f"{TINY} --exit-signal SIGKILL".split())


def _one_rank_signalled(rank, world_size):
    real_after_step = runtime.Runtime.after_step

    def after_step(self, iteration):
        real_after_step(self, iteration)
        if rank == 1 and iteration == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    runtime.Runtime.after_step = after_step
    cfg = parse_args(f"{TINY} --train-iters 10 --exit-signal-handler".split(), world_size=world_size)
    assert Trainer(cfg).train().iteration == 2


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step():
    run_distributed(_one_rank_signalled, world_size=2)
