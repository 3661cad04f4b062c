"""Delayed scaling's first scales, calibrated before any FP8 GEMM runs (the default; `--no-fp8-calibration` starts
every scale at 1, as Transformer Engine does).

Delayed scaling casts each tensor with a scale made from the amaxes of earlier casts. Before the first step there
are none, and Transformer Engine starts every scale at 1. At scale 1 the first
casts are far from their range: weights of std 0.02 fall mostly into e4m3's subnormals (below 2^-6), and output
gradients, whose elements are around 1e-6 to 1e-9, flush to zero in e5m2 (smallest subnormal 2^-16). Transformer
Engine keeps the scale-1 weight cast for every micro-batch of the first step; the local engine updates its scales
once per step, so its whole first step would run so. On llama-1b (one H100, mock data) that start puts FP8
delayed 3.4% behind bf16 at iteration 30; docs/fp8.md has the measurements.

Calibration runs the first micro-batch once more, forward and backward, in high precision, recording the amax of
every FP8 tensor (input, weight, output gradient) of every FP8 linear, MAX-reduced over the amax group as a step's
amaxes are, and then applies the delayed-scaling rule to them exactly as after a step:

    history = [amax, 0, ...],    scale = fp8_max / amax / 2^margin    (where amax > 0; 1 otherwise)

Its gradients are thrown away and it draws nothing from the random streams the run uses (the caller forks them),
so the run differs from an uncalibrated one only in its first scales. The trainer runs it with every layer recomputed
(megatron/training/warmup.py): in high precision it would otherwise keep twice FP8's bytes of every GEMM input and
need more memory than the step. A recomputed forward records the same amaxes again (running maxima here and in
the taps) and the output gradients once, so the scales are those of the pass without recomputation, bit for bit.
Other recipes compute their scales from the tensor being cast and need no calibration.

FP8 weights (--fp8-param-gather) were cast before any of this, Transformer Engine's at scale 1 (mostly into e4m3's
subnormals): after the pass the trainer casts their fp32 main copies into them again with the calibrated weight
scales, so the first step runs on the weights every later step would cast.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .formats import Role, fp8_max
from .params import is_fp8_param
from .recipes import Recipe
from .scaling import delayed_scale
from .stats import Fp8StatsCollector
from .te_monitor import TE_META_KEY


def calibrate_delayed_scaling(
    model: nn.Module,
    manager: Any,
    taps: Any,
    precision: Any,
    run: Callable[[], None],
    dims: Any,
    userbuffers: bool = False,
) -> str:
    """Calibrate either engine's delayed scaling with `run` (one forward and backward of the first micro-batch);
    `manager` is the local engine's Fp8Manager, None for Transformer Engine's layers (observed through `taps`);
    `userbuffers`: TE's layers communicate through userbuffers (--tp-comm-overlap). Returns the startup log line."""
    recipe = Recipe.from_config(precision)
    if manager is not None:
        finite = calibrate_local(manager, run, dims.amax_group)
    elif userbuffers:
        # TE registers the userbuffers of an FP8 run for FP8 GEMMs only; its high-precision pass finds none
        # ("UB for qkv_fprop with use_fp8=False is not registered", measured on two H200s, TE 2.20).
        return (
            "FP8 calibration: skipped with --tp-comm-overlap (Transformer Engine's userbuffers serve FP8 GEMMs only);"
            " delayed scaling starts from scale 1"
        )
    else:
        finite = calibrate_te(model, taps, recipe, run, dims.amax_group)
    return describe(finite, recipe)


def holds_delayed_scales(manager: Any, taps: Any, device: torch.device) -> bool:
    """Whether every FP8 linear of the run already has delayed-scaling state, as after loading a checkpoint of a
    delayed-scaling run: in the local engine's `manager` (None for Transformer Engine's layers) an amax history not
    all zero; in the fp8_meta of each TE linear of `taps` (the monitor's) a scale other than 1 or an amax not zero
    (TE zeroes the newest row of its history after each update: with a history of 1, all of it). A checkpoint of a
    bf16 run, of another recipe or a conversion holds none, and its first FP8 step would cast at scale 1. Every
    rank agrees the answer (one reduction on the run's `device`), so that the calibration pass, which communicates,
    runs on every rank or on none."""
    if manager is not None:
        history = manager.amax.history
        held = history is None or bool(history.any())
    else:
        keys = {key for key, _ in TE_META_KEY.values()}
        held = all(key in m.fp8_meta and _te_state_set(m.fp8_meta[key]) for m in taps.modules for key in keys)
    if dist.is_initialized():
        missing = torch.tensor([0.0 if held else 1.0], device=device)
        dist.all_reduce(missing, op=dist.ReduceOp.MAX)
        held = not bool(missing.item())
    return held


def _te_state_set(meta: Any) -> bool:
    """A TE module's forward or backward delayed-scaling state (fp8_meta["scaling_fwd"] or ["scaling_bwd"]) holds
    scales from amaxes: a freshly made one has every scale 1 and every amax 0."""
    return bool((meta.scale != 1).any()) or bool(meta.amax_history.any())


def calibrate_local(manager: Any, run: Callable[[], None], group: dist.ProcessGroup | None) -> bool:
    """The local engine: run the calibration pass with every `Fp8LinearState` observing (high-precision GEMMs that
    record amaxes), then one delayed-scaling update. False when an amax was inf/NaN (the scales stay at 1)."""
    states = list(manager.states.values())
    for state in states:
        state.calibrating = True
    try:
        run()
    finally:
        for state in states:
            state.calibrating = False
    finite = manager.amax.step(group)
    manager.forget_weight_casts()
    return finite


def calibrate_te(
    model: nn.Module, taps: Any, recipe: Recipe, run: Callable[[], None], group: dist.ProcessGroup | None
) -> bool:
    """Transformer Engine: run the calibration pass in TE's calibration mode (the FP8 layers run in high precision
    and set up their FP8 state) with the taps recording amaxes (te_monitor.py), then write each module's amax
    history and scales. False when an amax was inf/NaN (TE's scales stay at 1)."""
    device = torch.device("cuda", torch.cuda.current_device())
    collector = Fp8StatsCollector(taps.names, taps.layer_numbers, device)
    te_fp8 = model.te_fp8
    te_fp8.calibrating = True
    # FP8-only weights (--fp8-param-gather) run the high-precision pass dequantized, as plain tensors that have no
    # main_grad for TE's fused weight-gradient accumulation (which fails, measured on TE 2.20): the pass needs the
    # output gradients' amaxes, not weight gradients, so those weights take none.
    fp8_weights = [p for p in model.parameters() if p.requires_grad and is_fp8_param(p)]
    for weight in fp8_weights:
        weight.requires_grad_(False)
    try:
        with taps.attached(collector, amax_only=True):
            run()
    finally:
        te_fp8.calibrating = False
        for weight in fp8_weights:
            weight.requires_grad_(True)
        for layer in model.decoder.layers:
            layer.forget_weight_casts()  # the pass cached no FP8 weight casts for the first step to reuse
    collector.amax = torch.nan_to_num(collector.amax, nan=float("inf"))  # a MAX reduction may drop a NaN
    collector.reduce(group)
    amax = collector.amax
    if not bool(torch.isfinite(amax).all()):
        return False
    with torch.no_grad():
        for index, module in enumerate(taps.modules):
            for role in Role:
                key, position = TE_META_KEY[role]
                meta = module.fp8_meta[key]
                value = amax[index, role.value]
                meta.amax_history[0, position] = value
                meta.scale[position] = delayed_scale(
                    value, fp8_max(recipe.dtype(role)), recipe.margin, meta.scale[position]
                )
    return True


def describe(finite: bool, recipe: Recipe) -> str:
    """The startup log line."""
    if not finite:
        return "FP8 calibration: an amax of the first micro-batch was inf/NaN; delayed scaling starts from scale 1"
    return (
        "FP8 calibration: delayed-scaling scales set from one high-precision pass over the first micro-batch"
        f" (scale = fp8_max / amax / 2^{recipe.margin}); --no-fp8-calibration starts them at 1"
    )
