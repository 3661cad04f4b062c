"""The statistics of the FP8 numerics monitor (monitor.py): what one cast did (`scaled_counts`), their accumulation
over a watched step (`Fp8StatsCollector`), and the resulting rows (`Fp8TensorStats`) as TensorBoard scalars and a log
line. The engines record into the collector: the local FP8 linear at each cast, Transformer Engine's linears through
the taps of te_monitor.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .formats import E4M3, E5M2, Role
from .quantize import TENSOR, BlockSpec, _blocked, block_amax, block_scales
from .recipes import Recipe

FIELDS = ("amax", "scale", "saturated", "underflow", "peak_ratio", "scale_spread")

FLUSHED = {E4M3: 2.0**-10, E5M2: 2.0**-17}
"""Half the smallest subnormal of each format: a scaled magnitude at or below it rounds (to nearest even) to 0."""
CLIPPED = {E4M3: 464.0, E5M2: 61440.0}
"""fp8_max plus half its ulp (448 + 16, 57344 + 4096): up to there the saturating cast gives fp8_max, as rounding
would; beyond it the clamp loses more than rounding does. A scale from the current amax lands the amax itself a
rounding error above fp8_max, which is not saturation."""


def scaled_counts(x: torch.Tensor, scale: torch.Tensor, spec: BlockSpec, dtype: torch.dtype) -> torch.Tensor:
    """[saturated, underflow, elements] (float64, on x's device, no host sync) of casting x [R, C] to `dtype` with
    block scales `scale` [blocks of spec]: with a = |x| * scale_b formed in fp32 as the cast forms it,
    saturated: a > CLIPPED[dtype] (the clamp to fp8_max cut it); underflow: 0 < a <= FLUSHED[dtype] (it became 0)."""
    a = _blocked(x, spec).abs().float() * scale[:, None, :, None]  # the padding is 0 and counts as neither
    saturated = (a > CLIPPED[dtype]).sum()
    underflow = ((a > 0) & (a <= FLUSHED[dtype])).sum()
    return torch.stack([saturated, underflow, torch.tensor(x.numel(), device=x.device)]).double()


class Fp8StatsCollector:
    """Accumulates the statistics of one watched step for `names` (the FP8 linears, index = position).

    counts [n, 3 roles, 3] float64 (saturated, underflow, elements), squares [n, 3] float64 (sum of t^2), amax
    [n, 3] (max), scale [n, 3] (min) and spread [n, 3] (the scale's max over ranks / its min), all on `device`;
    recording does no host sync. Each (linear, tensor) is counted once per watched step, at its first
    cast: the first micro-batch's input and output gradient, and the weight (cast once per step). Counting every
    micro-batch would multiply the monitor's cost by their number for fractions that one micro-batch of thousands
    of tokens already estimates well.
    """

    def __init__(self, names: list[str], layer_numbers: list[int], device: torch.device):
        self.names, self.layer_numbers, self.device = names, layer_numbers, device
        n = len(names)
        self.counts = torch.zeros(n, len(Role), 3, dtype=torch.float64, device=device)
        self.squares = torch.zeros(n, len(Role), dtype=torch.float64, device=device)
        self.amax = torch.zeros(n, len(Role), device=device)
        self.scale = torch.full((n, len(Role)), math.inf, device=device)
        self.spread = torch.ones(n, len(Role), device=device)
        self.counted: set[tuple[int, Role]] = set()

    def record(self, index: int, role: Role, x: torch.Tensor, recipe: Recipe, scale: torch.Tensor | None) -> None:
        """Count the cast of x [R, C] (along its rows) for linear `index`'s `role` under `recipe`; `scale`: the
        given per-tensor scale of delayed scaling (None: the recipe computes it from x, as its cast does)."""
        if (index, role) in self.counted:
            return
        self.counted.add((index, role))
        spec, dtype = recipe.block(role), recipe.dtype(role)
        amax_blocks = block_amax(x, spec)
        scales, _ = block_scales(amax_blocks, dtype, scale=scale, power_of_two=recipe.power_of_two(role), mx=recipe.mx)
        counts = scaled_counts(x, scales, spec, dtype)
        self.record_counts(index, role, counts, amax_blocks.amax(), scales.min(), _squares(x))

    def record_cast(
        self, index: int, role: Role, piece: torch.Tensor, first_row: int, scale: torch.Tensor, recipe: Recipe
    ) -> None:
        """Count a cast made elsewhere (an FP8 weight's, --fp8-param-gather) of this rank's `piece` of the tensor:
        with one `scale` [1] a piece of any shape; with a grid of block scales [row blocks, column blocks] the rows
        [first_row, first_row + rows) of the tensor, whose blocks start at multiples of the block height."""
        if (index, role) in self.counted:
            return
        self.counted.add((index, role))
        if not piece.numel():  # a rank holding no piece of the tensor: nothing cast here (neutral in the reductions)
            none = torch.zeros(3, dtype=torch.float64)
            self.record_counts(index, role, none, torch.zeros(()), torch.tensor(math.inf))
            return
        spec, dtype = recipe.block(role), recipe.dtype(role)
        if scale.numel() == 1:
            x, spec, scale = piece.reshape(1, -1), TENSOR, scale.reshape(1, 1)
        else:  # zero rows up to the first block's start count as neither (and not as elements)
            height = spec[0]
            assert height is not None
            x = F.pad(piece, (0, 0, first_row % height, 0))
            scale = scale[first_row // height :][: -(-x.shape[0] // height)]
        counts = scaled_counts(x, scale, spec, dtype)
        counts[2] = piece.numel()
        self.record_counts(index, role, counts, piece.detach().abs().amax(), scale.min(), _squares(piece))

    def record_counts(
        self,
        index: int,
        role: Role,
        counts: torch.Tensor,
        amax: torch.Tensor,
        scale: torch.Tensor,
        squares: torch.Tensor | None = None,
    ) -> None:
        """Add one cast's [saturated, underflow, elements] and its tensor's sum of squares (None: not measured,
        the peak/RMS ratio then reads 1)."""
        self.counts[index, role.value] += counts.to(self.counts.device)
        if squares is not None:
            self.squares[index, role.value] += squares.to(self.squares.device)
        cell = self.amax[index, role.value]
        cell.copy_(torch.maximum(cell, amax.float()))
        cell = self.scale[index, role.value]
        cell.copy_(torch.minimum(cell, scale.float()))

    def reduce(self, group: dist.ProcessGroup | None, agreeing: bool = False) -> None:
        """SUM counts, MAX amax and MIN scale over `group` (the ranks holding other shards or replicas). `agreeing`:
        the ranks of `group` must all cast with the same scales (delayed scaling over its amax group), so the
        spread max/min of the scale over them is measured first; a spread above 1 is a broken amax reduction."""
        if group is None or dist.get_world_size(group) == 1:
            return
        if agreeing:
            largest = self.scale.clone()
            dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(self.counts, group=group)
        dist.all_reduce(self.squares, group=group)
        dist.all_reduce(self.amax, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(self.scale, op=dist.ReduceOp.MIN, group=group)
        if agreeing:
            finite = torch.isfinite(largest) & (self.scale > 0)  # inf: a tensor this linear never cast
            self.spread.copy_(torch.where(finite, largest / self.scale, torch.ones_like(largest)))
        else:  # the spread measured over an earlier group, made the same on every rank of this one
            dist.all_reduce(self.spread, op=dist.ReduceOp.MAX, group=group)

    def rows(self) -> list[Fp8TensorStats]:
        """The step's statistics, one row per (linear, role) that quantized anything (one host sync)."""
        counts, squares, amax = self.counts.cpu(), self.squares.cpu(), self.amax.cpu()
        scale, spread = self.scale.cpu(), self.spread.cpu()
        out = []
        for i, name in enumerate(self.names):
            for role in Role:
                saturated, underflow, elements = counts[i, role.value].tolist()
                if elements == 0:
                    continue
                rms = math.sqrt(float(squares[i, role.value]) / elements)
                peak = float(amax[i, role.value]) / rms if rms > 0 else 1.0  # 1: not measured (or all zeros)
                out.append(
                    Fp8TensorStats(
                        name,
                        self.layer_numbers[i],
                        role,
                        float(amax[i, role.value]),
                        float(scale[i, role.value]),
                        saturated / elements,
                        underflow / elements,
                        peak,
                        float(spread[i, role.value]),
                    )
                )
        return out


@dataclass(frozen=True)
class Fp8TensorStats:
    """One FP8 tensor's statistics over a monitored step."""

    linear: str
    """The linear's module name, e.g. `decoder.layers.3.mlp.linear_fc2`."""
    layer_number: int
    """1-based transformer layer number (global across pipeline stages)."""
    role: Role
    amax: float
    scale: float
    saturated: float
    underflow: float
    peak_ratio: float = 1.0
    """amax / RMS of the tensor: with one scale per tensor the RMS element is cast peak_ratio below the amax's place
    (fp8_max), so a growing ratio (outlier channels) pushes the bulk toward the subnormals before anything flushes."""
    scale_spread: float = 1.0
    """max / min over the amax group's ranks of the scale (delayed scaling; 1 elsewhere): above 1, replicas that
    should cast alike disagree."""

    @property
    def tensor(self) -> str:
        return {Role.INPUT: "input", Role.WEIGHT: "weight", Role.GRAD: "grad"}[self.role]

    @property
    def tag(self) -> str:
        """TensorBoard tag prefix: fp8/<linear>/<tensor>."""
        return f"fp8/{self.linear.removeprefix('decoder.')}/{self.tensor}"

    def describe(self) -> str:
        return f"{self.linear.removeprefix('decoder.')} {self.tensor}"


def tensorboard_scalars(rows: list[Fp8TensorStats]) -> dict[str, float]:
    """{tag/field: value} for every row (amax, scale, saturated and underflow fractions)."""
    out = {}
    for row in rows:
        for field in FIELDS:
            value = getattr(row, field)
            out[f"{row.tag}/{field}"] = value if math.isfinite(value) else float("nan")
    return out


def summary_line(iteration: int, rows: list[Fp8TensorStats], worst: int = 3) -> str:
    """One log line: the `worst` tensors by saturation, by underflow and by peak/RMS ratio, the amax range, and the
    tensors whose scales disagree across ranks that should share them (only when some do)."""

    def top(field: str, pct: bool = True) -> str:
        ranked = sorted(rows, key=lambda r: getattr(r, field), reverse=True)[:worst]
        if pct:
            return ", ".join(f"{r.describe()} {100 * getattr(r, field):.3g}%" for r in ranked)
        return ", ".join(f"{r.describe()} {getattr(r, field):.3g}" for r in ranked)

    if not rows:
        return f" fp8 stats iteration {iteration:8d} | no FP8 tensors on this rank"
    amaxes = [r.amax for r in rows]
    line = (
        f" fp8 stats iteration {iteration:8d} | saturated: {top('saturated')} | underflow: {top('underflow')} |"
        f" peak/rms: {top('peak_ratio', pct=False)} | amax range: {min(amaxes):.3g}..{max(amaxes):.3g} |"
    )
    disagree = [r for r in rows if r.scale_spread > 1]
    if disagree:
        worst_spread = sorted(disagree, key=lambda r: r.scale_spread, reverse=True)[:worst]
        line += (
            " scales disagree across ranks: "
            + ", ".join(f"{r.describe()} x{r.scale_spread:.4g}" for r in worst_spread)
            + " |"
        )
    return line


def _squares(x: torch.Tensor) -> torch.Tensor:
    """sum x^2 (float64 on x's device, no host sync): with the element count, the RMS behind the peak/RMS ratio.
    One fused pass (a norm, in fp32: an RMS to a few digits is all the ratio needs), no temporary copy of x."""
    return torch.linalg.vector_norm(x.detach(), dtype=torch.float32).double().square()


def global_name(name: str, layer_number: int) -> str:
    """`decoder.layers.<i>.<rest>` with i the layer's global index (a pipeline stage numbers its own layers from 0),
    so that every stage's statistics have distinct names in the log and TensorBoard."""
    prefix = "decoder.layers."
    if not name.startswith(prefix):
        return name
    return f"{prefix}{layer_number - 1}.{name[len(prefix) :].split('.', 1)[1]}"
