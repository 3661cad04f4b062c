"""Activation recomputation under tensor (+ sequence) and pipeline parallelism, on 2 gloo ranks: each granularity
trains exactly as the same layout without recomputation (the recomputed forward repeats the layout's collectives
in backward, in the same order on every rank), dropout on."""

import torch

from megatron.config import parse_args
from megatron.training import Trainer
from tests.dist_utils import run_distributed

BASE = (
    "--mock-data --vocab-size 128 --num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16"
    " --micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --eval-iters 0 --log-interval 100 --train-iters 2"
    " --transformer-impl local --hidden-dropout 0.1 --attention-dropout 0.1 --attention-backend unfused"
)
LAYOUTS = {
    "tp2": "--tensor-model-parallel-size 2",
    "tp2_sp": "--tensor-model-parallel-size 2 --sequence-parallel",
    "pp2": "--pipeline-model-parallel-size 2",
}
MODES = [
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
    "--recompute-granularity full --recompute-method block --recompute-num-layers 1",
    "--recompute-granularity selective --recompute-modules core_attn mlp layernorm",
]


def _body(rank: int, world_size: int) -> None:
    for layout in LAYOUTS.values():
        reference = Trainer(parse_args(f"{BASE} {layout}".split(), world_size=world_size)).train().losses
        assert len(reference) == 2
        for mode in MODES:
            losses = Trainer(parse_args(f"{BASE} {layout} {mode}".split(), world_size=world_size)).train().losses
            assert losses == reference, (layout, mode, losses, reference)
    torch.distributed.barrier()


def test_recomputation_matches_under_tp_sp_and_pp():
    run_distributed(_body, world_size=2)
