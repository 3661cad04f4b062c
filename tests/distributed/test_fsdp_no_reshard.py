"""--use-torch-fsdp2 optim_grads_params with --torch-fsdp2-no-reshard-after-forward (Megatron-LM's flag) at DP=2
against the distributed optimizer at DP=2 over 10 steps (two micro-batches per step): fp32 losses within 1e-5, bf16,
FP8 delayed (with every layer recomputed, and with --fp8-param-gather, also with O2's precision-aware states) and
untied two-layer units with explicit prefetch (--fsdp-double-buffer) within 1e-3; bf16 bitwise the losses without
the flag. Measured: every unit is still gathered when a micro-batch's forward ends (without the flag only the root
and the last layer unit are), none after its backward nor between steps (each rank holds its shards only), nor after
an evaluation; the four layer units are gathered once per micro-batch (without the flag three of them twice). Its
torch_dist checkpoint resumes exactly, and under the distributed optimizer within 1e-5."""

from collections import Counter

from megatron.parallel.fsdp import fsdp2_internals as internals
from megatron.training.data_loading import to_device
from tests.dist_utils import run_distributed
from tests.distributed.test_fsdp import (
    CKPT,
    DISTOPT,
    FLAGS,
    PA,
    STEPS,
    UNITS,
    _counted,
    _gathered_bytes,
    _held_bytes,
    _run,
)
from tests.distributed.test_fsdp import _close as _close_steps
from tests.distributed.test_parallel_layouts import FP8

TORCH = "--use-torch-fsdp2 --data-parallel-sharding-strategy optim_grads_params"
NO_RESHARD = f"{TORCH} --torch-fsdp2-no-reshard-after-forward"
RECOMPUTE = " --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
LAYERS, MICRO = 4, 2


def _close(got: list[float], want: list[float], rel: float, label: str, steps: int = STEPS) -> None:
    _close_steps(got, want, rel, label, steps=steps)


def _gathered_units(trainer) -> list[bool]:
    """Whether each FSDP unit (the root included) holds its gathered weights now."""
    groups = [internals.param_group(unit) for unit in internals.units(trainer.model)]
    return [internals.is_unsharded(group) for group in groups if group is not None]


def _micro_batch(trainer) -> list[bool]:
    """One micro-batch's forward and backward: the units gathered when the forward ends (the backward's start)."""
    batch = to_device(next(iter(trainer.loader(trainer.datasets.train, 0))), trainer.device)
    loss = trainer.steps.loss(batch)
    gathered = _gathered_units(trainer)
    loss.backward()
    assert _gathered_bytes(trainer.model) == 0  # freed after the backward
    trainer.optimizer.restore_freed_shards()  # no step follows (--use-precision-aware-optimizer's freed shards)
    trainer.optimizer.buffers.zero()
    return gathered


def _numerics_body(rank, world_size):
    for precision, rel in (("", 1e-5), ("--bf16", 1e-3)):
        want, distopt = _run(f"{FLAGS} {precision} {DISTOPT}", world_size)
        got, trainer = _run(f"{FLAGS} {precision} {NO_RESHARD}", world_size)
        _close(got, want, rel, f"no reshard {precision}")
        # between steps: only the shards (fp32 weights, gradients, two moments, halved, plus one layer)
        numel = sum(p.numel() for p in distopt.model.parameters())
        layer = sum(p.numel() for p in trainer.model.decoder.layers[0].parameters())
        assert _gathered_bytes(trainer.model) == 0 and not any(_gathered_units(trainer))
        assert _held_bytes(trainer) <= 16 * (numel / 2 + layer) < _held_bytes(distopt), precision
    # bf16: the same losses as without the flag, bit for bit, in fewer all-gathers
    base, base_sent, _, resharded = _counted(f"{FLAGS} --bf16 {TORCH}", world_size)
    got, sent, _, trainer = _counted(f"{FLAGS} --bf16 {NO_RESHARD}", world_size)
    assert got == base, (got, base)
    layer_bytes = Counter(base_sent).most_common(1)[0][0]  # a layer unit's gather, the most frequent
    assert Counter(base_sent)[layer_bytes] == (2 * (LAYERS - 1) + 1) * MICRO * STEPS  # the last layer: kept
    assert Counter(sent)[layer_bytes] == LAYERS * MICRO * STEPS  # each layer once per micro-batch
    assert len(base_sent) - len(sent) == (LAYERS - 1) * MICRO * STEPS
    assert all(_micro_batch(trainer))  # every unit still gathered for the backward
    assert sum(_micro_batch(resharded)) == 2  # without the flag: the root and the last layer unit
    # FP8 delayed (its calibration pass recomputes every layer), with activation recomputation, and FP8 all-gathers
    # with O2's states (bf16 shards, freed from the forward's cast to the step)
    gather, wants = f"{FP8} --fp8-param-gather", {}
    for fp8, extra in ((FP8, ""), (FP8, RECOMPUTE), (gather, ""), (f"{gather} {PA}", "")):
        if fp8 not in wants:  # the recomputed run is held to the same reference as the plain one (trained once)
            wants[fp8], _ = _run(f"{FLAGS} --bf16 {fp8} {DISTOPT}", world_size)
        got, trainer = _run(f"{FLAGS} --bf16 {fp8} {extra} {NO_RESHARD}", world_size)
        _close(got, wants[fp8], 1e-3, f"no reshard, {fp8} {extra}")
        assert _gathered_bytes(trainer.model) == 0, (fp8, extra)
        assert all(_micro_batch(trainer)), (fp8, extra)
    # untied embeddings, units of two layers, explicit prefetch (--fsdp-double-buffer)
    want, _ = _run(f"{FLAGS} --bf16 --untie-embeddings-and-output-weights {DISTOPT}", world_size)
    got, trainer = _run(f"{FLAGS} --bf16 {UNITS} {NO_RESHARD}", world_size)
    _close(got, want, 1e-3, "no reshard, two-layer units, double buffer")
    units = _gathered_units(trainer)  # embedding, two units of two layers, final norm + output (the root: none)
    gathered = _micro_batch(trainer)
    assert len(units) == 4 and all(gathered), (units, gathered)


def test_no_reshard_after_forward_matches_distributed_optimizer_in_fewer_gathers():
    run_distributed(_numerics_body, world_size=2)


def _checkpoint_body(rank, world_size, out_dir):
    # An evaluation's forward (no backward) frees the units it gathered: the run ends with one
    _, trainer = _run(f"{FLAGS} --eval-iters 1 --eval-interval 10 {NO_RESHARD}", world_size)
    assert _gathered_bytes(trainer.model) == 0 and not any(_gathered_units(trainer))
    flags = f"{CKPT} --train-iters 4 {NO_RESHARD}"
    whole, _ = _run(flags, world_size)
    _run(f"{flags} --exit-interval 2 --save {out_dir}/ckpt", world_size)
    resumed, _ = _run(f"{flags} --load {out_dir}/ckpt", world_size)
    assert resumed == whole[2:], (resumed, whole)
    resumed, _ = _run(f"{CKPT} --train-iters 4 {DISTOPT} --load {out_dir}/ckpt", world_size)
    _close(resumed, whole[2:], 1e-5, "the distributed optimizer from the no-reshard checkpoint", steps=2)


def test_no_reshard_after_forward_frees_after_evaluation_and_resumes(tmp_path):
    run_distributed(_checkpoint_body, world_size=2, args=(str(tmp_path),))
