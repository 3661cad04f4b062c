"""FP8 weights (--fp8-param-gather): the transformer linears' weights kept in FP8 only, written from fp32 masters.

The optimizer keeps an fp32 master copy of each FP8 weight (a piece of it per data-parallel rank with the
distributed optimizer) and, after every step, casts the masters straight into the weights' FP8 bytes with
`quantize_masters`; the gradient buffers then all-gather those bytes (one byte per element instead of two) and no
bf16 copy of a GEMM weight ever exists. Two kinds of FP8 weight take part:

* Transformer Engine's quantized parameters (`Float8Tensor` for delayed and tensorwise, `Float8BlockwiseQTensor`
  for blockwise), built by TE under `quantized_model_init`. Their masters are cast by TE's own helper
  (`quantize_master_weights`), which max-reduces the amaxes (per tensor, or per 128x128 block) over the
  data-parallel group in one collective, so a tensor cut by shard boundaries gets the scales of the whole tensor.
  TE rebuilds the transposes it needs at the next forward.
* `Fp8Parameter`, the local engine's: an `nn.Parameter` whose storage is E4M3 data [out, in], with one fp32 scale
  per tensor beside it (`scale_inv`) and the amax of the value it holds. The linear reads it as its FP8 operand
  directly (`fp8_tensor`) and adds the weight gradient straight into `main_grad` (fp32), as TE's fused wgrad
  accumulation does; autograd gets a zero-stride dummy. Per-tensor recipes only: delayed casts with the scale
  delayed scaling computed at this step's update, tensorwise with fp8_max / amax of the new master. The amaxes of
  all weights are max-reduced over the group in one collective (tensor x data parallel: the same scale as one
  process computes for the whole tensor).

Casting a piece gives the same bytes as casting the whole tensor (the scale is one number per tensor and the cast is
elementwise), so the sharded optimizer writes exactly the weights the unsharded one writes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.config.precision import TE_FP8_PARAM_RECIPES

from .formats import E4M3, Role
from .quantize import TENSOR, Fp8Tensor, scale_from_amax, scaled_cast, tensor_amax


def holds_fp8(weight: torch.Tensor | None) -> bool:
    """A weight the FP8 linear reads as its operand without casting (`fp8_tensor`): an `Fp8Parameter`, or under
    FSDP the gathered FP8 weight (parallel/fsdp/fp8_gather.py)."""
    return callable(getattr(weight, "fp8_tensor", None))


def is_fp8_param(param: torch.Tensor | None) -> bool:
    """An FP8 weight (a Transformer Engine quantized parameter or an `Fp8Parameter`): it is written by quantizing a
    value into it (`quantize_`) and read back with `dequantize`."""
    return callable(getattr(param, "quantize_", None))


class Fp8Parameter(nn.Parameter):
    """A local linear's weight stored in E4M3 (see the module docstring). `state`: the linear's `Fp8LinearState`
    (its recipe and, for delayed scaling, its scale)."""

    state: Any
    nominal_dtype: torch.dtype
    scale_inv: torch.Tensor
    amax: torch.Tensor
    version: int

    def __new__(cls, value: torch.Tensor, state: Any) -> Fp8Parameter:
        param = super().__new__(cls, torch.empty(value.shape, dtype=E4M3, device=value.device), requires_grad=True)
        param.state, param.version, param.nominal_dtype = state, 0, value.dtype
        param.scale_inv = torch.ones((), device=value.device)
        param.amax = torch.zeros((), device=value.device)
        param._high_precision_init_val = value.detach().float().clone()  # the optimizer's first master value
        param.quantize_(value)
        return param

    def __deepcopy__(self, memo: dict) -> Fp8Parameter:
        raise TypeError("an FP8 weight cannot be deep-copied; copy its dequantize() value instead")

    def cast_scale(self, amax: torch.Tensor) -> torch.Tensor:
        """The scale a new value of this amax is cast with: delayed scaling's current weight scale, or (tensorwise,
        and before delayed scaling has one) fp8_max / amax."""
        if self.state.recipe.delayed and self.state.amax.generation > 0:
            return self.state.amax.scale[self.state.index, Role.WEIGHT.value].reshape(())
        return scale_from_amax(amax.reshape(()), E4M3)

    def quantize_(self, value: torch.Tensor) -> None:
        """Cast a whole high-precision value into this weight with a scale from its own amax (building and loading
        a model; the optimizer casts its masters with `quantize_masters`)."""
        amax = value.detach().abs().amax().float()
        _write(self, value.detach().reshape(-1), 0, amax, scale_from_amax(amax, E4M3))

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The value held, in `dtype` (default: the dtype the weight had before it became FP8)."""
        return (self.data.float() * self.scale_inv).to(dtype or self.nominal_dtype)

    def fp8_tensor(self) -> Fp8Tensor:
        """The weight as the GEMM operand q(W) [out, in] (one block: the whole tensor)."""
        return Fp8Tensor(self.data, self.scale_inv.reshape(1, 1), tuple(self.shape), self.amax)

    def get_high_precision_init_val(self) -> torch.Tensor | None:
        return self._high_precision_init_val

    def clear_high_precision_init_val(self) -> None:
        self._high_precision_init_val = None


def _write(param: Fp8Parameter, piece: torch.Tensor | None, offset: int, amax: torch.Tensor, scale: torch.Tensor):
    """param's flattened elements [offset, offset + piece.numel()) <- E4M3(piece * scale); scale and amax kept."""
    with torch.no_grad():
        if piece is not None and piece.numel():
            data, _ = scaled_cast(piece.reshape(1, -1), scale.reshape(1, 1), TENSOR, E4M3)
            param.data.view(-1)[offset : offset + piece.numel()].copy_(data.reshape(-1))
        param.scale_inv.copy_(scale.reciprocal())
        param.amax.copy_(amax)
    param.version += 1  # the linear's cached operands (and transpose) are stale


def convert_to_fp8_params(linears: list[nn.Module]) -> None:
    """Replace each linear's weight by an `Fp8Parameter` holding its value (after `attach_fp8` gave it a state);
    the tensor-parallel attributes move along."""
    for linear in linears:
        old = linear.weight
        new = Fp8Parameter(old.detach(), linear.fp8)
        for key, value in vars(old).items():
            if not key.startswith("_"):
                setattr(new, key, value)
        linear.weight = new


def quantize_masters(
    params: list[torch.Tensor],
    masters: list[torch.Tensor | None],
    offsets: list[int],
    group: dist.ProcessGroup | None,
) -> None:
    """Cast fp32 masters into FP8 weights: `masters[i]` is the flattened piece of `params[i]` starting at element
    `offsets[i]` that this rank updated (None: none). Every rank of `group` calls it with the same `params`, as
    their amaxes are max-reduced over the group in one collective."""
    if not params:
        return
    local = [i for i, p in enumerate(params) if isinstance(p, Fp8Parameter)]
    te = [i for i in range(len(params)) if not isinstance(params[i], Fp8Parameter)]
    if te:
        _quantize_te([params[i] for i in te], [masters[i] for i in te], [offsets[i] for i in te], group)
    if local:
        _quantize_local([params[i] for i in local], [masters[i] for i in local], [offsets[i] for i in local], group)


def _quantize_te(
    params: list[torch.Tensor], masters: list[torch.Tensor | None], offsets: list[int], group: dist.ProcessGroup | None
) -> None:
    if group is None or dist.get_world_size(group) == 1:  # whole masters: TE's own cast, no collective
        for param, master in zip(params, masters):
            assert master is not None and master.numel() == param.numel()
            param.quantize_(master.view(param.shape))
        return
    masters = [None if m is None else m.view(-1) for m in masters]  # TE's helper takes flat pieces
    from transformer_engine.pytorch.tensor.utils import quantize_master_weights

    # Row-wise casts only: a shard piece is a [1, n] row, whose transpose TE would form with its slow general
    # cast-transpose kernel (measured: 39 ms per step on llama-1b, DP=2); the transposes the GEMMs need are rebuilt
    # from the gathered bytes at the next forward.
    quantizers = list({id(q): q for q in (p._get_quantizer() for p in params)}.values())
    usages = [q.columnwise_usage for q in quantizers]
    for quantizer in quantizers:
        quantizer.set_usage(columnwise=False)
    try:
        quantize_master_weights(params, masters, offsets, group)
    finally:
        for quantizer, usage in zip(quantizers, usages):
            quantizer.set_usage(columnwise=usage)


def _quantize_local(
    params: list[Fp8Parameter], masters: list[torch.Tensor | None], offsets: list[int], group: dist.ProcessGroup | None
) -> None:
    zero = torch.zeros((), device=params[0].device)
    amax = torch.stack([tensor_amax(m) if m is not None and m.numel() else zero for m in masters])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    for param, master, offset, weight_amax in zip(params, masters, offsets, amax):
        _write(param, master, offset, weight_amax, param.cast_scale(weight_amax))


class _LinearOnDequantizedWeight(torch.autograd.Function):
    """y = x W^T + b in high precision with W an `Fp8Parameter` (its layer kept out of FP8, or delayed scaling's
    calibration pass): the weight is dequantized, and its gradient goes to main_grad as in the FP8 linear."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.weight, ctx.has_bias = weight, bias is not None
        return F.linear(x, weight.dequantize(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        dx = grad_out @ weight.dequantize(grad_out.dtype) if ctx.needs_input_grad[0] else None
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        dw = accumulate_weight_grad(weight, dy.t().float() @ x.reshape(-1, x.shape[-1]).float())
        db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


def high_precision_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, also for an FP8 weight (dequantized)."""
    if holds_fp8(weight):
        return _LinearOnDequantizedWeight.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def accumulate_weight_grad(weight: torch.Tensor, dw: torch.Tensor) -> torch.Tensor:
    """main_grad += dw (fp32) for an FP8 weight, which can hold no gradient of its own (main_grad = dw for a weight
    marked `overwrite_main_grad`: parallel/fsdp/flat_shards.py's buffers); returns the zero-stride dummy gradient
    autograd gets instead (the gradient buffers' hook frees it). A weight gathered by FSDP gets dw itself (FSDP
    reduce-scatters the autograd gradient into the shards)."""
    if getattr(weight, "grad_to_autograd", False):
        return dw.to(weight.dtype)
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        raise RuntimeError(
            "FP8 weights (--fp8-param-gather) add their gradients into main_grad: build"
            " megatron.parallel.GradientBuffers for the model before its first backward"
        )
    if getattr(weight, "overwrite_main_grad", False):  # the flat gradient shards' buffers: written, not added
        main_grad.copy_(dw)
    else:
        main_grad.add_(dw)
    weight.grad_added_to_main_grad = True
    return torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)


def fp8_raw_data(param: torch.Tensor) -> torch.Tensor:
    """The bytes of an FP8 weight the all-gather moves: uint8 [numel] (TE: the row-wise data)."""
    if isinstance(param, Fp8Parameter):
        return param.data.view(torch.uint8).view(-1)
    raw = getattr(param, "_data", None)
    raw = raw if raw is not None else getattr(param, "_rowwise_data", None)
    if raw is None or raw.dtype != torch.uint8 or raw.numel() != param.numel():
        raise ValueError(
            f"{type(param).__name__} weights cannot be all-gathered as FP8 bytes; use --fp8-recipe"
            f" {'|'.join(TE_FP8_PARAM_RECIPES)} with --fp8-param-gather and --use-distributed-optimizer"
        )
    return raw.view(-1)


def move_fp8_storage(param: torch.Tensor, raw: torch.Tensor) -> None:
    """Re-home an FP8 weight's bytes into `raw` (uint8 [numel], a view into a bucket's buffer), keeping its value."""
    with torch.no_grad():
        if isinstance(param, Fp8Parameter):
            raw.copy_(fp8_raw_data(param))
            param.data = raw.view(E4M3).view(param.shape)
            return
    from transformer_engine.pytorch.tensor.utils import replace_raw_data

    replace_raw_data(param, raw.view(param.shape))
