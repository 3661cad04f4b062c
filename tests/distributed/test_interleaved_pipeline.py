"""The interleaved (virtual-pipeline) 1F1B schedule trains the single-process model: PP=2 x VPP=2 on 2 gloo ranks
(also with an uneven first stage, with a --pipeline-model-parallel-layout, with the embedding and loss counted
as layers, and with FP8 delayed scaling) and
TP=2 x SP x PP=2 x VPP=2 on 4 match one process
(losses and gradients at the tolerances of test_parallel_layouts.py: only summation orders differ); checkpoints
saved under VPP resume exactly under it (--ckpt-format torch and torch_dist) and, with torch_dist, in one process;
a torch-format one is refused without VPP (its stages hold other layers) and converts to the torch_dist one's
weights; the startup log states the bubble fraction."""

import contextlib
import io
from pathlib import Path

import pytest
import torch

from megatron.checkpoint.checkpointing import CheckpointError
from megatron.convert import read_ours
from megatron.training import Trainer
from tests.dist_utils import run_distributed
from tests.distributed.test_parallel_layouts import (
    BASE,
    FP8,
    GPT2,
    _assemble,
    _compare,
    _parse,
    _record,
    _resume_check,
)

VPP2 = "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1"
# 6 layers: the first stage holds 2 (1 per chunk), the last 4 (2 per chunk)
UNEVEN = "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2"
UNEVEN += " --decoder-first-pipeline-num-layers 2"
FP32_TOLS, FP8_TOLS = (1e-5, 1e-3), (1e-3, 3e-2)  # (loss rtol, gradient rtol), as in test_parallel_layouts.py
# name: (model flags, layout flags, tolerances); FP8 delayed scaling also calibrates through the interleaved schedule
# --pipeline-model-parallel-layout: the first rank's chunks hold the embedding alone and 2 layers, the last rank's 3
# layers and 1 layer with the loss; Megatron-LM's shorthand for the embedding and the loss counted as layers (8 over
# 4 virtual stages: 1, 2, 2, 1 transformer layers)
LAYOUT = "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout E|t*3|t*2|tL"
ACCOUNTED = "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2"
ACCOUNTED += " --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split"
LAYOUTS_2 = {
    "vpp2": (BASE, VPP2, FP32_TOLS),
    "vpp2_uneven": (f"{BASE} --num-layers 6", UNEVEN, FP32_TOLS),
    "vpp2_layout": (f"{BASE} --num-layers 6", LAYOUT, FP32_TOLS),
    "vpp2_accounted": (f"{BASE} --num-layers 6", ACCOUNTED, FP32_TOLS),
    "vpp2_fp8": (f"{BASE}{FP8}", VPP2, FP8_TOLS),
}
LAYOUTS_4 = {"tp2_vpp2": (BASE, f"{VPP2} --tensor-model-parallel-size 2 --sequence-parallel", FP32_TOLS)}


def _two_rank_body(rank, world_size, out):
    for name, (base, extra, _) in LAYOUTS_2.items():
        if name in ("vpp2", "vpp2_accounted"):  # the startup lines, from rank 0's log
            log = io.StringIO()
            with contextlib.redirect_stdout(log):
                record = _record(f"{base} {extra}", world_size)
            if rank == 0:
                Path(out, f"log_{name}.txt").write_text(log.getvalue())
        else:
            record = _record(f"{base} {extra}", world_size)
        torch.save(record, Path(out, f"{name}.rank{rank}.pt"))
    _resume_check(f"{GPT2} {VPP2} --ckpt-format torch", world_size, str(Path(out, "ckpt_torch")))
    # the same stages without interleaving hold other layers (1-2 and 3-4, not 1, 3 and 2, 4): refused, not misloaded
    flags = f"{GPT2} --pipeline-model-parallel-size 2 --ckpt-format torch --train-iters 4"
    flags += f" --load {Path(out, 'ckpt_torch')}"
    held, placed = ("1, 3", "1-2") if rank == 0 else ("2, 4", "3-4")
    with pytest.raises(
        CheckpointError, match=f"holds layers {held} on pipeline stage {rank}, this run places layers {placed}"
    ):
        Trainer(_parse(flags, world_size)).train()
    dist_flags = f"{GPT2} {VPP2} --ckpt-format torch_dist"
    _resume_check(dist_flags, world_size, str(Path(out, "ckpt_dist")))
    full = Trainer(_parse(f"{dist_flags} --train-iters 4", world_size)).train()
    if rank == 0:
        torch.save(full.losses, Path(out, "dist_reference.pt"))


def _four_rank_body(rank, world_size, out):
    for name, (base, extra, _) in LAYOUTS_4.items():
        torch.save(_record(f"{base} {extra}", world_size), Path(out, f"{name}.rank{rank}.pt"))


def _check(out: Path, layouts: dict, world_size: int) -> None:
    for name, (base, _, tols) in layouts.items():
        reference = _record(base, 1)
        records = [torch.load(p, weights_only=False) for p in sorted(out.glob(f"{name}.rank*.pt"))]
        assert len(records) == world_size
        _compare(_assemble(records), reference, *tols, label=name)


def test_two_rank_interleaved_matches_single_process_and_resumes(tmp_path):
    run_distributed(_two_rank_body, world_size=2, args=(str(tmp_path),))
    _check(tmp_path, LAYOUTS_2, 2)
    assert (
        "pipeline layout Et|tt|tt|tL: rank 0: embedding + 1, 2 layers; rank 1: 2, 1 layers + loss"
        in (tmp_path / "log_vpp2_accounted.txt").read_text()
    )
    log = (tmp_path / "log_vpp2.txt").read_text()
    assert "interleaved 1F1B, 2 virtual stages per rank over 2 stages, 4 micro-batches" in log
    assert "bubble fraction (p - 1) / (v * m) = 1 / 8 = 0.125" in log
    # the torch_dist checkpoint saved under PP=2 x VPP=2 at iteration 2, resumed in one process
    reference = torch.load(tmp_path / "dist_reference.pt")
    flags = f"{GPT2} --ckpt-format torch_dist --train-iters 4 --load {tmp_path / 'ckpt_dist'}"
    resumed = Trainer(_parse(flags, 1)).train().losses
    assert [resumed[i] for i in (3, 4)] == pytest.approx([reference[i] for i in (3, 4)], rel=1e-5)
    # the converter places the torch-format checkpoint's interleaved layers as the torch_dist one names them
    plain, dist = read_ours(tmp_path / "ckpt_torch"), read_ours(tmp_path / "ckpt_dist")
    assert plain.state.keys() == dist.state.keys()
    for name in plain.state:
        torch.testing.assert_close(plain.state[name], dist.state[name], atol=0, rtol=0, msg=name)


def test_four_rank_interleaved_with_tensor_parallel_matches_single_process(tmp_path):
    run_distributed(_four_rank_body, world_size=4, args=(str(tmp_path),))
    _check(tmp_path, LAYOUTS_4, 4)
