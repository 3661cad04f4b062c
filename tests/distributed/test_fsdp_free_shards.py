"""FSDP with --fp8-param-gather and --use-precision-aware-optimizer (2 gloo ranks, local layers, FP8 emulated): the
bf16 shards of the FP8-gathered weights are freed once a training forward has cast them for the step's all-gathers,
and given back when the optimizer step writes the new weights (megatron/parallel/fsdp/fp8_gather_scales.py,
`Fp8GatherScales`).

Storage given back holds whatever the allocator had there: here every reclaimed byte is set to 0xFF (bf16 NaN), so
that an element the optimizer step did not write shows in the losses. Then:
* the losses are those of the same run with nothing freed, bit for bit (tensorwise under optim_grads_params; delayed
  under optim_grads, whose calibration pass frees the shards too, with no step after it to write them: they are
  written back from the main weights; with the FP8 monitor, which reads the shards in a watched step's forward, so
  that step frees nothing);
* between the training forward and the optimizer step every FP8-gathered shard's storage is empty, and the weight
  storages this rank holds are 2 bytes per FP8-gathered element / 2 ranks fewer than between steps (measured);
* a skipped step (an infinite gradient) leaves each shard equal to its decoded main weight, and the run goes on
  bit for bit as the one with nothing freed;
* torch_dist checkpoints saved after a step and after an evaluation resume exactly;
* over 3 ranks, whose last rank's shards have FSDP's pad rows (FSDP2 keeps the padded storage the optimizer steps:
  parallel/fsdp/fsdp2.py, `share_padded_storage`), every rank frees its shards, pad rows included (poisoned too when
  given back: nothing reads them), and the losses are still those of the run with nothing freed."""

from pathlib import Path

import torch

from megatron.parallel.fsdp.fp8_gather import shard_data
from megatron.parallel.fsdp.fp8_gather_scales import Fp8GatherScales
from megatron.parallel.fsdp.fsdp2 import local_shard
from megatron.training import Trainer
from tests.dist_utils import run_distributed
from tests.distributed.test_fsdp import PA, _storage_bytes
from tests.distributed.test_parallel_layouts import BASE, FP8, TENSORWISE, _parse

STEPS = 4
PARAMS = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"
GRADS = "--use-torch-fsdp2 --data-parallel-sharding-strategy optim_grads"
FLAGS = f"{BASE} --train-iters {STEPS} --eval-iters 0 --bf16 {PA} --fp8-param-gather"


RECLAIMED: list[int] = []  # shards given back by each reclaim, in this process


def _poison_reclaimed_storage() -> None:
    """Every byte a reclaim gives back set to 0xFF (bf16 NaN), in this process."""
    reclaim = Fp8GatherScales.reclaim

    def poisoned(self: Fp8GatherScales) -> None:
        storages = [storage for storage, _ in self._freed]
        RECLAIMED.append(len(storages))
        reclaim(self)
        for storage in storages:
            torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).fill_(255)

    Fp8GatherScales.reclaim = poisoned


def _weight_bytes(trainer: Trainer) -> int:
    return _storage_bytes(shard_data(local_shard(p)) for p in trainer.model.parameters())


def _run(
    flags: str, release: bool = True, poison_step: int | None = None, world_size: int = 2
) -> tuple[list[float], Trainer, list]:
    """Losses, trainer and, for each optimizer step, what the rank held just before it: (shards freed, each FP8
    shard's storage bytes, the weight storages' bytes). `release`: whether the FP8 shards are freed (the setting
    build_fsdp2 derives from the flags; off: the run without freeing). `poison_step`: the step whose first gradient
    is made infinite (skipped), after which each shard is checked against its decoded main weight."""
    init, before = Fp8GatherScales.__init__, len(RECLAIMED)
    if not release:  # from the start: delayed scaling's calibration pass, in the trainer's build, frees nothing

        def init_kept(self, shards, group, release=False):
            init(self, shards, group, False)

        Fp8GatherScales.__init__ = init_kept
    try:
        trainer = Trainer(_parse(flags, world_size))
    finally:
        Fp8GatherScales.__init__ = init
    trainer.reclaimed_in_build = sum(RECLAIMED[before:])  # the calibration's freed shards, written back
    opt = trainer.optimizer
    scales = opt.buffers.fp8_scales
    scales.release = release
    seen, step = [], opt.step

    def observed(lr, grad_norm_fn):
        held = [s.to_local()._tensor.untyped_storage().nbytes() for s in scales.shards]
        seen.append((scales.released, held, _weight_bytes(trainer)))
        if len(seen) == poison_step:
            opt.grads()[0].view(-1)[0] = float("inf")
        norm, stepped = step(lr, grad_norm_fn)
        if len(seen) == poison_step:
            assert not bool(stepped)
            for target, i in opt._plain:  # every weight shard: the unchanged main weight, decoded
                assert torch.equal(target, opt._main(i).to(target.dtype).view_as(target)), i
        return norm, stepped

    opt.step = observed
    return list(trainer.train().losses.values()), trainer, seen


def _body(rank, world_size):
    _poison_reclaimed_storage()
    for recipe, layout, extra in (
        (TENSORWISE, PARAMS, ""),
        (FP8, GRADS, ""),  # delayed: calibrated in a pass whose gradients are thrown away (shards written back)
        (TENSORWISE, PARAMS, "--fp8-stats-interval 2"),
    ):
        flags = f"{FLAGS} {recipe} {layout} {extra}"
        want, kept, kept_seen = _run(flags, release=False)
        got, trainer, seen = _run(flags)
        assert got == want, (recipe, layout, extra, got, want)
        calibrated = recipe == FP8
        assert (trainer.reclaimed_in_build > 0) == calibrated and kept.reclaimed_in_build == 0, recipe
        between = _weight_bytes(trainer)
        fp8_numel = sum(s.to_local().numel() for s in trainer.optimizer.buffers.fp8_scales.shards)
        freed = [s.to_local()._tensor.untyped_storage().nbytes() for s in trainer.optimizer.buffers.fp8_scales.shards]
        assert _weight_bytes(kept) == between and all(w == between for _, _, w in kept_seen)
        assert len(seen) == STEPS and fp8_numel > 0, (len(seen), fp8_numel)
        for step, (released, held, weights) in enumerate(seen, 1):
            if "stats" in extra and step % 2 == 0:  # a watched step: the monitor read the shards in its forward
                assert not released and weights == between, step
                continue
            assert released and not any(held), (step, held)
            # 2 bytes per FP8-gathered element / 2 ranks (the shards' even here: no pad rows)
            assert between - weights == sum(freed) == 2 * fp8_numel, (step, between - weights, fp8_numel)
    # A skipped step gives the shards back and writes them from the unchanged main weights
    flags = f"{FLAGS} {TENSORWISE} {PARAMS}"
    want, _, _ = _run(flags, release=False, poison_step=2)
    got, _, _ = _run(flags, poison_step=2)
    assert got == want and len(got) == STEPS, (got, want)


def test_fsdp_frees_fp8_gathered_shards_between_forward_and_step():
    run_distributed(_body, world_size=2)


CKPT = f"{FLAGS} {TENSORWISE} {PARAMS} --ckpt-format torch_dist --eval-iters 1 --eval-interval 2"


def _checkpoint_body(rank, world_size, out_dir):
    _poison_reclaimed_storage()
    whole, _, _ = _run(CKPT)
    # saved at step 1 (after the step) and step 2 (after the step and an evaluation), then stopped
    _run(f"{CKPT} --save {out_dir} --save-interval 1 --exit-interval 2")
    resumed, _, _ = _run(f"{CKPT} --load {out_dir}")
    assert resumed == whole[2:], (resumed, whole)
    torch.distributed.barrier()
    if rank == 0:
        (Path(out_dir) / "latest_checkpointed_iteration.txt").write_text("1")
    torch.distributed.barrier()
    resumed, _, _ = _run(f"{CKPT} --load {out_dir}")
    assert resumed == whole[1:], (resumed, whole)


def test_fsdp_freed_shards_checkpoints_resume_exactly(tmp_path):
    run_distributed(_checkpoint_body, world_size=2, args=(str(tmp_path),))


def _uneven_body(rank, world_size):
    _poison_reclaimed_storage()
    flags = f"{FLAGS} {TENSORWISE} {PARAMS} --global-batch-size 6"
    want, _, _ = _run(flags, release=False, world_size=world_size)
    got, _, seen = _run(flags, world_size=world_size)
    assert got == want, (got, want)
    assert len(seen) == STEPS and all(released and not any(held) for released, held, _ in seen), (rank, seen)


def test_fsdp_frees_shards_with_pad_rows():
    run_distributed(_uneven_body, world_size=3)


def _calibration_oom_body(rank, world_size):
    import megatron.training.warmup as warmup

    calibrate = warmup.calibrate_delayed_scaling

    def out_of_memory(model, manager, taps, precision, run, *args):
        calibrate(model, manager, taps, precision, run, *args)  # the pass ran: its forward freed the shards
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    warmup.calibrate_delayed_scaling = out_of_memory
    try:
        Trainer(_parse(f"{FLAGS} {FP8} {GRADS}", world_size))
    except RuntimeError as error:  # the cause and the fixes, not the freed shards' bookkeeping
        assert str(error) == warmup.CALIBRATION_OOM and isinstance(error.__cause__, torch.OutOfMemoryError), error
    else:
        raise AssertionError("the calibration pass's out-of-memory error was swallowed")
    finally:
        warmup.calibrate_delayed_scaling = calibrate


def test_calibration_out_of_memory_is_one_line_with_its_fixes():
    run_distributed(_calibration_oom_body, world_size=2)
