"""The FP8 monitor and delayed scaling's calibration under tensor (+sequence) and pipeline parallelism on 2 gloo ranks:
the statistics and the calibrated scales of every linear equal the single-process run's, and the first rank's
report covers every pipeline stage under global layer names."""

from __future__ import annotations

import torch

from megatron.config import parse_args
from megatron.training import Trainer
from tests.dist_utils import run_distributed

BASE = (
    "--mock-data --vocab-size 127 --make-vocab-size-divisible-by 64 --num-layers 2 --hidden-size 32"
    " --num-attention-heads 4 --group-query-attention --num-query-groups 2 --seq-length 16 --swiglu"
    " --ffn-hidden-size 64 --position-embedding-type rope --normalization RMSNorm --micro-batch-size 2"
    " --global-batch-size 4 --lr 1e-3 --hidden-dropout 0 --attention-dropout 0 --eval-iters 0 --log-interval 1"
    " --transformer-impl local --fp8-format hybrid --fp8-recipe delayed --fp8-stats-interval 1 --train-iters 1"
    " --no-fp8-first-layer-bf16"  # both layers in FP8: under pp2 each stage then has FP8 linears to report
)
LAYOUTS = {"tp2_sp": "--tensor-model-parallel-size 2 --sequence-parallel", "pp2": "--pipeline-model-parallel-size 2"}


def _run(flags: str, world_size: int) -> tuple[dict, dict, list]:
    """Train one watched step: ({(linear, tensor): (amax, scale, saturated, underflow)} of this stage,
    {linear: calibrated scales [3]}, the rows the monitor logged (all stages, on the first rank))."""
    t = Trainer(parse_args(f"{BASE} {flags}".split(), world_size=world_size))
    names = t.fp8_monitor.taps.names
    calibrated = {name: t.fp8.amax.scale[i].clone() for i, name in enumerate(names)}
    logged, stage = [], []

    def keep(collector, iteration, log, scalars, report=t.fp8_monitor.report):
        stage.extend(report(collector, iteration, log, lambda values, step: logged.append(values)))
        return stage

    t.fp8_monitor.report = keep
    t.train()
    rows = {(r.linear, r.tensor): (r.amax, r.scale, r.saturated, r.underflow) for r in stage}
    return rows, calibrated, logged


def _body(rank: int, world_size: int, reference: tuple[dict, dict, list]) -> None:
    ref_rows, ref_scales, _ = reference
    for layout, flags in LAYOUTS.items():
        rows, scales, logged = _run(flags, world_size)
        assert rows and set(rows) <= set(ref_rows), (layout, set(rows) - set(ref_rows))
        for key, (amax, scale, saturated, underflow) in rows.items():
            ref = ref_rows[key]
            # TP shards are counted on their own and summed; fp32 summation order moves amaxes by rounding only,
            # and the counts by the few elements whose scaled magnitude sits at a boundary (measured: 4 of the 2048
            # output-gradient elements of a linear_qkv, 0.2%, flush on one side and not the other)
            assert abs(amax - ref[0]) <= 1e-5 * ref[0] and abs(scale - ref[1]) <= 1e-5 * ref[1], (layout, key)
            assert abs(saturated - ref[2]) <= 5e-3 and abs(underflow - ref[3]) <= 5e-3, (layout, key, ref, rows[key])
        for name, value in scales.items():
            assert torch.allclose(value, ref_scales[name], rtol=1e-5), (layout, name)
        if rank == 0:  # the log covers both layers (both stages under pp2), with global names
            tags = set(logged[0])
            assert {t.split("/")[1] for t in tags} >= {"layers.0.mlp.linear_fc1", "layers.1.mlp.linear_fc1"}, layout


def test_fp8_monitor_and_calibration_match_one_process_under_tp_and_pp():
    reference = _run("", 1)
    assert len(reference[0]) == 2 * 4 * 3
    run_distributed(_body, world_size=2, args=(reference,))


def _stage_pending(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    from megatron.fp8.guard import Fp8Guard
    from megatron.fp8.monitor import Fp8Monitor, LocalTaps
    from tests.unit.test_fp8_monitor import watched_steps

    guard = Fp8Guard(saturation=0.01, underflow=0.5, intervals=3, auto_bf16=False, move_to_bf16=lambda n: None)
    monitor = Fp8Monitor(LocalTaps([]), 10, guard, torch.device("cpu"), pp_group=dist.group.WORLD)
    # only the last stage is over: both stages watch the steps its streak needs (their gathers would not pair up)
    over = {10: True, 11: True, 12: True} if rank == world_size - 1 else {}
    assert watched_steps(monitor, over, 25) == [10, 11, 12, 20], rank


def test_every_pipeline_stage_watches_while_one_stage_has_a_streak_to_finish():
    run_distributed(_stage_pending, world_size=2)
