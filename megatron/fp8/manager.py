"""Attach the FP8 engine to a built model, and the per-step manager the trainer drives.

    manager = attach_fp8(model, cfg, amax_group)      # None when --fp8-format is absent
    ...   forward / backward of every micro-batch  ...
    if manager.step():                                # amax reduction + delayed-scaling update
        optimizer.step()
    else:
        skipped_iterations += 1                       # an inf/NaN amax: nothing was updated

FP8 covers the four linears of each transformer layer (linear_qkv, linear_proj, linear_fc1, linear_fc2) that
`PrecisionConfig.fp8_layer_numbers` names: all but the first by default, or all but the first
--num-layers-at-start-in-bf16 and last --num-layers-at-end-in-bf16 layers under --first-last-layers-bf16.
Embeddings, the output layer, norms and softmax stay in high precision.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from megatron.config import Config, ConfigError
from megatron.config.pipeline_split import layer_ranges

from .formats import Role
from .gemm import describe_path
from .linear import Fp8LinearState
from .params import convert_to_fp8_params
from .quantize import EAGER, KERNEL_NOTES, compiled_kernels
from .recipes import Recipe
from .scaling import AmaxState

_KIND = {"delayed": "tensor", "tensorwise": "tensor", "rowwise": "row", "mxfp8": "mx"}


class Fp8Capable(Protocol):
    """A linear the FP8 engine takes over: the local layers' `Linear` and `LayerNormLinear` (megatron/model/layers.py,
    above this package, so the engine names what it needs rather than the class). Its forward runs the GEMMs through
    `fp8` when that holds an `Fp8LinearState`; `parallel_mode` ("column", "row" or None) and `tp` (its
    `TensorParallel`, whose `group` holds the other shards) say how the weight is split."""

    fp8: Fp8LinearState | None
    weight: torch.Tensor
    parallel_mode: str | None
    tp: Any


def is_fp8_capable(module: nn.Module) -> bool:
    """Whether `module` has what `Fp8Capable` names. Not an isinstance check against a runtime protocol: from Python
    3.12 that looks attributes up statically and misses an nn.Module's parameters (`weight` lives in `_parameters`)."""
    return all(hasattr(module, name) for name in Fp8Capable.__annotations__)


def attach_fp8(
    model: nn.Module,
    cfg: Config,
    amax_group: dist.ProcessGroup | None = None,
    *,
    compile_kernels: bool | None = None,
    device: torch.device | None = None,
) -> Fp8Manager | None:
    """Give each covered linear an `Fp8LinearState` (as `linear.fp8`) and return the manager; None when FP8 is off
    or the layers are Transformer Engine's.

    The amax state is allocated on `device`, by default where the weights are: call it once the model is on its
    device, or name the device of a model built on the meta device (--init-model-with-meta-device: the FP8 state is
    real from the start while FSDP gives the weights storage shard by shard later).
    compile_kernels: run the quantization passes through `quantize.compiled_kernels()` (Triton kernels for per-tensor
    scaling, torch.compile for the rest); default on CUDA. Eager PyTorch on CPU, where compiling costs more than
    it saves.
    """
    if not cfg.precision.fp8 or cfg.model.transformer_impl == "transformer_engine":
        return None  # FP8 off, or Transformer Engine's layers run their own (megatron.fp8.te_recipe)
    recipe = Recipe.from_config(cfg.precision)
    fp8_layers = set(cfg.precision.fp8_layer_numbers(cfg.model.num_layers))
    targets: list[tuple[str, Fp8Capable, int]] = []
    for name, module in model.named_modules():
        number = getattr(module, "layer_number", None)
        if number is None or number not in fp8_layers:
            continue
        for sub_name, sub in module.named_modules():
            if is_fp8_capable(sub):
                _check_shape(f"{name}.{sub_name}", sub)
                targets.append((f"{name}.{sub_name}", sub, number))
    if not targets:
        raise ConfigError("FP8 is on but no transformer layer is left in FP8; lower --num-layers-at-*-in-bf16")
    device = targets[0][1].weight.device if device is None else device
    if compile_kernels is None:
        compile_kernels = device.type == "cuda"
    kernels = compiled_kernels() if compile_kernels else EAGER
    amax = AmaxState(recipe, len(targets), device)
    states = {}
    for index, (name, linear, number) in enumerate(targets):
        tp_group = linear.tp.group if linear.parallel_mode else None
        linear.fp8 = states[name] = Fp8LinearState(name, index, recipe, amax, kernels, tp_group, number)
    # before the gradient buffers and the optimizer see the weights; under FSDP the weights stay fp32 shards and
    # their all-gather casts them (parallel/fsdp/fsdp2.py, parallel/fsdp/fp8_gather.py)
    if cfg.precision.fp8_param_gather and not cfg.sharding.fsdp2:
        convert_to_fp8_params([linear for _, linear, _ in targets])
    return Fp8Manager(recipe, states, amax, amax_group, cfg, compile_kernels, device)


def _check_shape(name: str, linear: nn.Module) -> None:
    out_features, in_features = linear.weight.shape
    if in_features % 16 or out_features % 16:
        raise ConfigError(
            f"FP8 needs linear sizes divisible by 16 (FP8 GEMM alignment); {name} is {in_features}->{out_features}:"
            " use multiples of 16 for --hidden-size, --ffn-hidden-size and --kv-channels x heads, or drop --fp8-format"
        )


class Fp8Manager:
    """The FP8 linears of a model, their shared amax state, and the once-per-step update."""

    def __init__(
        self,
        recipe: Recipe,
        states: dict[str, Fp8LinearState],
        amax: AmaxState,
        amax_group: dist.ProcessGroup | None,
        cfg: Config,
        compiled: bool,
        device: torch.device,
    ):
        self.recipe, self.states, self.amax, self.amax_group = recipe, states, amax, amax_group
        self.cfg, self.compiled, self.device = cfg, compiled, device

    def step(self) -> bool:
        """Once per optimizer step, after every micro-batch's backward: MAX-reduce this step's amaxes over the amax
        group, update delayed scaling, drop the cached weight casts; False (nothing updated) on an inf/NaN amax."""
        for state in self.states.values():
            state.drop_weight_cache()
        return self.amax.step(self.amax_group)

    def forget_weight_casts(self) -> None:
        """Requantize weights at the next forward (weights changed outside an optimizer step, or benchmarking)."""
        for state in self.states.values():
            state.drop_weight_cache()

    def state_dict(self) -> dict:
        """Delayed-scaling histories and scales (empty for the other recipes, which keep no state across steps)."""
        return {"recipe": self.recipe.name, "linears": list(self.states), **self.amax.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("linears") != list(self.states):
            raise ValueError(
                "the checkpoint's FP8 linears differ from this model's (other --num-layers, --first-last-layers-bf16"
                " or --no-fp8-first-layer-bf16 settings); resume with the checkpoint's flags"
            )
        self.amax.load_state_dict({k: v for k, v in state.items() if k in ("amax_history", "scale")})
        self.forget_weight_casts()

    def describe(self) -> list[str]:
        """Startup log lines: the recipe, the GEMM path of each of the three GEMMs here, the layers in FP8."""
        recipe, device = self.recipe, self.device
        out_dtype = self.cfg.precision.params_dtype
        lines = [recipe.describe()]
        lines += [f"FP8 {label} on {device.type}: {path}" for label, path in gemm_paths(recipe, device, out_dtype)]
        if not recipe.fp8_wgrad:
            lines.append("FP8 wgrad dY^T.x: high precision (--no-fp8-wgrad)")
        kernels = "; ".join(["torch.compile (fused)", *KERNEL_NOTES]) if self.compiled else "eager PyTorch"
        lines.append(f"FP8 quantization kernels: {kernels}")
        numbers = self.cfg.precision.fp8_layer_numbers(self.cfg.model.num_layers)
        kept = sorted(set(range(1, self.cfg.model.num_layers + 1)) - set(numbers))
        lines.append(
            f"FP8 linears: {len(self.states)} in transformer layers {layer_ranges(numbers)}"
            + (
                f"; layers {layer_ranges(kept)} kept in high precision ({self.cfg.precision.fp8_kept_layers_reason()})"
                if kept
                else ""
            )
            + "; embeddings, output layer, norms and softmax in high precision"
        )
        group = f"{dist.get_world_size(self.amax_group)} ranks" if dist.is_initialized() else "this process"
        use = "delayed-scaling update and inf/NaN check" if recipe.delayed else "inf/NaN check"
        lines.append(f"FP8 amax reduction (MAX) over {group} once per step ({use})")
        return lines


def gemm_paths(recipe: Recipe, device: torch.device, out_dtype: torch.dtype) -> list[tuple[str, str]]:
    """(GEMM, path) for the FP8 GEMMs of a linear layer under this recipe on this device (probing each once)."""
    kind = {r: _kind(recipe, r) for r in Role}
    dtype = {r: recipe.dtype(r) for r in Role}
    gemms = [("fprop x.W^T", Role.INPUT, Role.WEIGHT), ("dgrad dY.W", Role.GRAD, Role.WEIGHT)]
    if recipe.fp8_wgrad:
        gemms.append(("wgrad dY^T.x", Role.GRAD, Role.INPUT))
    # W^T has W's scaling kind: the same blocks transposed (tensor, 128x128) or W requantized along N
    return [
        (label, describe_path(device, kind[a], kind[b], dtype[a], dtype[b], out_dtype, label.startswith("fprop")))
        for label, a, b in gemms
    ]


def _kind(recipe: Recipe, role: Role) -> str:
    if recipe.name == "blockwise":
        return "block" if role is Role.WEIGHT else "tile"
    return _KIND[recipe.name]
