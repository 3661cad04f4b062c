"""Transformer Engine's side of FP8: which TE recipe our precision flags mean, and the startup checks on the GPU that
turn TE's late failures (an assert inside the first GEMM, a CUDA error) into one-line configuration errors. The rules
that need no GPU (does TE import, has the recipe a TE counterpart, do the GEMM shapes fit) are checked when the flags
are validated: megatron/config/te_rules.py.

The same flags drive the local FP8 engine and TE; this is the one place that maps them to a TE recipe
(`transformer_engine.common.recipe`):

    --fp8-recipe   TE recipe                                         scales
    delayed        DelayedScaling(fp8_format, margin,                fp8_max / max(amax history) / 2^margin,
                     amax_history_len, amax_compute_algo)            one per tensor, from earlier steps
    tensorwise     Float8CurrentScaling(fp8_format)                  fp8_max / amax, one per tensor, this step
    blockwise      Float8BlockScaling(fp8_format)                    1x128 tiles (x, dY), 128x128 blocks (W)
    mxfp8          MXFP8BlockScaling(fp8_format)                     32-element blocks, E8M0 (compute capability 10.0)
    rowwise        none: refused, `--transformer-impl local` implements it

`--fp8-format e4m3` is `Format.E4M3` everywhere, `hybrid` is `Format.HYBRID` (E4M3 forward, E5M2 gradients).
`--no-fp8-wgrad` maps to `override_linear_precision=(fprop=False, dgrad=False, wgrad=True)` where the installed TE
still has that argument; TE 2.x removed it, and there the flag is refused with the alternative (`--transformer-impl
local` keeps the weight-gradient GEMM in high precision).

Nothing here imports transformer_engine at module level: CPU machines never load it.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from megatron.config.base import ConfigError, require
from megatron.config.precision import PrecisionConfig
from megatron.config.te_rules import TE_RECIPES, check_te_recipe_name

MIN_COMPUTE_CAPABILITY = {"delayed": (8, 9), "tensorwise": (8, 9), "blockwise": (9, 0), "mxfp8": (10, 0)}
"""Oldest GPU architecture whose tensor cores run each recipe's GEMMs: FP8 needs Ada/Hopper (8.9/9.0), TE's
blockwise GEMMs Hopper, MXFP8 (hardware block scales) Blackwell (10.0)."""

BLOCKWISE_MIN_CUDA = (12, 9)
"""TE runs Float8BlockScaling GEMMs through cuBLASLt's block-scaled FP8 kernels, which need CUDA 12.9."""

_ALTERNATIVE = {
    "delayed": "use --transformer-impl local (emulates FP8 on any GPU) or drop --fp8-format",
    "tensorwise": "use --transformer-impl local (emulates FP8 on any GPU) or drop --fp8-format",
    "blockwise": "use --fp8-recipe tensorwise, or --transformer-impl local (emulates blockwise)",
    "mxfp8": "use --fp8-recipe blockwise (Hopper's block-scaled recipe), or --transformer-impl local (emulates mxfp8)",
}


def te_version() -> str:
    import transformer_engine

    return getattr(transformer_engine, "__version__", "unknown")


def te_recipe(precision: PrecisionConfig, recipe_module: Any = None) -> Any:
    """The TE recipe object for the FP8 flags. `recipe_module` defaults to `transformer_engine.common.recipe`
    (tests pass a stand-in). Raises ConfigError for settings TE cannot express."""
    require(precision.fp8, "FP8 is off: pass --fp8-format e4m3|hybrid")
    check_te_recipe_name(precision)
    if recipe_module is None:
        from transformer_engine.common import recipe as recipe_module
    cls = getattr(recipe_module, TE_RECIPES[precision.fp8_recipe])
    fmt = recipe_module.Format.E4M3 if precision.fp8_format == "e4m3" else recipe_module.Format.HYBRID
    kwargs: dict[str, Any] = {"fp8_format": fmt}
    if precision.fp8_recipe == "delayed":
        kwargs.update(
            margin=precision.fp8_margin,
            amax_history_len=precision.fp8_amax_history_len,
            amax_compute_algo=precision.fp8_amax_compute_algo,
        )
    if not precision.fp8_wgrad:
        kwargs["override_linear_precision"] = _wgrad_in_high_precision(cls, recipe_module)
    if precision.fp8_dot_product_attention:
        kwargs["fp8_dpa"] = True
    recipe = cls(**kwargs)
    if precision.fp8_recipe == "blockwise" and precision.fp8_blockwise_fp32_scales:
        # TE reads the scale kind from three QParams set when the class is defined (from an environment variable),
        # not from constructor arguments; setting them on the instance is the per-run equivalent.
        for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
            setattr(recipe, name, recipe_module.QParams(power_2_scale=False, amax_epsilon=0.0))
    return recipe


def _wgrad_in_high_precision(cls: type, recipe_module: Any) -> Any:
    """override_linear_precision with only wgrad in high precision, or ConfigError where TE lacks the argument."""
    if "override_linear_precision" not in inspect.signature(cls).parameters:
        raise ConfigError(
            f"--no-fp8-wgrad: this Transformer Engine's {cls.__name__} has no override_linear_precision (removed in"
            " TE 2.x); drop --no-fp8-wgrad or use --transformer-impl local"
        )
    override = getattr(recipe_module, "_OverrideLinearPrecision", None)
    return override(fprop=False, dgrad=False, wgrad=True) if override is not None else (False, False, True)


def check_recipe_on_gpu(
    recipe: str, capability: tuple[int, int], gpu_name: str, cuda_version: str | None = None
) -> None:
    """Raise ConfigError naming the GPU, the recipe and the alternative when this GPU cannot run the recipe."""
    need = MIN_COMPUTE_CAPABILITY[recipe]
    require(
        tuple(capability) >= need,
        f"--fp8-recipe {recipe} with Transformer Engine needs compute capability {need[0]}.{need[1]}; this GPU"
        f" ({gpu_name}) is {capability[0]}.{capability[1]}: {_ALTERNATIVE[recipe]}",
    )
    if recipe == "blockwise" and cuda_version:
        version = tuple(int(p) for p in cuda_version.split(".")[:2])
        require(
            version >= BLOCKWISE_MIN_CUDA,
            f"--fp8-recipe blockwise with Transformer Engine needs CUDA >= 12.9, this build of torch has"
            f" {cuda_version} ({gpu_name}): {_ALTERNATIVE['blockwise']}",
        )


def check_fp8_attention_on_gpu(head_dim: int, capability: tuple[int, int], gpu_name: str) -> None:
    """cuDNN's FP8 fused attention, TE's only FP8 attention for training on Hopper, takes heads of 128 there (TE
    2.20, cuDNN 9.14); without this check the first forward fails with "no dot product attention backend"."""
    require(
        tuple(capability) >= (10, 0) or head_dim == 128,
        f"--fp8-dot-product-attention on {gpu_name} (compute capability {capability[0]}.{capability[1]}) needs a head"
        f" size of 128 (cuDNN's FP8 attention on Hopper); the head size (--kv-channels) is {head_dim}: drop the flag",
    )


def check_te_fp8_on_this_gpu(precision: PrecisionConfig, device: torch.device | None = None) -> None:
    """The startup check on the real device: our capability table first (clear message), then TE's own
    availability test as a backstop (for reasons such as a driver too old for FP8)."""
    if not precision.fp8:
        return
    recipe = precision.fp8_recipe
    capability = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    check_recipe_on_gpu(recipe, capability, name, torch.version.cuda)
    import transformer_engine.pytorch as te

    probe = {
        "delayed": te.is_fp8_available,
        "tensorwise": te.is_fp8_available,
        "blockwise": te.is_fp8_block_scaling_available,
        "mxfp8": te.is_mxfp8_available,
    }[recipe]
    available, reason = probe(return_reason=True)
    require(available, f"--fp8-recipe {recipe} on {name}: Transformer Engine says {reason!r}; {_ALTERNATIVE[recipe]}")


def describe_te_recipe(recipe: Any, fp8_layers: set[int], num_layers: int, reason: str) -> str:
    """One startup log line: the TE recipe and the layers it covers (`reason`: why the others are not)."""
    kept = num_layers - len(fp8_layers)
    return (
        f"Transformer Engine FP8 recipe {type(recipe).__name__} ({recipe!r}) in {len(fp8_layers)} of {num_layers}"
        f" transformer layers" + (f"; {kept} kept in high precision ({reason})" if kept else "")
    )
