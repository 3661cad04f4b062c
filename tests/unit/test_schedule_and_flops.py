"""Learning-rate schedule values and the FLOPs formula against hand calculations."""

import math

import pytest

from megatron.config import OptimizerConfig, parse_args
from megatron.optim.schedule import LRSchedule
from megatron.training.flops import num_floating_point_operations


def sched(style, warmup=10, decay=110, lr=1.0, min_lr=0.1):
    return OptimizerConfig(lr=lr, min_lr=min_lr, lr_decay_style=style, lr_warmup_iters=warmup, lr_decay_iters=decay)


def test_warmup_is_linear_from_zero():
    cfg = sched("cosine")
    assert [LRSchedule.from_config(cfg).lr(s) for s in (0, 5, 10)] == [0.0, 0.5, 1.0]


@pytest.mark.parametrize(
    "style, step, expected",
    [
        ("constant", 60, 1.0),
        ("constant", 500, 1.0),
        ("linear", 60, 0.1 + 0.9 * 0.5),
        ("linear", 85, 0.1 + 0.9 * 0.25),
        ("cosine", 60, 0.1 + 0.9 * 0.5),
        ("cosine", 35, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25))),
        ("cosine", 110, 0.1),
        ("cosine", 200, 0.1),
        ("linear", 200, 0.1),
    ],
)
def test_decay_values(style, step, expected):
    assert LRSchedule.from_config(sched(style)).lr(step) == pytest.approx(expected, rel=1e-12)


def test_flops_gpt2_style_by_hand():
    cfg = parse_args(
        "--mock-data --vocab-size 1000 --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32".split()
    )
    b, s, h, layers, v, f = 3, 32, 64, 2, 1024, 256
    per_token_fwd = (
        layers
        * (
            2 * h * 3 * h  # QKV
            + 2 * s * h * 2  # QK^T and AV, full (non-causal) s x s
            + 2 * h * h  # projection
            + 2 * h * f * 2  # fc1 + fc2
        )
        + 2 * h * v
    )  # logits
    assert num_floating_point_operations(cfg.model, b, v) == pytest.approx(3 * b * s * per_token_fwd, rel=1e-12)


def test_flops_llama_style_by_hand():
    cfg = parse_args(
        "--mock-data --vocab-size 1000 --num-layers 3 --hidden-size 128 --num-attention-heads 8"
        " --group-query-attention --num-query-groups 2 --swiglu --ffn-hidden-size 320 --seq-length 64"
        " --position-embedding-type rope".split()
    )
    b, s, h, layers, v, f, hn = 2, 64, 128, 3, 1024, 320, 16
    q, kv = 8 * hn, 2 * hn
    per_token_fwd = layers * (2 * h * (q + 2 * kv) + 2 * s * q * 2 + 2 * q * h + 2 * h * 2 * f + 2 * f * h) + 2 * h * v
    assert num_floating_point_operations(cfg.model, b, v) == pytest.approx(3 * b * s * per_token_fwd, rel=1e-12)
