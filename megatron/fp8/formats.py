"""FP8 element formats and which tensor of a linear layer gets which.

Two OCP FP8 formats exist, both without infinities in e4m3 (`float8_e4m3fn`: 4 exponent bits, 3 mantissa bits,
max 448, smallest subnormal 2^-9) and with IEEE-like specials in e5m2 (`float8_e5m2`: max 57344, smallest
subnormal 2^-16). Every cast into them here is *saturating*: values beyond +-max become +-max, NaN stays NaN.

`--fp8-format e4m3` uses e4m3 for all three tensors of a linear layer; `--fp8-format hybrid` keeps e4m3 for
activations and weights (precision) and uses e5m2 for gradients (range), as Transformer Engine does.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E8M0 = torch.float8_e8m0fnu

#: Largest finite value of each FP8 element format.
FP8_MAX: dict[torch.dtype, float] = {E4M3: 448.0, E5M2: 57344.0}


class Role(Enum):
    """The three tensors a linear layer quantizes: its input x, its weight W, and the output gradient dY."""

    INPUT = 0
    WEIGHT = 1
    GRAD = 2


@dataclass(frozen=True)
class Fp8Format:
    """`--fp8-format`: the element dtype of each role."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in ("e4m3", "hybrid"):
            raise ValueError(f"unknown FP8 format {self.name!r}; use --fp8-format e4m3 or hybrid")

    def dtype(self, role: Role) -> torch.dtype:
        return E5M2 if (self.name == "hybrid" and role is Role.GRAD) else E4M3


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype."""
    return FP8_MAX[dtype]
