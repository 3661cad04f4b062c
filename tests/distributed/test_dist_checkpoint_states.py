"""--ckpt-format torch_dist with the precision-aware optimizer's low-precision states (FP8-LM's O2: fp16 main params
with remainders, fp8 first moment, fp16 second moment; megatron/checkpoint/dist_optimizer.py). Saved as held, they
resume bit for bit (tests/distributed/test_low_precision_optimizer.py::test_o2_resumes_exactly, both formats). Under
another layout each element is decoded with the scale of the block it was saved in: loaded into torch's AdamW, the
fp32 states equal the saving ranks' decoded states exactly (from TP=2 with SwiGLU's split fc1, and from the
distributed optimizer's pieces under DP=2); loaded into the precision-aware optimizer they are re-encoded in this
layout's blocks (within the formats' rounding), training goes on, and the log says what was converted and that
stochastic rounding was seeded afresh."""

from pathlib import Path

import torch

from megatron.checkpoint.dist_optimizer import KINDS, OptimizerEntries
from megatron.training import Trainer
from tests.dist_utils import run_distributed
from tests.distributed.test_parallel_layouts import BASE, _parse

FLAGS = f"{BASE} --bf16 --lr 3e-3 --lr-warmup-iters 2 --lr-decay-iters 8 --min-lr 3e-4"
O2 = "--fp8-optimizer-level O2"
SAVED = {
    "tp2": "--tensor-model-parallel-size 2",
    "dp2_distopt": "--use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 3000",
}


def _decoded(trainer: Trainer) -> dict:
    """(kind, entry name) -> [(global shape, offsets, local shape, start, stop, decoded fp32 values)] of this rank."""
    entries = OptimizerEntries(
        trainer.optimizer, trainer.model, list(trainer.model.stage.layer_numbers), trainer.dims, None
    )
    fp32 = trainer.optimizer.fp32_state()
    out = {}
    for i, slot in enumerate(entries.slots):
        for kind in KINDS:
            value = fp32["masters" if kind == "main" else kind][i]
            where = slot.where
            out[(kind, slot.name)] = (
                where.global_shape,
                where.offsets,
                where.local_shape,
                slot.start,
                slot.stop,
                value,
            )
    return out


def _save_body(rank, world_size, out):
    for name, layout in SAVED.items():
        trainer = Trainer(_parse(f"{FLAGS} {O2} {layout} --train-iters 3 --save {Path(out, name)}", world_size))
        trainer.train()
        torch.save(_decoded(trainer), Path(out, f"{name}.rank{rank}.pt"))


def _global(records: list[dict]) -> dict:
    """The saving ranks' decoded states assembled into global tensors (checkpoint form)."""
    full = {}
    for record in records:
        for key, (shape, offsets, local, start, stop, value) in record.items():
            tensor = full.setdefault(key, torch.full(shape, float("nan")))
            box = tuple(slice(o, o + n) for o, n in zip(offsets, local))
            flat = tensor[box].reshape(-1).clone()
            flat[start:stop] = value.reshape(-1)
            tensor[box] = flat.view(local)
    return full


def test_other_layouts_decode_each_element_with_its_saved_block(tmp_path, capsys):
    run_distributed(_save_body, world_size=2, args=(str(tmp_path),))
    for name in SAVED:
        reference = _global([torch.load(tmp_path / f"{name}.rank{r}.pt") for r in range(2)])
        assert all(not t.isnan().any() for t in reference.values()), name  # the ranks covered every element
        ckpt = tmp_path / name
        # torch's AdamW in one process: the fp32 states are the saved ones decoded, bit for bit
        plain = Trainer(_parse(f"{FLAGS} --train-iters 5 --load {ckpt}", 1))
        for key, (shape, _, local, start, stop, value) in _decoded(plain).items():
            assert (start, stop) == (0, value.numel()) and tuple(shape) == tuple(local)
            assert torch.equal(value.reshape(shape), reference[key]), (name, key)
        out = capsys.readouterr().out
        assert "the precision-aware optimizer's -> fp32 (torch AdamW)" in out, out[-2000:]
        # the precision-aware optimizer in one process: re-encoded in its own blocks, then training goes on
        o2 = Trainer(_parse(f"{FLAGS} {O2} --train-iters 5 --load {ckpt}", 1))
        for key, (shape, _, _, _, _, value) in _decoded(o2).items():
            # the formats' bounds (megatron/optim/states.py), relative, and absolute under a block's smallest normal
            rel, floor = {"main": (2**-18, 2**-47), "exp_avg": (2**-4, 2**-18.8), "exp_avg_sq": (2**-11, 2**-40)}[
                key[0]
            ]
            want = reference[key]
            atol = float(want.abs().max()) * floor
            torch.testing.assert_close(value.reshape(shape), want, rtol=rel, atol=atol, msg=str(key))
        losses = o2.train().losses
        assert set(losses) == {4, 5} and all(torch.isfinite(torch.tensor(v)) for v in losses.values())
        out = capsys.readouterr().out
        assert "optimizer state pieces re-encoded in this layout's blocks" in out, out[-2000:]
        assert "stochastic rounding of the optimizer states seeded afresh" in out, out[-2000:]
