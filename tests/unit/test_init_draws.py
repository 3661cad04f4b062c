"""The initial weights drawn part by part in a pool of threads (megatron/model/init_draws.py) are bitwise the weights
drawn one after another from the global generator, as the model drew them before the pool."""

import contextlib
from functools import partial

import pytest
import torch

from megatron.config import parse_args
from megatron.model import GPTModel, gpt, init_draws
from megatron.model.init_draws import init_normal, parallel_draws, seeded
from megatron.model.te_linear import sharded_normal_init
from megatron.parallel.tensor_parallel import TensorParallel


def test_a_generator_of_its_own_draws_what_the_seeded_global_one_draws():
    for seed in (0, 1234, 2**31 - 2):
        for shape in ((5,), (17,), (96, 40), (1000, 33)):
            torch.manual_seed(seed)
            want = [torch.empty(shape).normal_(0.0, std) for std in (0.02, 0.003)]
            generator = torch.Generator().manual_seed(seed)
            got = [torch.empty(shape).normal_(0.0, std, generator=generator) for std in (0.02, 0.003)]
            assert all(torch.equal(a, b) for a, b in zip(want, got))


def _parts(weights: dict[str, torch.Tensor], defer_second: bool = True) -> None:
    """Three parts in the model's manner: several draws each, of different shapes, stds and tensor-parallel slices
    (a column-parallel SwiGLU [gate; up], a row-parallel one, TE's init function), into bf16 and fp32 weights."""
    tp = TensorParallel(None, 2, 1)
    with seeded(11):
        init_normal(weights["a1"], (64, 24), 0.02, partial(tp.shard, dim=0, parts=2))
        init_normal(weights["a2"], (24, 40), 0.01, partial(tp.shard, dim=1))
    with seeded(12, defer=defer_second):
        init_normal(weights["b1"], (7, 9), 0.5)
        sharded_normal_init(0.03, tp, 0)(weights["b2"])
    with seeded(13):
        init_normal(weights["c1"], (300, 16), 0.02)


def _weights() -> dict[str, torch.Tensor]:
    shapes = {"a1": (32, 24), "a2": (24, 20), "b1": (7, 9), "b2": (20, 8), "c1": (300, 16)}
    return {
        k: torch.full(s, float("nan"), dtype=torch.bfloat16 if k < "c" else torch.float32) for k, s in shapes.items()
    }


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("defer_second", [True, False])
def test_deferred_parts_in_threads_draw_the_immediate_draws(threads, defer_second):
    before = torch.get_rng_state()
    immediate = _weights()
    _parts(immediate)  # outside parallel_draws: at once, from the global generator, as before the pool
    assert torch.equal(torch.get_rng_state(), before)
    deferred = _weights()
    with parallel_draws(threads):
        _parts(deferred, defer_second)
        assert deferred["a1"].isnan().all() and bool(deferred["b1"].isnan().all()) == defer_second
    assert torch.equal(torch.get_rng_state(), before)  # neither moves the global generator
    for name, value in immediate.items():
        assert not value.isnan().any() and torch.equal(deferred[name], value), name


def _model(flags: str, threads: int) -> dict[str, torch.Tensor]:
    cfg = parse_args(
        f"--mock-data --num-layers 3 --hidden-size 64 --num-attention-heads 4 --seq-length 16 {flags}".split(),
        world_size=1,
    )
    torch.manual_seed(1234)
    model = GPTModel(cfg.model, 256, torch.bfloat16, init_threads=threads)
    return model.state_dict()


@pytest.mark.parametrize(
    "flags",
    [
        "--vocab-size 200",  # tied, learned absolute positions
        "--vocab-size 200 --untie-embeddings-and-output-weights --swiglu --position-embedding-type rope"
        " --group-query-attention --num-query-groups 2 --disable-bias-linear --normalization RMSNorm",
    ],
)
def test_a_model_drawn_in_threads_is_bitwise_the_model_drawn_one_part_after_another(flags, monkeypatch):
    threaded = _model(flags, threads=4)
    monkeypatch.setattr(gpt, "parallel_draws", lambda threads: contextlib.nullcontext())  # every draw at once
    old = _model(flags, threads=1)
    assert threaded.keys() == old.keys()
    for name, value in old.items():
        assert torch.equal(threaded[name], value), name


def test_a_draw_that_fails_in_a_thread_raises():
    with pytest.raises(RuntimeError, match="size"):
        with parallel_draws(2):
            with seeded(1):
                init_normal(torch.empty(3, 3), (4, 4), 0.02)  # a full matrix that is no shard of the weight
            with seeded(2):
                init_normal(torch.empty(2), (2,), 0.02)
    assert init_draws._deferred.get() is None
