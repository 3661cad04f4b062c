"""The FP8 guard: name the FP8 tensors whose saturation or underflow stays high, and optionally move their
transformer layers to bf16 for the rest of the run (`--fp8-auto-bf16`).

It reads the monitor's statistics (`--fp8-stats-interval N`): a tensor is *over* on a watched step when

    saturated > --fp8-guard-saturation    or    underflow > --fp8-guard-underflow
    or (delayed scaling over several ranks) its scale differs between the ranks that share it

and the guard acts when a tensor has been over on --fp8-guard-intervals watched steps in a row: it logs the layer,
the linear, the tensor and the numbers, and, with --fp8-auto-bf16, takes the whole transformer layer out of FP8
(Transformer Engine runs FP8 per layer, so the layer is the unit in both engines). Moved layers are kept in the
checkpoint and stay in bf16 when the run resumes. While a tensor is over on fewer watched steps than that
(`pending`), the monitor watches every step, so the guard decides on consecutive steps, not N-th ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Fp8Guard:
    def __init__(
        self,
        saturation: float,
        underflow: float,
        intervals: int,
        auto_bf16: bool,
        move_to_bf16: Callable[[int], None],
    ):
        self.saturation, self.underflow, self.intervals = saturation, underflow, intervals
        self.auto_bf16, self.move_to_bf16 = auto_bf16, move_to_bf16
        self.streaks: dict[tuple[str, str], int] = {}
        self.bf16_layers: list[int] = []
        """Transformer layers moved out of FP8 (in the order they were moved)."""

    def conditions(self, row: Any) -> list[str]:
        """What makes a row (`Fp8TensorStats`) over on its watched step, e.g. `saturated 0.5% > 0.1%`; empty: none."""
        over = []
        if row.saturated > self.saturation:
            over.append(f"saturated {_pct(row.saturated)} > {_pct(self.saturation)}")
        if row.underflow > self.underflow:
            over.append(f"underflow {_pct(row.underflow)} > {_pct(self.underflow)}")
        if row.scale_spread > 1:  # measured only where the ranks must agree: any disagreement is a broken reduction
            over.append(f"scales disagree across ranks (x{row.scale_spread:.4g})")
        return over

    def check(self, rows: list[Any]) -> list[str]:
        """Update the streaks with one watched step's rows (`Fp8TensorStats`); the messages of what it did."""
        messages = []
        for row in rows:
            over = self.conditions(row)
            key = (row.linear, row.tensor)
            streak = self.streaks[key] = self.streaks.get(key, 0) + 1 if over else 0
            if streak < self.intervals or streak % self.intervals:
                continue  # says so once per `intervals` watched steps over, not on every one
            message = (
                f"FP8 guard: transformer layer {row.layer_number}, {row.describe()}: {' and '.join(over)} on"
                f" {streak} watched steps in a row"
            )
            if not self.auto_bf16:
                message += "; --fp8-auto-bf16 would move the layer to bf16"
            elif row.layer_number not in self.bf16_layers:
                self.move(row.layer_number)
                message += "; moved the layer to bf16 for the rest of the run (--fp8-auto-bf16)"
            messages.append(message)
        return messages

    def pending(self) -> bool:
        """Whether a tensor is over on fewer watched steps in a row than the guard acts on: the monitor then watches
        the next step too, so a failure growing between N-th steps is acted on intervals - 1 steps after its flag."""
        return any(0 < streak < self.intervals for streak in self.streaks.values())

    def move(self, layer_number: int) -> None:
        self.move_to_bf16(layer_number)
        self.bf16_layers.append(layer_number)

    def state_dict(self) -> dict[str, Any]:
        return {"bf16_layers": list(self.bf16_layers)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for number in state.get("bf16_layers", []):
            if number not in self.bf16_layers:
                self.move(number)


def _pct(fraction: float) -> str:
    return f"{100 * fraction:.3g}%"
