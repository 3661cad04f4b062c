"""The precision-aware AdamW (`--use-precision-aware-optimizer`): masters and moments held as `states.ScaledState`s.

It owns the states, steps them (on CUDA with the fused kernel of `adam_kernel.py`, else with the eager
`states.adamw_update_`), counts the steps on the device and saves, loads and converts the states. The encodings, their
error bounds and the measurements behind them are in `states.py`'s docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import adam_kernel
from .states import BLOCK, DTYPES, MAIN_PARAMS_DTYPES, ScaledState, adamw_update_


def _conversion(name: str, old: ScaledState, new: ScaledState) -> str:
    """'exp_avg fp32 -> fp8'; with the block sizes where only they differ."""
    before, after = old.describe(), new.describe()
    if before == after:
        before, after = old.describe(block=True), new.describe(block=True)
    return f"{name} {before} -> {after}"


class PrecisionAwareAdamW:
    """AdamW over fp32 master tensors (flat pieces or any shape) whose masters and moments are held as ScaledStates.

    `masters`: taken over (fp32 ones are kept and updated in place; for other formats the caller drops its fp32
    copies). `weight_decays`: one per tensor. Main params fp16 keep an int8 remainder (see `states.py`'s docstring);
    an fp8 second moment is encoded as sqrt(v). The step count is a float64 0-dim tensor on the masters' device that
    a step adds 1 - [found_inf != 0] to, as torch's fused AdamW does with its device step, so a skipped step does
    not count and nothing waits for the device. `stochastic_rounding` (bf16, fp16, fp8 moments) draws from a
    torch.Generator on that device seeded with `seed`, saved in `state_dict()`.
    """

    def __init__(
        self,
        masters: list[torch.Tensor],
        weight_decays: list[float],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        main_params_dtype: str = "fp32",
        exp_avg_dtype: str = "fp32",
        exp_avg_sq_dtype: str = "fp32",
        block_size: int = BLOCK,
        stochastic_rounding: bool = True,
        seed: int = 0,
    ) -> None:
        if main_params_dtype not in MAIN_PARAMS_DTYPES:
            raise ValueError(f"--main-params-dtype {main_params_dtype} is not supported; use fp32 or fp16")
        for flag, name in (("--exp-avg-dtype", exp_avg_dtype), ("--exp-avg-sq-dtype", exp_avg_sq_dtype)):
            if name not in DTYPES:
                raise ValueError(f"{flag} {name} is not supported; use one of {', '.join(DTYPES)}")
        if len(weight_decays) != len(masters):
            raise ValueError(f"{len(weight_decays)} weight decays for {len(masters)} tensors; pass one per tensor")
        self.lr, self.betas, self.eps = lr, betas, eps
        self.dtypes = {"main_params": main_params_dtype, "exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}
        self.block_size = block_size
        self.weight_decays = [float(wd) for wd in weight_decays]
        fp16_master = main_params_dtype == "fp16"
        self.masters = [ScaledState(m, main_params_dtype, block=block_size, remainder=fp16_master) for m in masters]
        self.exp_avg = [ScaledState.zeros(m.shape, exp_avg_dtype, block=block_size, device=m.device) for m in masters]
        root = exp_avg_sq_dtype == "fp8"
        self.exp_avg_sq = [
            ScaledState.zeros(m.shape, exp_avg_sq_dtype, block=block_size, root=root, device=m.device) for m in masters
        ]
        device = masters[0].device if masters else torch.device("cpu")
        self._step = torch.zeros((), dtype=torch.float64, device=device)
        self.generator = torch.Generator(device).manual_seed(seed) if stochastic_rounding else None
        self.seed = seed  # keys the fused CUDA kernel's random stream instead (adam_kernel.py); saved in state_dict

    def __len__(self) -> int:
        return len(self.masters)

    @property
    def step_count(self) -> int:
        """Steps taken (skipped ones not counted); reads the device counter (a host sync)."""
        return int(self._step.item())

    def step(
        self,
        grads: list[torch.Tensor],
        lr: float | Sequence[float] | None = None,
        grad_scale: torch.Tensor | None = None,
        found_inf: torch.Tensor | None = None,
        model_copies: list[torch.Tensor | None] | None = None,
    ) -> None:
        """One AdamW step over every tensor at `lr` (None: the constructor's; a sequence: one per tensor, e.g.
        --decoupled-lr's). `grad_scale` divides the gradients; a nonzero `found_inf` (0-dim) skips the step: states
        and step count unchanged, no host synchronisation. `model_copies[i]` (or None) receives master i's new value
        in its own dtype (the model's weights, or fp32 for a cast to FP8), skipped step or not: on CUDA written by the
        fused step itself, saving a pass that decodes the master."""
        if len(grads) != len(self.masters):
            raise ValueError(f"{len(grads)} gradients for {len(self.masters)} tensors; pass one per master")
        lr = self.lr if lr is None else lr
        if found_inf is None:
            self._step.add_(1)
        else:
            self._step.add_(found_inf.eq(0).to(torch.float64))
        beta1, beta2 = self.betas
        # On CUDA the fused Triton kernel (adam_kernel.py): the same arithmetic in one pass per tensor instead of
        # ~30, stochastic rounding drawn from Philox keyed by self.seed rather than from self.generator.
        fused = adam_kernel.available(self._step.device)
        if fused and adam_kernel.supports(self.masters, self.exp_avg, self.exp_avg_sq):
            seed = None if self.generator is None else self.seed
            hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=self.eps, step=self._step, seed=seed)
            kernel_args = self.masters, grads, self.exp_avg, self.exp_avg_sq, self.weight_decays
            adam_kernel.adamw_step_(
                *kernel_args, **hyper, grad_scale=grad_scale, found_inf=found_inf, model_copies=model_copies
            )
            return
        lrs = [lr] * len(grads) if isinstance(lr, (int, float)) else lr
        for master, grad, m, v, wd, lr_i in zip(
            self.masters, grads, self.exp_avg, self.exp_avg_sq, self.weight_decays, lrs
        ):
            adamw_update_(
                master,
                grad,
                m,
                v,
                lr=lr_i,
                beta1=beta1,
                beta2=beta2,
                eps=self.eps,
                weight_decay=wd,
                step=self._step,
                grad_scale=grad_scale,
                found_inf=found_inf,
                generator=self.generator,
            )
        with torch.no_grad():  # the copies may be the model's parameters
            for i, copy in enumerate(model_copies or []):
                if copy is not None:
                    copy.view(-1).copy_(self.master(i).view(-1))

    def master(self, i: int) -> torch.Tensor:
        """Master tensor i decoded to fp32 (a new tensor)."""
        return self.masters[i].decode()

    def set_master_(self, i: int, value: torch.Tensor) -> None:
        """Overwrite master i (e.g. from model weights loaded without optimizer state)."""
        self.masters[i].encode_(value)

    def bytes_per_element(self) -> dict[str, float]:
        """Bytes per element of each state over all tensors, scales and the fp16 remainder included."""
        numel = max(sum(s.numel for s in self.masters), 1)
        kinds = {"master": self.masters, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        return {kind: sum(s.nbytes for s in states) / numel for kind, states in kinds.items()}

    def _kinds(self) -> list[tuple[str, str, list[ScaledState]]]:
        """(state_dict key, name in notes, states)."""
        return [
            ("masters", "main params", self.masters),
            ("exp_avg", "exp_avg", self.exp_avg),
            ("exp_avg_sq", "exp_avg_sq", self.exp_avg_sq),
        ]

    def state_dict(self) -> dict[str, Any]:
        """Self-describing: formats, block size, step (a float64 0-dim tensor) and the encoded tensors (references:
        save or clone before the next step)."""
        state: dict[str, Any] = {f"{k}_dtype": v for k, v in self.dtypes.items()}
        state.update(block_size=self.block_size, step=self._step.clone(), seed=self.seed)
        if self.generator is not None:
            state["rng"] = self.generator.get_state()
        for key, _, states in self._kinds():
            state[key] = [s.state_dict() for s in states]
        return state

    def _check(self, state: dict[str, Any], shape_of: Callable[[Any], torch.Size]) -> None:
        for key, _, states in self._kinds():
            if key not in state:
                raise ValueError(f"the optimizer state has no {key!r}; pass a state_dict() or fp32_state_dict()")
            if len(state[key]) != len(states):
                raise ValueError(
                    f"the optimizer state holds {len(state[key])} {key} tensors, this optimizer {len(states)}:"
                    " load a checkpoint of the same model and parallel layout"
                )
            for i, (saved, mine) in enumerate(zip(state[key], states)):
                if tuple(shape_of(saved)) != tuple(mine.shape):
                    raise ValueError(
                        f"{key}[{i}] has shape {tuple(shape_of(saved))} in the optimizer state, {tuple(mine.shape)}"
                        " here: load a checkpoint of the same model and parallel layout"
                    )

    def load_state_dict(self, state: dict[str, Any]) -> str | None:
        """Load a `state_dict()` (or an `fp32_state_dict()`). Same formats: bitwise, returns None. Other formats or
        block size: converted through fp32; returns a one-line note naming each conversion."""
        if "main_params_dtype" not in state:
            return self.load_fp32_state_dict(state)
        self._check(state, lambda saved: saved["data"].shape)
        converted = []
        for key, name, states in self._kinds():
            saved = [ScaledState.from_state_dict(d) for d in state[key]]
            for old, mine in zip(saved, states):
                if mine.same_format(old):
                    mine.copy_(old)
                else:
                    mine.encode_(old.decode())
            if saved and not states[0].same_format(saved[0]):
                converted.append(_conversion(name, saved[0], states[0]))
        self._step.copy_(torch.as_tensor(state["step"], dtype=torch.float64))
        self.load_rounding_state(state)
        return f"optimizer states converted: {', '.join(converted)}" if converted else None

    def rounding_state(self) -> dict[str, Any]:
        """What stochastic rounding continues from: the seed (the fused kernel's Philox key) and the generator's
        state (the eager step's stream; None without stochastic rounding)."""
        return {"seed": self.seed, "rng": None if self.generator is None else self.generator.get_state()}

    def load_rounding_state(self, state: dict[str, Any]) -> None:
        """Continue the stream of `rounding_state()` (or of a `state_dict()`)."""
        self.seed = int(state.get("seed", self.seed))  # states saved before the fused kernel have none
        rng = state.get("rng")
        # A generator's state fits only its own device type; elsewhere the stream starts afresh (not bitwise then).
        if self.generator is not None and rng is not None and rng.numel() == self.generator.get_state().numel():
            self.generator.set_state(rng)

    def reseed_rounding(self, seed: int) -> None:
        """Start the eager step's stochastic-rounding stream afresh from `seed` (the fused kernel's stream is keyed
        by the seed and the step: it needs nothing)."""
        if self.generator is not None:
            self.generator.manual_seed(seed)

    def set_step_count(self, step: int) -> None:
        """The step count after loading encodings in place."""
        self._step.fill_(float(step))

    def fp32_state_dict(self) -> dict[str, Any]:
        """{"step": int, "masters": [fp32], "exp_avg": [fp32], "exp_avg_sq": [fp32]}: new tensors, the values
        torch.optim.AdamW would hold (its per-parameter "exp_avg", "exp_avg_sq" and "step")."""
        state: dict[str, Any] = {"step": self.step_count}
        for key, _, states in self._kinds():
            state[key] = [s.decode() for s in states]
        return state

    def load_fp32_state_dict(self, state: dict[str, Any]) -> str | None:
        """Load the plain form of `fp32_state_dict`; returns a note naming the states encoded below fp32, or None."""
        self._check(state, lambda saved: saved.shape)
        for key, _, states in self._kinds():
            for value, mine in zip(state[key], states):
                mine.encode_(value)
        self._step.fill_(float(state["step"]))
        kinds = [(name, states[0].dtype_name) for _, name, states in self._kinds() if states]
        converted = [f"{name} fp32 -> {dtype}" for name, dtype in kinds if dtype != "fp32"]
        return f"optimizer states converted: {', '.join(converted)}" if converted else None
