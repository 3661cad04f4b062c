"""`pretrain_gpt.py --load MLM_DIR`: a Megatron-LM run resumes here (weights, Adam's main params and moments, step,
iteration, consumed samples, schedule, RNG) from each of its checkpoint formats, written at TP=2 and resumed in one
process (TP=1), continuing as the uninterrupted run does; --finetune takes the weights only; what cannot be mapped
stops with one line naming the flag that does without it. The distributed (TP=2) resume: tests/distributed/
test_megatron_lm_resume.py; checkpoints Megatron-LM itself wrote: test_megatron_lm_checkpoints.py."""

import math

import pytest
import torch

from megatron.config import parse_args
from megatron.convert import read_mlm
from megatron.convert.mlm_resume import is_megatron_lm
from megatron.errors import UserError
from megatron.training import Trainer
from tests.unit.mlm_writer import by_name, mlm_args, write_mlm

FLAGS = (
    "--mock-data --vocab-size 127 --make-vocab-size-divisible-by 64 --num-layers 2 --hidden-size 32"
    " --num-attention-heads 4 --group-query-attention --num-query-groups 2 --seq-length 16 --swiglu"
    " --ffn-hidden-size 64 --position-embedding-type rope --normalization RMSNorm --micro-batch-size 2"
    " --global-batch-size 8 --lr 1e-2 --min-lr 0 --lr-decay-style linear --hidden-dropout 0 --attention-dropout 0"
    " --eval-iters 1 --eval-interval 1000 --log-interval 100 --transformer-impl local --train-iters 6"
    " --use-distributed-optimizer --disable-bias-linear"
)
FORMATS = ["dist_dp", "dist_fully", "dist_old", "torch"]


@pytest.fixture(scope="module")
def run():
    """The uninterrupted run's losses, and its state after iteration 3 (the Megatron-LM checkpoint's content)."""
    reference = Trainer(parse_args(FLAGS.split(), world_size=1)).train().losses
    trainer = Trainer(parse_args(f"{FLAGS} --exit-interval 3".split(), world_size=1))
    trainer.train()
    weights, states, step = by_name(trainer.model, trainer.optimizer)
    return reference, trainer.model.cfg, weights, states, step


def _write(tmp_path, run, fmt, tp=2, **extra):
    _, cfg, weights, states, step = run
    args = mlm_args(cfg, tp, 127, 3, 24, **extra)
    write_mlm(tmp_path / fmt, fmt, cfg, weights, states, step, args)
    return tmp_path / fmt


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_resumes_and_continues(tmp_path, run, fmt, capsys):
    reference, _, weights, states, step = run
    root = _write(tmp_path, run, fmt)
    assert is_megatron_lm(root)
    trainer = Trainer(parse_args(f"{FLAGS} --load {root}".split(), world_size=1))
    assert (trainer.state.iteration, trainer.state.consumed_samples) == (3, 24)
    got, got_states, got_step = by_name(trainer.model, trainer.optimizer)
    assert got_step == step
    for name, tensor in weights.items():
        torch.testing.assert_close(got[name], tensor, atol=0, rtol=0)
    for kind in states:  # every moment on its own parameter, bit for bit
        for name, tensor in states[kind].items():
            torch.testing.assert_close(got_states[kind][name], tensor, atol=0, rtol=0, msg=f"{kind} {name}")
    losses = trainer.train().losses
    assert set(losses) == {4, 5, 6}
    for i in (4, 5, 6):
        assert math.isclose(losses[i], reference[i], rel_tol=1e-6), (i, losses, reference)
    out = capsys.readouterr().out
    assert "successfully loaded checkpoint" in out and "(Megatron-LM)" in out
    assert "vocabulary padded to 256 rows in the checkpoint, 128 here" in out


def test_finetune_takes_the_weights_only(tmp_path, run):
    root = _write(tmp_path, run, "dist_dp")
    trainer = Trainer(parse_args(f"{FLAGS} --load {root} --finetune".split(), world_size=1))
    assert trainer.state.iteration == 0 and trainer.state.consumed_samples == trainer.state.consumed_valid_samples == 0
    _, states, step = by_name(trainer.model, trainer.optimizer)
    assert step == 0 and all(float(t.abs().max()) == 0 for t in states["exp_avg"].values())
    torch.testing.assert_close(
        dict(trainer.model.named_parameters())["decoder.final_layernorm.weight"].detach(),
        run[2]["decoder.final_layernorm.weight"],
    )


def test_no_load_optim_keeps_the_position_and_starts_adam_afresh(tmp_path, run):
    root = _write(tmp_path, run, "torch", consumed_valid_samples=40)
    trainer = Trainer(parse_args(f"{FLAGS} --load {root} --no-load-optim --no-load-rng".split(), world_size=1))
    # Megatron-LM's load_checkpoint takes iteration, consumed_train_samples and consumed_valid_samples from the
    # checkpoint's args whatever --no-load-optim/--no-load-rng say (only --finetune starts them at 0)
    assert (trainer.state.iteration, trainer.state.consumed_samples, trainer.state.consumed_valid_samples) == (
        3,
        24,
        40,
    )
    _, states, step = by_name(trainer.model, trainer.optimizer)
    assert step == 0 and all(float(t.abs().max()) == 0 for t in states["exp_avg_sq"].values())


@pytest.mark.parametrize(
    "fmt,extra,match",
    [  # the args say --overlap-grad-reduce with 1000-element buckets, the checkpoint holds one bucket
        ("dist_dp", {"overlap_grad_reduce": True, "ddp_bucket_size": 1000}, "buckets hold .* --no-load-optim"),
        # the args say the local layer spec (norms first in each layer), the buckets hold the TE spec's order
        ("dist_dp", {"transformer_impl": "local"}, "main params of .* are not its weights.* --no-load-optim"),
        ("dist_sgd", {"optimizer": "sgd"}, r"\(sgd\) lacks Adam's exp_avg of .* --no-load-optim"),
        ("dist_unknown", {}, "optimizer state .optimizer.layer_wise.* is in a layout not read here.* --no-load-optim"),
    ],
)
def test_what_cannot_be_mapped_stops_in_one_line(tmp_path, run, fmt, extra, match):
    """An optimizer state the reader does not map: one line naming --no-load-optim (never a silent fresh
    optimizer); with it the run resumes."""
    root = _write(tmp_path, run, fmt, **extra)
    with pytest.raises(UserError, match=match) as err:
        Trainer(parse_args(f"{FLAGS} --load {root}".split(), world_size=1))
    assert "\n" not in str(err.value)
    assert Trainer(parse_args(f"{FLAGS} --load {root} --no-load-optim".split(), world_size=1)).state.iteration == 3


@pytest.mark.parametrize("name", [None, "apply_layernorm_1p", "layernorm_zero_centered_gamma"])
def test_zero_centred_norms_are_read_under_either_name(tmp_path, run, name):
    """--apply-layernorm-1p: older Megatron-LM checkpoints name it `apply_layernorm_1p` in their args, today's
    `layernorm_zero_centered_gamma` (its TransformerConfig field); either one means zero-centred norm weights."""
    root = _write(tmp_path, run, "torch", **({name: True} if name else {}))
    assert read_mlm(root, log=lambda *_: None).model.apply_layernorm_1p == (name is not None)
