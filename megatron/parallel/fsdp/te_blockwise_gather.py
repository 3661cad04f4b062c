"""FP8 all-gather of Transformer Engine's weights in 128x128 blocks under FSDP2 (--fp8-param-gather --fp8-recipe
blockwise with --use-megatron-fsdp and --transformer-impl transformer_engine).

The shard side is the local layers' blockwise gather (fp8_gather.py): the shard stays the fp32 main weight (bf16
under --use-precision-aware-optimizer); once per step `Fp8GatherScales.agree` max-reduces every weight's grid of
block amaxes over the ranks sharding it, so every rank holds the whole grid, and each rank casts its rows (a block
may straddle two shards) with their blocks' scales into the E4M3 bytes every all-gather of the step moves. The
scales follow the rule of TE's `Float8BlockScaling` for weights (`fp8_quant_fwd_weight`): fp8_max / amax per block,
rounded down to a power of two unless the recipe says fp32 scales (--fp8-blockwise-fp32-scales, or TE's
NVTE_FP8_BLOCK_SCALING_FP32_SCALES), read from the run's recipe object. So the gathered bytes and scales are TE's own
quantization of the whole weight (tests/gpu/test_te_fsdp_blockwise.py checks them bit for bit).

The gathered weight is a TE `Float8BlockwiseQTensor`, which TE's linears take as an already-quantized weight and
feed to the block-scaled GEMMs without casting anything. Its layout (TE 2.20, `Float8BlockQuantizer` with
block_scaling_dim=2):

* row-wise data: the gathered bytes, uint8 [out, in] (FSDP's padding rows cut off);
* row-wise scale_inv: fp32 [ceil(out/128), ceil(in/128) rounded up to a multiple of 4] (`te_scale_shape`): the GEMM
  reads the grid with that padded row stride. Here it is one persistent tensor per weight, whose left columns are
  the `scale_inv` that `agree` writes (a view), the padding 1 (TE leaves its own unset; nothing reads it as a
  scale). Persistent, as the per-tensor scale: FSDP2 builds the gathered weight on another stream than the one
  casting it (docs/fsdp.md, "The scale must outlive the gather");
* column-wise (Hopper's dgrad operand, the weight transposed): data uint8 [in, out] and scale_inv
  [ceil(in/128), ceil(out/128) rounded up to a multiple of 4]. With square blocks the column-wise cast of W is the
  transpose of its row-wise cast with the transposed grid, so nothing is gathered or cast for it: TE makes it from
  the gathered bytes when the backward asks for it (`update_usage(columnwise_usage=True)`, an FP8 transpose) and,
  under FSDP2, drops it right after the dgrad GEMM (`clear_columnwise_cache`), so no layer keeps one after its
  backward. Each all-gather hands the tensor over without one, so a transpose of an earlier gather's bytes is never
  read.

transformer_engine is imported inside functions only: importing this module on a CPU machine is harmless.
"""

from __future__ import annotations

from typing import Any

import torch

from .fp8_gather import Fp8ShardWeight, GatherScale
from .te_fp8_gather import gathered_rows, wrap_te_fp8_weight

BLOCK = 128
"""The side of TE's weight blocks (`Float8BlockQuantizer.block_len`)."""


def block_grid(shape: tuple[int, ...]) -> tuple[int, int]:
    """Blocks of a weight [out, in] along each dimension: (ceil(out/128), ceil(in/128)); the last may be partial."""
    rows, cols = shape
    return -(-rows // BLOCK), -(-cols // BLOCK)


def te_scale_shape(shape: tuple[int, ...], columnwise: bool = False) -> tuple[int, int]:
    """The shape of TE's scale_inv of a weight [out, in] quantized in 128x128 blocks (`Float8BlockQuantizer.
    get_scale_shape` with block_scaling_dim=2): the grid, its second dimension rounded up to a multiple of 4 (the
    GEMM's alignment); column-wise, the transposed grid so padded."""
    rows, cols = block_grid(shape)
    if columnwise:
        rows, cols = cols, rows
    return rows, -(-cols // 4) * 4


class TeBlockScale(GatherScale):
    """A TE weight's grid of block scales (`GatherScale` blockwise, with TE's weight rule) and the padded scale_inv
    its gathered `Float8BlockwiseQTensor` reads (`padded_scale_inv`; `scale_inv` is a view of its left columns)."""

    def __init__(self, device: torch.device, shape: tuple[int, ...], power_of_two: bool):
        super().__init__(device, None)
        self.block, self.power_of_two = (BLOCK, BLOCK), power_of_two
        grid = block_grid(shape)
        self.scale = torch.ones(grid, device=device)
        self.padded_scale_inv = torch.ones(te_scale_shape(shape), device=device)
        self.scale_inv = self.padded_scale_inv[:, : grid[1]]  # `set` writes the reciprocals through this view


class TeBlockShardWeight(Fp8ShardWeight):
    """A shard of a TE linear's weight whose all-gather moves E4M3 bytes cast in 128x128 blocks and yields a TE
    `Float8BlockwiseQTensor` (see the module docstring)."""

    _scale: TeBlockScale

    def rewrap(self, tensor: torch.Tensor) -> TeBlockShardWeight:
        return TeBlockShardWeight(tensor, self._scale)

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        """(the step's E4M3 bytes of this shard, padded to FSDP's rows,); metadata: the weight's shape. The grid of
        scales is every rank's already (agreed), so only the bytes travel."""
        inputs, metadata = super().fsdp_pre_all_gather(mesh, orig_size, contiguous_orig_stride, module, mp_policy)
        if metadata is None:  # gathered in the training dtype (its layer moved to bf16 by the FP8 guard)
            return inputs, None
        return inputs, (tuple(orig_size),)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """The gathered Float8BlockwiseQTensor with the inner tensor FSDP frees at reshard and allocates again before
        the next gather (the bytes), or, on later gathers, `out` pointed at this gather's bytes, without a column-wise
        copy (TE makes it from these bytes when the backward needs it). Gathered in the training dtype: the plain
        weight TE's bf16 GEMM reads."""
        if metadata is None:
            return super().fsdp_post_all_gather(outputs, metadata, param_dtype, out=out)
        (padded,) = outputs
        (shape,) = metadata
        data, scale_inv = gathered_rows(padded, shape), self._scale.padded_scale_inv
        if out is None:
            return _blockwise_tensor(data, scale_inv, param_dtype, self._scale.power_of_two), (padded,)
        out._rowwise_data, out._rowwise_scale_inv = data, scale_inv
        out._columnwise_data = out._columnwise_scale_inv = None
        return None


def _blockwise_tensor(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, power_of_two: bool) -> Any:
    """A TE Float8BlockwiseQTensor of E4M3 `data` (uint8 [out, in]) in 128x128 blocks with the padded `scale_inv`,
    nominally `dtype`, row-wise only (TE adds the column-wise copy in the backward), whose quantizer is the one
    TE's blockwise recipe makes for weights."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import (
        Float8BlockQuantizer,
        Float8BlockwiseQTensor,
    )

    e4m3 = tex.DType.kFloat8E4M3
    quantizer = Float8BlockQuantizer(
        e4m3, rowwise=True, columnwise=False, force_pow_2_scales=power_of_two, block_scaling_dim=2
    )
    return Float8BlockwiseQTensor(
        shape=data.shape,
        dtype=dtype,
        rowwise_data=data,
        rowwise_scale_inv=scale_inv,
        columnwise_data=None,
        columnwise_scale_inv=None,
        fp8_dtype=e4m3,
        quantizer=quantizer,
        is_2D_scaled=True,
        requires_grad=False,
        device=data.device,
    )


def wrap_te_block_weight(weight: torch.Tensor, recipe: Any, device: torch.device | None = None) -> torch.nn.Parameter:
    """A TE linear's (fp32 or bf16) weight [out, in] as a parameter whose FSDP2 all-gather moves E4M3 bytes cast in
    128x128 blocks with the scale rule of `recipe` (TE's Float8BlockScaling) for weights, and yields a TE
    Float8BlockwiseQTensor; its scales live on `device` (default: the weight's; see `wrap_fp8_weight`). Raises
    ValueError for a recipe whose weights TE casts otherwise (1x128 tiles, an amax floor), which the ranks' agreed
    grid would not reproduce."""
    rule = recipe.fp8_quant_fwd_weight
    if recipe.w_block_scaling_dim != 2 or rule.amax_epsilon != 0:
        raise ValueError(
            f"FP8 all-gather of TE blockwise weights needs 128x128 weight blocks and no amax floor; the recipe has"
            f" w_block_scaling_dim={recipe.w_block_scaling_dim}, amax_epsilon={rule.amax_epsilon}: use the recipe"
            " megatron/fp8/te_recipe.py builds, or drop --fp8-param-gather"
        )
    scale = TeBlockScale(weight.device if device is None else device, tuple(weight.shape), rule.power_2_scale)
    return torch.nn.Parameter(TeBlockShardWeight(weight.detach(), scale))


def wrap_te_weight(weight: torch.Tensor, recipe: Any, device: torch.device | None = None) -> torch.nn.Parameter:
    """A TE linear's weight as a parameter whose FSDP2 all-gather moves FP8 bytes, as `recipe` (the TE recipe of
    the run) casts weights: in 128x128 blocks (Float8BlockScaling: `wrap_te_block_weight`), else with one scale per
    tensor (te_fp8_gather.py)."""
    if recipe.float8_block_scaling():
        return wrap_te_block_weight(weight, recipe, device)
    return wrap_te_fp8_weight(weight, device)
