"""Loss scaling for fp16 training (Megatron-LM's `--fp16` with `--loss-scale` or dynamic scaling).

fp16 has five fewer exponent bits than bf16: small gradients flush to zero. The loss is multiplied by a scale S
before backward, so every gradient is S times larger and stays representable; the fp32 main gradients are multiplied
by 1/S before clipping and the optimizer step. A scale too large overflows: the gradients hold inf/NaN, the step is
skipped (the trainer sees it through the global gradient norm, which every tensor-, pipeline- and data-parallel rank
computes in one reduction) and a dynamic scaler lowers the scale.

Dynamic scaling follows Megatron-LM's DynamicGradScaler: the scale is halved (never below --min-loss-scale) on an
overflow once --hysteresis overflows have been seen since the scale last grew (they need not be consecutive), and
doubled after --loss-scale-window steps in a row without one, which also refills the hysteresis.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.config import PrecisionConfig


class LossScaler:
    """A constant scale (`--loss-scale S`, or 1.0 for bf16 and fp32 runs, which then do nothing)."""

    def __init__(self, scale: float = 1.0):
        self.scale = float(scale)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """What backward runs on: the loss times the scale."""
        return loss if self.scale == 1.0 else loss * self.scale

    def unscale_(self, grads: list[torch.Tensor], factor: float | torch.Tensor = 1.0) -> None:
        """Multiply the (fp32) main gradients by `factor` / scale in place; `factor`, a 0-dim tensor or a number,
        folds another rescaling into the same pass (the per-token loss's 1/tokens)."""
        grads = [g for g in grads if g.numel()]
        if not grads:
            return
        if isinstance(factor, torch.Tensor):
            torch._foreach_mul_(grads, factor / self.scale)
        elif factor / self.scale != 1.0:
            torch._foreach_mul_(grads, factor / self.scale)

    def update(self, found_inf: bool) -> None:
        """After each step: whether its gradients held inf/NaN (a constant scale ignores it)."""

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A static scale is the command line's: a checkpoint's does not override it."""


class DynamicLossScaler(LossScaler):
    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_interval: int,
        hysteresis: int,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
    ):
        if not 0 < min_scale <= initial_scale:
            raise ValueError(f"the minimum loss scale ({min_scale}) must be in (0, initial scale {initial_scale}]")
        if growth_interval < 1 or hysteresis < 1 or growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ValueError("loss scale window and hysteresis must be >= 1, growth > 1, backoff in (0, 1)")
        super().__init__(initial_scale)
        self.min_scale, self.growth_interval, self.hysteresis = float(min_scale), int(growth_interval), hysteresis
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the scale and its trackers (a checkpoint saved without them, e.g. by a bf16 run, keeps ours)."""
        if "growth_tracker" not in state:
            return
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])


def build_loss_scaler(precision: PrecisionConfig) -> LossScaler:
    """Dynamic scaling for --fp16 unless --loss-scale fixes the scale; a constant 1 (no-op) without --fp16."""
    if not precision.fp16:
        return LossScaler(1.0)
    if precision.loss_scale:
        return LossScaler(precision.loss_scale)
    return DynamicLossScaler(
        precision.initial_loss_scale,
        precision.min_loss_scale,
        int(precision.loss_scale_window),
        precision.hysteresis,
    )
