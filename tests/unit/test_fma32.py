"""`adam_kernel.fma32`, the fp32 fma the AdamW kernel's rounding checks and Triton's interpreter tests emulate: x * y
+ z rounded once, against exact rational arithmetic on random values and cancelling sums, and on the near-tie of a
division's correction step, where rounding the fp64 sum again would be wrong."""

from __future__ import annotations

from fractions import Fraction

import torch

from megatron.optim.adam_kernel import fma32


def rounded_once(x: float, y: float, z: float) -> float:
    """The fp32 value nearest x * y + z (ties to even), by exact arithmetic over the neighbours of a first guess."""
    exact = Fraction(x) * Fraction(y) + Fraction(z)
    guess = torch.tensor(float(exact), dtype=torch.float32)
    up, down = torch.nextafter(guess, torch.tensor(torch.inf)), torch.nextafter(guess, torch.tensor(-torch.inf))

    def key(c: torch.Tensor) -> tuple[Fraction, int]:
        return abs(Fraction(c.item()) - exact), int(c.view(torch.int32)) & 1

    return min((down, guess, up), key=key).item()


def test_rounds_once_on_random_values_and_near_ties():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(2000, generator=gen), torch.randn(2000, generator=gen)
    cancelling = (-(x.double() * y.double())).float() * 1.0000001  # sums far below the product: ties in fp64
    for z in (torch.randn(2000, generator=gen), cancelling):
        got = fma32(x, y, z)
        want = torch.tensor([rounded_once(*v) for v in zip(x.tolist(), y.tolist(), z.tolist())])
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_the_correction_step_of_a_division_by_an_all_ones_significand():
    """1 / (2 - 2^-23) by a reciprocal and its residual: the corrected sum lies just above an fp32 midpoint, which
    the fp64 sum rounds onto (and a second rounding would take to the even side, 0.5)."""
    b = torch.tensor([0x3FFFFFFF], dtype=torch.int32).view(torch.float32)
    r = (1 / b.double()).float()
    residual = fma32(-r, b, 1.0)
    assert fma32(residual, r, r).item() == (1 / b.double()).float().item() == 0.5 + 2**-24
    assert (residual.double() * r.double() + r.double()).float().item() == 0.5  # the twice-rounded value
