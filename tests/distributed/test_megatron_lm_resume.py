"""A Megatron-LM run saved at TP=2 resumes here at TP=2 (gloo, two ranks, distributed optimizer): each rank's
weights and Adam moments are its tensor-parallel shard of the checkpoint's, the RNG streams are Megatron-LM's
ranks', and training continues as the uninterrupted run does (the one-process resume: tests/unit/
test_megatron_lm_resume.py)."""

import math

import torch

from megatron.config import parse_args
from megatron.convert.state import split_tp
from megatron.training import Trainer
from tests.dist_utils import run_distributed
from tests.unit.mlm_writer import by_name, mlm_args, write_mlm
from tests.unit.test_megatron_lm_resume import FLAGS

FORMATS = ["dist_dp", "torch"]


def _body(rank, world_size, roots, reference, cfg, weights, states, step):
    for root in roots:  # one checkpoint per format, of the same run
        flags = f"{FLAGS} --tensor-model-parallel-size 2 --load {root}"
        trainer = Trainer(parse_args(flags.split(), world_size=world_size))
        assert (trainer.state.iteration, trainer.state.consumed_samples) == (3, 24), root
        got, got_states, got_step = by_name(trainer.model, trainer.optimizer)
        assert got_step == step, root
        for name, tensor in weights.items():
            torch.testing.assert_close(got[name], split_tp(name, tensor, cfg, 2)[rank], atol=0, rtol=0, msg=root)
        for kind in states:
            for name, tensor in states[kind].items():
                want = split_tp(name, tensor, cfg, 2)[rank]
                torch.testing.assert_close(got_states[kind][name], want, atol=0, rtol=0, msg=f"{root} {kind} {name}")
        losses = trainer.train().losses
        for i in (4, 5, 6):
            assert math.isclose(losses[i], reference[i], rel_tol=1e-5), (root, i, losses, reference)


def test_a_tp2_megatron_lm_run_resumes_at_tp2(tmp_path):
    """Each format's checkpoint of one run, resumed in one process group."""
    reference = Trainer(parse_args(FLAGS.split(), world_size=1)).train().losses
    trainer = Trainer(parse_args(f"{FLAGS} --exit-interval 3".split(), world_size=1))
    trainer.train()
    weights, states, step = by_name(trainer.model, trainer.optimizer)
    cfg = trainer.model.cfg
    for fmt in FORMATS:
        write_mlm(tmp_path / fmt, fmt, cfg, weights, states, step, mlm_args(cfg, 2, 127, 3, 24))
    roots = [str(tmp_path / fmt) for fmt in FORMATS]
    run_distributed(_body, world_size=2, args=(roots, reference, cfg, weights, states, step))


# ------------------------------------------------------------------ checkpoints Megatron-LM itself wrote (TP=2)


def _real_body(rank, world_size, root, reference):
    import random

    from tests.unit.test_megatron_lm_checkpoints import FLAGS as REAL
    from tests.unit.test_megatron_lm_checkpoints import LAYER_KEYS, raw

    trainer = Trainer(parse_args(f"{REAL} --tensor-model-parallel-size 2 --load {root}".split(), world_size=2))
    assert (trainer.state.iteration, trainer.state.consumed_samples) == (4, 16)
    weights, states, step = by_name(trainer.model, trainer.optimizer)
    cfg = trainer.model.cfg
    keys = [f"decoder.layers.{k}" for k in LAYER_KEYS]
    saved = raw(root, ["output_layer.weight", *keys])
    torch.testing.assert_close(weights["output_layer.weight"], saved["output_layer.weight"].chunk(2)[rank])
    for key in keys:
        name = key.replace("layers.", "layers.1.")
        torch.testing.assert_close(weights[name], split_tp(name, saved[key][1], cfg, 2)[rank], atol=0, rtol=0)
    if reference is not None:  # the optimizer-state fixture: its moments, and Megatron-LM's rank's RNG streams
        assert step == 4
        moments = raw(reference, [f"optimizer.state.exp_avg.{k}" for k in keys])
        for key in keys:
            name = key.replace("layers.", "layers.0.")
            want = split_tp(name, moments[f"optimizer.state.exp_avg.{key}"][0], cfg, 2)[rank]
            torch.testing.assert_close(states["exp_avg"][name], want, atol=0, rtol=0)
        from megatron.convert.mlm_resume import read_resume

        assert random.getstate() == read_resume(root, load_optim=False).rng[(0, rank)]["python"]
    losses = trainer.train().losses
    assert set(losses) == {5, 6} and all(6.5 < v < 7.2 for v in losses.values()), losses


def test_checkpoints_megatron_lm_wrote_resume_at_tp2():
    from tests.unit.test_megatron_lm_checkpoints import ASSET, FIXTURES

    run_distributed(_real_body, world_size=2, args=(ASSET, None))
    if (FIXTURES / "td_full").is_dir():
        run_distributed(_real_body, world_size=2, args=(FIXTURES / "td_bf16", FIXTURES / "td_full"))
