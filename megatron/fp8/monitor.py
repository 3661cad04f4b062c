"""The FP8 numerics monitor (`--fp8-stats-interval N`): per linear and per FP8 tensor, what quantization did.

Every N-th optimizer step, each FP8 linear reports for its three tensors (input x, weight W, output gradient dY):

    amax        max |t| (over all tensor- and data-parallel ranks)
    scale       the scale of the cast (per-tensor recipes: the scale; block recipes: the most constrained block's)
    saturated   fraction of elements the saturating cast clipped to +-fp8_max: |t * scale_b| beyond fp8_max by more
                than half an ulp (464 for e4m3, 61440 for e5m2), where clamping loses more than rounding
    underflow   fraction of elements that were nonzero and became zero in FP8 (flushed below half the smallest
                subnormal: 2^-10 for e4m3, 2^-17 for e5m2, in scaled units)

each counted at the tensor's first cast of the step (the first micro-batch; see stats.py, `Fp8StatsCollector`), over
all ranks that hold a shard or a replica of it. The counts follow the cast's own arithmetic with the scales the
cast uses (`scaled_counts`), so they are exact, not estimates from dequantized values. The local engine hands each
cast to the collector (`Fp8LinearState.quantize`); Transformer Engine's linears are observed through hooks on the
same high-precision tensors, with TE's own delayed-scaling scales (`te_monitor.py`): both engines report the same
quantities. This module decides when a step is watched and through which taps (`build_fp8_monitor`).

Off (N = 0) the engines see no collector and pay nothing; on, the counting passes run on the monitored steps only,
and the results reach the host once per monitored step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .guard import Fp8Guard
from .recipes import Recipe
from .stats import Fp8StatsCollector, Fp8TensorStats, global_name, summary_line, tensorboard_scalars


class LocalTaps:
    """The local engine's FP8 linears as the monitor sees them: each `Fp8LinearState` counts its own casts."""

    def __init__(self, states: list[Any]):
        self.states = states
        self.names = [global_name(state.name, state.layer_number) for state in states]
        self.layer_numbers = [state.layer_number for state in states]

    @contextlib.contextmanager
    def attached(self, collector: Fp8StatsCollector) -> Iterator[None]:
        for state in self.states:
            state.stats = collector
        try:
            yield
        finally:
            for state in self.states:
                state.stats = None

    def move_to_bf16(self, layer_number: int) -> None:
        for state in self.states:
            if state.layer_number == layer_number:
                state.enabled = False


class Fp8Monitor:
    """Watches every `interval`-th step (none when 0) through `taps`, reports it, and lets the guard act on it; while
    the guard has a streak to finish (`Fp8Guard.pending`, on any pipeline stage), every step.

    Statistics are reduced over `groups` in turn (together: the tensor- and data-parallel ranks of a stage), so every
    rank of a pipeline stage sees the same numbers and the guard takes the same decisions there; the first rank
    gathers the stages' rows for the log and TensorBoard."""

    def __init__(
        self,
        taps: Any,
        interval: int,
        guard: Fp8Guard,
        device: torch.device,
        groups: tuple[dist.ProcessGroup | None, ...] = (),
        pp_group: dist.ProcessGroup | None = None,
        agreeing: bool = False,
    ):
        """`agreeing`: every rank of `groups[0]` (the amax group) casts with the same scales (delayed scaling), so
        their spread over it is measured and any disagreement reported."""
        self.taps, self.interval, self.guard, self.device = taps, interval, guard, device
        self.groups, self.pp_group, self.agreeing = groups, pp_group, agreeing
        self.dense = False
        """Watch the next step whatever its number: the guard has a streak to finish. The same on every rank (the
        guard's rows are reduced over its stage, and the stages' flags gathered), as the watched steps' collectives
        need."""

    @contextlib.contextmanager
    def watch(self, iteration: int) -> Iterator[Fp8StatsCollector | None]:
        """Around the step numbered `iteration` (1-based): yields the collector if the step is watched, else None."""
        if not self.interval or (iteration % self.interval and not self.dense):
            yield None
            return
        collector = Fp8StatsCollector(self.taps.names, self.taps.layer_numbers, self.device)
        with self.taps.attached(collector):
            yield collector

    def report(
        self,
        collector: Fp8StatsCollector,
        iteration: int,
        log: Callable[[str], None],
        scalars: Callable[[dict[str, float], int], None],
    ) -> list[Fp8TensorStats]:
        """Reduce a watched step's statistics, run the guard on this stage's rows, and log everything (the summary
        line and guard messages through `log`, every number through `scalars`). Returns this stage's rows."""
        for i, group in enumerate(self.groups):
            collector.reduce(group, agreeing=self.agreeing and i == 0)
        rows = collector.rows()
        messages = self.guard.check(rows)
        all_rows, all_messages, self.dense = rows, messages, self.guard.pending()
        if self.pp_group is not None and dist.get_world_size(self.pp_group) > 1:
            gathered: list[Any] = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(gathered, (rows, messages, self.dense), group=self.pp_group)
            all_rows = [row for stage_rows, _, _ in gathered for row in stage_rows]
            all_messages = [message for _, stage_messages, _ in gathered for message in stage_messages]
            self.dense = any(pending for _, _, pending in gathered)
        log(summary_line(iteration, all_rows))
        for message in all_messages:
            log(message)
        scalars(tensorboard_scalars(all_rows), iteration)
        return rows

    def state_dict(self) -> dict[str, Any]:
        return self.guard.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.guard.load_state_dict(state)


def build_fp8_monitor(cfg: Any, model: nn.Module, manager: Any, dims: Any, device: torch.device) -> Fp8Monitor | None:
    """The monitor (and guard) of a run with FP8 on, for either engine; None with FP8 off. Built even with
    --fp8-stats-interval 0, because it also carries the layers a guard moved to bf16 across checkpoints."""
    precision = cfg.precision
    if not precision.fp8:
        return None
    recipe = Recipe.from_config(precision)
    if manager is None:  # Transformer Engine's layers
        from .te_monitor import TETaps

        taps: Any = TETaps(model, recipe, model.te_fp8.fp8_layers)
    else:
        taps = LocalTaps(list(manager.states.values()))
    guard = Fp8Guard(
        precision.fp8_guard_saturation,
        precision.fp8_guard_underflow,
        precision.fp8_guard_intervals,
        precision.fp8_auto_bf16,
        taps.move_to_bf16,
    )
    # --tp-only-amax-red narrows the amax group to the tensor-parallel ranks; the statistics still cover the
    # data-parallel replicas, so that they all take the guard's decisions alike
    groups = (dims.amax_group, dims.dp_cp_group) if precision.tp_only_amax_red else (dims.amax_group,)
    # The scales' agreement is checked where the local FP8 engine casts: it reduces its amaxes once per step over
    # exactly this group. Transformer Engine reduces its own; its ranks' scales are not yet shown to agree bit for bit.
    agreeing = recipe.delayed and cfg.model.transformer_impl == "local"
    return Fp8Monitor(taps, precision.fp8_stats_interval, guard, device, groups, dims.pp_group, agreeing)
