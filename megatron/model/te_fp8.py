"""The FP8 regions of the Transformer Engine layers (`TEFp8Autocast`, built by `build_te_fp8`) and TE's activation
checkpoint (`te_checkpoint`), which has to respect their nesting.

Delayed scaling reduces and updates the amax histories when an autocast region ends, and in backward after the
micro-batch's first FP8 module; the pieces here keep that to once per pass: one autocast around the whole stack
with the layers' own nested in it (`_keeping_the_mark`), the backward update moved to the stage input's gradient
under recomputation (`TEFp8Autocast.update_backward_amaxes_at`), and the recomputation run one nesting level deep
(`_te_checkpoint_contexts`).

transformer_engine is imported inside functions only: importing this module on a CPU machine is harmless.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron.config import ModelConfig, PrecisionConfig
from megatron.config.base import require
from megatron.config.te_rules import check_te_recipe_name, require_te
from megatron.fp8.te_recipe import check_fp8_attention_on_gpu, check_te_fp8_on_this_gpu, te_recipe


class TEFp8Autocast:
    """FP8 regions for the TE layers: one TE recipe and one amax-reduction group for the whole stack.

    GPTModel enters `stack()` around all transformer layers, and each layer enters `layer(n)`, enabled or not
    (--first-last-layers-bf16). The nesting keeps delayed scaling right: TE reduces (MAX over the group) and
    updates the amax histories of *every* module it has seen when the outermost autocast exits (and, in backward,
    after the first FP8 module of that region), so one reduction per micro-batch covers all FP8 layers. Separate
    top-level autocasts per layer, Megatron-LM's scheme and the reason it rejects this flag with delayed scaling,
    would run that reduction at every layer's exit: L collectives per pass, each rolling all histories once more.
    """

    def __init__(
        self,
        recipe: Any,
        amax_group: dist.ProcessGroup | None,
        fp8_layers: set[int],
        fp8_params: bool = False,
        kept_reason: str = "",
    ):
        self.recipe, self.amax_group, self.fp8_layers = recipe, amax_group, fp8_layers
        self.kept_reason = kept_reason
        """Why the layers not in `fp8_layers` are kept out of FP8 (for the startup log)."""
        self.fp8_params = fp8_params
        """--fp8-param-gather: the FP8 layers' weights are built as TE quantized tensors (see `param_init`)."""
        self.calibrating = False
        """Delayed scaling's calibration pass (megatron/fp8/calibration.py): TE runs the FP8 layers in high precision
        and sets up their FP8 state (`calibrating=True`) without casting anything."""

    def param_init(self, layer_number: int) -> Any:
        """The context a layer is built in: with --fp8-param-gather and the layer in FP8, TE creates its linear
        weights as FP8 tensors of this recipe (`quantized_model_init`); each keeps its high-precision initial value
        on the CPU until the optimizer has taken it as its fp32 main parameter (`get_high_precision_init_val`)."""
        import transformer_engine.pytorch as te

        enabled = self.fp8_params and layer_number in self.fp8_layers
        return te.quantized_model_init(enabled=enabled, recipe=self.recipe, preserve_high_precision_init_val=enabled)

    def stack(self) -> Any:
        return self._autocast(True)

    def layer(self, layer_number: int) -> Any:
        """`fp8_layers` is live: the FP8 guard (megatron/fp8/guard.py) removes layers it moves to bf16."""
        return _keeping_the_mark(self._autocast(layer_number in self.fp8_layers))

    def update_backward_amaxes_at(self, x: torch.Tensor) -> None:
        """Inside `stack()`, before the stage's layers run on `x` (their input), with recomputation: take TE's
        first-module mark from every module and reduce and update the backward amaxes once `x`'s gradient is formed,
        after the last FP8 backward of the stage, which is where the first FP8 module's backward does it without
        recomputation. A reentrant checkpoint runs its first forward without autograd, so a checkpointed module
        cannot keep the mark for backward; TE queues the mark at each region's entry in forward order but hands the
        queue out to the recomputations in reverse order, and while recomputing leaves it set for every module of
        the region: the update would run early, several times per backward, and (with some layers recomputed and
        some not) out of step with the modules' amaxes."""
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        state = FP8GlobalStateManager.quantization_state
        if not (state.is_first_fp8_module and FP8GlobalStateManager.is_fp8_enabled() and x.requires_grad):
            return
        state.is_first_fp8_module = False
        x.register_hook(_reduce_and_update_backward_amaxes)

    def _autocast(self, fp8: bool) -> Any:
        import transformer_engine.pytorch as te

        calibrating = fp8 and self.calibrating
        return te.autocast(
            enabled=fp8 and not calibrating,
            calibrating=calibrating,
            recipe=self.recipe,
            amax_reduction_group=self.amax_group,
        )


def build_te_fp8(
    cfg: ModelConfig, precision: PrecisionConfig | None, amax_group: dist.ProcessGroup | None
) -> TEFp8Autocast | None:
    """Check that TE and this GPU can run the configuration (ConfigError naming the flag otherwise), then build the
    FP8 autocast of the TE layers; None with FP8 off."""
    require_te()
    no_gpu = "--transformer-impl transformer_engine needs a CUDA GPU; use --transformer-impl local"
    require(torch.cuda.is_available(), no_gpu)
    if precision is None or not precision.fp8:
        return None
    check_te_recipe_name(precision)  # (shapes against TE's GEMM rules are checked when the flags are parsed)
    check_te_fp8_on_this_gpu(precision)
    if precision.fp8_dot_product_attention:
        check_fp8_attention_on_gpu(cfg.kv_channels, torch.cuda.get_device_capability(), torch.cuda.get_device_name())
    fp8_layers = set(precision.fp8_layer_numbers(cfg.num_layers))
    require(bool(fp8_layers), "FP8 is on but no transformer layer is left in FP8; lower --num-layers-at-*-in-bf16")
    recipe = te_recipe(precision)
    if amax_group is None and hasattr(recipe, "reduce_amax"):
        # Nothing to reduce with. TE would otherwise all-reduce the amaxes over the *world* group whenever
        # torch.distributed is up: across pipeline stages, whose layers and timing differ, that hangs.
        recipe.reduce_amax = False
    return TEFp8Autocast(recipe, amax_group, fp8_layers, precision.fp8_param_gather, precision.fp8_kept_layers_reason())


def te_checkpoint(function: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """function(*args) under TE's reentrant activation checkpoint (see megatron/model/recompute.py)."""
    from transformer_engine.pytorch.distributed import checkpoint

    return checkpoint(
        function, *args, distribute_saved_activations=False, use_reentrant=True, context_fn=_te_checkpoint_contexts
    )


def _reduce_and_update_backward_amaxes(grad: torch.Tensor) -> None:
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)


def _te_checkpoint_contexts() -> tuple[Any, Any]:
    """TE checkpoint's (forward, recompute) contexts: nothing around the first forward; one more level of FP8
    autocast nesting around the recomputation. TE's checkpoint runs the recomputation inside an autocast of its own,
    whose exit at the outermost level would reduce and update every module's forward amax history once more (in
    backward, with no new amaxes: an extra roll of the histories per checkpoint). Nested, it leaves that update to
    the model's own autocast, which runs it once per forward as without recomputation. (The backward update:
    `TEFp8Autocast.update_backward_amaxes_at`.)"""
    return contextlib.nullcontext(), _nested_te_autocast()


@contextlib.contextmanager
def _keeping_the_mark(autocast: Any) -> Iterator[None]:
    """A layer's FP8 autocast, nested in the stack's, that leaves TE's first-module mark as its body left it.

    Delayed scaling reduces and updates the backward amaxes at the end of the backward of the micro-batch's first
    FP8 module, which takes the mark (`is_first_fp8_module`) in forward. TE's autocast restores the whole FP8
    state on exit, mark included: after each layer the mark would be set again, the next layer's first FP8 module
    would take it too, and the backward would reduce (a collective over the amax group) and roll every backward
    amax history once per FP8 layer instead of once, where a graphed layer (which takes the mark whether in FP8 or
    not) or a recomputation updates once."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    state = FP8GlobalStateManager.quantization_state
    with autocast:
        yield
        mark = state.is_first_fp8_module
    state.is_first_fp8_module = mark


@contextlib.contextmanager
def _nested_te_autocast() -> Iterator[None]:
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    state = FP8GlobalStateManager.quantization_state
    state.autocast_depth += 1
    try:
        yield
    finally:
        state.autocast_depth -= 1
