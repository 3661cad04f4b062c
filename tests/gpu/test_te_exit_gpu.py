"""Transformer Engine keeps our process groups after the model is gone (megatron/model/te_state.py), on one GPU: a
TE model under FP8 delayed scaling, given an amax group, trains one micro-batch in a one-rank NCCL world. Without
`release_te_state` `Shutdown.close` warns that the group is still referenced and names TE's structure; with it as
an exit part (as the trainer registers it) the group goes and nothing is logged."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from megatron.config import parse_args
from megatron.config.te_rules import te_import_error
from megatron.model import GPTModel
from megatron.model.te_state import release_te_state
from megatron.training.shutdown import Shutdown
from tests.dist_utils import one_rank_world

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(te_import_error() is not None, reason=f"needs Transformer Engine ({te_import_error()})"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]
VOCAB = 256
FLAGS = (
    "--mock-data --vocab-size 256 --num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 64"
    " --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear --micro-batch-size 2"
    " --transformer-impl transformer_engine --bf16 --fp8-format hybrid --fp8-recipe delayed"
)


def _train_one_micro_batch(amax_group: dist.ProcessGroup) -> None:
    cfg = parse_args(FLAGS.split(), device_type="cuda")
    torch.manual_seed(0)
    model = GPTModel(cfg.model, VOCAB, precision=cfg.precision, amax_group=amax_group).to("cuda", torch.bfloat16)
    tokens = torch.randint(0, VOCAB, (2, 64), device="cuda")
    model(tokens).float().square().mean().backward()
    torch.cuda.synchronize()


@pytest.mark.parametrize("release", [False, True])
def test_te_keeps_the_amax_group_until_its_state_is_released(tmp_path, release):
    torch.cuda.set_device(0)
    with one_rank_world(str(tmp_path), "nccl", torch.device("cuda", 0)):
        _check_exit(release)


def _check_exit(release: bool) -> None:
    lines: list[str] = []
    shutdown = Shutdown(log=lines.append)
    shutdown.own_process_groups({"world": dist.group.WORLD}, timeout_minutes=2)
    amax_group = dist.new_group([0])
    shutdown.watch({"amax_group": amax_group})
    if release:
        shutdown.add_at_exit("Transformer Engine's global state", release_te_state)
    _train_one_micro_batch(amax_group)
    watched = weakref.ref(amax_group)
    del amax_group
    try:
        shutdown.close()
        gc.collect()
        if release:
            assert lines == [] and watched() is None
        else:
            assert watched() is not None and len(lines) == 1, lines
            assert "amax_group (ranks 0) held by" in lines[0]
            assert "autocast_arguments" in lines[0] or "_attention_backends" in lines[0], lines[0]
    finally:
        # TE reduces every amax buffer it knows at each autocast exit: the next test's model must not find this
        # one's, keyed to a destroyed group
        release_te_state()
