"""A tiny GPT trained on CPU with each FP8 recipe and format, against the unquantized run; attach_fp8's contract."""

from __future__ import annotations

import io

import pytest
import torch

from megatron.config import ConfigError, parse_args
from megatron.data.mock import MockGPTDataset
from megatron.fp8 import RECIPES, attach_fp8
from megatron.model import GPTModel

BASE = (
    "--mock-data --vocab-size 128 --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32"
    " --hidden-dropout 0 --attention-dropout 0"
)
STEPS, BATCH, LR = 24, 4, 3e-3
LOSS_TOLERANCE = 0.1
"""nats, on the mean loss of the last 4 steps; the unquantized run's loss falls by ~0.9 over these 24 steps, so
a broken FP8 path (no learning, or a wrong gradient) lands far outside."""


def build(flags: str):
    cfg = parse_args(f"{BASE} {flags}".split())
    torch.manual_seed(0)
    model = GPTModel(cfg.model, 128)
    return cfg, model, attach_fp8(model, cfg)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = MockGPTDataset(STEPS * BATCH, 32, 128, eod=127, seed=1)
    samples = [data[step * BATCH + i] for i in range(BATCH)]
    return torch.stack([s["tokens"] for s in samples]), torch.stack([s["labels"] for s in samples])


def train(model, manager, optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        tokens, labels = batch(step)
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        if manager is None or manager.step():
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def final_loss(flags: str) -> tuple[float, list[float]]:
    _, model, manager = build(flags)
    losses = train(model, manager, torch.optim.AdamW(model.parameters(), lr=LR), range(STEPS))
    return sum(losses[-4:]) / 4, losses


@pytest.fixture(scope="module")
def unquantized() -> float:
    loss, losses = final_loss("")
    assert losses[0] - loss > 0.6  # the baseline learns, so the comparison below means something
    return loss


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_tiny_gpt_trains_with_each_recipe_like_the_unquantized_run(recipe, fmt, unquantized):
    loss, _ = final_loss(f"--fp8-format {fmt} --fp8-recipe {recipe}")
    assert abs(loss - unquantized) < LOSS_TOLERANCE, (loss, unquantized)


def test_first_and_last_layers_stay_unquantized():
    flags = "--num-layers 3 --fp8-format e4m3 --fp8-recipe tensorwise --first-last-layers-bf16"
    cfg = parse_args(f"{BASE} {flags}".split())
    torch.manual_seed(0)
    model = GPTModel(cfg.model, 128)
    reference = GPTModel(cfg.model, 128)
    reference.load_state_dict(model.state_dict())
    manager = attach_fp8(model, cfg)
    layers = model.decoder.layers
    assert all(m.fp8 is None for layer in (layers[0], layers[2]) for m in _linears(layer))
    assert all(m.fp8 is not None and m.fp8.enabled for m in _linears(layers[1]))
    assert len(manager.states) == 4 and all(".layers.1." in name for name in manager.states)
    assert "layers 1, 3 kept in high precision" in "\n".join(manager.describe())

    outputs: dict[str, list[torch.Tensor]] = {"fp8": [], "ref": []}
    for key, net in (("fp8", model), ("ref", reference)):
        for layer in net.decoder.layers:
            layer.register_forward_hook(lambda mod, args, out, key=key: outputs[key].append(out.detach()))
        net(batch(0)[0])
    assert torch.equal(outputs["fp8"][0], outputs["ref"][0])  # layer 1: bit-identical, never quantized
    assert not torch.allclose(outputs["fp8"][1], outputs["ref"][1], rtol=1e-4, atol=1e-6)  # layer 2: FP8


@pytest.mark.parametrize(
    ("flags", "layers"),
    [
        ("", [2, 3, 4]),  # the default: the first layer, which reads the embeddings, stays in bf16
        ("--no-fp8-first-layer-bf16", [1, 2, 3, 4]),  # Megatron-LM's default
        ("--first-last-layers-bf16 --num-layers-at-end-in-bf16 2", [2]),  # Megatron's counts replace ours
        ("--first-last-layers-bf16 --num-layers-at-start-in-bf16 0", [1, 2, 3]),
    ],
)
def test_which_layers_run_in_fp8(flags, layers):
    precision = parse_args(f"{BASE} --num-layers 4 --fp8-format hybrid {flags}".split()).precision
    assert precision.fp8_layer_numbers(4) == layers


def test_a_one_layer_model_runs_its_layer_in_fp8_and_fp8_off_runs_none():
    assert parse_args(f"{BASE} --num-layers 1 --fp8-format hybrid".split()).precision.fp8_layer_numbers(1) == [1]
    assert parse_args(f"{BASE} --num-layers 4".split()).precision.fp8_layer_numbers(4) == []


def test_the_first_layer_stays_unquantized_by_default():
    cfg = parse_args(f"{BASE} --num-layers 2 --fp8-format hybrid --fp8-recipe delayed".split())
    torch.manual_seed(0)
    model = GPTModel(cfg.model, 128)
    manager = attach_fp8(model, cfg)
    layers = model.decoder.layers
    assert all(m.fp8 is None for m in _linears(layers[0]))
    assert all(m.fp8 is not None and m.fp8.enabled for m in _linears(layers[1]))
    assert "layers 1 kept in high precision (the first layer: --no-fp8-first-layer-bf16" in "\n".join(
        manager.describe()
    )
    all_fp8 = parse_args(f"{BASE} --num-layers 2 --fp8-format hybrid --no-fp8-first-layer-bf16".split())
    assert len(attach_fp8(GPTModel(all_fp8.model, 128), all_fp8).states) == 8


def _linears(layer):
    return [
        layer.self_attention.linear_qkv,
        layer.self_attention.linear_proj,
        layer.mlp.linear_fc1,
        layer.mlp.linear_fc2,
    ]


def test_off_without_fp8_format_and_refuses_unaligned_sizes():
    cfg, model, manager = build("")
    assert manager is None and all(m.fp8 is None for m in _linears(model.decoder.layers[0]))
    with pytest.raises(ConfigError, match="divisible by 16.*--hidden-size"):
        build("--fp8-format e4m3 --hidden-size 72 --num-attention-heads 4")


def test_describe_names_the_gemm_paths():
    lines = "\n".join(build("--fp8-format hybrid --fp8-recipe rowwise")[2].describe())
    assert "fprop x.W^T on cpu: torch._scaled_mm (row x row)" in lines
    assert "wgrad dY^T.x on cpu: torch._scaled_mm (row x row)" in lines
    lines = "\n".join(build("--fp8-format e4m3 --fp8-recipe blockwise --no-fp8-wgrad")[2].describe())
    assert "dgrad dY.W on cpu: emulated" in lines and "wgrad dY^T.x: high precision" in lines


def test_resume_reproduces_an_uninterrupted_delayed_scaling_run():
    flags = "--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 4 --fp8-amax-compute-algo max"
    _, model, manager = build(flags)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    straight = train(model, manager, optimizer, range(6))

    _, model, manager = build(flags)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    first = train(model, manager, optimizer, range(3))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "fp8": manager.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    _, model, manager = build(flags)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optim"])
    manager.load_state_dict(saved["fp8"])
    assert first + train(model, manager, optimizer, range(3, 6)) == straight


def test_the_engine_takes_over_the_local_linears_by_their_attributes():
    """attach_fp8 finds its linears by the attributes Fp8Capable names, looked up as a module serves them (a
    parameter from `_parameters`): an isinstance against a runtime protocol misses them on Python 3.12."""
    from torch import nn

    from megatron.fp8.manager import is_fp8_capable
    from megatron.model.layers import Linear

    _, model, _ = build("--fp8-format hybrid")
    linear = next(m for m in model.modules() if isinstance(m, Linear))
    assert "weight" not in vars(linear) and is_fp8_capable(linear)
    assert not is_fp8_capable(nn.Linear(4, 4))
