"""Observe Transformer Engine's FP8 linears for the monitor and for delayed scaling's calibration.

TE casts inside its fused kernels and keeps no saturation or underflow counts, so `TETaps` hooks each TE linear of
the FP8 layers and counts what casting the very tensors TE casts does (`stats.scaled_counts`, with the scale rules
of quantize.py, which implements every recipe bit for bit) and, under delayed scaling, with TE's own scales
(`fp8_meta[...].scale`, read when the tensor is cast):

    input x    forward pre-hook; what the module's GEMM casts, which the layer says (`fp8_gemm_input`): for
               te.LayerNormLinear the normalized input (the norm is fused into its GEMM, so the layer recomputes
               RMSNorm/LayerNorm with the module's own weight and epsilon, in fp32)
    weight W   the same hook (TE casts it once per step and reuses the cast for later micro-batches); an FP8
               weight (--fp8-param-gather: FSDP's gathered one, or the distributed optimizer's) is counted from
               the cast that made it, of this rank's high-precision piece with the weight's scale, as the local
               linears count theirs (read back, it would show neither saturation nor underflow); the monitor's
               sums over the data-parallel ranks then cover the weight once (`count_weight_casts`)
    grad dY    a hook on the module's output tensor, registered in the forward hook

While attached, the MLPs' fused SwiGLU stops writing FP8 (te_mlp.TEMLP.fp8_swiglu), so that TE casts the bf16
activation and gradient itself and the hooks see them: on watched steps the MLP runs TE's unfused path, which
rounds the same values once more in bf16 (a difference of one e5m2 step in ~1.5% of the gradient's elements).
Hooks exist only while attached; CUDA graphs would bypass them (the configuration refuses the combination).
The taps know the model only by what its TE layers offer (megatron.model sits above this package): `layer_number`,
`te_modules()`, `fp8_gemm_input(module, x)` and `mlp.fp8_swiglu` (megatron/model/te_layers.py). Nothing here
imports transformer_engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .formats import Role
from .recipes import Recipe
from .stats import Fp8StatsCollector, global_name

TE_META_KEY = {Role.INPUT: ("scaling_fwd", 0), Role.WEIGHT: ("scaling_fwd", 1), Role.GRAD: ("scaling_bwd", 0)}
"""Where TE keeps each role's delayed-scaling state: fp8_meta[key].scale[index] (TE's GEMM1_INPUT, GEMM1_WEIGHT
and GRAD_OUTPUT1)."""


class TETaps:
    """The TE linears of a model's FP8 transformer layers (this pipeline stage's), in a fixed order."""

    def __init__(self, model: nn.Module, recipe: Recipe, fp8_layers: set[int]):
        """`fp8_layers`: the live set of layers in FP8 (`TEFp8Autocast.fp8_layers`); `move_to_bf16` edits it."""
        self.recipe, self.fp8_layers = recipe, fp8_layers
        self.modules: list[nn.Module] = []
        self.names: list[str] = []
        self.layer_numbers: list[int] = []
        self.mlps: list[nn.Module] = []
        self.gemm_inputs: list[Callable[[nn.Module, torch.Tensor], torch.Tensor]] = []
        self.weight_pieces: dict[int, Callable[[], tuple[torch.Tensor, int]]] = {}
        """By linear (index): the high-precision piece this rank casts into its FP8 weight and the weight's row it
        starts at (`count_weight_casts`)."""
        for name, layer in model.named_modules():
            number = getattr(layer, "layer_number", None)
            if number is None or number not in fp8_layers or not hasattr(layer, "te_modules"):
                continue
            self.mlps.append(layer.mlp)
            for sub_name, module in layer.named_modules():
                if any(module is m for m in layer.te_modules()):
                    self.modules.append(module)
                    self.names.append(global_name(f"{name}.{sub_name}", number))
                    self.layer_numbers.append(number)
                    self.gemm_inputs.append(layer.fp8_gemm_input)

    @contextlib.contextmanager
    def attached(self, collector: Fp8StatsCollector, amax_only: bool = False) -> Iterator[None]:
        """Hand the FP8 tensors of the TE linears to `collector` until exit (amax_only: record every micro-batch's
        amaxes, for calibration; else the collector counts each tensor's first cast)."""
        handles = []
        for index, module in enumerate(self.modules):
            if self.layer_numbers[index] not in self.fp8_layers:
                continue  # moved to bf16 by the guard
            handles.append(module.register_forward_pre_hook(self._pre_hook(index, collector, amax_only)))
            handles.append(module.register_forward_hook(self._post_hook(index, collector, amax_only)))
        for mlp in self.mlps:
            mlp.fp8_swiglu = False
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for mlp in self.mlps:
                mlp.fp8_swiglu = True

    def move_to_bf16(self, layer_number: int) -> None:
        self.fp8_layers.discard(layer_number)

    def count_weight_casts(self, pieces: dict[int, Callable[[], tuple[torch.Tensor, int]]]) -> None:
        """--fp8-param-gather: `pieces` by the id of an FP8 weight's parameter as the linear holds it between steps
        (FSDP's sharded one), (a getter of) the piece this rank casts into it and its first row: the cast counted."""
        for index, module in enumerate(self.modules):
            piece = pieces.get(id(module.weight))
            if piece is not None:
                self.weight_pieces[index] = piece

    def _record_weight(self, collector: Fp8StatsCollector, index: int, weight: torch.Tensor, amax_only: bool) -> None:
        """The weight's statistics: of the cast of this rank's piece with the FP8 weight's scale (one per tensor: TE's
        Float8Tensor `_scale_inv`), or of the weight as the linear holds it (TE casts a high-precision one itself)."""
        piece, scale_inv = self.weight_pieces.get(index), getattr(weight, "_scale_inv", None)
        if amax_only or piece is None or scale_inv is None or scale_inv.numel() != 1:
            self._record(collector, index, Role.WEIGHT, weight, amax_only)
            return
        shard, first_row = piece()
        collector.record_cast(index, Role.WEIGHT, shard, first_row, scale_inv.reciprocal(), self.recipe)

    def _record(self, collector: Fp8StatsCollector, index: int, role: Role, t: torch.Tensor, amax_only: bool) -> None:
        t = _high_precision(t).detach()
        t = t.reshape(-1, t.shape[-1])
        if amax_only:
            amax = t.abs().amax().float()
            collector.record_counts(index, role, torch.zeros(3, dtype=torch.float64), amax, torch.ones(()))
        else:
            scale = self._delayed_scale(index, role, t.device) if self.recipe.delayed else None
            collector.record(index, role, t, self.recipe, scale)

    def _delayed_scale(self, index: int, role: Role, device: torch.device) -> torch.Tensor:
        """The scale TE casts this tensor with now: 1 before TE has set up the module's FP8 state, as TE starts (the
        first watched step of a run, or of one resumed from a checkpoint without FP8 state, such as a bf16 run's)."""
        key, position = TE_META_KEY[role]
        meta = self.modules[index].fp8_meta.get(key)
        if meta is None:
            return torch.ones((), device=device)
        return meta.scale[position]

    def _pre_hook(self, index: int, collector: Fp8StatsCollector, amax_only: bool) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if not amax_only and (index, Role.INPUT) in collector.counted:
                return  # a later micro-batch: spare the norm's recomputation
            x = self.gemm_inputs[index](module, _high_precision(args[0]))
            self._record(collector, index, Role.INPUT, x, amax_only)
            # a smoothed linear_fc2 (--smooth-swiglu) casts W / s
            weight = module.smoothed_weight() if getattr(module, "smooth_input", False) else module.weight
            self._record_weight(collector, index, weight, amax_only)

        return hook

    def _post_hook(self, index: int, collector: Fp8StatsCollector, amax_only: bool) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            counted = not amax_only and (index, Role.GRAD) in collector.counted
            if isinstance(out, torch.Tensor) and out.requires_grad and not counted:
                out.register_hook(lambda grad: self._record(collector, index, Role.GRAD, grad, amax_only))

        return hook


def _high_precision(t: torch.Tensor) -> torch.Tensor:
    """A TE quantized tensor (FP8 weights under --fp8-param-gather) dequantized; anything else as it is."""
    dequantize = getattr(t, "dequantize", None)
    return dequantize() if callable(dequantize) and type(t) is not torch.Tensor else t
