"""FP8 all-gather under FSDP2 (--fp8-param-gather with --use-megatron-fsdp / --use-torch-fsdp2): the delayed and
tensorwise recipes (one scale per tensor) and, for the local layers, blockwise (one scale per 128x128 block).

FSDP2 calls two hooks on a parameter's sharded local tensor when it defines them (torch's all-gather extension):
`fsdp_pre_all_gather` gives the tensors to gather for this rank's shard, `fsdp_post_all_gather` builds the
unsharded weight from the gathered ones. Here:

* `Fp8ShardWeight` is the local shard (fp32: the optimizer's main weight, stepped in place; or bf16 under
  --use-precision-aware-optimizer, written from the optimizer's main weights) wrapped so that FSDP's own ops on shards
  (view, narrow, copy_, new_zeros, ...) keep the wrapper. Its all-gather moves the shard's E4M3 bytes (uint8: gloo
  has no FP8 dtype), cast with one scale per tensor agreed by all ranks: one byte per element instead of bf16's two.
* `Fp8GatheredWeight` is the unsharded weight the FP8 linear reads: the gathered bytes and the scale. The linear
  takes it as its FP8 operand without re-casting (`fp8_tensor`), as an `Fp8Parameter`; its weight gradient is
  returned to autograd in fp32 (FSDP reduce-scatters `unsharded_param.grad`, not `main_grad`: fp8/params.py).
* `Fp8GatherScales.agree` (fp8_gather_scales.py, with the once-per-step cast it makes and the shards it frees)
  max-reduces the amaxes of all wrapped shards in one all-reduce, once per optimizer step, over the data-parallel
  ranks (and the tensor-parallel ones: the whole weight's amax) (parallel/fsdp/fsdp2.py calls it from the root's
  forward pre-hook, before any unit's all-gather): tensorwise casts
  with fp8_max / amax, delayed with delayed scaling's weight scale (reduced by the FP8 manager already; the agreed amax
  is what the linear records in the history). Each rank casts its own shard with the scale of the whole tensor: the
  bytes the distributed optimizer's FP8 weights hold.

Blockwise (the weight in 128x128 blocks): FSDP shards rows, ceil(rows / ranks) per rank, so a block straddles two
shards wherever a shard's rows are not a multiple of 128. `agree` max-reduces every weight's grid of block amaxes
(each rank fills the blocks its rows touch, zeros elsewhere) in the same one all-reduce, over the ranks sharding
the weight (the tensor-parallel pieces are cast block by block on their own, as the linear casts them): every rank
then holds the whole grid of scales, casts its rows with their blocks' scales, and the grid travels as metadata
like the per-tensor scale. The gathered bytes and scales are those the linear casts from the whole weight, and, as
the blocks are square, the transpose of q(W) is the dgrad operand q(W^T). Rowwise and mxfp8 cast the weight along
both axes (their dgrad operand is a second cast, fp8/recipes.py): `GatherScale.axes` (fp8_gather_axes.py) casts both,
and a gather moves the one its pass needs (or both), agreed in the same all-reduce as the block grids.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map_only

from megatron.fp8.formats import E4M3, Role
from megatron.fp8.quantize import (
    TENSOR,
    BLOCK_128x128,
    Fp8Tensor,
    block_amax,
    per_tensor_triton,
    scale_from_amax,
    scaled_cast,
    tensor_amax,
)

from .fp8_gather_axes import AXES_RECIPES, AxesCast

aten = torch.ops.aten

# FSDP2's ops on a shard, whose results are still the shard (or a piece of it) and must keep the hooks
_SHARD_OPS = {
    aten.detach.default,
    aten.view.default,
    aten.as_strided.default,
    aten.slice.Tensor,
    aten.narrow.default,
    aten.split.Tensor,
    aten.chunk.default,
    aten.copy_.default,
    aten.new_zeros.default,
    aten.empty_like.default,
    aten.clone.default,
    aten._to_copy.default,
    aten.alias.default,
}
# View ops on the gathered weight (FSDP's as_strided to the parameter's shape, nn.Parameter's detach)
_GATHERED_VIEWS = {aten.detach.default, aten.alias.default, aten.as_strided.default, aten.view.default}


class Agreement(Protocol):
    """What a scale asks of the `Fp8GatherScales` that agrees it (fp8_gather_scales.py, which builds on this
    module): the step's scales and casts, made before a gather that finds its own stale."""

    def agree(self) -> None: ...


def shard_rows(rows: int, ranks: int) -> int:
    """The rows of each FSDP shard of a weight of `rows` rows: FSDP pads every shard to ceil(rows / ranks)."""
    return -(-rows // ranks)


class GatherScale:
    """The scale one weight is cast with for its all-gathers, the amax it came from, and the step's cast of this
    rank's shard (shared by all wrappers of the weight's shard). `state`: the local linear's `Fp8LinearState` (its
    recipe; delayed scaling's scale), None for a Transformer Engine weight (te_fp8_gather.py: fp8_max / amax;
    under the blockwise recipe te_blockwise_gather.py's `TeBlockScale`). `shape`: the whole weight's [out, in],
    which sizes the grid of block scales under the blockwise recipe (else one scale)."""

    def __init__(self, device: torch.device, state: Any | None, shape: tuple[int, ...] | None = None):
        blockwise = state is not None and state.recipe.block(Role.WEIGHT) == BLOCK_128x128
        self.block: tuple[int, int] | None = (128, 128) if blockwise else None
        self.power_of_two = blockwise and state.recipe.power_of_two(Role.WEIGHT)  # the block scales' rule
        grid = tuple(-(-n // 128) for n in shape) if blockwise and shape is not None else ()
        self.scale = torch.ones(grid, device=device)
        # rowwise and mxfp8: both casts of the shard, with their scales (fp8_gather_axes.py)
        axes = state is not None and shape is not None and state.recipe.name in AXES_RECIPES
        self.axes = AxesCast(state.recipe.mx, shape, device) if axes else None
        # The gathered weight's scale_inv and amax come from these tensors, which live as long as the weight: FSDP2
        # runs `fsdp_pre_all_gather` on its copy-in stream, and a tensor made there and freed once the gathered
        # weight has copied it (on the compute stream) could be handed to the next unit's pre-all-gather before the
        # copy ran, giving a layer another one's scale.
        self.scale_inv = torch.ones(grid, device=device)
        self.amax = torch.zeros((), device=device)
        self.state = state
        # The shard's E4M3 bytes for this step's all-gathers ([shard rows, ...] uint8, its pad rows zero), and whether
        # they are the cast of the shard and scale as they are now; the `Fp8GatherScales` agreeing the scale
        self.data: torch.Tensor | None = None
        self.fresh = False
        self.agreement: Agreement | None = None
        # Gathered in the training dtype instead, as a plain tensor (its layer moved out of FP8 by the FP8 guard:
        # parallel/fsdp/fsdp2.py, `Fp8GatherDtypes`): no scale agreed, no cast made
        self.high_precision = False

    @property
    def own_pieces(self) -> bool:
        """Agreed over the ranks sharding the weight only (block and axis scales: a tensor-parallel piece's own)."""
        return self.block is not None or self.axes is not None

    def local_amax(self, shard: torch.Tensor, first_row: int, rows: int = 0) -> torch.Tensor:
        """What this rank contributes to the agreed amax: |shard|'s max (one scale), or the grid of block amaxes
        over its rows [first_row, first_row + rows) of the whole weight, zeros in the blocks it holds no row of
        (`rows`: FSDP's shard rows; axis scales: `AxesCast.local_amax`)."""
        if self.axes is not None:
            return self.axes.local_amax(shard, first_row, rows)
        if self.block is None:
            return tensor_amax(shard) if shard.numel() else self.amax.new_zeros(())
        grid = torch.zeros_like(self.scale)
        if shard.numel():
            rows = self.block[0]
            aligned = F.pad(shard, (0, 0, first_row % rows, 0))  # zero rows up to the block's start change no amax
            amax = block_amax(aligned, self.block)
            grid[first_row // rows : first_row // rows + amax.shape[0]] = amax
        return grid

    def cast(self, shard: torch.Tensor, first_row: int) -> torch.Tensor:
        """E4M3 bytes of the shard (rows [first_row, ...) of the weight), cast with the agreed scale(s)."""
        if self.block is None:
            flat, _ = scaled_cast(shard.reshape(1, -1), self.scale.reshape(1, 1), TENSOR, E4M3)
            return flat.reshape(shard.shape)
        rows, cols = self.block
        row_blocks = torch.arange(first_row, first_row + shard.shape[0], device=self.scale.device) // rows
        data, _ = scaled_cast(shard, self.scale[row_blocks], (1, cols), E4M3)  # each row with its blocks' scales
        return data

    def fill(self, shard: torch.Tensor, first_row: int, rows: int, ranks: int = 1) -> torch.Tensor | None:
        """`data`: the shard's `cast`, padded to `rows` (FSDP's shard rows) with zero rows; allocated once and
        written in place. One scale on CUDA: one fused kernel writing into it (`triton_kernels.tensor_cast`, the
        same bytes, checked against the eager cast once per process). Axis scales: `AxesCast.fill` (over `ranks`)."""
        if self.axes is not None:
            self.axes.fill(shard, first_row, rows, ranks)
            self.fresh = True
            return None
        shape = (rows, *shard.shape[1:])
        if self.data is None or self.data.shape != shape:
            self.data = torch.zeros(shape, dtype=torch.uint8, device=shard.device)
        if shard.numel():
            out = self.data[: shard.shape[0]]
            triton = per_tensor_triton() if self.block is None and shard.is_cuda and shard.dim() == 2 else None
            if triton is not None:
                triton.tensor_cast(shard, self.scale.reshape(1, 1), E4M3, False, out=out.view(E4M3))
            else:
                out.copy_(self.cast(shard, first_row).view(torch.uint8))
        self.fresh = True
        return self.data

    def set(self, amax: torch.Tensor, rows: int = 0) -> None:
        """The weight's agreed amax (blockwise: the grid of block amaxes), and its scale: delayed scaling's current
        weight scale once it has one (the scale the distributed optimizer casts its FP8 weights with), else
        fp8_max / amax (blockwise: per block, powers of two unless --fp8-blockwise-fp32-scales, as the linear's)."""
        if self.axes is not None:
            self.axes.set(amax, rows)
            return
        amax = amax.reshape(self.scale.shape)
        if self.block is not None:
            self.amax.copy_(amax.amax())
            self.scale.copy_(scale_from_amax(amax, E4M3, self.power_of_two))
            torch.reciprocal(self.scale, out=self.scale_inv)
            return
        self.amax.copy_(amax)
        delayed = self.state is not None and self.state.recipe.delayed
        if delayed and self.state.amax.generation > 0:
            self.scale.copy_(self.state.amax.scale[self.state.index, Role.WEIGHT.value])
        else:
            self.scale.copy_(scale_from_amax(amax, E4M3))
        torch.reciprocal(self.scale, out=self.scale_inv)


class Fp8ShardWeight(torch.Tensor):
    """A shard (fp32 or bf16) of an FP8 linear's weight with FSDP2's all-gather hooks (see the module docstring)."""

    _tensor: torch.Tensor
    _scale: GatherScale

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, scale: GatherScale, *state: Any) -> Fp8ShardWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), dtype=tensor.dtype, device=tensor.device
        )

    def __init__(self, tensor: torch.Tensor, scale: GatherScale):
        self._tensor, self._scale = tensor, scale

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        wrappers = []

        def unwrap(t: Fp8ShardWeight) -> torch.Tensor:
            wrappers.append(t)
            return t._tensor

        args, kwargs = tree_map_only(Fp8ShardWeight, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _SHARD_OPS:  # arithmetic (the optimizer's, the amax): plain tensors
            return out
        return tree_map_only(torch.Tensor, wrappers[0].rewrap, out)

    def rewrap(self, tensor: torch.Tensor) -> Fp8ShardWeight:
        """`tensor` (a result of FSDP's ops on this shard) wrapped as this shard is, sharing its scale."""
        return Fp8ShardWeight(tensor, self._scale)

    def untyped_storage(self) -> torch.UntypedStorage:
        """The storage of the shard it holds (a wrapper has none of its own): FSDP2 compares it with its padded
        shard's to tell whether the shard still lives there (parallel/fsdp/fsdp2.py, `share_padded_storage`)."""
        return self._tensor.untyped_storage()

    def __repr__(self) -> str:
        return f"Fp8ShardWeight({self._tensor})"

    def __reduce_ex__(self, protocol):
        """Saved (checkpoints) as the plain shard it holds: a checkpoint is data, loadable without this class."""
        return self._tensor.__reduce_ex__(protocol)

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        """(E4M3 bytes of this shard padded to FSDP's shard rows,): this step's cast, made by `agree` (no kernel
        here); metadata: the scale (or grid of block scales) and amax used, tensors that live as long as the weight
        (docs/fsdp.md: the scale must outlive the gather)."""
        scale = self._scale
        if scale.high_precision:
            return (_high_precision_input(self._tensor, orig_size, mesh, mp_policy.param_dtype),), None
        dtype = getattr(mp_policy, "param_dtype", None) or self._tensor.dtype  # the unit's other weights'
        if orig_size[0] % mesh.size():  # FSDP2 wants a padded shard's input in the shard's shape: as bytes, on all
            dtype = torch.uint8  # ranks (every rank's inputs must agree in dtype and element count)
        if scale.axes is not None:  # the cast(s) this pass needs (fp8_gather_axes.py), agreed first where no step did
            if not scale.fresh:  # (a collective, as the gather is: every rank gathers the unit)
                assert scale.agreement is not None, "an FP8 weight cast per axis gathered without Fp8GatherScales"
                scale.agreement.agree()
            tensors, casts = scale.axes.inputs()
            return tuple(gather_view(t, dtype) for t in tensors), casts
        if not scale.fresh:  # gathered before this step's `agree` (no training step does): cast with today's scale
            rows = shard_rows(orig_size[0], mesh.size())
            first_row = 0 if scale.block is None else mesh.get_local_rank() * rows  # where the blocks start
            scale.fill(self._tensor, first_row, rows)
        return (gather_view(scale.data, dtype),), (scale.scale_inv, scale.amax)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """The gathered weight (first gather), or nothing to do for `out`: its bytes are the re-allocated outputs
        already, and its scale and amax are the weight's own `GatherScale` tensors, which `agree` updates."""
        if isinstance(metadata, str):  # cast per axis: `metadata` says which casts came (fp8_gather_axes.py)
            casts = tuple(gathered_bytes(t) for t in outputs)
            return self._scale.axes.gathered(casts, metadata, param_dtype, out), outputs
        (data,) = outputs
        if out is not None:
            return None
        if metadata is None:  # gathered in the training dtype: the plain weight (FSDP views its unpadded rows)
            return data, (data,)
        scale_inv, amax = metadata
        fp8 = gathered_bytes(data).view(E4M3)
        return Fp8GatheredWeight(fp8, scale_inv, amax, param_dtype, self._scale.block), (data,)


def gather_view(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """E4M3 bytes [rows, cols] handed to FSDP2's all-gather as `dtype` (the unit's other weights' gather dtype),
    [rows, cols / itemsize], where the columns divide: FSDP2 gathers a unit in one dtype and, given several, views
    every input as uint8, so its copy-in (a `_foreach_copy_`) would move the whole unit a byte per element, at a
    fraction of the bandwidth of a wider dtype (on CUDA it loads 4 elements at a time). `gathered_bytes` views the
    all-gather output back. The same bytes arrive, with one exception: CUDA's foreach copy passes bf16 and fp16
    through fp32, which makes every NaN canonical, so a pair of bytes that reads as a NaN (an odd-indexed E4M3 NaN,
    0x7F or 0xFF, beside a negative value) arrives as the canonical NaN's bytes; a weight holding a NaN has made the
    loss NaN whatever its neighbour reads."""
    width = dtype.itemsize
    if width > 1 and data.dim() > 0 and data.is_contiguous() and data.shape[-1] % width == 0:
        return data.view(dtype)
    return data


def gathered_bytes(output: torch.Tensor) -> torch.Tensor:
    """An all-gather output of `gather_view`'s input as the uint8 bytes [rows, cols] it holds."""
    return output.view(torch.uint8)


def _high_precision_input(shard: torch.Tensor, orig_size: Any, mesh: Any, dtype: torch.dtype | None) -> torch.Tensor:
    """The shard in the gather dtype (`dtype`; None: its own), padded with zero rows to FSDP's shard rows."""
    pad = shard_rows(orig_size[0], mesh.size()) - shard.shape[0]
    return F.pad(shard, (0, 0, 0, pad)).to(dtype or shard.dtype)


class Fp8GatheredWeight(torch.Tensor):
    """An unsharded FP8 weight [out, in] under FSDP: E4M3 data and one scale (or, `block` given, a grid of block
    scales), with the nominal dtype FSDP gathers the other weights in (its gradient's: FSDP reduce-scatters a unit's
    gradients of one dtype together). The FP8 linear reads it as `fp8_tensor()`; anything else sees `dequantize()`."""

    grad_to_autograd = True  # params.accumulate_weight_grad: FSDP reduce-scatters the autograd gradient

    @staticmethod
    def __new__(cls, data, scale_inv, amax, dtype, block=None):
        return torch.Tensor._make_wrapper_subclass(cls, data.size(), dtype=dtype, device=data.device)

    def __init__(
        self,
        data: torch.Tensor,
        scale_inv: torch.Tensor,
        amax: torch.Tensor,
        dtype: torch.dtype,
        block: tuple[int, int] | None = None,
    ):
        self._data, self.scale_inv, self.amax, self.block = data, scale_inv, amax, block

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in _GATHERED_VIEWS:  # the result shares the bytes and the scale tensors (refilled in place)
            weight = args[0]
            rest = tree_map_only(Fp8GatheredWeight, lambda t: t._data, (args[1:], kwargs or {}))
            data = func(weight._data, *rest[0], **rest[1])
            return Fp8GatheredWeight(data, weight.scale_inv, weight.amax, weight.dtype, weight.block)
        args, kwargs = tree_map_only(Fp8GatheredWeight, lambda t: t.dequantize(), (args, kwargs or {}))
        return func(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Fp8GatheredWeight(shape={tuple(self.shape)}, scale_inv={self.scale_inv})"

    @property
    def version(self) -> int:
        """Changes whenever the ranks agree a new scale (`GatherScale.set`, once per step): the linear's weight cache
        key (the gathered bytes of one step are the same at every all-gather)."""
        return self.scale_inv._version

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.fp8_tensor().dequantize(dtype or self.dtype)

    def fp8_tensor(self) -> Fp8Tensor:
        """The weight as the GEMM operand q(W) [out, in] (one block, the whole tensor, unless blockwise)."""
        if self.block is None:
            return Fp8Tensor(self._data, self.scale_inv.reshape(1, 1), tuple(self.shape), self.amax)
        return Fp8Tensor(self._data, self.scale_inv, self.block, self.amax)


def shard_data(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor an `Fp8ShardWeight` (or a view of one) holds, sharing its storage; any other tensor itself:
    what kernels that write raw storage (the precision-aware optimizer's Triton step) are given."""
    return tensor._tensor if isinstance(tensor, Fp8ShardWeight) else tensor


def wrap_fp8_weight(weight: torch.Tensor, state: Any, device: torch.device | None = None) -> torch.nn.Parameter:
    """An FP8 linear's (fp32 or bf16) weight as a parameter whose FSDP2 all-gather moves E4M3 bytes (`state`: the
    linear's `Fp8LinearState`). Its scale lives on `device` (default: the weight's; a weight on the meta device,
    given storage later by FSDP, names the run's device, as the scale is never reallocated)."""
    scale = GatherScale(weight.device if device is None else device, state, tuple(weight.shape))
    return torch.nn.Parameter(Fp8ShardWeight(weight.detach(), scale))
