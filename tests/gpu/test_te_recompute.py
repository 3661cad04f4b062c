"""Activation recomputation on the Transformer Engine layers (TE's checkpoint): against the same model without
recomputation, losses and gradients agree (within the nondeterminism of TE's kernels), dropout included, and the
delayed-scaling amax histories and scales evolve alike (no extra update per recomputed forward); with and without
recomputation the backward amaxes are reduced and updated once per micro-batch."""

import contextlib
from collections.abc import Iterator
from unittest import mock

import pytest
import torch

from megatron.config import parse_args
from megatron.config.te_rules import te_import_error
from megatron.data.mock import MockGPTDataset
from megatron.model import GPTModel
from megatron.optim import MixedPrecisionAdamW
from megatron.parallel import GradientBuffers
from tests.gpu.test_te_model import LLAMA as TE_MODEL_LLAMA

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(te_import_error() is not None, reason=f"needs Transformer Engine ({te_import_error()})"),
]

VOCAB = 256
LLAMA = f"{TE_MODEL_LLAMA} --transformer-impl transformer_engine --bf16 --micro-batch-size 2"
DELAYED = "--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 16 --fp8-amax-compute-algo max"
MODES = [
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
    "--recompute-granularity full --recompute-method block --recompute-num-layers 1",
    "--recompute-granularity selective --recompute-modules core_attn mlp",
    "--recompute-granularity selective --recompute-modules core_attn mlp layernorm --attention-backend local",
]


def run(flags: str, steps: int = 4, dropout: float = 0.0):
    dropouts = f"--hidden-dropout {dropout} --attention-dropout {dropout}"
    cfg = parse_args(f"--mock-data --vocab-size {VOCAB} {LLAMA} {dropouts} {flags}".split(), device_type="cuda")
    torch.manual_seed(0)
    model = GPTModel(cfg.model, VOCAB, precision=cfg.precision).to("cuda", torch.bfloat16)
    buffers = GradientBuffers(model, None)
    optimizer = MixedPrecisionAdamW(model, cfg.optimizer)
    data = MockGPTDataset(64, 64, VOCAB, eod=VOCAB - 1, seed=3)
    torch.cuda.manual_seed(1234)
    losses, grads = [], []
    for step in range(steps):
        samples = [data[2 * step + j] for j in range(2)]
        tokens, labels = (torch.stack([s[k] for s in samples]).cuda() for k in ("tokens", "labels"))
        for _ in range(2):  # two micro-batches per step: the weight casts are reused by the second
            loss = model(tokens, labels=labels).mean()
            loss.backward()
        grads.append(torch.cat([p.main_grad.flatten() for p in optimizer.params]).clone())
        optimizer.step(1e-3, lambda: torch.ones((), device="cuda"))
        buffers.zero()
        losses.append(float(loss))
    histories = [
        (m.fp8_meta["scaling_fwd"].amax_history.clone(), m.fp8_meta["scaling_fwd"].scale.clone())
        for layer in model.decoder.layers
        for m in layer.te_modules()
        if "scaling_fwd" in m.fp8_meta
    ]
    return losses, grads, histories


@contextlib.contextmanager
def backward_updates() -> Iterator[list[None]]:
    """Collects one entry per reduction and update of the backward amaxes (TE's `forward=False` calls)."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    calls, update = [], FP8GlobalStateManager.reduce_and_update_fp8_tensors

    def counted(forward: bool = True) -> None:
        if not forward:
            calls.append(None)
        update(forward=forward)

    with mock.patch.object(FP8GlobalStateManager, "reduce_and_update_fp8_tensors", counted):
        yield calls


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fp8", ["", DELAYED], ids=["bf16", "fp8-delayed"])
def test_te_recomputation_matches_no_recomputation(mode, fp8):
    # The same attention on both sides: in FP8 another attention's rounding alone moves gradients by a few percent.
    flags = mode.split()
    backend = flags[flags.index("--attention-backend") :][:2] if "--attention-backend" in flags else []
    ref_losses, ref_grads, ref_hist = run(" ".join([fp8, *backend]))
    losses, grads, hist = run(f"{fp8} {mode}")
    assert losses == pytest.approx(ref_losses, rel=2e-2)
    assert all(rel_err(g, r) < 3e-2 for g, r in zip(grads, ref_grads))
    assert len(hist) == len(ref_hist)
    for (history, scale), (ref_history, ref_scale) in zip(hist, ref_hist):
        # As many updates as without recomputation: the zeros (no amax yet) sit in the same rows.
        assert torch.equal(history == 0, ref_history == 0)
        assert rel_err(history, ref_history) < 5e-2 and rel_err(scale, ref_scale) < 5e-2


@pytest.mark.parametrize("mode", [MODES[0], MODES[2]])
def test_te_recomputation_draws_the_same_dropout_masks(mode):
    ref_losses, ref_grads, _ = run("", steps=2, dropout=0.2)
    losses, grads, _ = run(mode, steps=2, dropout=0.2)
    assert losses == pytest.approx(ref_losses, rel=2e-2)
    assert all(rel_err(g, r) < 3e-2 for g, r in zip(grads, ref_grads))


@pytest.mark.parametrize("first_layer", ["", "--no-fp8-first-layer-bf16"], ids=["first-bf16", "all-fp8"])
@pytest.mark.parametrize("mode", ["", *MODES], ids=["no-recompute", *MODES])
def test_backward_amaxes_are_updated_once_per_micro_batch(mode, first_layer):
    """Once per micro-batch, after its last FP8 backward: not once per layer (TE's per-layer autocasts restore the
    first-module mark), nor per recomputed region."""
    with backward_updates() as calls:
        run(f"{DELAYED} {first_layer} {mode}", steps=2)
    assert len(calls) == 2 * 2
