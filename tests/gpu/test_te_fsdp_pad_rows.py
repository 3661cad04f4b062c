"""Transformer Engine's layers under FSDP with --fp8-param-gather on 3 GPUs (NCCL), where the ranks do not divide the
weights' rows: tests/distributed/test_fsdp_pad_rows.py with TE's shard classes (`TeFp8ShardWeight`, delayed;
`TeBlockShardWeight`, blockwise), which FSDP2 must keep in the padded storage the optimizer steps
(megatron/parallel/fsdp/fsdp2.py, `share_padded_storage`).

* every rank's FP8-gathered shards change at every step, in the storage they were built with (delayed under
  optim_grads_params and optim_grads, delayed with the precision-aware optimizer, whose freed shards have pad rows
  on the last rank, and blockwise);
* the losses are within 1e-3 of the distributed optimizer's at DP=3 (blockwise: of FSDP's bf16 gather);
* a torch_dist checkpoint resumes within 1e-5 (two GPU runs agree so, not bit for bit)."""

import pytest
import torch

from megatron.config.te_rules import te_import_error
from megatron.training import Trainer
from tests.dist_utils import run_distributed
from tests.distributed.test_fsdp import PA, _close
from tests.distributed.test_fsdp_pad_rows import DISTOPT, FLAGS, GRADS, PARAMS, STEPS, _run_watched, resume
from tests.distributed.test_parallel_layouts import FP8, _parse
from tests.gpu.test_te_fsdp_blockwise import BLOCKWISE

TE = f"{FLAGS} --transformer-impl transformer_engine"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(te_import_error() is not None, reason=f"needs Transformer Engine ({te_import_error()})"),
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 3, reason="needs 3 GPUs (nvidia-h100-x4)"
    ),
]


def _losses(flags: str, world_size: int) -> list[float]:
    return list(Trainer(_parse(flags, world_size)).train().losses.values())


def _body(rank, world_size, out_dir):
    for recipe, layout in ((FP8, PARAMS), (FP8, GRADS), (f"{FP8} {PA}", PARAMS)):
        want = _losses(f"{TE} {recipe} {DISTOPT}", world_size)
        got, _ = _run_watched(f"{TE} {recipe} {layout}", world_size)
        _close(got, want, 1e-3, f"TE FSDP FP8 gather at DP=3 ({recipe} {layout})", STEPS)
    blockwise = f"{TE} {BLOCKWISE} {PARAMS}"
    want = _losses(blockwise.replace("--fp8-param-gather", ""), world_size)
    got, _ = _run_watched(blockwise, world_size)
    _close(got, want, 1e-3, "TE FSDP blockwise FP8 gather at DP=3", STEPS)
    whole, resumed = resume(f"{TE} {FP8} {PARAMS}", world_size, out_dir)
    _close(resumed, whole[2:], 1e-5, "TE FSDP FP8 gather at DP=3, resumed", 2)


def test_te_fsdp_fp8_gather_updates_every_rank_when_ranks_do_not_divide_rows(tmp_path):
    run_distributed(_body, world_size=3, args=(str(tmp_path),), backend="nccl")
