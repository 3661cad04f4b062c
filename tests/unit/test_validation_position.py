"""Validation reads on, as in Megatron-LM: each evaluation takes the next eval_iters x global batch samples of the
validation split (at every --eval-interval-th step and after training, each iteration once: where the last step is
a multiple of --eval-interval its evaluation is the final one), the position is saved in checkpoints and restored on
--load (also with --no-load-optim --no-load-rng), and a checkpoint without one resumes where Megatron-LM's rule puts
it; the test split is read from its start."""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from megatron.config import parse_args
from megatron.data.builder import split_sizes
from megatron.training import Trainer
from megatron.training.train_state import TrainState, restore_train_state, resumed_valid_samples

FLAGS = (
    "--mock-data --vocab-size 127 --num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 8"
    " --micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --hidden-dropout 0 --attention-dropout 0"
    " --transformer-impl local --train-iters 4 --eval-interval 2 --eval-iters 1 --log-interval 100"
)


def _trainer(flags: str, reads: list) -> Trainer:
    trainer = Trainer(parse_args(flags.split(), world_size=1))
    loader = trainer.loader
    names = {id(trainer.datasets.valid): "valid", id(trainer.datasets.test): "test"}

    def spy(dataset, consumed):
        if id(dataset) in names:
            reads.append((names[id(dataset)], consumed))
        return loader(dataset, consumed)

    trainer.loader = trainer.evaluation.loader = spy  # the loop's and the evaluations' reads
    return trainer


@pytest.fixture(scope="module")
def uninterrupted():
    reads, out = [], io.StringIO()
    trainer = _trainer(FLAGS, reads)
    with contextlib.redirect_stdout(out):
        state = trainer.train()
    return state, reads, len(trainer.datasets.valid), out.getvalue()


def test_each_evaluation_reads_the_next_validation_samples(uninterrupted):
    state, reads, valid_len, _ = uninterrupted
    # Evaluations at 2 and 4, the one at the last step the final one: not a second one of iteration 4 on the next
    # samples (Megatron-LM's, which its validation size still counts) to print two values for the same weights.
    assert reads == [("valid", 0), ("valid", 4), ("test", 0)]
    assert state.consumed_valid_samples == 8 < split_sizes(parse_args(FLAGS.split()))[1] <= valid_len


def test_each_evaluation_prints_one_labelled_line(uninterrupted):
    state, _, _, out = uninterrupted
    lines = re.findall(r" validation loss at iteration (\d+)( on \w+ set)? \| lm loss value: (\S+) \|", out)
    assert lines == [
        ("2", "", f"{state.valid_losses[2]:.6E}"),
        ("4", " on validation set", f"{state.valid_losses[4]:.6E}"),
        ("4", " on test set", lines[2][2]),
    ]


def test_a_last_step_off_the_interval_gets_the_final_evaluation_after_the_loop():
    reads = []
    _trainer(FLAGS.replace("--train-iters 4", "--train-iters 3"), reads).train()
    assert reads == [("valid", 0), ("valid", 4), ("test", 0)]  # at 2 in the loop, at 3 after it


@pytest.mark.parametrize("weights_only", [False, True])
def test_a_resumed_run_reads_on_where_the_checkpoint_stopped(tmp_path, uninterrupted, weights_only):
    reference, _, _, _ = uninterrupted
    first = []
    _trainer(f"{FLAGS} --save {tmp_path} --save-interval 2 --exit-interval 2", first).train()
    assert first[0] == ("valid", 0)
    reads = []
    extra = " --no-load-optim --no-load-rng" if weights_only else ""
    trainer = _trainer(f"{FLAGS} --load {tmp_path}{extra}", reads)
    assert (trainer.state.iteration, trainer.state.consumed_samples, trainer.state.consumed_valid_samples) == (2, 8, 4)
    state = trainer.train()
    assert reads == [("valid", 4), ("test", 0)]
    if not weights_only:  # the same weights and the same samples: the uninterrupted run's validation loss
        assert state.valid_losses[4] == reference.valid_losses[4]


class _Checkpointer:
    def __init__(self, loaded: dict):
        self.loaded = loaded

    def load(self, root):
        return dict(self.loaded)


@pytest.mark.parametrize(
    "saved, expected", [({}, 8), ({"consumed_valid_samples": 0}, 8), ({"consumed_valid_samples": 5}, 5)]
)
def test_a_checkpoint_without_a_validation_position_gets_megatron_lms(tmp_path, saved, expected):
    # Megatron-LM (training.py): iteration > 0 and consumed_valid_samples == 0 -> one evaluation of eval_iters x
    # global batch per --eval-interval steps done: 5 // 2 x 1 x 4 = 8.
    cfg = parse_args(f"{FLAGS} --load {tmp_path} --no-load-optim".split())
    state = TrainState()
    restore_train_state(state, _Checkpointer({"iteration": 5, "consumed_samples": 20, **saved}), cfg, None)
    assert (state.iteration, state.consumed_samples, state.consumed_valid_samples) == (5, 20, expected)
    assert resumed_valid_samples(cfg, 5) == 8
    by_samples = FLAGS.replace("--train-iters 4", "--train-samples 16")
    assert resumed_valid_samples(parse_args(by_samples.split()), 5) == 0  # Megatron-LM: only for --train-iters runs


def test_log_lines_are_megatron_lms_in_the_loop_and_after_training():
    from megatron.training.logger import validation_log_lines

    assert " validation loss at iteration 40 | lm loss value: 6.000000E+00 |" in validation_log_lines(40, 6.0)
    final = validation_log_lines(40, 6.0, final=True)
    assert " validation loss at iteration 40 on validation set | lm loss value: 6.000000E+00 |" in final
    test = validation_log_lines(40, 6.0, "test", final=True)
    assert " validation loss at iteration 40 on test set | lm loss value: 6.000000E+00 |" in test


def test_full_validation_reads_the_whole_split_from_its_start_every_time():
    reads = []
    trainer = _trainer(f"{FLAGS} --full-validation", reads)
    valid_len = len(trainer.datasets.valid)
    state = trainer.train()
    assert reads == [("valid", 0), ("valid", 0), ("test", 0)]  # at 2, and at 4 (the last iteration: the final one)
    assert state.consumed_valid_samples == 0 and valid_len == 4  # mock data: one evaluation's worth
    # The same weights and the same samples: evaluated again, the last iteration gives the same loss.
    assert trainer.evaluation.run(trainer.datasets.valid) == state.valid_losses[4]
