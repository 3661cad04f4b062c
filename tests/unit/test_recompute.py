"""Activation recomputation (megatron/model/recompute.py): every granularity, method and module gives the losses and
gradients of no recomputation bitwise in fp32, dropout on; with local FP8 delayed scaling the amax histories and
scales match too; the plan covers the layers Megatron-LM's does; the flags' errors are one line."""

from __future__ import annotations

import pytest
import torch

from megatron.config import ConfigError, parse_args
from megatron.data.mock import MockGPTDataset
from megatron.fp8 import attach_fp8
from megatron.model import GPTModel
from megatron.model.recompute import RecomputePlan, checkpoint, splits_units
from megatron.training.memory import estimate_bytes

BASE = (
    "--mock-data --vocab-size 128 --num-layers 3 --hidden-size 32 --num-attention-heads 2 --seq-length 16"
    " --hidden-dropout 0.1 --attention-dropout 0.1 --attention-backend unfused"
)
STEPS, BATCH = 2, 2

RECOMPUTE = [
    "--recompute-activations",
    "--recompute-granularity selective",
    "--recompute-granularity selective --recompute-modules mlp",
    "--recompute-granularity selective --recompute-modules layernorm",
    "--recompute-granularity selective --recompute-modules core_attn mlp layernorm",
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
    "--recompute-granularity full --recompute-method block --recompute-num-layers 2",
]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = MockGPTDataset(STEPS * BATCH, 16, 128, eod=127, seed=1)
    samples = [data[step * BATCH + i] for i in range(BATCH)]
    return torch.stack([s["tokens"] for s in samples]), torch.stack([s["labels"] for s in samples])


def run(flags: str, extra: str = "") -> tuple[list[float], list[dict[str, torch.Tensor]], object, GPTModel]:
    """A few training steps (SGD) from seed 0 and the same data; the losses and each step's gradients."""
    cfg = parse_args(f"{BASE} {extra} {flags}".split())
    torch.manual_seed(0)
    model = GPTModel(cfg.model, 128)
    manager = attach_fp8(model, cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    torch.manual_seed(1234)  # the dropout stream
    for step in range(STEPS):
        tokens, labels = batch(step)
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        if manager is None or manager.step():
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads, manager, model


@pytest.fixture(scope="module")
def reference():
    return run("")


@pytest.mark.parametrize("flags", RECOMPUTE)
def test_same_losses_and_gradients_as_no_recomputation_bitwise(flags, reference):
    losses, grads, _, model = run(flags)
    ref_losses, ref_grads, _, _ = reference
    assert losses == ref_losses
    for got, want in zip(grads, ref_grads):
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name
    assert model.describe()[0].startswith("activation recomputation:")
    assert "model FLOPs" in model.describe()[0]


def test_recomputation_really_drops_activations():
    """Fewer bytes kept by the forward for backward: the checkpoints are not bypassed."""

    def saved_bytes(flags: str) -> int:
        cfg = parse_args(f"{BASE} {flags}".split())
        torch.manual_seed(0)
        model = GPTModel(cfg.model, 128)
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        tokens, labels = batch(0)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(tokens, labels=labels).mean()
        kept = total  # what the forward keeps (the recomputation in backward saves more, for a moment)
        loss.backward()
        return kept

    plain = saved_bytes("")
    full = saved_bytes("--recompute-granularity full --recompute-method uniform --recompute-num-layers 3")
    mlp = saved_bytes("--recompute-granularity selective --recompute-modules mlp")
    assert full < mlp < plain


@pytest.mark.parametrize(
    "recipe,recompute",
    [
        ("delayed", "--recompute-granularity full --recompute-method uniform --recompute-num-layers 2"),
        ("delayed", "--recompute-granularity selective --recompute-modules core_attn mlp layernorm"),
        ("tensorwise", "--recompute-granularity full --recompute-method block --recompute-num-layers 2"),
    ],
)
def test_local_fp8_amax_histories_and_scales_match(recipe, recompute):
    fp8 = f"--fp8-format hybrid --fp8-recipe {recipe} --fp8-amax-history-len 4 --fp8-amax-compute-algo max"
    ref_losses, ref_grads, ref_manager, _ = run("", fp8)
    losses, grads, manager, _ = run(recompute, fp8)
    assert losses == ref_losses
    for got, want in zip(grads, ref_grads):
        assert all(torch.equal(got[name], want[name]) for name in want)
    want, got = ref_manager.state_dict(), manager.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        if isinstance(want[key], torch.Tensor):
            assert torch.equal(got[key], want[key]), key
    if recipe == "delayed":
        assert bool((want["amax_history"] > 0).any())


def test_plan_layers_follow_megatron():
    def plan(flags: str) -> RecomputePlan:
        return RecomputePlan.from_config(parse_args(f"{BASE} --num-layers 5 {flags}".split()).model)

    uniform = plan("--recompute-granularity full --recompute-method uniform --recompute-num-layers 2")
    assert uniform.chunks(5) == [(0, 2, True), (2, 4, True), (4, 5, True)]
    block = plan("--recompute-granularity full --recompute-method block --recompute-num-layers 2")
    assert block.chunks(5) == [(0, 1, True), (1, 2, True), (2, 3, False), (3, 4, False), (4, 5, False)]
    assert block.recomputed_layers(5) == 2 and block.recomputed_layers(1) == 1
    assert plan("--recompute-activations").modules == {"core_attn"}  # Megatron-LM's default module
    assert plan("").chunks(5) == [(0, 5, False)]


def test_runs_that_split_fsdp_units():
    """Full recomputation must not recompute part of an FSDP unit of several layers (`check_units_whole`)."""
    uniform = lambda n: RecomputePlan("full", "uniform", n)  # noqa: E731
    assert not splits_units(uniform(2), (2, 2, 1), 5)
    assert not splits_units(uniform(4), (2, 2), 4)  # a run of two whole units
    assert splits_units(uniform(1), (2, 2), 4)
    assert splits_units(uniform(3), (2, 2), 4)
    assert splits_units(RecomputePlan("full", "block", 1), (2, 2), 4)  # the first layer alone
    assert not splits_units(RecomputePlan("full", "block", 1), (1, 1, 1), 3)
    assert not splits_units(RecomputePlan("selective", None, None, frozenset({"mlp"})), (2, 2), 4)


def test_checkpoint_restores_the_rng_of_the_first_forward():
    x = torch.randn(64, requires_grad=True)
    torch.manual_seed(7)
    expected_mask = torch.nn.functional.dropout(torch.ones(64), 0.5)
    after = torch.rand(1)
    torch.manual_seed(7)
    y = checkpoint(lambda t: torch.nn.functional.dropout(t, 0.5), x)
    y.sum().backward()  # the recomputation inside must not move the stream either
    assert torch.equal(torch.rand(1), after)
    assert torch.equal(x.grad, expected_mask)


def test_memory_estimate_counts_recomputation():
    def activations(flags: str) -> float:
        cfg = parse_args(f"{BASE} --num-layers 8 {flags}".split())
        return estimate_bytes(cfg, 10**6, 128, torch.bfloat16)["activations"]

    plain = activations("")
    full = activations("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    block = activations("--recompute-granularity full --recompute-method block --recompute-num-layers 4")
    mlp = activations("--recompute-granularity selective --recompute-modules mlp")
    assert full < block < plain and full < mlp < plain
    assert activations("--recompute-activations") == plain  # core_attn: SDPA keeps no s x s matrix anyway


@pytest.mark.parametrize(
    "flags,match",
    [
        ("--recompute-granularity full", "--recompute-granularity full needs --recompute-method"),
        ("--recompute-granularity full --recompute-method uniform", "--recompute-num-layers between 1 and"),
        ("--recompute-granularity full --recompute-method block --recompute-num-layers 9", "between 1 and"),
        ("--recompute-method uniform", "--recompute-method needs --recompute-granularity full"),
        ("--recompute-num-layers 1", "--recompute-num-layers needs --recompute-granularity full"),
        ("--recompute-modules mlp", "--recompute-modules needs --recompute-granularity selective"),
        ("--recompute-granularity selective --recompute-method uniform", "--recompute-method applies to"),
        ("--recompute-granularity selective --recompute-num-layers 1", "--recompute-num-layers applies to"),
        ("--recompute-granularity selective --recompute-modules moe", "--recompute-modules moe: this model"),
        ("--recompute-activations --recompute-granularity full", "--recompute-activations means"),
        (
            "--recompute-granularity full --recompute-method block --recompute-num-layers 1 --recompute-modules mlp",
            "--recompute-modules applies to",
        ),
    ],
)
def test_config_errors_are_one_line(flags, match):
    with pytest.raises(ConfigError, match=match) as err:
        parse_args(f"{BASE} {flags}".split())
    assert "\n" not in str(err.value)
