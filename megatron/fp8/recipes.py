"""FP8 recipes: for each tensor of a linear layer, its FP8 dtype and its block shape.

A linear layer y = x W^T (x [M, K], W [N, K], dY [M, N]) runs three GEMMs, each as A . B^T with both operands
quantized along their last dimension, the GEMM's reduction dimension:

    fprop  y  = x   . W^T      A = x    [M, K]   B = W    [N, K]    (reduce over K)
    dgrad  dx = dY  . W        A = dY   [M, N]   B = W^T  [K, N]    (reduce over N)
    wgrad  dW = dY^T . x       A = dY^T [N, M]   B = x^T  [K, M]    (reduce over M)

So every tensor is needed in two orientations. With one scale per tensor, or square blocks (128x128 weight blocks),
the second orientation is the transpose of the first, byte for byte. With row, 1x128 or 32-element blocks it is a
second quantization of the high-precision tensor along the other axis (as in Transformer Engine), never a
requantization of FP8 data.

    recipe      input x        weight W        grad dY        scale
    delayed     tensor         tensor          tensor         fp8_max / amax_history / 2^margin (scaling.py)
    tensorwise  tensor         tensor          tensor         fp8_max / amax (current tensor)
    rowwise     row            row             row            fp8_max / amax per row
    blockwise   1x128          128x128         1x128          power of two (default) or fp32, per block
    mxfp8       1x32           1x32            1x32           E8M0, rounded up (quantize.py)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.config import PrecisionConfig

from .formats import Fp8Format, Role
from .quantize import MX_BLOCK, ROW, TENSOR, BLOCK_128x128, BlockSpec, TILE_1x128

RECIPES = ("delayed", "tensorwise", "rowwise", "blockwise", "mxfp8")

_BLOCKS: dict[str, dict[Role, BlockSpec]] = {
    "delayed": {Role.INPUT: TENSOR, Role.WEIGHT: TENSOR, Role.GRAD: TENSOR},
    "tensorwise": {Role.INPUT: TENSOR, Role.WEIGHT: TENSOR, Role.GRAD: TENSOR},
    "rowwise": {Role.INPUT: ROW, Role.WEIGHT: ROW, Role.GRAD: ROW},
    "blockwise": {Role.INPUT: TILE_1x128, Role.WEIGHT: BLOCK_128x128, Role.GRAD: TILE_1x128},
    "mxfp8": {Role.INPUT: MX_BLOCK, Role.WEIGHT: MX_BLOCK, Role.GRAD: MX_BLOCK},
}


@dataclass(frozen=True)
class Recipe:
    """The FP8 recipe of a run, built once from the precision flags."""

    name: str
    format: Fp8Format
    fp8_wgrad: bool = True
    power_of_two_scales: bool = True
    """blockwise only: scales rounded down to powers of two (Transformer Engine's default)."""
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"

    def __post_init__(self) -> None:
        if self.name not in RECIPES:
            raise ValueError(f"unknown FP8 recipe {self.name!r}; use --fp8-recipe one of {', '.join(RECIPES)}")

    @classmethod
    def from_config(cls, precision: PrecisionConfig) -> Recipe:
        if precision.fp8_format is None:
            raise ValueError("FP8 is off: pass --fp8-format e4m3|hybrid")
        return cls(
            name=precision.fp8_recipe,
            format=Fp8Format(precision.fp8_format),
            fp8_wgrad=precision.fp8_wgrad,
            power_of_two_scales=not precision.fp8_blockwise_fp32_scales,
            margin=precision.fp8_margin,
            amax_history_len=precision.fp8_amax_history_len,
            amax_compute_algo=precision.fp8_amax_compute_algo,
        )

    @property
    def delayed(self) -> bool:
        return self.name == "delayed"

    @property
    def mx(self) -> bool:
        return self.name == "mxfp8"

    def dtype(self, role: Role) -> torch.dtype:
        return self.format.dtype(role)

    def block(self, role: Role) -> BlockSpec:
        """Block shape of this role's operand [rows, reduction dim], in either orientation."""
        return _BLOCKS[self.name][role]

    def transposable(self, role: Role) -> bool:
        """Whether the quantized tensor, transposed, is already the operand of the other orientation."""
        rows, cols = self.block(role)
        return (rows, cols) == (cols, rows)  # whole tensor (None, None) or square blocks

    def power_of_two(self, role: Role) -> bool:
        return self.name == "blockwise" and self.power_of_two_scales

    def describe(self) -> str:
        fmt = ", ".join(f"{r.name.lower()} {str(self.dtype(r)).removeprefix('torch.')}" for r in Role)
        blocks = ", ".join(f"{r.name.lower()} {_block_name(self.block(r))}" for r in Role)
        text = f"FP8 recipe {self.name}, format {self.format.name} ({fmt}); blocks: {blocks}"
        if self.name == "blockwise":
            text += "; scales " + ("powers of two" if self.power_of_two_scales else "fp32")
        if self.mx:
            text += "; E8M0 scales rounded up (no element saturates)"
        if self.delayed:
            text += f"; margin {self.margin}, amax history {self.amax_history_len}, algo {self.amax_compute_algo}"
        if not self.fp8_wgrad:
            text += "; wgrad in high precision (--no-fp8-wgrad)"
        return text


def _block_name(spec: BlockSpec) -> str:
    if spec == TENSOR:
        return "per tensor"
    if spec == ROW:
        return "per row"
    return f"{spec[0]}x{spec[1]}"
