"""The run guards by themselves: the divergence count (and fp16's back-off, which is not divergence), the loss-spike
rule, which collective failures count as a lost rank, and the exit signal's record."""

from __future__ import annotations

import os
import signal

import pytest
import torch.distributed as dist

from megatron.errors import DivergenceError, LostRankError
from megatron.optim.loss_scaler import DynamicLossScaler, LossScaler
from megatron.training.guards import NonFiniteGuard, SpikeDetector, guard_collectives, is_peer_failure
from megatron.training.signals import ExitSignal

NAN, INF = float("nan"), float("inf")


def test_divergence_stops_after_the_limit_in_a_row():
    guard = NonFiniteGuard(True, 3, fp16=False, loss_scaler=LossScaler())
    assert guard.after_step(1, NAN, NAN, stepped=False)
    assert guard.after_step(2, 2.0, INF, stepped=False)
    assert not guard.after_step(3, 2.0, 1.0, stepped=True)  # a good step starts the count again
    guard.after_step(4, NAN, NAN, stepped=False)
    guard.after_step(5, NAN, NAN, stepped=False)
    with pytest.raises(DivergenceError, match=r"3 steps in a row .*iteration 6.*--max-consecutive-skipped"):
        guard.after_step(6, NAN, NAN, stepped=False)
    off = NonFiniteGuard(False, 1, fp16=False, loss_scaler=LossScaler())
    assert off.after_step(1, NAN, NAN, stepped=False) and off.in_a_row == 1  # counted, never stops


def test_fp16_back_off_is_not_divergence_until_the_minimum_scale():
    scaler = DynamicLossScaler(2.0**16, 1.0, 1000, 2, 2.0, 0.5)
    guard = NonFiniteGuard(True, 2, fp16=True, loss_scaler=scaler)
    for i in range(10):  # overflowing gradients while the scale is above its minimum: the scaler's business
        assert not guard.after_step(i, 3.0, INF, stepped=False)
    scaler.scale = 1.0
    guard.after_step(11, 3.0, INF, stepped=False)
    with pytest.raises(DivergenceError, match="gradient norm"):
        guard.after_step(12, 3.0, INF, stepped=False)


def test_spike_is_far_above_the_running_mean(capsys):
    spikes = SpikeDetector(window=20, k=5.0, rel=0.1, min_history=10)
    losses = [4.0 - 0.01 * i + (0.02 if i % 2 else -0.02) for i in range(30)]
    assert not any(spikes.after_step(i + 1, x) for i, x in enumerate(losses))
    assert not spikes.after_step(31, NAN)  # not finite: the divergence guard's business
    assert spikes.after_step(32, 9.0)
    assert "loss spike at iteration 32: lm loss 9.000000E+00" in capsys.readouterr().out
    assert spikes.count == 1
    flat = SpikeDetector(min_history=3)
    assert not any(flat.after_step(i, 2.0 + 1e-6 * (i % 2)) for i in range(10))
    assert not flat.after_step(11, 2.01)  # many standard deviations of a flat curve, but not 10% above it


def test_peer_failures_become_one_line(monkeypatch):
    reset = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer.\nmore")
    assert not is_peer_failure(reset)  # no process group: not a collective's failure
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    assert is_peer_failure(reset)
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_failure(ValueError("Connection reset by peer"))

    def fail():
        raise reset

    with pytest.raises(LostRankError, match=r"^rank 1: a collective failed.*--distributed-timeout-minutes 7") as info:
        guard_collectives(fail, 7)
    assert "\n" not in str(info.value) and "Connection reset by peer" in str(info.value)
    assert info.value.exit_code == 4
    with pytest.raises(KeyError):
        guard_collectives(lambda: {}["x"], 7)
    assert guard_collectives(lambda: 5, 7) == 5


def test_exit_signal_records_and_hands_back():
    before = signal.getsignal(signal.SIGUSR2)
    watcher = ExitSignal("SIGUSR2")
    assert not watcher.received
    os.kill(os.getpid(), signal.SIGUSR2)
    os.kill(os.getpid(), signal.SIGUSR2)
    assert watcher.received and watcher.count == 2
    watcher.release()
    watcher.release()
    assert signal.getsignal(signal.SIGUSR2) == before
