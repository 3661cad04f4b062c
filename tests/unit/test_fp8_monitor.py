"""The FP8 monitor's statistics against hand-computed values and against the real casts, the guard's rule, and the
steps the monitor watches."""

import pytest
import torch

from megatron.fp8 import E4M3, E5M2, Recipe, Role, fp8_max, quantize
from megatron.fp8.formats import Fp8Format
from megatron.fp8.guard import Fp8Guard
from megatron.fp8.monitor import Fp8Monitor, LocalTaps
from megatron.fp8.quantize import TENSOR, block_amax, block_scales
from megatron.fp8.stats import (
    CLIPPED,
    FLUSHED,
    Fp8StatsCollector,
    Fp8TensorStats,
    scaled_counts,
    summary_line,
    tensorboard_scalars,
)


def test_counts_by_hand_e4m3_scale_one():
    # e4m3: max 448 (ulp 32 there), smallest subnormal 2^-9. At scale 1, |x| > 464 is clipped (up to 464 the cast
    # gives 448 as rounding would) and 0 < |x| <= 2^-10 flushes (2^-10 is a tie, and ties go to the even 0).
    x = torch.tensor([[500.0, -465.0, 460.0, 448.0, 1.0, 2.0**-10, -(2.0**-11), 1.01 * 2.0**-10, 0.0]])
    counts = scaled_counts(x, torch.ones(1, 1), TENSOR, E4M3)
    assert counts.tolist() == [2, 2, 9]  # 500, -465 | 2^-10, -2^-11
    # at scale 4: 460 * 4 and 448 * 4 are clipped too, and 2^-10 * 4 = 2^-8 is representable
    assert scaled_counts(x, torch.full((1, 1), 4.0), TENSOR, E4M3).tolist() == [4, 0, 9]


def test_counts_by_hand_e5m2():
    # e5m2: max 57344 (ulp 8192 there), smallest subnormal 2^-16
    x = torch.tensor([[70000.0, 61000.0, 57344.0, 2.0**-17, 2.0**-16, 3.0 * 2.0**-18]])
    assert scaled_counts(x, torch.ones(1, 1), TENSOR, E5M2).tolist() == [1, 1, 6]
    assert (FLUSHED[E5M2], CLIPPED[E5M2]) == (2.0**-17, 61440.0)


@pytest.mark.parametrize("recipe_name", ["delayed", "tensorwise", "rowwise", "blockwise", "mxfp8"])
@pytest.mark.parametrize("role", list(Role))
def test_counts_match_the_real_cast(recipe_name, role):
    """Underflow from the formula equals the elements the real cast turned into zero; saturation equals the
    elements the cast clamped to fp8_max although they exceed it by more than half an ulp (found by dequantizing)."""
    recipe = Recipe(recipe_name, Fp8Format("hybrid"))
    gen = torch.Generator().manual_seed(0)
    # magnitudes over 40 binades, so that every recipe flushes some elements; a few exact zeros too
    x = torch.randn(96, 160, generator=gen) * torch.exp2(torch.randint(-30, 10, (96, 160), generator=gen).float())
    x[0, :5] = 0.0
    spec, dtype = recipe.block(role), recipe.dtype(role)
    given = torch.tensor(3.0e3) if recipe.delayed else None  # a stale delayed scale: some elements saturate
    options = dict(scale=given, power_of_two=recipe.power_of_two(role), mx=recipe.mx)
    q, _ = quantize(x, spec, dtype, **options)
    scales, _ = block_scales(block_amax(x, spec), dtype, **options)
    saturated, underflow, elements = scaled_counts(x, scales, spec, dtype).tolist()
    data, deq = q.data.float().abs(), q.dequantize().abs()
    flushed = int(((data == 0) & (x != 0)).sum())
    clipped = int(((data == fp8_max(dtype)) & (x.abs() > deq * CLIPPED[dtype] / fp8_max(dtype))).sum())
    assert elements == x.numel()
    assert underflow == flushed and underflow > 0
    assert saturated == clipped
    if recipe.delayed:
        assert saturated > 0
    else:
        assert saturated == 0  # scales from the current amax never clip (MXFP8 rounds its exponent up)


def test_collector_counts_each_tensor_once_per_step_and_reports_fractions():
    recipe = Recipe("tensorwise", Fp8Format("hybrid"))
    collector = Fp8StatsCollector(["decoder.layers.0.mlp.linear_fc1"], [1], torch.device("cpu"))
    first = torch.tensor([[1.0, 2.0**-20, 3.0, 0.0]])
    collector.record(0, Role.INPUT, first, recipe, None)
    collector.record(0, Role.INPUT, torch.full((1, 4), 1e-30), recipe, None)  # a later micro-batch: not counted
    (row,) = collector.rows()
    assert row.role is Role.INPUT and row.layer_number == 1
    assert row.amax == 3.0 and row.scale == pytest.approx(448.0 / 3.0)
    # 2^-20 * 448/3 ~ 1.4e-4 <= 2^-10 flushes: 1 of 4 elements
    assert (row.saturated, row.underflow) == (0.0, 0.25)
    assert collector.counted == {(0, Role.INPUT)}
    # peak/RMS of the counted tensor: 3 / sqrt((1 + 2^-40 + 9 + 0) / 4)
    assert row.peak_ratio == pytest.approx(3.0 / (10.0 / 4) ** 0.5)
    assert row.scale_spread == 1.0  # one process: nothing to disagree with


@pytest.mark.parametrize("recipe_name", ["tensorwise", "blockwise"])
def test_a_cast_made_in_pieces_counts_as_the_whole_tensor_cast(recipe_name):
    # --fp8-param-gather: each rank counts the rows it cast (FSDP's shards: blocks cut by a shard boundary) with the
    # weight's scales, and the reduction sums the pieces: the whole tensor's counts, amax and smallest scale
    recipe = Recipe(recipe_name, Fp8Format("hybrid"))
    spec = recipe.block(Role.WEIGHT)
    w = torch.randn(200, 160, generator=torch.Generator().manual_seed(0)) * torch.logspace(-9, 0, 160)
    scale = torch.tensor([[3e3, 5e2], [9e2, 2e4]]) if recipe_name == "blockwise" else torch.full((1, 1), 4e3)
    whole = scaled_counts(w, scale, spec if recipe_name == "blockwise" else TENSOR, E4M3)
    assert whole[0] > 0 and whole[1] > 0  # some saturate, some flush: the pieces' counts are no zeros
    collectors = []
    for first, last in ((0, 70), (70, 140), (140, 200), (200, 200)):  # the last rank holds no row
        collector = Fp8StatsCollector(["linear"], [1], torch.device("cpu"))
        piece = w[first:last] if recipe_name == "blockwise" else w[first:last].reshape(-1)
        collector.record_cast(0, Role.WEIGHT, piece, first, scale.reciprocal().reciprocal(), recipe)
        collector.record_cast(0, Role.WEIGHT, w, 0, scale, recipe)  # counted once per step
        collectors.append(collector)
    counts = sum(c.counts[0, Role.WEIGHT.value] for c in collectors)
    assert counts.tolist() == whole.tolist()
    assert max(float(c.amax[0, Role.WEIGHT.value]) for c in collectors) == float(w.abs().max())
    assert min(float(c.scale[0, Role.WEIGHT.value]) for c in collectors) == pytest.approx(float(scale.min()))


def _row(linear="decoder.layers.1.mlp.linear_fc2", layer=2, role=Role.INPUT, saturated=0.0, underflow=0.0):
    return Fp8TensorStats(linear, layer, role, 10.0, 44.8, saturated, underflow)


def test_tensorboard_tags_and_summary_line():
    rows = [_row(saturated=0.02), _row("decoder.layers.0.self_attention.linear_qkv", 1, Role.GRAD, underflow=0.3)]
    scalars = tensorboard_scalars(rows)
    assert scalars["fp8/layers.1.mlp.linear_fc2/input/saturated"] == 0.02
    assert scalars["fp8/layers.0.self_attention.linear_qkv/grad/underflow"] == 0.3
    assert len(scalars) == 12  # 2 rows x (amax, scale, saturated, underflow, peak_ratio, scale_spread)
    line = summary_line(100, rows)
    assert "saturated: layers.1.mlp.linear_fc2 input 2%" in line
    assert "underflow: layers.0.self_attention.linear_qkv grad 30%" in line


def test_scale_disagreement_is_a_guard_condition_and_in_the_summary_line():
    agreeing = _row()
    split = Fp8TensorStats("decoder.layers.1.mlp.linear_fc1", 2, Role.INPUT, 10.0, 44.8, 0.0, 0.0, 5.0, 1.25)
    guard = Fp8Guard(saturation=0.01, underflow=0.5, intervals=1, auto_bf16=False, move_to_bf16=lambda n: None)
    assert guard.conditions(agreeing) == []
    assert guard.conditions(split) == ["scales disagree across ranks (x1.25)"]
    assert "scales disagree" not in summary_line(7, [agreeing])
    line = summary_line(7, [agreeing, split])
    assert "scales disagree across ranks: layers.1.mlp.linear_fc1 input x1.25 |" in line
    assert "peak/rms: layers.1.mlp.linear_fc1 input 5," in line


def test_guard_acts_after_the_streak_and_only_then():
    moved = []
    guard = Fp8Guard(saturation=0.01, underflow=0.5, intervals=2, auto_bf16=True, move_to_bf16=moved.append)
    assert guard.check([_row(saturated=0.02)]) == []  # one interval over: not yet
    assert guard.check([_row(saturated=0.0)]) == []  # the streak is broken
    assert guard.check([_row(saturated=0.02)]) == []
    (message,) = guard.check([_row(saturated=0.02)])
    assert "transformer layer 2, layers.1.mlp.linear_fc2 input: saturated 2% > 1%" in message
    assert "moved the layer to bf16" in message and moved == [2]
    assert guard.state_dict() == {"bf16_layers": [2]}
    restored = []
    Fp8Guard(0.01, 0.5, 2, False, restored.append).load_state_dict(guard.state_dict())
    assert restored == [2]


def test_guard_is_pending_while_a_streak_is_shorter_than_its_intervals():
    guard = Fp8Guard(saturation=0.01, underflow=0.5, intervals=3, auto_bf16=False, move_to_bf16=lambda n: None)
    assert not guard.pending()
    pending = [(guard.check([_row(saturated=s)]), guard.pending())[1] for s in (0.02, 0.02, 0.02, 0.02, 0.0, 0.02)]
    # over twice: pending; the third acts (and the fourth continues the streak it acted on); broken; over again
    assert pending == [True, True, False, False, False, True]


class _Over:
    """A watched step's collector whose one row is over the guard's saturation threshold, or not."""

    def __init__(self, over: bool):
        self.over = over

    def reduce(self, group, agreeing=False) -> None:
        pass

    def rows(self) -> list[Fp8TensorStats]:
        return [_row(saturated=0.02 if self.over else 0.0)]


def watched_steps(monitor: Fp8Monitor, over: dict[int, bool], steps: int) -> list[int]:
    """The steps `monitor` watches in 1..steps, each reported with a row over the threshold where `over` says so."""
    seen = []
    for i in range(1, steps + 1):
        with monitor.watch(i) as collector:
            if collector is not None:
                seen.append(i)
                monitor.report(_Over(over.get(i, False)), i, lambda line: None, lambda values, step: None)
    return seen


def test_monitor_watches_every_step_until_the_guard_acts_then_every_nth_again():
    moved = []
    guard = Fp8Guard(saturation=0.01, underflow=0.5, intervals=3, auto_bf16=True, move_to_bf16=moved.append)
    monitor = Fp8Monitor(LocalTaps([]), 10, guard, torch.device("cpu"))
    over = dict.fromkeys(range(20, 60), True)  # over from step 20 on: flagged on 20, acted on at 22, not 40
    assert watched_steps(monitor, over, 45) == [10, 20, 21, 22, 30, 40]
    assert moved == [2] and not monitor.dense


def test_monitor_goes_back_to_every_nth_step_when_the_streak_breaks():
    guard = Fp8Guard(saturation=0.01, underflow=0.5, intervals=3, auto_bf16=True, move_to_bf16=lambda n: None)
    monitor = Fp8Monitor(LocalTaps([]), 10, guard, torch.device("cpu"))
    assert watched_steps(monitor, {10: True}, 25) == [10, 11, 20]


def test_guard_without_auto_bf16_only_names_the_tensor():
    moved = []
    guard = Fp8Guard(saturation=0.01, underflow=0.1, intervals=1, auto_bf16=False, move_to_bf16=moved.append)
    (message,) = guard.check([_row(role=Role.GRAD, underflow=0.4)])
    assert "grad: underflow 40% > 10%" in message and "--fp8-auto-bf16 would move" in message and moved == []


class _TeLayer(torch.nn.Module):
    """What TETaps knows of a Transformer Engine layer (megatron/model/te_layers.py), without TE."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.layer_number, self.linear = 1, torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        self.linear.weight = torch.nn.Parameter(weight)
        self.mlp = torch.nn.Module()

    def te_modules(self):
        return [self.linear]

    def fp8_gemm_input(self, module, x):
        return x

    def forward(self, x):
        return self.linear(x)


def test_te_taps_count_an_fp8_weight_from_its_pieces_casts():
    """--fp8-param-gather with TE's layers (FSDP's shards or the distributed optimizer's main pieces): each rank's
    taps count the cast of its piece with the FP8 weight's scale (TE's `_scale_inv`), so the sum over the ranks is
    the whole weight's cast, saturation and underflow included; without a piece, the weight as the linear holds it."""
    from megatron.fp8.te_monitor import TETaps

    recipe = Recipe("tensorwise", Fp8Format("hybrid"))
    w = torch.randn(64, 160, generator=torch.Generator().manual_seed(0)) * torch.logspace(-9, 0, 160)
    scale = torch.tensor(4e3)
    whole = scaled_counts(w.reshape(1, -1), scale.reshape(1, 1), TENSOR, E4M3)
    assert whole[0] > 0 and whole[1] > 0
    collectors = []
    for first, last in ((0, 40), (40, 64)):  # two ranks' shards
        layer = _TeLayer(w.clone())
        layer.linear.weight._scale_inv = scale.reciprocal().reshape(1)  # as TE's Float8Tensor keeps it
        taps = TETaps(layer, recipe, {1})
        taps.count_weight_casts({id(layer.linear.weight): lambda first=first, last=last: (w[first:last], first)})
        collector = Fp8StatsCollector(taps.names, taps.layer_numbers, torch.device("cpu"))
        with taps.attached(collector):
            layer(torch.randn(4, 160))
        collectors.append(collector)
    counts = sum(c.counts[0, Role.WEIGHT.value] for c in collectors)
    assert counts.tolist() == whole.tolist()
    assert max(float(c.amax[0, Role.WEIGHT.value]) for c in collectors) == float(w.abs().max())
    assert all(float(c.scale[0, Role.WEIGHT.value]) == pytest.approx(4e3) for c in collectors)
    read_back = Fp8StatsCollector(taps.names, taps.layer_numbers, torch.device("cpu"))
    taps.weight_pieces.clear()
    with taps.attached(read_back):
        layer(torch.randn(4, 160))
    assert read_back.counts[0, Role.WEIGHT.value, 2] == w.numel()  # the whole weight, its scale from its amax
    assert read_back.counts[0, Role.WEIGHT.value, 0] == 0
