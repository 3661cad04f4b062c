"""The FP8 linear layer: y = x W^T + b with its three GEMMs on quantized operands.

    forward   y  = x . W^T                   A = q(x) along K,      B = q(W) along K        (fast accumulation)
    backward  dx = dY . W                    A = q(dY) along N,     B = q(W^T) along N
              dW = dY^T . x                  A = q(dY^T) along M,   B = q(x^T) along M
              db = sum_M dY                  (high precision)

What forward keeps for backward is FP8: q(x^T) (the wgrad operand, quantized along the tokens) and q(W^T), never
a high-precision copy of x. With `--no-fp8-wgrad` the wgrad GEMM runs in high precision on the unquantized x and
dY, so forward keeps x itself (that is the flag's cost).

Weights are quantized once per optimizer step: the casts are cached on the layer's state and dropped by
`Fp8Manager.step()` (or when the weight tensor is modified in place), so micro-batches after the first reuse them.

Shapes: x may have any leading dimensions ([s, b, h] here); it is flattened to [M, K]. On CUDA, M is zero-padded to a
multiple of 16 for `torch._scaled_mm` (zero rows change no amax and no product) and the padding is cut off again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .formats import Role
from .gemm import fp8_gemm
from .params import accumulate_weight_grad, high_precision_linear, holds_fp8
from .quantize import EAGER, Fp8Tensor, Kernels, quantize, scale_from_amax
from .recipes import Recipe
from .scaling import AmaxState
from .stats import Fp8StatsCollector


class Fp8LinearState:
    """The FP8 state of one linear layer, set as `linear.fp8` by `attach_fp8`; `Linear.forward` calls `linear`."""

    def __init__(
        self,
        name: str,
        index: int,
        recipe: Recipe,
        amax: AmaxState,
        kernels: Kernels = EAGER,
        tp_group: dist.ProcessGroup | None = None,
        layer_number: int = 0,
    ):
        """`tp_group`: the tensor-parallel ranks holding the other shards of this linear. With the tensorwise recipe
        each operand's current amax is max-reduced over it, so a sharded tensor gets one scale, as in one process.
        `layer_number`: the 1-based transformer layer the linear belongs to (for the monitor and the guard)."""
        self.name, self.index, self.recipe, self.amax, self.kernels = name, index, recipe, amax, kernels
        self.layer_number = layer_number
        self.tp_group = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
        self.enabled = True
        self.calibrating = False
        """Set during delayed scaling's calibration pass: the GEMMs run in high precision and only record the amaxes
        (calibration.py)."""
        self.stats: Fp8StatsCollector | None = None
        """Set by the FP8 monitor on the steps it watches: every cast is then counted (monitor.py)."""
        self.weight_piece: Callable[[], tuple[torch.Tensor, int]] | None = None
        """With an FP8 weight (--fp8-param-gather), which the linear reads cast already: the high-precision piece
        this rank cast into it and the weight's row it starts at (the distributed optimizer's main piece, flat, at
        0; FSDP's shard [rows, in]; training/build.py sets it). The monitor counts that cast; the pieces of all
        ranks make up the weight once."""
        self._weight_cache: tuple[Any, Fp8Tensor, Fp8Tensor | None] | None = None
        self.cache_weight = True
        """Keep the weight's casts for the step's later micro-batches. Off under FSDP (megatron/parallel/fsdp/fsdp2.py),
        which frees each gathered weight after use: cached casts of every layer would hold a byte or two per
        parameter of the whole model."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K], weight [N, K], bias [N] -> [..., N] in x's dtype."""
        if x.shape[-1] != weight.shape[1]:
            raise ValueError(f"{self.name}: input has {x.shape[-1]} features, the weight expects {weight.shape[1]}")
        if self.calibrating:
            return self._observe(x, weight, bias)
        if not self.enabled:  # the FP8 guard moved this layer to bf16
            return high_precision_linear(x, weight, bias)
        out = _Fp8LinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, bias, self)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def _observe(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """y = x W^T + b in high precision, recording the amaxes of x, W and (in backward) dY as a cast would."""
        self.amax.record(self.index, Role.INPUT, x.detach().abs().amax())
        w_amax = weight.amax if holds_fp8(weight) else weight.detach().abs().amax()
        self.amax.record(self.index, Role.WEIGHT, w_amax)
        y = high_precision_linear(x, weight, bias)
        if y.requires_grad:
            y.register_hook(lambda grad: self.amax.record(self.index, Role.GRAD, grad.abs().amax()))
        return y

    def quantize(
        self, t: torch.Tensor, role: Role, *, rows: bool = True, cols: bool = False
    ) -> tuple[Fp8Tensor | None, Fp8Tensor | None]:
        """q(t) along t's last dim (rows) and/or q(t^T) along t's first dim (cols), as the recipe says; records the
        amax for the step."""
        recipe = self.recipe
        options: dict[str, Any] = {
            "power_of_two": recipe.power_of_two(role),
            "mx": recipe.mx,
            "kernels": self.kernels,
        }
        if recipe.delayed:
            assert self.amax.scale is not None
            options["scale"] = self.amax.scale[self.index, role.value]
        elif recipe.name == "tensorwise" and self.tp_group is not None:
            current = t.abs().amax().float()
            dist.all_reduce(current, op=dist.ReduceOp.MAX, group=self.tp_group)
            options["scale"] = scale_from_amax(current, recipe.dtype(role), recipe.power_of_two(role))
        spec, dtype = recipe.block(role), recipe.dtype(role)
        if recipe.transposable(role):
            q, q_t = quantize(t, spec, dtype, transpose=cols, **options)
            q = q if rows else None
        else:
            q = quantize(t, spec, dtype, **options)[0] if rows else None
            q_t = quantize(t.t(), spec, dtype, **options)[0] if cols else None
        for part in (q, q_t):
            if part is not None:
                self.amax.record(self.index, role, part.amax)
        if self.stats is not None:
            self.stats.record(self.index, role, t, recipe, options.get("scale"))
        return q, q_t

    def weight_operands(self, weight: torch.Tensor) -> tuple[Fp8Tensor, Fp8Tensor | None]:
        """(q(W) along K for fprop, q(W^T) along N for dgrad), cached until the step ends or W changes. An FP8
        weight (--fp8-param-gather) is its own q(W); only its transpose is made here, but for a weight gathered per
        axis under FSDP (rowwise, mxfp8: parallel/fsdp/fp8_gather_axes.py), whose dgrad operand the backward reads from
        its own gather (None here)."""
        if holds_fp8(weight):
            key: tuple = (id(weight), weight.version)
        else:
            key = (weight.data_ptr(), weight._version, weight.dtype, self.amax.generation)
        if self._weight_cache is not None and self._weight_cache[0] == key:
            _, w_q, w_t = self._weight_cache
            self.amax.record(self.index, Role.WEIGHT, w_q.amax)  # this step saw the weight too
            return w_q, w_t
        if holds_fp8(weight):
            w_q = weight.fp8_tensor()
            w_t = None if hasattr(weight, "dgrad_operand") else w_q.t()
            self.amax.record(self.index, Role.WEIGHT, w_q.amax)
            if self.stats is not None:
                self._record_fp8_weight(weight)
        else:
            w_q, w_t = self.quantize(weight.detach(), Role.WEIGHT, rows=True, cols=True)
        assert w_q is not None and (w_t is not None or holds_fp8(weight))
        if self.cache_weight:
            self._weight_cache = (key, w_q, w_t)
        return w_q, w_t

    def _record_fp8_weight(self, weight: torch.Tensor) -> None:
        """Count the cast that made an FP8 weight: of this rank's piece, with the weight's scales (read back, the
        weight would show neither saturation nor underflow). Without a piece known (a model outside training),
        the weight read back, its block scales recomputed."""
        assert self.stats is not None
        if self.weight_piece is None:
            scale = weight.scale_inv.reciprocal() if weight.scale_inv.numel() == 1 else None
            self.stats.record(self.index, Role.WEIGHT, weight.dequantize(), self.recipe, scale)
            return
        piece, first_row = self.weight_piece()
        if hasattr(weight, "dgrad_operand") and piece.numel():  # rowwise, mxfp8: a row's scales are its own
            self.stats.record(self.index, Role.WEIGHT, piece, self.recipe, None)  # (parallel/fsdp/fp8_gather_axes.py)
            return
        self.stats.record_cast(self.index, Role.WEIGHT, piece, first_row, weight.scale_inv.reciprocal(), self.recipe)

    def drop_weight_cache(self) -> None:
        self._weight_cache = None


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = (-t.shape[0]) % multiple
    return torch.nn.functional.pad(t, (0, 0, 0, extra)) if extra else t


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: Fp8LinearState):
        recipe = state.recipe
        tokens = x.shape[0]
        x_padded = _pad_rows(x.detach(), 16) if x.is_cuda else x.detach()
        weight_grad = ctx.needs_input_grad[1]
        fp8_wgrad = weight_grad and recipe.fp8_wgrad
        x_q, x_t = state.quantize(x_padded, Role.INPUT, rows=True, cols=fp8_wgrad)
        w_q, w_t = state.weight_operands(weight)
        assert x_q is not None
        y = fp8_gemm(x_q, w_q, x.dtype, fast_accum=True, bias=bias)[:tokens]

        ctx.state, ctx.tokens = state, tokens
        ctx.x_dtype, ctx.b_dtype = x.dtype, None if bias is None else bias.dtype
        # an FP8 weight's gradient is formed in fp32 and added into main_grad (params.py)
        ctx.fp8_weight = weight if holds_fp8(weight) else None
        ctx.w_dtype = torch.float32 if ctx.fp8_weight is not None else weight.dtype
        ctx.w_t = w_t  # FP8, shared with the weight cache (None: the gathered weight's, read in backward)
        ctx.x_t = x_t  # FP8 wgrad operand (None unless fp8 wgrad)
        ctx.save_for_backward(x if weight_grad and not recipe.fp8_wgrad else None)
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        state: Fp8LinearState = ctx.state
        (x_high,) = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dy = grad_out.reshape(ctx.tokens, -1)
        dy_padded = _pad_rows(dy, 16) if dy.is_cuda else dy
        fp8_wgrad = need_dw and ctx.x_t is not None
        dy_q, dy_t = state.quantize(dy_padded, Role.GRAD, rows=need_dx, cols=fp8_wgrad)

        dx = dw = db = None
        if need_dx:
            w_t = ctx.w_t if ctx.w_t is not None else ctx.fp8_weight.dgrad_operand()
            dx = fp8_gemm(dy_q, w_t, ctx.x_dtype)[: ctx.tokens]
        if fp8_wgrad:
            dw = fp8_gemm(dy_t, ctx.x_t, ctx.w_dtype)
        elif need_dw:
            dw = (dy.t().to(x_high.dtype) @ x_high).to(ctx.w_dtype)
        if need_db and ctx.b_dtype is not None:
            db = dy.float().sum(0).to(ctx.b_dtype)
        if dw is not None and ctx.fp8_weight is not None:
            dw = accumulate_weight_grad(ctx.fp8_weight, dw)
        ctx.x_t = ctx.w_t = ctx.fp8_weight = None
        return dx, dw, db, None
