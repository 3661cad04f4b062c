"""AdamW with Megatron-LM's mixed precision, global-norm clipping and non-finite step skipping.

Gradients come from `param.main_grad`, the fp32 accumulation buffers of `megatron.parallel.GradientBuffers`
(build those first). With fp32 parameters (CPU default) the optimizer updates the model's parameters directly.
With bf16 parameters (`--bf16`) it keeps an fp32 *main* copy of every parameter, steps on that, and casts it back
into the bf16 parameter once per step (not once per micro-batch).

With sharded buffers (`--use-distributed-optimizer`) the same holds for the flattened *pieces* of the parameters
that lie in this data-parallel rank's shard of each bucket: main copies, Adam moments, the update and the
gradient-norm contribution cover those pieces only, and the buffers all-gather the updated parameters.

FP8 weights (--fp8-param-gather) are written from their fp32 main copies (or pieces) by casting straight into their
FP8 bytes (`megatron.fp8.params.quantize_masters`), so with the distributed optimizer the all-gather moves FP8.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron.config import OptimizerConfig
from megatron.fp8.params import is_fp8_param, quantize_masters
from megatron.parallel import GradientBuffers, counts_in_grad_norm


def _initial_main_value(param: torch.Tensor) -> torch.Tensor:
    """The fp32 main copy's starting value: an FP8 parameter's high-precision initial value (kept on the CPU by TE
    until now, then released), as the FP8 value has lost precision; otherwise the parameter itself."""
    if is_fp8_param(param):
        initial = param.get_high_precision_init_val() if hasattr(param, "get_high_precision_init_val") else None
        if initial is None:
            return param.dequantize().float()
        param.clear_high_precision_init_val()
        return initial.to(param.device, torch.float32)
    return param.detach().float().clone()


def _initial_piece(param: torch.Tensor, target: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The fp32 main copy of this rank's piece [start, stop) of `param`: an FP8 weight's from its high-precision
    initial value; any other from the piece itself (`target`), without an fp32 copy of the whole parameter."""
    if is_fp8_param(param):
        return _initial_main_value(param).view(-1)[start:stop].clone()
    return target.float().clone()


def _no_weight_decay(name: str, param: nn.Parameter) -> bool:
    """Biases and norm weights (every 1-D parameter) are not decayed, as in Megatron-LM."""
    return param.ndim == 1 or name.endswith(".bias")


class MixedPrecisionAdamW:
    def __init__(
        self,
        model: nn.Module,
        cfg: OptimizerConfig,
        fused: bool = False,
        buffers: GradientBuffers | None = None,
        fp8_group: dist.ProcessGroup | None = None,
    ):
        """`buffers`: the model's gradient buffers; needed when they are sharded (the distributed optimizer).
        `fp8_group`: the ranks over which FP8 weights' amaxes are max-reduced when their main copies are cast
        (see `quantize_masters`; the data-parallel group for TE's weights, tensor x data parallel for local ones)."""
        self.cfg = cfg
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not all(hasattr(p, "main_grad") for p in self.params):
            raise RuntimeError("build megatron.parallel.GradientBuffers for the model before its optimizer")
        self.buffers = buffers if buffers is not None and buffers.sharded else None
        self.mixed = any(p.dtype != torch.float32 for p in self.params)
        if self.buffers is None:
            owned, starts = self.params, [0] * len(self.params)
            self._grads = [p.main_grad for p in self.params]
            self.main_params = [_initial_main_value(p) for p in self.params] if self.mixed else self.params
            targets = self.params
        else:
            # This rank's pieces: flat views of the parameters, of their gradients, and fp32 copies (bf16, FP8) or
            # the views themselves (fp32) to step on.
            self.pieces = [(p, r) for p in self.params if (r := self.buffers.owned_range(p)) is not None]
            owned, starts = [p for p, _ in self.pieces], [a for _, (a, _) in self.pieces]
            targets = [p if is_fp8_param(p) else p.detach().view(-1)[a:b] for p, (a, b) in self.pieces]
            self._grads = [p.main_grad.view(-1)[a:b] for p, (a, b) in self.pieces]
            self.main_params = (
                [_initial_piece(p, t, a, b) for (p, (a, b)), t in zip(self.pieces, targets)] if self.mixed else targets
            )
        self._counted = [g for p, g in zip(owned, self._grads) if counts_in_grad_norm(p)]
        self._plain = [(p, m) for p, m in zip(targets, self.main_params) if not is_fp8_param(p)]
        # Every FP8 weight, owned here or not (the cast's amax reduction spans all of them), with this rank's main
        # piece and where it starts.
        piece_of = {id(p): (m, a) for p, m, a in zip(owned, self.main_params, starts) if is_fp8_param(p)}
        self._fp8 = [(p, *piece_of.get(id(p), (None, 0))) for p in self.params if is_fp8_param(p)]
        self._fp8_group = fp8_group
        decay_of = {id(p): not _no_weight_decay(name, p) for name, p in model.named_parameters()}
        decay = [m for p, m in zip(owned, self.main_params) if decay_of[id(p)]]
        no_decay = [m for p, m in zip(owned, self.main_params) if not decay_of[id(p)]]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        # A rank whose shards hold only padding has nothing to step on; torch's optimizers refuse an empty list.
        self.optimizer = torch.optim.AdamW(
            groups or [{"params": [torch.zeros(0, device=self.params[0].device)]}],
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            fused=fused or None,
        )

    def grads(self) -> list[torch.Tensor]:
        """The fp32 gradients the step uses (this rank's pieces with the distributed optimizer)."""
        return self._grads

    def norm_grads(self) -> list[torch.Tensor]:
        """The gradients this rank contributes to the global norm (see `megatron.parallel.grad_norm`)."""
        return self._counted

    def step(self, lr: float, grad_norm_fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip and take one AdamW step at `lr`; returns (grad norm, stepped) as 0-dim tensors on the gradients'
        device. `grad_norm_fn()` gives the global gradient norm (it knows the parallel layout). A non-finite norm
        skips the step. The caller zeroes the gradient buffers afterwards.

        With the fused AdamW (GPUs) nothing here waits for the GPU: the kernel divides the gradients by the device
        tensor max(1, norm / clip) and skips the update when told the norm is not finite (`grad_scale` and
        `found_inf`, the hooks torch's GradScaler uses). Reading the norm on the host instead would stall the
        launch queue behind the whole backward pass and leave the GPU idle while the update is being launched."""
        grads = self.grads()
        norm = grad_norm_fn()
        finite = torch.isfinite(norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for main, grad in zip(self.main_params, grads):
            main.grad = grad
        if self.optimizer.defaults["fused"]:
            if self.cfg.clip_grad > 0:
                self.optimizer.grad_scale = ((norm.float() + 1e-6) / self.cfg.clip_grad).clamp(min=1.0)
            self.optimizer.found_inf = (~finite).float()
            self.optimizer.step()
        elif finite:  # the unfused AdamW takes no found_inf: decide on the host (CPU runs have no queue to stall)
            if self.cfg.clip_grad > 0 and norm > self.cfg.clip_grad:
                torch._foreach_mul_(grads, self.cfg.clip_grad / (float(norm) + 1e-6))
            self.optimizer.step()
        for main in self.main_params:
            main.grad = None
        self._copy_main_to_model()
        return norm, finite

    def _copy_main_to_model(self) -> None:
        """Model parameters <- fp32 main parameters: one batched copy (cast) for bf16 ones; FP8 ones quantize the
        main value straight into their FP8 data (and, on Hopper, its transpose) with their recipe's scale. Sharded,
        every rank then gathers the others' updated pieces."""
        if self.mixed:
            with torch.no_grad():
                if self._plain:
                    torch._foreach_copy_([p for p, _ in self._plain], [m for _, m in self._plain])
                self._cast_fp8_params()
        if self.buffers is not None:
            self.buffers.gather_params()

    def _cast_fp8_params(self) -> None:
        if self._fp8:
            params, mains, starts = zip(*self._fp8)
            with torch.no_grad():
                quantize_masters(list(params), list(mains), list(starts), self._fp8_group)

    def recast_fp8_params(self) -> None:
        """Cast the main copies into the FP8 weights again (and gather them): after delayed scaling's calibration
        replaced the weight scales they were first cast with (Transformer Engine's: scale 1)."""
        if self._fp8:
            self._cast_fp8_params()
            if self.buffers is not None:
                self.buffers.gather_params()

    def shard_layout(self) -> list[tuple[int, int, int]] | None:
        """(parameter index, start, stop) of each piece this rank steps on; None when not sharded. A checkpoint's
        optimizer state fits only the same layout (same data-parallel size and buckets)."""
        if self.buffers is None:
            return None
        index = {id(p): i for i, p in enumerate(self.params)}
        return [(index[id(p)], a, b) for p, (a, b) in self.pieces]

    def state_dict(self) -> dict[str, Any]:
        state = {"optimizer": self.optimizer.state_dict(), "shard_layout": self.shard_layout()}
        if self.mixed:
            state["main_params"] = [m.clone() for m in self.main_params]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("shard_layout") != self.shard_layout():
            raise ValueError(
                "the checkpoint's optimizer state is sharded differently (saved with another data-parallel size,"
                " --ddp-bucket-size or --use-distributed-optimizer setting)"
            )
        self.optimizer.load_state_dict(state["optimizer"])
        if self.mixed:
            if "main_params" not in state:
                raise ValueError("the checkpoint's optimizer has no fp32 main parameters (saved without --bf16?)")
            with torch.no_grad():
                for main, saved in zip(self.main_params, state["main_params"]):
                    main.copy_(saved)
            self._copy_main_to_model()

    def reload_model_params(self) -> None:
        """Refresh the fp32 main copies from the model (after loading model weights without optimizer state)."""
        if self.mixed:
            with torch.no_grad():
                for param, main in self._plain:
                    main.copy_(param)
                for param, main, start in self._fp8:
                    if main is not None:
                        main.view(-1).copy_(param.dequantize().float().view(-1)[start : start + main.numel()])
