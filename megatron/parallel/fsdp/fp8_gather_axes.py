"""FP8 all-gather under FSDP2 for the recipes that cast a weight along both of its axes: rowwise and mxfp8 (local
layers; fp8_gather.py has the design and the per-tensor and blockwise recipes).

A linear's fprop operand is q(W) cast along K (one scale per row, or 1x32 E8M0 blocks along a row) and its dgrad
operand q(W^T) a second cast along N (one scale per column of W, or 32x1 blocks down a column): gathered q(W)
bytes cannot give it. So each step's cast (`Fp8GatherScales.agree`) writes both casts of this rank's rows, 1 byte
per element each, into persistent buffers [shard rows, in] (2 bytes per FP8-gathered element / dp, held between
steps), and a gather sends one of them or both, as Transformer Engine's MXFP8Tensor does under FSDP2:

* a unit resharded after its forward (optim_grads_params' default) gathers the row cast (with its scales) for the
  forward and the column cast for the backward: 1 byte per element plus scales each time. The gathered weight holds
  only what its gather brought: the linear's backward reads the dgrad operand from the weight FSDP2 refilled for it
  (the same tensor object, `out=`), and nothing keeps the forward's bytes alive until then;
* a unit kept gathered from its forward to its backward (optim_grads, --torch-fsdp2-no-reshard-after-forward, the
  last layer unit and the output unit) gathers both casts in one go, and so does every weight whose linear activation
  recomputation runs again (a layer full recomputation covers, fc1 and fc2 under selective `mlp`: the recomputed
  forward runs inside the backward, on the weight gathered for it, and needs the row cast).

Which gather is the backward's: FSDP2's parameter group says, in its (private) training state, PRE_BACKWARD for
every all-gather made for a backward: the pre-backward unshard and the backward prefetches, which it issues from
another unit's pre-backward under `use_training_state(PRE_BACKWARD)`; FORWARD for the forward and its prefetches.
A state of our own set from hooks would have to replay FSDP2's prefetch order to tell a prefetch for the backward
from one for the forward, so `bind_gather_phases` reads FSDP2's (fsdp2_internals.py; checked at build, one-line
error if torch moves it), and whether the unit reshards after its forward from the same group.

The scales (every cast equals the linear's own cast of the whole weight, `quantize(W)` and `quantize(W.t())`,
byte for byte):

* rowwise: each row's scale is its rank's own, each column's spans all ranks: both amax vectors, [out] (zeros in
  the rows other ranks hold) and [in], are max-reduced in `agree`'s one all-reduce, and every rank holds both
  scale vectors as the gathered weight's metadata. FSDP2 requires a padded shard's (uneven rows) all-gather inputs
  in the shard's shape, which leaves no room for scales beside the bytes: so the row amaxes travel in the
  all-reduce too (4 bytes per row and column, once per step).
* mxfp8: the row cast's 1x32 block scales are local and gathered with the bytes (E8M0, 1 byte per 32 elements).
  The column cast's 32x1 blocks belong to the rank holding their first row, which gathers their scales; a block
  cut by a shard boundary (none when the shard rows, ceil(out / ranks), are a multiple of 32) has its column amaxes
  max-reduced in the same all-reduce, so that both ranks cast their rows of it with the whole block's scale. The
  scales ride in the gather, which FSDP2 allows only where the ranks divide the rows: a weight they do not divide
  stays a plain weight (gathered in the training dtype and cast by the linear, as without --fp8-param-gather).
  The scales travel viewed as the unit's gather dtype, as the bytes do (fp8_gather.gather_view), with the same
  caveat on CUDA: two E8M0 bytes reading as a bf16 NaN arrive as the canonical NaN's, which takes a block of amax in
  (224, 448] beside one above 896 (or a NaN), far outside a weight's range.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from megatron.fp8.formats import E4M3, E8M0
from megatron.fp8.quantize import MX_BLOCK, ROW, Fp8Tensor, block_amax, block_scales, scale_from_amax, scaled_cast

from . import fsdp2_internals as internals

AXES_RECIPES = ("rowwise", "mxfp8")
ROW_CAST, COLUMN_CAST, BOTH_CASTS = "row", "column", "both"  # what one all-gather moves
MX = MX_BLOCK[1]  # 32: the mx block's length, along a row (row cast) or down a column (column cast)
_VIEWS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}
_VIEWS |= {torch.ops.aten.as_strided.default, torch.ops.aten.view.default}


def gathers_axes(recipe_name: str, rows: int, ranks: int) -> bool:
    """Whether a weight of `rows` rows under this recipe is FP8-gathered over `ranks` ranks (see the docstring:
    mxfp8 needs ranks that divide the rows)."""
    return recipe_name != "mxfp8" or rows % ranks == 0


class AxesCast:
    """The two casts of one weight's shard for its FSDP2 all-gathers, their scales, and the gathered weight's."""

    def __init__(self, mx: bool, shape: tuple[int, ...], device: torch.device):
        self.mx, (self.rows, self.cols) = mx, shape
        self.amax = torch.zeros((), device=device)  # the whole weight's (agreed)
        # rowwise: every row's and column's scale (agreed) and their reciprocals, the gathered operands' scale_inv
        self.row_scale = torch.ones(self.rows, device=device)
        self.col_scale = torch.ones(self.cols, device=device)
        self.row_scale_inv, self.col_scale_inv = self.row_scale.clone(), self.col_scale.clone()
        self.straddled = torch.zeros((0, self.cols), device=device)  # mx: agreed amaxes of the cut column blocks
        # [shard rows, in] uint8 each; mx: the scales sent with each, flat uint8 (this rank's blocks, zero padded)
        self.row_data: torch.Tensor | None = None
        self.col_data: torch.Tensor | None = None
        self.row_scales: torch.Tensor | None = None
        self.col_scales: torch.Tensor | None = None
        self.ranks = 1
        # Set by `bind_gather_phases`; unbound (a model outside `build_fsdp2`), every gather moves both casts
        self.split = False
        self.in_backward: Callable[[], bool] = lambda: False

    # -- the sharding: FSDP's shards of ceil(rows / ranks) rows, rank r's from row r * shard
    def _cut_blocks(self, shard: int) -> list[int]:
        """mx: the column blocks (32 rows) holding rows of more than one rank."""
        blocks = range(-(-self.rows // MX))
        return [b for b in blocks if (b * MX) // shard != (min(b * MX + MX, self.rows) - 1) // shard]

    def _mx_sizes(self, shard: int) -> tuple[int, int, int]:
        """mx: (row scales per rank, column block slots per rank, bytes of each scale input: a multiple of 4)."""
        row_scales, slots = shard * -(-self.cols // MX), -(-shard // MX)
        return row_scales, slots, -(-max(row_scales, slots * self.cols) // 4) * 4

    def local_amax(self, shard: torch.Tensor, first_row: int, rows: int) -> torch.Tensor:
        """This rank's part of the all-reduce (MAX): rowwise, the amaxes of every row (its own, zeros elsewhere) and
        column (of its rows); mx, the whole weight's amax and the cut column blocks' amaxes over its rows."""
        n = shard.shape[0]
        if not self.mx:
            row = self.row_scale.new_zeros(self.rows)
            col = self.col_scale.new_zeros(self.cols)
            if n:
                row[first_row : first_row + n] = block_amax(shard, ROW).reshape(-1)
                col = block_amax(shard, (None, 1)).reshape(-1)
            return torch.cat([row, col])
        cut = self._cut_blocks(rows)
        amax = shard.abs().amax().float().reshape(1) if n else self.amax.new_zeros(1)
        blocks = self._column_block_amax(shard, first_row)
        first = first_row // MX
        straddled = [
            blocks[b - first] if first <= b < first + blocks.shape[0] else blocks.new_zeros(self.cols) for b in cut
        ]
        return torch.cat([amax, *straddled])

    def _column_block_amax(self, shard: torch.Tensor, first_row: int) -> torch.Tensor:
        """mx: the amax of each 32x1 block over this rank's rows [blocks its rows touch, in]."""
        if not shard.shape[0]:
            return self.amax.new_zeros((0, self.cols))
        aligned = torch.nn.functional.pad(shard, (0, 0, first_row % MX, 0))  # zero rows change no amax
        return block_amax(aligned, (MX, 1))

    def set(self, agreed: torch.Tensor, rows: int) -> None:
        """The agreed amaxes (`local_amax`'s layout, max-reduced over the ranks): the scales they give."""
        if not self.mx:
            row, col = agreed.split([self.rows, self.cols])
            for amax, scale, scale_inv in (
                (row, self.row_scale, self.row_scale_inv),
                (col, self.col_scale, self.col_scale_inv),
            ):
                scale.copy_(scale_from_amax(amax, E4M3))
                torch.reciprocal(scale, out=scale_inv)
            self.amax.copy_(row.amax())
            return
        self.amax.copy_(agreed[0])
        self.straddled = agreed[1:].reshape(-1, self.cols).clone()

    def fill(self, shard: torch.Tensor, first_row: int, rows: int, ranks: int) -> None:
        """Cast this rank's rows along both axes into the persistent buffers sent by this step's all-gathers."""
        self.ranks, n = ranks, shard.shape[0]
        if self.row_data is None or self.row_data.shape[0] != rows:
            self.row_data = torch.zeros((rows, self.cols), dtype=torch.uint8, device=shard.device)
            self.col_data = torch.zeros_like(self.row_data)
            if self.mx:
                size = self._mx_sizes(rows)[2]
                self.row_scales = torch.zeros(size, dtype=torch.uint8, device=shard.device)
                self.col_scales = torch.zeros_like(self.row_scales)
        if not n:
            return
        assert self.col_data is not None
        if not self.mx:
            row_scale = self.row_scale[first_row : first_row + n].reshape(n, 1)
            self.row_data[:n].copy_(scaled_cast(shard, row_scale, ROW, E4M3)[0].view(torch.uint8))
            col = scaled_cast(shard, self.col_scale.reshape(1, -1), (None, 1), E4M3)[0]
            self.col_data[:n].copy_(col.view(torch.uint8))
            return
        assert self.row_scales is not None and self.col_scales is not None
        # the row cast: 1x32 blocks of this rank's rows, its own
        scale, scale_inv = block_scales(block_amax(shard, MX_BLOCK), E4M3, mx=True)
        self.row_data[:n].copy_(scaled_cast(shard, scale, MX_BLOCK, E4M3)[0].view(torch.uint8))
        slots = self._mx_sizes(rows)[1]
        self.row_scales[: scale_inv.numel()].copy_(scale_inv.view(torch.uint8).reshape(-1))
        # the column cast: 32x1 blocks, those cut by a shard boundary with their agreed amaxes
        amax = self._column_block_amax(shard, first_row)
        first = first_row // MX
        for i, block in enumerate(self._cut_blocks(rows)):
            if first <= block < first + amax.shape[0]:
                amax[block - first] = self.straddled[i]
        scale, scale_inv = block_scales(amax, E4M3, mx=True)
        block_of_row = torch.arange(first_row, first_row + n, device=shard.device) // MX - first
        self.col_data[:n].copy_(scaled_cast(shard, scale[block_of_row], (1, 1), E4M3)[0].view(torch.uint8))
        # the scales of the blocks starting in this rank's rows (their owner's), zero padded to `slots` blocks
        owned = scale_inv.view(torch.uint8)[1 if first_row % MX else 0 :][:slots]
        self.col_scales.zero_()
        self.col_scales[: owned.numel()].copy_(owned.reshape(-1))

    def inputs(self) -> tuple[tuple[torch.Tensor, ...], str]:
        """(the uint8 tensors this all-gather sends, which casts they are)."""
        casts = BOTH_CASTS if not self.split else COLUMN_CAST if self.in_backward() else ROW_CAST
        row = (self.row_data, self.row_scales) if self.mx else (self.row_data,)
        col = (self.col_data, self.col_scales) if self.mx else (self.col_data,)
        tensors = row if casts == ROW_CAST else col if casts == COLUMN_CAST else row + col
        return tuple(t for t in tensors if t is not None), casts

    def gathered(self, outputs: tuple[torch.Tensor, ...], casts: str, dtype: torch.dtype, out: Any = None) -> Any:
        """The gathered weight from the all-gather outputs (uint8), or `out` (FSDP2's, refilled) told what it holds."""
        if out is not None:
            out._gathered.update(outputs, casts)
            return out
        return Fp8AxesWeight(_Gathered(self, outputs, casts), dtype)

    # -- the gathered weight's operands
    def row_operand(self, outputs: tuple[torch.Tensor, ...]) -> Fp8Tensor:
        """q(W) [out, in] along K, as `quantize(W, ...)` gives it."""
        data = outputs[0][: self.rows].view(E4M3)
        if not self.mx:
            return Fp8Tensor(data, self.row_scale_inv.reshape(-1, 1), (1, self.cols), self.amax)
        shard = outputs[0].shape[0] // self.ranks
        per_rank = self._mx_sizes(shard)[0]
        scales = outputs[1].view(self.ranks, -1)[:, :per_rank].reshape(self.ranks * shard, -1)[: self.rows]
        return Fp8Tensor(data, scales.view(E8M0), (1, MX), self.amax)

    def column_operand(self, outputs: tuple[torch.Tensor, ...]) -> Fp8Tensor:
        """q(W^T) [in, out] along N, as `quantize(W.t(), ...)` gives it."""
        data = outputs[0][: self.rows].t().contiguous().view(E4M3)
        if not self.mx:
            return Fp8Tensor(data, self.col_scale_inv.reshape(-1, 1), (1, self.rows), self.amax)
        shard = outputs[0].shape[0] // self.ranks
        slots = self._mx_sizes(shard)[1]
        scales = outputs[1].view(self.ranks, -1)[:, : slots * self.cols].reshape(self.ranks, slots, self.cols)
        blocks = torch.arange(-(-self.rows // MX), device=data.device)
        owner = blocks * MX // shard
        slot = blocks - (owner * shard + MX - 1) // MX  # the owner's first block is the first starting in its rows
        return Fp8Tensor(data, scales[owner, slot].t().contiguous().view(E8M0), (1, MX), self.amax)


class _Gathered:
    """What a gathered weight holds now (shared by FSDP2's views of it, refilled at each all-gather)."""

    def __init__(self, axes: AxesCast, outputs: tuple[torch.Tensor, ...], casts: str):
        self.axes = axes
        self.update(outputs, casts)

    def update(self, outputs: tuple[torch.Tensor, ...], casts: str) -> None:
        self.outputs, self.casts = outputs, casts

    def part(self, cast: str) -> tuple[torch.Tensor, ...] | None:
        """The outputs of one cast, if this gather brought it."""
        if self.casts == BOTH_CASTS:
            half = len(self.outputs) // 2
            return self.outputs[:half] if cast == ROW_CAST else self.outputs[half:]
        return self.outputs if self.casts == cast else None


class Fp8AxesWeight(torch.Tensor):
    """An unsharded rowwise or mxfp8 weight [out, in] under FSDP: the cast(s) its last all-gather brought, with the
    nominal dtype FSDP gathers the other weights in. The FP8 linear reads `fp8_tensor()` in its forward and
    `dgrad_operand()` in its backward; anything else sees `dequantize()`."""

    grad_to_autograd = True  # params.accumulate_weight_grad: FSDP reduce-scatters the autograd gradient

    @staticmethod
    def __new__(cls, gathered: _Gathered, dtype: torch.dtype):
        axes, device = gathered.axes, gathered.outputs[0].device
        return torch.Tensor._make_wrapper_subclass(cls, (axes.rows, axes.cols), dtype=dtype, device=device)

    def __init__(self, gathered: _Gathered, dtype: torch.dtype):
        self._gathered = gathered

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in _VIEWS:  # FSDP2's views of the whole weight (as_strided to its shape, the Parameter's detach)
            weight = args[0]
            view = func(torch.empty(weight.shape, device="meta"), *args[1:], **(kwargs or {}))
            if view.shape != weight.shape:
                raise NotImplementedError(f"a view of shape {tuple(view.shape)} of a gathered FP8 weight")
            return Fp8AxesWeight(weight._gathered, weight.dtype)
        args, kwargs = tree_map_only(Fp8AxesWeight, lambda t: t.dequantize(), (args, kwargs or {}))
        return func(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Fp8AxesWeight(shape={tuple(self.shape)}, casts={self._gathered.casts})"

    @property
    def amax(self) -> torch.Tensor:
        return self._gathered.axes.amax

    @property
    def version(self) -> int:
        """Changes whenever the ranks agree new scales (once per step): the linear's weight cache key."""
        return self._gathered.axes.amax._version

    def fp8_tensor(self) -> Fp8Tensor:
        """The fprop operand q(W): in a forward, which every gather brings the row cast for."""
        outputs = self._gathered.part(ROW_CAST)
        if outputs is None:
            raise RuntimeError("a weight gathered for its backward (column cast only) was read by a forward")
        return self._gathered.axes.row_operand(outputs)

    @property
    def scale_inv(self) -> torch.Tensor:
        return self.fp8_tensor().scale_inv

    def dgrad_operand(self) -> Fp8Tensor:
        """The dgrad operand q(W^T), from the column cast this weight's gather for the backward brought."""
        outputs = self._gathered.part(COLUMN_CAST)
        if outputs is None:
            raise RuntimeError("a weight gathered for its forward (row cast only) was read by a backward")
        return self._gathered.axes.column_operand(outputs)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight's value from the cast it holds: the row cast where gathered, else the column cast's (a layer
        computed in high precision, --fp8-auto-bf16, reads that one in its backward)."""
        if self._gathered.part(ROW_CAST) is not None:
            return self.fp8_tensor().dequantize(dtype or self.dtype)
        return self.dgrad_operand().dequantize(dtype or self.dtype).t()


def rerun_in_backward(model: torch.nn.Module) -> Callable[[torch.nn.Module], bool]:
    """Whether activation recomputation runs a module of `model` (a GPT model) forward again in the backward: the
    layers full recomputation covers (`model.recompute`, the model's plan) and, under selective recomputation of
    mlp, each layer's MLP. Selective core_attn and layernorm re-run no linear (the attention core; the norm alone)."""
    plan, layers = model.recompute, list(model.decoder.layers)
    again = [layers[i] for start, end, done in plan.chunks(len(layers)) if done for i in range(start, end)]
    again += [layer.mlp for layer in layers] if plan.selective("mlp") else []
    ids = {id(module) for part in again for module in part.modules()}
    return lambda module: id(module) in ids


def bind_gather_phases(params: Iterable[tuple[torch.nn.Module, Any]], rerun: Callable[[torch.nn.Module], bool]) -> None:
    """Tell each weight cast per axis (its `FSDPParam` with the FSDP unit holding it) whether its unit is resharded
    after its forward and, then, whether a gather is the backward's: FSDP2's parameter group's own records (see
    the module docstring). `rerun(linear)`: activation recomputation runs the linear's forward again in the
    backward; every gather of its weight then moves both casts."""
    for unit, param in params:
        axes = internals.sharded_local_tensor(param)._scale.axes
        if axes is None:
            continue
        group = internals.param_group(unit)
        reshard = internals.reshards_after_forward(group)
        if internals.training_phase(group) not in ("IDLE", "FORWARD") or reshard is None:
            raise RuntimeError(
                f"torch {torch.__version__}'s FSDP2 parameter group has no _training_state / _reshard_after_forward,"
                " which the rowwise and mxfp8 FP8 all-gathers read (megatron/parallel/fsdp/fsdp2_internals.py): use"
                " torch 2.11 to 2.13, or drop --fp8-param-gather"
            )
        axes.split = reshard and not rerun(internals.module_of(param))
        axes.in_backward = lambda group=group: internals.training_phase(group) == "PRE_BACKWARD"
