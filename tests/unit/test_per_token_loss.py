"""--calculate-per-token-loss: the step's loss and gradient are the mean over all unmasked tokens of the global
batch, not the mean of the micro-batches' means (megatron/training/loss.py)."""

import torch

from megatron.config import parse_args
from megatron.training import Trainer
from tests.e2e.test_training import TINY


def step_grads(flags: str, batches: list[dict[str, torch.Tensor]]) -> tuple[float, list[torch.Tensor], Trainer]:
    """One training step over `batches` (the micro-batches); the gradients the optimizer receives."""
    trainer = Trainer(
        parse_args(f"{TINY} --global-batch-size 4 --hidden-dropout 0 --attention-dropout 0 {flags}".split())
    )
    captured = []
    step = trainer.optimizer.step

    def capture(lr, norm_fn):
        captured.extend(g.clone() for g in trainer.optimizer.grads())
        return step(lr, norm_fn)

    trainer.optimizer.step = capture
    loss, _, _ = trainer.train_step(iter(batches), lr=0.0)
    return loss, captured, trainer


def micro_batches() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for keep in (32, 5):  # unmasked tokens per sample: the micro-batches differ a lot
        tokens = torch.randint(0, 128, (2, 33), generator=gen)
        mask = torch.zeros(2, 32)
        mask[:, :keep] = 1.0
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask})
    return out


def test_per_token_gradient_is_the_mean_over_all_tokens_of_the_batch():
    batches = micro_batches()
    loss, grads, trainer = step_grads("--calculate-per-token-loss", batches)
    model = trainer.model  # lr 0: the weights are still those the step saw
    for module in model.modules():  # the reference's gradients as plain autograd results, not into the buffers
        module.gradient_accumulation_fusion = False
    whole = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    token_losses = model(whole["tokens"], labels=whole["labels"])
    reference = (token_losses * whole["loss_mask"]).sum() / whole["loss_mask"].sum()
    params = [p for p in model.parameters() if p.requires_grad]
    expected = torch.autograd.grad(reference, params)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want.view_as(got), rtol=1e-4, atol=1e-7)
    assert abs(loss - float(reference.detach())) < 1e-5

    default_loss, default_grads, _ = step_grads("", batches)
    assert abs(default_loss - loss) > 1e-3
    assert max(float((a - b).abs().max()) for a, b in zip(default_grads, grads)) > 1e-4
