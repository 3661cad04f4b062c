"""Transformer Engine's linears as the TE layer builds them (`te_linear`): `te.LayerNormLinear` (the layer's input
norm fused into the GEMM) or `te.Linear`, tensor-parallel through TE's own arguments, initialized and marked as the
local layers' linears are (megatron/model/layers.py), so either implementation starts from the same weights and
the gradient-norm and checkpoint code sees the same parameter attributes.

transformer_engine is imported inside functions only: importing this module on a CPU machine is harmless.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, partial
from typing import Any

import torch
from torch import nn

from megatron.config import ModelConfig
from megatron.parallel.tensor_parallel import TensorParallel

from . import swiglu_kernel
from .init_draws import init_normal
from .layers import mark_replicated, mark_tensor_parallel, normalize
from .smooth_swiglu import add_smoothing, smooth_weight


def sharded_normal_init(std: float, tp: TensorParallel, dim: int, parts: int = 1) -> Callable[[torch.Tensor], None]:
    """A TE `init_method` for a weight that is this rank's tensor-parallel shard along `dim`: draw the full matrix
    N(0, std) from the CPU generator in fp32, as the local `Linear` does, and copy this rank's slice (`parts`: stacked
    matrices sliced separately, 2 for SwiGLU's [gate; up]) to the (GPU) weight; inside `parallel_draws` at its end,
    with the other parts' draws (megatron/model/init_draws.py).

    TE calls each module's init in construction order (linear_qkv, linear_proj, linear_fc1, linear_fc2), the order
    the local layer draws in, so with the same seed both implementations, under any layout, start from identical
    weights."""

    def init(weight: torch.Tensor) -> None:
        shape = list(weight.shape)
        shape[dim] *= tp.size
        init_normal(weight, tuple(shape), std, partial(tp.shard, dim=dim, parts=parts))

    return init


def te_linear(
    cfg: ModelConfig,
    in_features: int,
    out_features: int,
    parallel_mode: str,
    std: float,
    tp: TensorParallel,
    params_dtype: torch.dtype,
    device: torch.device,
    *,
    norm: bool = False,
    parts: int = 1,
    ub_name: str,
    smooth_input: bool = False,
) -> nn.Module:
    """A TE linear of the layer: `te.LayerNormLinear` (norm=True: the layer's input norm fused in; linear_qkv,
    linear_fc1) or `te.Linear`, column- or row-parallel over `tp` through TE's own arguments (TE all-gathers and
    reduce-scatters along the sequence with --sequence-parallel, as the local layers do).

    `parts`: stacked matrices sharded separately (2 for SwiGLU's [gate; up]), see `mark_te_params`. `ub_name`: the
    GEMM's name among TE's userbuffers ("qkv", "proj", "fc1", "fc2"); with --tp-comm-overlap the column-parallel
    linears gather their input inside the forward GEMM and overlap their backward's all-gather and reduce-scatter
    with the dgrad and wgrad GEMMs (bulk), and the row-parallel ones reduce-scatter inside the forward GEMM and
    gather the output gradient inside the dgrad GEMM (Megatron-LM's defaults). `smooth_input` (--smooth-swiglu,
    linear_fc2): a `te.Linear` that casts and multiplies W / s, its caller scaling the input by s."""
    import transformer_engine.pytorch as te

    column = parallel_mode == "column"
    overlap = (
        dict(ub_name=ub_name, ub_overlap_ag=True, ub_overlap_rs=not column, ub_bulk_dgrad=column, ub_bulk_wgrad=column)
        if tp.comm_overlap
        else {}
    )
    common: dict[str, Any] = dict(
        bias=cfg.add_bias,
        init_method=sharded_normal_init(std, tp, 0 if column else 1, parts),
        params_dtype=params_dtype,
        # TE defers its initialization (and allocates nothing) only when given the string: it tests `device == "meta"`,
        # which no torch.device equals
        device="meta" if device.type == "meta" else device,
        parallel_mode=parallel_mode,
        tp_group=tp.group,
        tp_size=tp.size,
        sequence_parallel=tp.sequence_parallel,
        **overlap,
    )
    if norm:
        module = te.LayerNormLinear(
            in_features,
            out_features,
            eps=cfg.norm_epsilon,
            normalization=cfg.normalization,
            zero_centered_gamma=cfg.apply_layernorm_1p,
            **common,
        )
    elif smooth_input:
        module = smoothed_te_linear()(in_features, out_features, **common)
        add_smoothing(module, module.weight.shape[1], module.weight.device)  # this rank's input channels
    else:
        module = te.Linear(in_features, out_features, **common)
    mark_te_params(module, tp, parts)
    return module


class _SmoothedWeight(torch.autograd.Function):
    """W / s for a smoothed linear_fc2 (`smoothed_te_linear`); backward, W's gradient g / s, added (or written,
    for weights marked `overwrite_main_grad`) straight into W.main_grad when `fuse`, as TE's fused wgrad
    accumulation would: one pass, no divided gradient written out for the buffers' hook to read and add."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, scale: torch.Tensor, quotient: torch.Tensor, fuse: bool) -> Any:
        ctx.save_for_backward(weight, scale)
        ctx.fuse = fuse
        return quotient.detach()  # computed outside (cached), so each call's output has its own autograd history

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None, None]:
        from transformer_engine.pytorch.module.base import get_dummy_wgrad

        weight, scale = ctx.saved_tensors
        if not ctx.fuse:
            return grad / scale.to(grad.dtype), None, None, None
        overwrite = getattr(weight, "overwrite_main_grad", False)
        swiglu_kernel.divide_columns(grad, scale, out=weight.main_grad, accumulate=not overwrite)
        weight.grad_added_to_main_grad = True
        return get_dummy_wgrad(list(weight.shape), weight.dtype), None, None, None


@cache
def smoothed_te_linear() -> type[nn.Module]:
    """`te.Linear` whose GEMM weight is W / s, s its `smooth_scale` per input channel (megatron/model/smooth_swiglu.py):
    TE reads its weight through `_get_weight_tensors` for the cast and both GEMMs, so the quotient is what it casts
    (once per step, reused for the later micro-batches as TE reuses any weight cast) and autograd carries W's
    gradient back through `_SmoothedWeight`. The parameter stays the plain W.

    The quotient is computed once per value of W and s (their version counters: the optimizer step and the
    smoothing update bump them) and kept for the step's later micro-batches, which TE's bf16 layers read too, where
    the layer keeps its weight casts across micro-batches (`is_first_microbatch` not None; not under FSDP's resharded
    weights, whose quotient would then outlive the unit's gather); while a CUDA graph is captured it is computed in
    the graph, at every replay, except where TE's device flag says the replay reuses the FP8 weight cast. The
    gradient goes into W.main_grad here, not inside TE's wgrad GEMM (whose weight is the quotient):
    `smooth_wgrad_fusion`, set by TETransformerLayer where TE's fusion would be."""
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    class SmoothedLinear(te.Linear):
        smooth_wgrad_fusion = False
        _quotient, _quotient_key, _keep_quotient = None, None, False

        def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None, *args: Any, **kwargs: Any) -> Any:
            self._keep_quotient = is_first_microbatch is not None  # the layer caches its weights' casts: so may W / s
            return super().forward(inp, is_first_microbatch, *args, **kwargs)

        def runs_kernels(self) -> bool:
            """Whether W / s and its gradient go through swiglu_kernel.divide_columns (a plain CUDA weight, not FP8
            nor a DTensor, and Triton), or through autograd's division."""
            w = self.weight
            return w.is_cuda and type(w.data) is torch.Tensor and swiglu_kernel.available()

        def _get_weight_tensors(self) -> list[torch.Tensor]:
            weights = super()._get_weight_tensors()
            if not self.runs_kernels():
                return [smooth_weight(w, self.smooth_scale) for w in weights]
            return [self._smoothed(w) for w in weights]

        def _smoothed(self, weight: torch.Tensor) -> torch.Tensor:
            scale = self.smooth_scale
            if torch.cuda.is_current_stream_capturing():
                capturing_fp8 = self.fp8 and FP8GlobalStateManager.fp8_graph_capturing()
                skip = FP8GlobalStateManager.get_skip_fp8_weight_update_tensor() if capturing_fp8 else None
                quotient = swiglu_kernel.divide_columns(weight.detach(), scale, skip=skip)
            elif not self._keep_quotient:
                self._quotient = self._quotient_key = None
                quotient = swiglu_kernel.divide_columns(weight.detach(), scale)
            else:
                key = (weight.data_ptr(), weight._version, scale.data_ptr(), scale._version)
                if key != self._quotient_key:
                    self._quotient = swiglu_kernel.divide_columns(weight.detach(), scale)
                    self._quotient_key = key
                quotient = self._quotient
            if not (torch.is_grad_enabled() and weight.requires_grad):
                return quotient
            return _SmoothedWeight.apply(weight, scale, quotient, self.smooth_wgrad_fusion)

        def smoothed_weight(self) -> torch.Tensor:
            """W / s, the weight TE casts and multiplies (for the FP8 monitor)."""
            return smooth_weight(self.weight, self.smooth_scale)

    return SmoothedLinear


def mark_te_params(module: nn.Module, tp: TensorParallel, parts: int = 1) -> None:
    """TE marks its sharded parameters (`tensor_model_parallel`, `partition_dim`) and its sequence-parallel ones;
    add what the local layers record: `partition_parts` on column-parallel shards and the replicated marking on the
    rest (norm weights, row-parallel biases), so the gradient norm counts those once (megatron.parallel.grads)."""
    if module.weight.is_meta:
        # TE marks the sharded parameters when it initializes them (`reset_parameters`), which it defers on the meta
        # device: mark them as it would, the weight along its split dim and a column-parallel bias along dim 0
        dim = 1 if module.parallel_mode == "row" else 0
        for param in [module.weight] + ([module.bias] if module.use_bias and dim == 0 else []):
            mark_tensor_parallel(param, dim, parts if dim == 0 else 1)
    for param in module.parameters():
        if getattr(param, "tensor_model_parallel", False):
            param.partition_parts = parts if param.partition_dim == 0 else 1
        else:
            mark_replicated(param, tp)


def te_norm_input(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the forward GEMM of `module` (a TE linear built by `te_linear`) casts to FP8 given its input x: for a
    te.LayerNormLinear the normalized input (the norm is fused into its GEMM), recomputed in fp32 by the local
    layers' norm with the module's own weight and epsilon; x itself for a te.Linear. (For the FP8 monitor, which
    hooks TE's linears: megatron/fp8/te_monitor.py.)"""
    if not hasattr(module, "layer_norm_weight"):
        return x
    bias = getattr(module, "layer_norm_bias", None)
    weight, bias = module.layer_norm_weight.float(), None if bias is None else bias.float()
    return normalize(x.float(), weight, bias, module.normalization, module.eps, module.zero_centered_gamma)
