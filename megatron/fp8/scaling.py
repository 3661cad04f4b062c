"""Per-step amax bookkeeping: the amaxes seen in a step, their max-reduction, and delayed-scaling state.

Every FP8 linear records, for each of its three tensors (input, weight, grad), the largest |x| it quantized during
the current optimizer step (over all micro-batches): `seen[linear, role]`. Once per step, after the last backward:

    amax    = all_reduce_max(seen)            over the amax group (tensor x data parallel ranks)
    finite  = all(isfinite(amax))             the same answer on every rank, since amax is reduced

If not finite, nothing else changes and the trainer skips the step. Otherwise, for delayed scaling only:

    history = [amax, history[0], ..., history[L-2]]        (newest first, L = --fp8-amax-history-len)
    a       = history[0]                  (most_recent)     or   max over history      (max)
    scale   = fp8_max / a / 2^margin      where a > 0 (a zero amax keeps the previous scale; fp32 max on overflow)

Scales start at 1, as in Transformer Engine, so the first step casts with scale 1 (saturating whatever is above
fp8_max) and every later step uses the amaxes of the steps before it: that is what "delayed" means.

NaN does not survive every backend's MAX reduction (a comparison with NaN is false), so NaN is sent as +inf: the
finiteness answer is what matters, and it is the same.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .formats import Role, fp8_max
from .recipes import Recipe

_FP32_MAX = torch.finfo(torch.float32).max


def delayed_scale(
    amax: torch.Tensor, fp8_max: torch.Tensor | float, margin: int, previous: torch.Tensor
) -> torch.Tensor:
    """The delayed-scaling rule: fp8_max / amax / 2^margin where amax > 0 (fp32 max where that overflows), else the
    previous scale."""
    scale = fp8_max / amax / (2.0**margin)
    scale = torch.where(torch.isposinf(scale), torch.full_like(scale, _FP32_MAX), scale)
    return torch.where(amax > 0, scale, previous)


class AmaxState:
    """The amaxes of the current step for `num_linears` linears, and (delayed recipe) their histories and scales.

    seen [n, 3], history [L, n, 3] and scale [n, 3] are fp32 tensors on `device`; the column is the Role value.
    `generation` counts steps (and state loads), so that cached weight casts know when they are stale.
    """

    def __init__(self, recipe: Recipe, num_linears: int, device: torch.device):
        self.recipe = recipe
        self.seen = torch.zeros(num_linears, len(Role), device=device)
        self.generation = 0
        self.history: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        if recipe.delayed:
            self.history = torch.zeros(recipe.amax_history_len, num_linears, len(Role), device=device)
            self.scale = torch.ones(num_linears, len(Role), device=device)
        self._fp8_max = torch.tensor([fp8_max(recipe.dtype(r)) for r in Role], device=device)

    def record(self, index: int, role: Role, amax: torch.Tensor) -> None:
        """seen[index, role] = max(seen[index, role], amax), NaN-propagating, without a host sync."""
        cell = self.seen[index, role.value]
        cell.copy_(torch.maximum(cell, amax.float()))

    def step(self, group: dist.ProcessGroup | None = None) -> bool:
        """Reduce this step's amaxes over `group`, update delayed scaling if they are all finite; True when they
        were. `group=None` means this process alone (as in `ParallelDims`), not torch's default world group: the
        ranks of other pipeline stages hold other layers, whose amaxes must not be mixed in."""
        amax = torch.nan_to_num(self.seen, nan=float("inf"), posinf=float("inf"))
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        self.seen.zero_()
        self.generation += 1  # weights change after every step: earlier weight casts are stale
        finite = bool(torch.isfinite(amax).all())
        if finite and self.recipe.delayed:
            self._update_delayed(amax)
        return finite

    def _update_delayed(self, amax: torch.Tensor) -> None:
        assert self.history is not None and self.scale is not None
        self.history.copy_(torch.cat([amax[None], self.history[:-1]]))
        used = self.history.amax(dim=0) if self.recipe.amax_compute_algo == "max" else self.history[0]
        self.scale.copy_(delayed_scale(used, self._fp8_max, self.recipe.margin, self.scale))

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.history is None or self.scale is None:
            return {}
        return {"amax_history": self.history.detach().cpu().clone(), "scale": self.scale.detach().cpu().clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.history is None or self.scale is None:
            if state:
                raise ValueError("the checkpoint has delayed-scaling FP8 state but --fp8-recipe is not delayed")
            return
        if not state:
            raise ValueError("the checkpoint has no delayed-scaling FP8 state; resume with its --fp8-recipe")
        history, scale = state["amax_history"], state["scale"]
        if history.shape != self.history.shape or scale.shape != self.scale.shape:
            raise ValueError(
                f"FP8 amax history {tuple(history.shape)} in the checkpoint does not match this run's"
                f" {tuple(self.history.shape)} ([--fp8-amax-history-len, FP8 linears, 3]); use the checkpoint's flags"
            )
        self.history.copy_(history)
        self.scale.copy_(scale)
        self.seen.zero_()
        self.generation += 1
