"""Transformer Engine's layers under FSDP with --fp8-param-gather and O2's precision-aware states on 2 GPUs (NCCL):
the FP8 layers' bf16 shards are freed once a training forward has cast them and given back (every byte set to 0xFF,
bf16 NaN, by the test) when the fused Triton AdamW writes the new weights: the comparison of
tests/distributed/test_fsdp_free_shards.py with --transformer-impl transformer_engine.

* the losses are those of the same run with nothing freed (within 1e-5 relative: two GPU runs agree so, not bit for
  bit; an element the step did not write would be a NaN), under optim_grads_params and optim_grads;
* before each optimizer step every FP8-gathered shard's storage is empty, and giving it back allocates 2 bytes per
  FP8-gathered element / 2 ranks on the GPU (torch.cuda.memory_allocated; the allocator's 512-byte rounding
  allowed); delayed scaling's calibration pass frees them too, and they are given back once after it;
* a skipped step (an infinite gradient): the fused kernel writes each shard from its unchanged main weight, bit for
  bit the decoded one, and the run goes on as the one with nothing freed."""

import torch

from megatron.parallel.fsdp.fp8_gather_scales import Fp8GatherScales
from tests.dist_utils import run_distributed
from tests.distributed.test_fsdp_free_shards import FLAGS, GRADS, PARAMS, STEPS, _poison_reclaimed_storage, _run
from tests.distributed.test_parallel_layouts import FP8
from tests.gpu.marks import TE_ON_TWO_GPUS

TE = f"{FLAGS} {FP8} --transformer-impl transformer_engine"

pytestmark = TE_ON_TWO_GPUS


def _close(got: list[float], want: list[float], label: str) -> None:
    assert len(got) == len(want) == STEPS, (label, got, want)
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want)), (label, got, want)


def _measure_reclaims() -> list[int]:
    """The GPU bytes each reclaim allocates (in this process, from now on)."""
    reclaim, allocated = Fp8GatherScales.reclaim, []

    def measured(self: Fp8GatherScales) -> None:
        before = torch.cuda.memory_allocated()
        reclaim(self)
        allocated.append(torch.cuda.memory_allocated() - before)

    Fp8GatherScales.reclaim = measured
    return allocated


def _body(rank, world_size):
    _poison_reclaimed_storage()
    reclaimed = _measure_reclaims()
    for layout in (PARAMS, GRADS):
        want, _, _ = _run(f"{TE} {layout}", release=False)
        reclaimed.clear()
        got, trainer, seen = _run(f"{TE} {layout}")
        _close(got, want, layout)
        shards = trainer.optimizer.buffers.fp8_scales.shards
        fp8_numel = sum(s.to_local().numel() for s in shards)
        # the first give-back: after delayed scaling's calibration pass (restore_freed_shards), then one per step
        assert fp8_numel > 0 and len(seen) == len(reclaimed) - 1 == STEPS, (layout, len(seen), len(reclaimed))
        for step, ((released, held, _), grown) in enumerate(zip(seen, reclaimed[1:]), 1):
            assert released and not any(held), (layout, step, held)
            assert 2 * fp8_numel <= grown <= 2 * fp8_numel + 512 * len(shards), (layout, step, grown, fp8_numel)
    want, _, _ = _run(f"{TE} {PARAMS}", release=False, poison_step=2)
    got, _, _ = _run(f"{TE} {PARAMS}", poison_step=2)
    _close(got, want, "a skipped step")


def test_te_fsdp_frees_fp8_gathered_shards_between_forward_and_step():
    run_distributed(_body, world_size=2, backend="nccl")
