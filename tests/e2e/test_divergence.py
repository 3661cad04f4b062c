"""A diverged tiny run stops with one line and a non-zero exit status, saving nothing; a loss spike is logged with
its iteration and counted in TensorBoard."""

from __future__ import annotations

import pretrain_gpt
from megatron.checkpoint import latest_iteration
from megatron.config import parse_args
from megatron.training import Trainer

TINY = (
    "--mock-data --vocab-size 128 --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32"
    " --micro-batch-size 2 --global-batch-size 8 --lr-warmup-iters 2 --log-interval 5 --eval-iters 1"
    " --eval-interval 1000"
)


def test_lr_1e4_stops_with_a_message_and_saves_nothing(tmp_path, capsys):
    argv = f"{TINY} --lr 1e4 --train-iters 60 --save {tmp_path} --save-interval 40".split()
    assert pretrain_gpt.main(argv) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pretrain_gpt.py: error: the run diverged: 10 steps in a row"), err
    assert latest_iteration(str(tmp_path)) is None
    # Off: the steps are skipped and counted, the run goes on (the behaviour before the check existed)
    off = f"{TINY} --lr 1e4 --train-iters 15 --no-check-for-nan-in-loss-and-grad".split()
    state = Trainer(parse_args(off)).train()
    assert state.iteration == 15 and state.nan_iters >= 10
    short = f"{TINY} --lr 1e4 --train-iters 60 --max-consecutive-skipped-iterations 2".split()
    assert pretrain_gpt.main(short) == 3
    assert "2 steps in a row" in capsys.readouterr().err


def test_loss_spike_is_logged_with_its_iteration(tmp_path, monkeypatch, capsys):
    real_step = Trainer.train_step

    def train_step(self, *args, **kwargs):
        loss, norm, stepped = real_step(self, *args, **kwargs)
        return (loss * 10 if self.state.iteration + 1 == 25 else loss), norm, stepped

    monkeypatch.setattr(Trainer, "train_step", train_step)
    cfg = parse_args(f"{TINY} --lr 3e-3 --train-iters 30 --tensorboard-dir {tmp_path}".split())
    state = Trainer(cfg).train()
    spikes = [line for line in capsys.readouterr().out.splitlines() if "loss spike" in line]
    assert len(spikes) == 1 and spikes[0].startswith("> loss spike at iteration 25: lm loss"), spikes
    assert state.iteration == 30 and state.skipped_iters == 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path)).Reload().Scalars("loss-spikes")
    assert [(e.step, e.value) for e in events] == [(25, 1.0)]
