"""FSDP with --fp8-param-gather under the rowwise and mxfp8 recipes (local layers, FP8 emulated on the CPU), whose
weights are cast along both axes (megatron/parallel/fsdp/fp8_gather_axes.py), against the distributed optimizer with the
same recipe (which casts the gathered weight itself) over 10 steps: within 1e-3 under optim_grads_params (and with
activation recomputation and O2's precision-aware states), optim_grads and --torch-fsdp2-no-reshard-after-forward at
DP=2, and at TP=2 x FSDP=2 (with explicit prefetches). Measured: a resharded unit's forward gathers carry the row cast
only and its backward gathers the column cast only, a unit kept gathered (or recomputed) gathers both at once; each
resharded layer's gather moves at most 0.55x the bf16 gather's bytes (rowwise 0.518x, mxfp8 0.540x); one amax
all-reduce per step. The gathered bytes and scales of both casts are the linear's own casts of the whole weight,
`quantize(W)` and `quantize(W.t())`, byte for byte, at DP=2 and FSDP=4, where shard boundaries cut mx blocks of 32
rows (shard rows 48, 16, 24 and 8), and rowwise at FSDP=3 (pad rows); there an mxfp8 weight whose rows the ranks do
not divide stays plain. Under recomputation only the weights of the linears it runs again gather both casts (selective
core_attn and layernorm: none; mlp: fc1 and fc2; full, block: the covered layer's), within 1e-3 of the bf16 gather."""

import torch
import torch.distributed as dist

from megatron.fp8.formats import E4M3
from megatron.fp8.quantize import MX_BLOCK, ROW, quantize
from megatron.parallel.fsdp.fp8_gather import Fp8ShardWeight, shard_rows
from megatron.parallel.fsdp.fp8_gather_axes import BOTH_CASTS, COLUMN_CAST, ROW_CAST, AxesCast
from megatron.parallel.fsdp.fsdp2 import local_shard
from megatron.training import Trainer
from tests.dist_utils import run_distributed
from tests.distributed.test_fsdp import DISTOPT, FLAGS, GRADS, PA, PARAMS, STEPS, _counted, _run
from tests.distributed.test_fsdp import _close as _close_steps
from tests.distributed.test_fsdp_no_reshard import NO_RESHARD, RECOMPUTE

# ffn 48: fc1 [96, 32] and fc2 [32, 48] (two mx blocks along a row, the second partial); over 2 ranks fc1's shards
# of 48 rows and proj's and fc2's of 16 cut a block of 32 rows in two, over 4 ranks 24 and 8 rows (a block over 4)
SHAPES = " --ffn-hidden-size 48 --no-fp8-first-layer-bf16 --lr 1e-3"
RECIPES = {name: f" --fp8-format hybrid --fp8-recipe {name}{SHAPES}" for name in ("rowwise", "mxfp8")}


def _close(got: list[float], want: list[float], rel: float, label: str, steps: int = STEPS) -> None:
    _close_steps(got, want, rel, label, steps=steps)


class Casts:
    """Which casts each all-gather of a weight cast per axis moved: (its unit reshards after forward, the casts,
    FSDP2 gathering it for a backward)."""

    def __init__(self) -> None:
        self.seen: list[tuple[bool, str, bool]] = []
        inputs = AxesCast.inputs

        def watched(axes: AxesCast):
            tensors, casts = inputs(axes)
            self.seen.append((axes.split, casts, axes.in_backward()))
            return tensors, casts

        AxesCast.inputs = watched
        self.close = lambda: setattr(AxesCast, "inputs", inputs)


def _watched(flags: str, world_size: int, counted: bool = False):
    casts = Casts()
    try:
        result = _counted(flags, world_size) if counted else (*_run(flags, world_size), None)
    finally:
        casts.close()
    return result, casts.seen


def _check_phases(seen: list[tuple[bool, str, bool]], split: bool) -> None:
    """Resharded units: the forward's gathers the row cast, the backward's the column cast; kept ones both."""
    if split:
        resharded = [(casts, backward) for was_split, casts, backward in seen if was_split]
        assert {(ROW_CAST, False), (COLUMN_CAST, True)} == set(resharded), set(resharded)
    assert all(casts == BOTH_CASTS for was_split, casts, _ in seen if not was_split)
    assert any(not was_split for was_split, _, _ in seen) and (split or all(not s for s, _, _ in seen))


def _all_gather(tensor: torch.Tensor, group) -> torch.Tensor:
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return torch.cat(pieces)


def _check_casts(trainer: Trainer, mx: bool) -> list[int]:
    """Each weight's gathered casts (both axes) against the linear's casts of the whole weight; returns the shard
    rows of the weights checked."""
    scales = trainer.optimizer.buffers.fp8_scales
    scales.stale = True
    scales.agree()
    spec, rows_checked = MX_BLOCK if mx else ROW, []
    for param in scales.shards:
        local = param.to_local()
        axes = local._scale.axes
        group = param.device_mesh.get_group()
        pad_rows = axes.row_data.shape[0] - local.shape[0]
        whole = _all_gather(torch.nn.functional.pad(local._tensor, (0, 0, 0, pad_rows)), group)[: param.shape[0]]
        both = [(axes.row_data, axes.row_scales), (axes.col_data, axes.col_scales)]
        row, col = [tuple(_all_gather(t, group) for t in cast if t is not None) for cast in both]
        for got, (want, _) in (
            (axes.row_operand(row), quantize(whole, spec, E4M3, mx=mx)),
            (axes.column_operand(col), quantize(whole.t(), spec, E4M3, mx=mx)),
        ):
            assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
            assert got.scale_inv.dtype == want.scale_inv.dtype and got.block == want.block
            bits = torch.uint8 if mx else torch.float32
            assert torch.equal(got.scale_inv.view(bits), want.scale_inv.view(bits))
            assert torch.equal(got.amax, want.amax)
        rows_checked.append(shard_rows(param.shape[0], param.device_mesh.size()))
    return rows_checked


def _dp2_body(rank, world_size):
    for name, recipe in RECIPES.items():
        flags = f"{FLAGS} --bf16 {recipe}"
        want, _ = _run(f"{flags} {DISTOPT}", world_size)
        (got, sent, reduces, trainer), seen = _watched(f"{flags} --fp8-param-gather {PARAMS}", world_size, True)
        _close(got, want, 1e-3, f"{name} optim_grads_params")
        _check_phases(seen, split=True)
        rows = _check_casts(trainer, name == "mxfp8")
        assert len(rows) == 16 and {48, 16} <= set(rows), rows  # every linear; mx blocks cut by the shards
        # The same all-gathers as the bf16 gather's: the 3 resharded layer units' (forward and backward, two
        # micro-batches) at most 0.55x the bytes; the last layer unit's (kept gathered: both casts) about bf16's
        _, bf16_sent, bf16_reduces, _ = _counted(f"{flags} {PARAMS}", world_size)
        assert len(sent) == len(bf16_sent), (len(sent), len(bf16_sent))
        ratios = [a / b for a, b in zip(sent, bf16_sent)]
        halved = sorted({round(r, 3) for r in ratios if r <= 0.55})
        assert len([r for r in ratios if r <= 0.55]) == 3 * 2 * 2 * STEPS and max(ratios) <= 1.1, halved
        if rank == 0:
            print(f"{name}: layer gathers {halved} x bf16's bytes, kept: {max(ratios):.3f}", flush=True)
        # one amax all-reduce per step
        assert reduces - bf16_reduces == STEPS
        for label, extra, split in (("optim_grads", GRADS, False), ("no reshard", NO_RESHARD, False)):
            (got, _, _), seen = _watched(f"{flags} --fp8-param-gather {extra}", world_size)
            _close(got, want, 1e-3, f"{name} {label}")
            _check_phases(seen, split)
    # activation recomputation (the recomputed forward runs on the backward's gather: both casts) and O2's states
    flags = f"{FLAGS} --bf16 {RECIPES['mxfp8']} {PA}"
    want, _ = _run(f"{flags} {DISTOPT}", world_size)
    (got, trainer, _), seen = _watched(f"{flags} {RECOMPUTE} --fp8-param-gather {PARAMS}", world_size)
    _close(got, want, 1e-3, "mxfp8 recomputed, O2")
    _check_phases(seen, split=False)
    assert trainer.optimizer.buffers.fp8_scales.release


def test_rowwise_and_mxfp8_fp8_gathers_match_the_distributed_optimizer_in_half_the_bytes():
    run_distributed(_dp2_body, world_size=2)


def _four_body(rank, world_size):
    for name, recipe in RECIPES.items():
        flags = f"{FLAGS} --bf16 {recipe} --ffn-hidden-size 96 --tensor-model-parallel-size 2"
        want, _ = _run(f"{flags} {DISTOPT}", world_size)
        # with explicit prefetches (--fsdp-double-buffer): FSDP2's state tells a backward prefetch too
        (got, trainer, _), seen = _watched(f"{flags} --fp8-param-gather {PARAMS} --fsdp-double-buffer", world_size)
        _close(got, want, 1e-3, f"{name} TP=2 x FSDP=2")
        _check_phases(seen, split=True)
        _check_casts(trainer, name == "mxfp8")  # each tensor-parallel piece's casts are its own
    flags = f"{FLAGS.replace(f'--train-iters {STEPS}', '--train-iters 2')} --bf16 {RECIPES['mxfp8']}"
    (_, trainer, _), _ = _watched(f"{flags} --fp8-param-gather {PARAMS}", world_size)
    assert {24, 8} <= set(_check_casts(trainer, True))


def test_tp2_fsdp2_and_fsdp4_gather_the_whole_weights_casts():
    run_distributed(_four_body, world_size=4)


def _three_body(rank, world_size):
    flags = f"{FLAGS.replace(f'--train-iters {STEPS}', '--train-iters 2')} --bf16 --global-batch-size 6"
    (_, trainer, _), _ = _watched(f"{flags} {RECIPES['rowwise']} --fp8-param-gather {PARAMS}", world_size)
    assert len(_check_casts(trainer, False)) == 16  # every weight, each with pad rows but fc1's (96 rows)
    (_, trainer, _), _ = _watched(f"{flags} {RECIPES['mxfp8']} --fp8-param-gather {PARAMS}", world_size)
    plain = [m.weight for m in trainer.model.modules() if getattr(m, "fp8", None) is not None]
    plain = [w for w in plain if not isinstance(local_shard(w), Fp8ShardWeight)]
    assert len(_check_casts(trainer, True)) == 4 and len(plain) == 12  # fc1 only: 64 and 32 rows stay plain


def _split_layers(trainer: Trainer) -> list[int]:
    """The 1-based layer of each FP8-gathered weight whose gathers send one cast at a time (its unit resharded after
    its forward and its linear's forward not run again in the backward)."""
    names = {
        id(local_shard(p)._scale): n for n, p in trainer.model.named_parameters() if hasattr(local_shard(p), "_scale")
    }
    shards = trainer.optimizer.buffers.fp8_scales.shards
    return [int(names[id(s.to_local()._scale)].split(".")[2]) + 1 for s in shards if s.to_local()._scale.axes.split]


def _recompute_body(rank, world_size):
    """Recomputation re-runs a linear's forward in the backward, on the backward's gather, only where full
    recomputation covers its layer or --recompute-modules names mlp (fc1 and fc2): those weights gather both casts,
    every other weight of a resharded unit one cast per pass (selective core_attn or layernorm re-run no linear)."""
    flags = f"{FLAGS.replace(f'--train-iters {STEPS}', '--train-iters 4')} --bf16 {RECIPES['mxfp8']}"
    selective = "--recompute-granularity selective --recompute-modules"
    for recompute, split in (
        (f"{selective} core_attn layernorm", [1] * 4 + [2] * 4 + [3] * 4),  # the last layer unit stays gathered
        (f"{selective} mlp", [1] * 2 + [2] * 2 + [3] * 2),  # linear_qkv and linear_proj
        ("--recompute-granularity full --recompute-method block --recompute-num-layers 1", [2] * 4 + [3] * 4),
    ):
        want, _ = _run(f"{flags} {recompute} {PARAMS}", world_size)
        (got, trainer, _), seen = _watched(f"{flags} {recompute} --fp8-param-gather {PARAMS}", world_size)
        _close(got, want, 1e-3, recompute, steps=4)
        _check_phases(seen, split=True)
        assert sorted(_split_layers(trainer)) == split, (recompute, _split_layers(trainer))


def test_recomputation_gathers_both_casts_only_for_the_linears_it_runs_again():
    run_distributed(_recompute_body, world_size=2)


def test_uneven_shards_rowwise_gathers_every_weight_mxfp8_only_those_the_ranks_divide():
    run_distributed(_three_body, world_size=3)
