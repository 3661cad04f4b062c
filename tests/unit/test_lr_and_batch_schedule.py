"""Learning-rate schedule styles and units, batch-size ramps, and the flags' one-line errors (hand-computed values)."""

import math
import shlex

import pytest

from megatron.config import ConfigError, parse_args
from megatron.config.batch_schedule import BatchSchedule, parse_count, parse_step_schedule, train_iterations
from megatron.optim.schedule import LRSchedule

BASE = "--mock-data --vocab-size 128 --seq-length 64"


def parse(extra: str, world_size: int = 1):
    return parse_args(shlex.split(f"{BASE} {extra}"), world_size=world_size)


def schedule(extra: str) -> LRSchedule:
    cfg = parse(extra)
    return LRSchedule.from_config(cfg.optimizer, cfg.training.global_batch_size)


def test_warmup_init_and_fraction():
    # decay 100 iterations x 4 samples; warmup 10% of it = 40 samples, from 0.1 to 1.0
    s = schedule(
        "--lr 1 --min-lr 0 --lr-warmup-init 0.1 --lr-warmup-fraction 0.1 --lr-decay-style linear"
        " --train-iters 100 --micro-batch-size 4"
    )
    assert s.warmup == 40 and s.decay == 400
    assert s.lr(0) == pytest.approx(0.1)
    assert s.lr(20) == pytest.approx(0.55)
    assert s.lr(40) == pytest.approx(1.0)
    assert s.lr(220) == pytest.approx(0.5)  # halfway through the linear decay
    assert s.lr(401) == 0.0


@pytest.mark.parametrize(
    "style, expected",
    [  # anneal over the last 20 of 100 samples: at sample 90 a = 0.5
        ("exponential", 2 * 0.5**0.5 - 1),
        ("linear", 0.5),
        ("cosine", 0.5),
        ("minus_sqrt", 1 - math.sqrt(0.5)),
    ],
)
def test_wsd_each_decay_style(style, expected):
    s = schedule(
        f"--lr 2 --min-lr 1 --lr-decay-style WSD --lr-wsd-decay-style {style} --train-samples 100"
        " --lr-wsd-decay-samples 20 --lr-warmup-samples 10 --micro-batch-size 1"
    )
    assert s.lr(5) == pytest.approx(1.0)  # warmup from 0
    assert s.lr(50) == 2.0 and s.lr(80) == 2.0  # stable
    assert s.lr(90) == pytest.approx(1 + expected)
    assert s.lr(100) == pytest.approx(1.0)


def test_wsd_in_iterations_and_inverse_square_root():
    s = schedule(
        "--lr 1 --lr-decay-style WSD --lr-wsd-decay-style linear --train-iters 10 --lr-wsd-decay-iters 4"
        " --micro-batch-size 2"
    )
    assert s.wsd_decay == 8 and [s.lr(2 * i) for i in (6, 8, 10)] == pytest.approx([1.0, 0.5, 0.0])
    s = schedule(
        "--lr 1 --min-lr 0.1 --lr-decay-style inverse-square-root --lr-warmup-samples 4 --train-samples 100"
        " --micro-batch-size 1"
    )
    assert s.lr(16) == pytest.approx(0.5) and s.lr(10000) == 0.1


@pytest.mark.parametrize("style", ["linear", "cosine", "constant"])
def test_samples_and_iterations_give_the_same_curve(style):
    common = f"--lr 1 --min-lr 0.1 --lr-decay-style {style} --micro-batch-size 2 --global-batch-size 8"
    by_iters = schedule(f"{common} --train-iters 50 --lr-warmup-iters 5 --lr-decay-iters 40")
    by_samples = schedule(f"{common} --train-samples 400 --lr-warmup-samples 40 --lr-decay-samples 320")
    for step in range(50):
        assert by_iters.lr(8 * step) == pytest.approx(by_samples.lr(8 * step), rel=1e-12)


def test_decoupled_lr_same_shape():
    s = schedule(
        "--lr 1 --min-lr 0.1 --decoupled-lr 4 --decoupled-min-lr 0.4 --lr-decay-style cosine"
        " --train-iters 10 --lr-warmup-iters 2 --micro-batch-size 1"
    )
    for n in range(12):
        rates = s.at(n)
        assert rates.decoupled == pytest.approx(4 * rates.default)
    assert schedule("--lr 1 --min-lr 0.1 --decoupled-lr 2 --train-iters 4").at(100).decoupled == 0.1  # min: --min-lr


def test_step_schedule_of_the_gpt3_175b_script():
    text = "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"
    assert parse_count("2.4B") == 2_400_000_000 and parse_count("12b") == 12 * 10**9 and parse_count("5K") == 5000
    assert parse_step_schedule(text, 2048)[:3] == [(0, 16), (1171875, 320), (2343750, 624)]
    cfg = parse(
        f"--micro-batch-size 1 --global-batch-size 1536 --step-batch-size-schedule '{text}' --seq-length 2048"
        " --train-iters 500000 --lr-warmup-fraction .001 --lr-decay-iters 430000",
        world_size=8,
    )
    b = BatchSchedule.from_config(cfg)
    assert cfg.training.global_batch_size == 1536 and cfg.num_micro_batches == 192
    assert [b.global_batch_size(n) for n in (0, 1171874, 1171875, 6 * 10**6)] == [16, 16, 320, 1536]
    assert [b.num_micro_batches(n) for n in (0, 1171875, 2343750)] == [2, 40, 78]
    # 1171875 / 16 steps at 16 (rounded up), then 320 until 2343750, ...
    assert b.samples_after(73243) == 1171888
    assert b.global_batch_size(b.samples_after(73243)) == 320  # 73243 x 16 = 1171888 >= 1171875
    assert b.global_batch_size(b.samples_after(73242)) == 16


def test_rampup_batch_size_and_train_samples():
    # 4 -> 16 by 4: three increments over 30 samples, one every 10
    cfg = parse(
        "--micro-batch-size 2 --global-batch-size 16 --rampup-batch-size 4 4 30 --train-samples 100", world_size=2
    )
    b = BatchSchedule.from_config(cfg)
    assert b.phases == ((0, 4), (10, 8), (20, 12), (30, 16))
    steps = []
    consumed = 0
    while consumed < 100:
        steps.append((b.global_batch_size(consumed), b.num_micro_batches(consumed)))
        consumed += steps[-1][0]
    # 0,4,8 -> 12 (batch 8) -> 20 (12) -> 32, 48, 64, 80, 96 (16) -> 112
    assert steps == [(4, 1), (4, 1), (4, 1), (8, 2), (12, 3), (16, 4), (16, 4), (16, 4), (16, 4), (16, 4)]
    assert train_iterations(cfg) == 10 and b.samples_after(10) == 112
    constant = parse("--micro-batch-size 2 --global-batch-size 16 --train-samples 100")
    assert train_iterations(constant) == 6  # a last partial batch is dropped


@pytest.mark.parametrize(
    "extra, message",
    [
        ("--train-iters 10 --train-samples 100", "--train-iters and --train-samples both given"),
        ("--train-iters 10 --lr-decay-samples 100", "--lr-decay-samples is for sample-based training"),
        ("--train-samples 100 --lr-warmup-iters 5", "--lr-warmup-iters is for iteration-based training"),
        ("--train-samples 100 --lr-wsd-decay-iters 5", "--lr-wsd-decay-iters is for iteration-based"),
        ("--lr-warmup-fraction 0.1 --lr-warmup-iters 5", "--lr-warmup-fraction and --lr-warmup-iters"),
        ("--lr-decay-style WSD --train-iters 10", "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
        ("--decoupled-min-lr 0.1", "--decoupled-min-lr needs --decoupled-lr"),
        ("--lr 1 --lr-warmup-init 2", "--lr-warmup-init (2.0) must be in [0, --lr (1.0)]"),
        ("--global-batch-size 8 --step-batch-size-schedule 0:4,100:16", "differs from the last batch size"),
        ("--step-batch-size-schedule 64:4,640:16", "the first threshold must be 0"),
        ("--global-batch-size 16 --rampup-batch-size 4 5 100", "must be a non-negative multiple of the increment"),
        ("--rampup-batch-size 4 4 10 --step-batch-size-schedule 0:4", "use one batch-size schedule"),
        ("--micro-batch-size 4 --global-batch-size 16 --rampup-batch-size 2 2 10", "not a multiple of"),
    ],
)
def test_one_line_errors(extra, message):
    with pytest.raises(ConfigError) as err:
        cfg = parse(extra)
        BatchSchedule.from_config(cfg).check_from(0, train_iterations(cfg))
    assert message in str(err.value) and "\n" not in str(err.value)
