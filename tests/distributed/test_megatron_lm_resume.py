"""A Megatron-LM run saved at TP=2 resumes here at TP=2 (gloo, two ranks, distributed optimizer): each rank's
weights and Adam moments are its tensor-parallel shard of the checkpoint's, the RNG streams are Megatron-LM's
ranks', and training continues as the uninterrupted run does (the one-process resume: tests/unit/
test_megatron_lm_resume.py)."""

import math

import pytest
import torch

from megatron.config import parse_args
from megatron.convert.state import split_tp
from megatron.training import Trainer
from tests.dist_utils import run_distributed
from tests.unit.mlm_writer import by_name, mlm_args, write_mlm
from tests.unit.test_megatron_lm_resume import FLAGS


def _body(rank, world_size, root, reference, cfg, weights, states, step):
    flags = f"{FLAGS} --tensor-model-parallel-size 2 --load {root}"
    trainer = Trainer(parse_args(flags.split(), world_size=world_size))
    assert (trainer.state.iteration, trainer.state.consumed_samples) == (3, 24)
    got, got_states, got_step = by_name(trainer.model, trainer.optimizer)
    assert got_step == step
    for name, tensor in weights.items():
        torch.testing.assert_close(got[name], split_tp(name, tensor, cfg, 2)[rank], atol=0, rtol=0)
    for kind in states:
        for name, tensor in states[kind].items():
            want = split_tp(name, tensor, cfg, 2)[rank]
            torch.testing.assert_close(got_states[kind][name], want, atol=0, rtol=0, msg=f"{kind} {name}")
    losses = trainer.train().losses
    for i in (4, 5, 6):
        assert math.isclose(losses[i], reference[i], rel_tol=1e-5), (i, losses, reference)


@pytest.mark.parametrize("fmt", ["dist_dp", "torch"])
def test_a_tp2_megatron_lm_run_resumes_at_tp2(tmp_path, fmt):
    reference = Trainer(parse_args(FLAGS.split(), world_size=1)).train().losses
    trainer = Trainer(parse_args(f"{FLAGS} --exit-interval 3".split(), world_size=1))
    trainer.train()
    weights, states, step = by_name(trainer.model, trainer.optimizer)
    cfg = trainer.model.cfg
    write_mlm(tmp_path / fmt, fmt, cfg, weights, states, step, mlm_args(cfg, 2, 127, 3, 24))
    run_distributed(_body, world_size=2, args=(str(tmp_path / fmt), reference, cfg, weights, states, step))
