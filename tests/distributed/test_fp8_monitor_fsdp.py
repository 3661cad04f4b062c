"""The FP8 monitor and guard under FSDP (optim_grads_params) on 2 gloo ranks, against the distributed optimizer with
the same model, seed and flags: the same statistics and log lines, with and without --fp8-param-gather (where the
weight's statistics count the cast of each rank's shard / main piece, not the FP8 weight read back; blockwise, rowwise
and mxfp8, gathered as FP8 under FSDP only, against FSDP's high-precision gathers), and the guard names and moves the
same layer to bf16 (--fp8-auto-bf16; its gathered FP8 weights then dequantized)."""

from __future__ import annotations

import math

from megatron.config import parse_args
from megatron.fp8 import Role
from megatron.training import Trainer
from tests.dist_utils import run_distributed
from tests.distributed.test_fp8_monitor_layouts import BASE

DISTOPT = "--use-distributed-optimizer"
FSDP = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"
FLAGS = f"{BASE} --global-batch-size 8"  # two micro-batches per rank
MARGIN = "--fp8-margin 12"  # scales 2^12 too small: some weight elements flush to zero in their cast
GUARD = "--train-iters 3 --fp8-guard-intervals 2 --fp8-guard-underflow 0.5 --fp8-auto-bf16"


def _run(flags: str, world_size: int, saturate: str | None = None) -> tuple[dict, list[str], Trainer, list[float]]:
    """Train: ({(iteration, linear, tensor): (amax, scale, saturated, underflow)}, the lines the monitor logged,
    the trainer, the losses); `saturate`: the linear whose input's delayed scale is pinned 1e6 too large."""
    t = Trainer(parse_args(f"{FLAGS} {flags}".split(), world_size=world_size))
    rows, lines = {}, []

    def keep(collector, iteration, log, scalars, report=t.fp8_monitor.report):
        stage = report(collector, iteration, lines.append, scalars)
        rows.update({(iteration, r.linear, r.tensor): (r.amax, r.scale, r.saturated, r.underflow) for r in stage})
        return stage

    t.fp8_monitor.report = keep
    if saturate is not None:
        index = next(i for i, s in enumerate(t.fp8.states.values()) if s.name.endswith(saturate))
        module = dict(t.model.named_modules())[list(t.fp8.states.values())[index].name]

        def pin_scale(mod, args):
            t.fp8.amax.scale[index, Role.INPUT.value] = 1e6

        module.register_forward_pre_hook(pin_scale)
    losses = list(t.train().losses.values())
    return rows, lines, t, losses


def _body(rank: int, world_size: int) -> None:
    weights = {}
    for gather in ("", "--fp8-param-gather"):
        want, want_lines, _, _ = _run(f"{MARGIN} {gather} {DISTOPT}", world_size)
        got, got_lines, _, _ = _run(f"{MARGIN} {gather} {FSDP}", world_size)
        differ = {key: (got.get(key), value) for key, value in want.items() if got.get(key) != value}
        assert len(got) == 24 and got == want, (gather, differ)
        assert got_lines == want_lines, gather
        weights[gather] = {key: value for key, value in got.items() if key[2] == "weight"}
    # the FP8 gathers' casts (of the fp32 shards, with the delayed weight scale) are the casts the linears make of
    # the gathered fp32 weights without --fp8-param-gather: the same counts, some weights underflowing; the scale
    # reported for an FP8 weight is 1 / its scale_inv, within an ulp of the scale the cast used
    gathered, cast = weights["--fp8-param-gather"], weights[""]
    assert gathered.keys() == cast.keys() and any(underflow > 0 for *_, underflow in cast.values())
    for key, (amax, scale, *fractions) in gathered.items():
        assert amax == cast[key][0] and fractions == list(cast[key][2:]), (key, gathered[key], cast[key])
        assert math.isclose(scale, cast[key][1], rel_tol=1e-6), (key, scale, cast[key][1])

    # blockwise FP8 gathers (FSDP only): each shard counted with its rows' blocks, a block cut by the shard boundary
    # (96 rows of linear_qkv: one 128x128 block over the two shards) as the linear's cast of the gathered weight
    # rowwise and mxfp8 gathered per axis (parallel/fsdp/fp8_gather_axes.py): each shard's row cast counted, its scales
    # its own
    for recipe in ("blockwise", "rowwise", "mxfp8"):
        blocks = {}
        for gather in ("", "--fp8-param-gather"):
            rows, _, _, _ = _run(f"--fp8-recipe {recipe} {gather} {FSDP}", world_size)
            blocks[gather] = {key: value for key, value in rows.items() if key[2] == "weight"}
        assert len(blocks[""]) == 8 and blocks["--fp8-param-gather"] == blocks[""], recipe

    moved = {}
    for layout in (DISTOPT, FSDP):
        _, lines, t, losses = _run(f"--fp8-param-gather {GUARD} {layout}", world_size, "layers.1.mlp.linear_fc1")
        guard = [line for line in lines if line.startswith("FP8 guard")]
        moved[layout] = guard, t.fp8_monitor.guard.bf16_layers, [s.enabled for s in t.fp8.states.values()], losses
    guard, layers, enabled, losses = moved[FSDP]
    named = "FP8 guard: transformer layer 2, layers.1.mlp.linear_fc1 input: saturated"
    assert any(line.startswith(named) and "moved the layer" in line for line in guard), guard
    assert layers == [2] and enabled == [s.layer_number != 2 for s in t.fp8.states.values()]
    assert (guard, layers, enabled) == moved[DISTOPT][:3]
    # after the move the layer computes in bf16 on its dequantized FP8 weights, under both layouts; the FP8
    # gathers' steps differ from the distributed optimizer's by rounding (docs/fsdp.md: within 1e-3)
    assert all(math.isclose(a, b, rel_tol=1e-3) for a, b in zip(losses, moved[DISTOPT][3])), (losses, moved)


def test_fp8_monitor_and_guard_under_fsdp_match_the_distributed_optimizer():
    run_distributed(_body, world_size=2)
