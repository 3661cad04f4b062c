"""Tiny CPU runs with a batch-size ramp and --train-samples: right length, exact resume mid-ramp, and
--decoupled-lr reaching the embedding and output layer only."""

import re

import pytest
import torch

from megatron.config import parse_args
from megatron.training import Trainer

TINY = (
    "--mock-data --vocab-size 128 --num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16"
    " --micro-batch-size 2 --lr 3e-3 --log-interval 1 --eval-iters 0"
)
# 2 -> 8 by 2 over 12 samples (a step up every 4 samples); 40 samples: 2,2,4,6 then 8 x 4 (ends at 46 >= 40)
RAMP = "--global-batch-size 8 --rampup-batch-size 2 2 12 --train-samples 40 --lr-warmup-samples 8"


def train(flags: str):
    return Trainer(parse_args(f"{TINY} {flags}".split())).train()


def test_ramp_with_train_samples_runs_to_the_right_step_and_logs_each_batch(capsys):
    state = train(RAMP)
    assert (state.iteration, state.consumed_samples) == (8, 46)
    sizes = [int(x) for x in re.findall(r"global batch size:\s+(\d+)", capsys.readouterr().out)]
    assert sizes == [2, 2, 4, 6, 8, 8, 8, 8]


def test_resume_mid_ramp_reproduces_the_uninterrupted_run(tmp_path):
    full = train(RAMP)
    first = train(f"{RAMP} --exit-interval 3 --save {tmp_path} --save-interval 3")
    assert first.consumed_samples == 8  # saved before the batch reached its final size
    resumed = train(f"{RAMP} --load {tmp_path}")
    assert [first.losses[i] for i in range(1, 4)] == [full.losses[i] for i in range(1, 4)]
    assert [resumed.losses[i] for i in range(4, 9)] == [full.losses[i] for i in range(4, 9)]
    assert resumed.consumed_samples == 46


@pytest.mark.parametrize("optimizer", ["", "--use-precision-aware-optimizer"])
def test_decoupled_lr_moves_only_embedding_and_output_layer(optimizer):
    # --lr 0: everything but the embedding and output layer stays put; they move at --decoupled-lr
    flags = f"--untie-embeddings-and-output-weights --lr 0 --min-lr 0 --decoupled-lr 1e-2 --train-iters 1 {optimizer}"
    trainer = Trainer(parse_args(f"{TINY} {flags}".split()))
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    if not optimizer:
        groups = [(g["lr_group"], len(g["params"])) for g in trainer.optimizer.optimizer.param_groups]
        assert sum(n for group, n in groups if group == "decoupled") == 2  # (both decayed: 2-D weights)
        assert sum(n for _, n in groups) == len(before)
    trainer.train()
    moved = {name for name, p in trainer.model.named_parameters() if not torch.equal(p, before[name])}
    assert moved == {"embedding.word_embeddings.weight", "output_layer.weight"}
