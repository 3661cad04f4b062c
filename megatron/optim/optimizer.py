"""AdamW with Megatron-LM's mixed precision, global-norm clipping and non-finite step skipping.

Gradients come from the model's gradient engine (`megatron.parallel.engines.GradientEngine`: `param.main_grad`, or
where the engine says; build it first). With fp32 parameters (CPU default) the optimizer updates the model's
parameters directly. With bf16 parameters (`--bf16`) it keeps an fp32 *main* copy of every parameter, steps on that,
and casts it back into the bf16 parameter once per step (not once per micro-batch).

With sharded buffers (`--use-distributed-optimizer`) the same holds for the flattened *pieces* of the parameters
that lie in this data-parallel rank's shard of each bucket: main copies, Adam moments, the update and the
gradient-norm contribution cover those pieces only, and the buffers all-gather the updated parameters. The pieces'
gradients are where the buffers say (`grad_piece`): views of `main_grad`, or under --use-megatron-fsdp's optim_grads
(megatron/parallel/fsdp/flat_shards.py) of the persistent gradient shards, as no whole gradient buffer outlives a
bucket.

FP8 weights (--fp8-param-gather) are written from their fp32 main copies (or pieces) by casting straight into their
FP8 bytes (`megatron.fp8.params.quantize_masters`), so with the distributed optimizer the all-gather moves FP8.

Under FSDP (megatron/parallel/fsdp/fsdp2.py) the pieces are each rank's whole local shards: fp32 ones are the main
weights themselves; bf16 ones (--use-precision-aware-optimizer) get main copies like the distributed optimizer's, and
those of FP8-gathered weights are freed during the forward and backward and given back here, before the step writes
them (megatron/parallel/fsdp/fp8_gather_scales.py).

With --use-precision-aware-optimizer the main copies and Adam's moments are held in lower precisions by
`megatron.optim.precision_aware.PrecisionAwareAdamW` (fp16 masters, fp8/fp16/bf16 moments), which updates one
tensor at a time in fp32; the model parameters are then written from each main copy decoded in turn. Checkpoints of
either kind load into the other, converted through fp32, and the returned note says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron.config import OptimizerConfig
from megatron.fp8.params import is_fp8_param, quantize_masters
from megatron.parallel import counts_in_grad_norm
from megatron.parallel.engines import GradientEngine
from megatron.parallel.fsdp.fp8_gather import shard_data
from megatron.parallel.fsdp.fsdp2 import flat_offset, local_shard

from .precision_aware import PrecisionAwareAdamW
from .schedule import DECOUPLED, DEFAULT, LearningRates, lr_group
from .states import ScaledState


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
        buffers: GradientEngine | None = None,
        fp8_group: dist.ProcessGroup | None = None,
    ):
        """`buffers`: the model's gradient engine; needed when it shards the optimizer's state (`sharded_state`).
        `fp8_group`: the ranks over which FP8 weights' amaxes are max-reduced when their main copies are cast
        (see `quantize_masters`; the data-parallel group for TE's weights, tensor x data parallel for local ones)."""
        self.cfg = cfg
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not all(hasattr(p, "main_grad") for p in self.params):
            raise RuntimeError("build the model's gradient engine (megatron.parallel.engines) before its optimizer")
        self.buffers = buffers if buffers is not None and buffers.sharded_state else None
        self.mixed = any(p.dtype != torch.float32 for p in self.params)
        if self.buffers is None:
            owned, starts = self.params, [0] * len(self.params)
            self._grads = [p.main_grad for p in self.params]
            self.main_params = [_initial_main_value(p) for p in self.params] if self.mixed else self.params
            targets = self.params
        else:
            # This rank's pieces: flat views of the parameters, of their gradients, and fp32 copies (bf16, FP8) or
            # the views themselves (fp32) to step on. FSDP's bf16 shards (--use-precision-aware-optimizer) are
            # pieces like the distributed optimizer's; an FP8-gathered one is written through its plain storage.
            self.pieces = [(p, r) for p in self.params if (r := self.buffers.owned_range(p)) is not None]
            owned, starts = [p for p, _ in self.pieces], [a for _, (a, _) in self.pieces]
            targets = [p if is_fp8_param(p) else local_shard(p).view(-1)[a:b] for p, (a, b) in self.pieces]
            self._grads = [self.buffers.grad_piece(p, a, b) for p, (a, b) in self.pieces]
            if self.mixed:
                targets, self._grads = [shard_data(t) for t in targets], [shard_data(g) for g in self._grads]
            self.main_params = (
                [_initial_piece(p, t, a, b) for (p, (a, b)), t in zip(self.pieces, targets)] if self.mixed else targets
            )
        self._counted = [g for p, g in zip(owned, self._grads) if counts_in_grad_norm(p)]
        self._counted_mains = [i for i, p in enumerate(owned) if counts_in_grad_norm(p)]
        # Main copies by index (the precision-aware optimizer holds them encoded): the plain parameters' targets,
        # and every FP8 weight, owned here or not (the cast's amax reduction spans all of them), with the index of
        # this rank's main piece and where it starts.
        self._plain = [(t, i) for i, t in enumerate(targets) if not is_fp8_param(t)]
        piece_of = {id(p): (i, a) for i, (p, a) in enumerate(zip(owned, starts)) if is_fp8_param(p)}
        self._fp8 = [(p, *piece_of.get(id(p), (None, 0))) for p in self.params if is_fp8_param(p)]
        self._fp8_group = fp8_group
        decay_of = {id(p): not _no_weight_decay(name, p) for name, p in model.named_parameters()}
        decays = self._decays = [decay_of[id(p)] for p in owned]
        # --decoupled-lr: the embedding and output layer step at their own rate (their own param groups)
        group_of = {
            id(p): lr_group(name) if cfg.decoupled_lr is not None else DEFAULT for name, p in model.named_parameters()
        }
        self._lr_groups = [group_of[id(p)] for p in owned]
        self._targets = targets
        # torch's AdamW numbers its parameters group by group: main copy index of each (for checkpoint conversion)
        keys = [(lr, d) for lr in (DEFAULT, DECOUPLED) for d in (True, False)]
        self._order = [i for key in keys for i, k in enumerate(zip(self._lr_groups, decays)) if k == key]
        self.precision_aware = cfg.use_precision_aware_optimizer
        if self.precision_aware:
            self.optimizer = PrecisionAwareAdamW(
                self.main_params,
                [cfg.weight_decay if d else 0.0 for d in decays],
                lr=cfg.lr,
                betas=(cfg.adam_beta1, cfg.adam_beta2),
                eps=cfg.adam_eps,
                main_params_dtype=cfg.main_params_dtype,
                exp_avg_dtype=cfg.exp_avg_dtype,
                exp_avg_sq_dtype=cfg.exp_avg_sq_dtype,
            )
            self.main_params = None  # encoded in the optimizer now: the fp32 copies go
            return
        groups = [
            {
                "params": [self.main_params[i] for i in self._order if (self._lr_groups[i], decays[i]) == (lr, d)],
                "weight_decay": cfg.weight_decay if d else 0.0,
                "lr_group": lr,
            }
            for lr, d in keys
        ]
        groups = [g for g in groups if g["params"]]
        # A rank whose shards hold only padding has nothing to step on; torch's optimizers refuse an empty list.
        self.optimizer = torch.optim.AdamW(
            groups or [{"params": [torch.zeros(0, device=self.params[0].device)]}],
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            fused=fused or None,
        )

    def _main(self, i: int) -> torch.Tensor:
        """Main copy i in fp32 (decoded by the precision-aware optimizer)."""
        return self.optimizer.master(i) if self.precision_aware else self.main_params[i]

    def grads(self) -> list[torch.Tensor]:
        """The gradients the step uses, fp32 (bf16 with --grad-reduce-in-bf16): this rank's pieces with the
        distributed optimizer."""
        return self._grads

    def norm_grads(self) -> list[torch.Tensor]:
        """The gradients this rank contributes to the global norm (see `megatron.parallel.grad_norm`)."""
        return self._counted

    def norm_params(self) -> list[torch.Tensor]:
        """The fp32 main parameters (pieces) that match `norm_grads`, for the parameter norm (--log-params-norm)."""
        return [self._main(i) for i in self._counted_mains]

    def step(
        self, lr: float | LearningRates, grad_norm_fn: Callable[[], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip and take one AdamW step at `lr`; returns (grad norm, stepped) as 0-dim tensors on the gradients'
        device. `grad_norm_fn()` gives the global gradient norm (it knows the parallel layout). A non-finite norm
        skips the step. The caller zeroes the gradient buffers afterwards.

        With the fused AdamW (GPUs) nothing here waits for the GPU: the kernel divides the gradients by the device
        tensor max(1, norm / clip) and skips the update when told the norm is not finite (`grad_scale` and
        `found_inf`, the hooks torch's GradScaler uses). Reading the norm on the host instead would stall the
        launch queue behind the whole backward pass and leave the GPU idle while the update is being launched."""
        rates = lr if isinstance(lr, LearningRates) else LearningRates(lr, lr)
        self._reclaim_shards()
        grads = self.grads()
        norm = grad_norm_fn()
        finite = torch.isfinite(norm)
        if self.precision_aware:  # decides on the device like the fused AdamW, on CPUs too
            scale = ((norm.float() + 1e-6) / self.cfg.clip_grad).clamp(min=1.0) if self.cfg.clip_grad > 0 else None
            copies, fp8_mains = self._model_copies()
            if len(self.optimizer):
                lrs = rates.default if rates.default == rates.decoupled else [rates.of(g) for g in self._lr_groups]
                self.optimizer.step(grads, lrs, scale, (~finite).float(), model_copies=copies)
            with torch.no_grad():
                self._cast_fp8_params(fp8_mains)
            if self.buffers is not None:
                self.buffers.gather_params()
            return norm, finite
        for group in self.optimizer.param_groups:
            group["lr"] = rates.of(group.get("lr_group", DEFAULT))
        # bf16 gradient buffers (--grad-reduce-in-bf16) are upcast for torch's AdamW, one step's worth at a time
        step_grads = [g if g.dtype == m.dtype else g.to(m.dtype) for m, g in zip(self.main_params, grads)]
        for main, grad in zip(self.main_params, step_grads):
            main.grad = grad
        if self.optimizer.defaults["fused"]:
            if self.cfg.clip_grad > 0:
                self.optimizer.grad_scale = ((norm.float() + 1e-6) / self.cfg.clip_grad).clamp(min=1.0)
            self.optimizer.found_inf = (~finite).float()
            self.optimizer.step()
        elif finite:  # the unfused AdamW takes no found_inf: decide on the host (CPU runs have no queue to stall)
            if self.cfg.clip_grad > 0 and norm > self.cfg.clip_grad:
                torch._foreach_mul_(step_grads, self.cfg.clip_grad / (float(norm) + 1e-6))
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
            self._reclaim_shards()
            with torch.no_grad():
                if self.precision_aware:
                    for target, i in self._plain:
                        target.copy_(self._main(i))
                elif self._plain:
                    torch._foreach_copy_([t for t, _ in self._plain], [self.main_params[i] for _, i in self._plain])
                self._cast_fp8_params()
        if self.buffers is not None:
            self.buffers.gather_params()

    def restore_freed_shards(self) -> None:
        """After a training pass no step follows (delayed scaling's calibration): FSDP weight shards freed once cast
        for the FP8 all-gathers (parallel/fsdp/fp8_gather_scales.py) are written again from the main weights they were
        made from."""
        if self.buffers is not None and self.buffers.shards_released():
            self._copy_main_to_model()

    def _reclaim_shards(self) -> None:
        """Under FSDP the weight shards its FP8 all-gathers were cast from may be freed since the training forward
        (parallel/fsdp/fp8_gather_scales.py: not being the main weights, they are written from them, in every
        element, skipped step or not: `PrecisionAwareAdamW.step`); their storage comes back before any write."""
        if self.buffers is not None:
            self.buffers.reclaim_shards()

    def _model_copies(self) -> tuple[list[torch.Tensor | None] | None, list[torch.Tensor | None]]:
        """Where the precision-aware step writes each main copy's new value (by main index): a plain parameter's
        own bf16 storage, an fp32 tensor for an FP8 weight's piece (the fp32 masters the cast takes, returned in
        `_fp8`'s order). None when the masters are the parameters themselves (an fp32 model)."""
        if not self.mixed:
            return None, []
        copies: list[torch.Tensor | None] = [None] * len(self._targets)
        for target, i in self._plain:
            copies[i] = target
        fp8_mains = [None if i is None else torch.empty(self._main_numel(i), device=p.device) for p, i, _ in self._fp8]
        for (_, i, _), main in zip(self._fp8, fp8_mains):
            if i is not None:
                copies[i] = main
        return copies, fp8_mains

    def _cast_fp8_params(self, mains: list[torch.Tensor | None] | None = None) -> None:
        """Quantize the main copies (`mains`, in `_fp8`'s order; None: decoded from the optimizer) into the FP8
        weights."""
        if self._fp8:
            params, indices, starts = zip(*self._fp8)
            if mains is None:
                mains = [None if i is None else self._main(i) for i in indices]
            with torch.no_grad():
                quantize_masters(list(params), mains, list(starts), self._fp8_group)

    def fp8_cast_pieces(self) -> list[tuple[torch.Tensor, Callable[[], tuple[torch.Tensor, int]]]]:
        """Each FP8 weight with (a getter of) the main piece this rank casts into it, flat (empty where it owns
        none), and 0 (one scale per tensor: where the piece starts does not matter): between two steps, the values
        the FP8 weight was cast from, whose cast the FP8 monitor counts."""
        empty = torch.empty(0, device=self.params[0].device) if self.params else None
        return [(p, (lambda: (empty, 0)) if i is None else lambda i=i: (self._main(i), 0)) for p, i, _ in self._fp8]

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
        if self.precision_aware:
            return {"precision_aware": self.optimizer.state_dict(), "shard_layout": self.shard_layout()}
        state = {"optimizer": self.optimizer.state_dict(), "shard_layout": self.shard_layout()}
        if self.mixed:
            state["main_params"] = [m.clone() for m in self.main_params]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> str | None:
        """Load a checkpoint's optimizer state; one saved with other state dtypes (precision-aware or not) is
        converted through fp32, and the returned note names what was converted (None: loaded as saved)."""
        if state.get("shard_layout") != self.shard_layout():
            raise ValueError(
                "the checkpoint's optimizer state is sharded differently (saved with another data-parallel size,"
                " --ddp-bucket-size or --use-distributed-optimizer setting)"
            )
        if self.mixed and "precision_aware" not in state and "main_params" not in state:
            raise ValueError("the checkpoint's optimizer has no fp32 main parameters (saved without --bf16?)")
        note = None
        if self.precision_aware and "precision_aware" in state:
            note = self.optimizer.load_state_dict(state["precision_aware"])
        elif self.precision_aware:
            note = self.optimizer.load_fp32_state_dict(self._fp32_form(state))
            note = note or "optimizer states converted: fp32 (torch AdamW) -> the precision-aware optimizer's"
        elif "precision_aware" in state:
            note = self._load_fp32_form(state["precision_aware"])
        else:
            self.optimizer.load_state_dict(state["optimizer"])
            if self.mixed:
                with torch.no_grad():
                    for main, saved in zip(self.main_params, state["main_params"]):
                        main.copy_(saved)
        if self.mixed:
            self._copy_main_to_model()
        return note

    def _fp32_form(self, state: dict[str, Any]) -> dict[str, Any]:
        """A torch AdamW checkpoint as the precision-aware optimizer's plain fp32 form (by main copy index)."""
        saved = state["optimizer"]["state"]
        masters = state["main_params"] if self.mixed else [t.detach().float() for t in self._targets]
        moments = {
            key: [torch.zeros_like(m, dtype=torch.float32) for m in masters] for key in ("exp_avg", "exp_avg_sq")
        }
        step = 0
        for k, i in enumerate(self._order):
            if k in saved:
                step = int(saved[k]["step"])
                for key, values in moments.items():
                    values[i] = saved[k][key]
        return {"step": step, "masters": masters, **moments}

    def _load_fp32_form(self, saved: dict[str, Any]) -> str | None:
        """A precision-aware checkpoint into torch's AdamW: decoded through a temporary fp32 precision-aware
        optimizer (the conversion's note comes from it)."""
        decays = [self.cfg.weight_decay if d else 0.0 for d in self._decays]
        scratch = PrecisionAwareAdamW([self._main(i).detach().clone() for i in range(len(decays))], decays, lr=0.0)
        note = scratch.load_state_dict(saved)
        self.load_fp32_state(scratch.fp32_state_dict(), copy_to_model=False)
        return note or "optimizer states converted: the precision-aware optimizer's -> fp32 (torch AdamW)"

    def encoded_states(self) -> dict[str, list[ScaledState]] | None:
        """The precision-aware optimizer's states as it holds them, by kind ("main", "exp_avg", "exp_avg_sq") and
        main index (None for torch's AdamW): a torch_dist checkpoint saves and loads these in place, bit for bit;
        call `encoded_states_loaded` after writing them."""
        if not self.precision_aware:
            return None
        held = self.optimizer
        return {"main": held.masters, "exp_avg": held.exp_avg, "exp_avg_sq": held.exp_avg_sq}

    def encoded_states_loaded(self, step: int) -> None:
        """After `encoded_states()` were written in place: set the step count and write the model's weights from
        the main params (gathered, with the distributed optimizer)."""
        self.optimizer.set_step_count(step)
        if self.mixed:
            self._copy_main_to_model()

    def owned(self) -> list[tuple[nn.Parameter, int, int]]:
        """(parameter, start, stop) for each main copy, by main index: the range of the parameter's flattened
        elements it covers (all of them unless --use-distributed-optimizer or FSDP cuts the parameter)."""
        if self.buffers is None:
            return [(p, 0, p.numel()) for p in self.params]
        return [(p, a + flat_offset(p), b + flat_offset(p)) for p, (a, b) in self.pieces]  # FSDP: local -> whole

    def fp32_state(self) -> dict[str, Any]:
        """{"step": int, "masters", "exp_avg", "exp_avg_sq": [fp32 tensor by main index]}, whatever the optimizer
        holds them in (the precision-aware optimizer's are decoded); with fp32 parameters "masters" holds the
        parameters (pieces) themselves. Layout-independent checkpoints store this form."""
        if self.precision_aware:
            return self.optimizer.fp32_state_dict()
        masters = [m.detach() for m in (self.main_params if self.mixed else self._targets)]
        state: dict[str, Any] = {"step": 0, "masters": masters, "exp_avg": [], "exp_avg_sq": []}
        for main in self.main_params:
            saved = self.optimizer.state.get(main)
            if saved:
                state["step"] = int(saved["step"])
            for key in ("exp_avg", "exp_avg_sq"):
                state[key].append(saved[key] if saved else torch.zeros_like(main, dtype=torch.float32))
        return state

    def load_fp32_state(self, state: dict[str, Any], copy_to_model: bool = True) -> str | None:
        """Load the form of `fp32_state` (a master given as None is left as it is: with fp32 parameters, the
        parameter itself); the precision-aware optimizer encodes it and returns a note naming the conversion."""
        note = None
        if self.precision_aware:
            note = self.optimizer.load_fp32_state_dict(state)
        else:
            torch_state = self.optimizer.state_dict()
            torch_state["state"] = {
                k: {
                    "step": torch.tensor(float(state["step"])),
                    "exp_avg": state["exp_avg"][i],
                    "exp_avg_sq": state["exp_avg_sq"][i],
                }
                for k, i in enumerate(self._order)
            }
            self.optimizer.load_state_dict(torch_state)
        if not self.precision_aware:
            with torch.no_grad():
                for i, master in enumerate(state["masters"]):
                    if master is not None:
                        self._set_main(i, master)
        if self.mixed and copy_to_model:
            self._copy_main_to_model()
        return note

    def reload_model_params(self) -> None:
        """Refresh the fp32 main copies from the model (after loading model weights without optimizer state)."""
        if self.mixed:
            with torch.no_grad():
                for target, i in self._plain:
                    self._set_main(i, target.detach().float())
                for param, i, start in self._fp8:
                    if i is not None:
                        self._set_main(i, param.dequantize().float().view(-1)[start : start + self._main_numel(i)])

    def _main_numel(self, i: int) -> int:
        return self.optimizer.masters[i].numel if self.precision_aware else self.main_params[i].numel()

    def _set_main(self, i: int, value: torch.Tensor) -> None:
        if self.precision_aware:
            self.optimizer.set_master_(i, value.reshape(self.optimizer.masters[i].shape))
        else:
            self.main_params[i].copy_(value.view_as(self.main_params[i]))
