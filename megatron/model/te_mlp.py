"""The MLP of the Transformer Engine layer (`TEMLP`): TE's linears with GELU, or SwiGLU as one TE kernel each way;
under delayed scaling those kernels write the FP8 operands of the MLP's linears directly (`_SwiGLU`).

transformer_engine is imported inside functions only: importing this module on a CPU machine is harmless.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron.config import ModelConfig
from megatron.parallel.tensor_parallel import NO_TP, TensorParallel

from . import swiglu_kernel
from .layers import init_std_of_output, mlp_activation
from .smooth_swiglu import smooth_input
from .te_linear import te_linear


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up over x = [gate; up] (last dimension), with TE's fused forward and backward kernels (TE's gated
    activations gate the first half, as Megatron-Core and the local MLP do).

    Given TE quantizers (see `TEMLP._fp8_quantizers`), the kernels write FP8 directly: the forward linear_fc2's input,
    the backward linear_fc1's output gradient. Those TE modules then take the FP8 tensors as they are instead of
    reading a bf16 tensor back to cast it (a bf16 write and read of each tensor saved)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_quantizer: Any, grad_quantizer: Any) -> torch.Tensor:
        import transformer_engine_torch as tex

        ctx.save_for_backward(x)
        ctx.grad_quantizer = grad_quantizer
        return tex.swiglu(x, out_quantizer)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        import transformer_engine_torch as tex

        (x,) = ctx.saved_tensors
        return tex.dswiglu(grad.contiguous(), x, ctx.grad_quantizer), None, None


class TEMLP(nn.Module):
    """h -> ffn -> h with GELU, or SwiGLU (linear_fc1 outputs [gate; up], 2*ffn wide).

    Not `te.LayerNormMLP`: measured on an H100 (llama-1b, FP8 delayed) it ran the same kernel time (685-688 against
    688-690 ms per step), because on Hopper it runs dSwiGLU and the FP8 cast of its output as two kernels, which
    `_SwiGLU` fuses here, and it would need its parameter names (fc1_weight, ...) mapped to these keys."""

    def __init__(self, cfg: ModelConfig, params_dtype: torch.dtype, device: torch.device, tp: TensorParallel = NO_TP):
        super().__init__()
        self.swiglu, self.activation = cfg.swiglu, mlp_activation(cfg)
        self.fp8_swiglu = True
        """Let `_SwiGLU` write FP8 under delayed scaling; the FP8 monitor turns it off on the steps it watches, so
        that TE casts (and the monitor sees) the high-precision activation and gradient."""
        fc1_out = 2 * cfg.ffn_hidden_size if cfg.swiglu else cfg.ffn_hidden_size
        self.linear_fc1 = te_linear(
            cfg, cfg.hidden_size, fc1_out, "column", cfg.init_method_std, tp, params_dtype, device, norm=True,
            parts=2 if cfg.swiglu else 1, ub_name="fc1",
        )  # fmt: skip
        self.linear_fc2 = te_linear(
            cfg, cfg.ffn_hidden_size, cfg.hidden_size, "row", init_std_of_output(cfg), tp, params_dtype, device,
            ub_name="fc2", smooth_input=cfg.smooth_swiglu,
        )  # fmt: skip

    def _fp8_quantizers(self) -> tuple[Any, Any]:
        """(linear_fc2's input quantizer, linear_fc1's output-gradient quantizer) for `_SwiGLU` to quantize with, or
        (None, None) for bf16 outputs.

        Only under delayed scaling: its per-tensor scales are known before the kernel runs (they come from the amax
        history), and the kernel records the amax into the same history the TE module would have. Current scaling
        needs the whole tensor's amax before it can scale, and TE casts Hopper's blockwise recipe separately; MXFP8
        (Blackwell) could take this path too but is left on TE's own cast until it can be tested on such a GPU. The
        quantizers are shallow copies of the modules' own: they share the scale and amax tensors TE quantizes with."""
        from transformer_engine.pytorch.constants import FP8BwdTensorIdx, FP8FwdTensorIdx
        from transformer_engine.pytorch.distributed import in_fp8_activation_recompute_phase
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        if not (self.fp8_swiglu and FP8GlobalStateManager.is_fp8_enabled()):
            return None, None
        recipe = FP8GlobalStateManager.get_fp8_recipe()
        if not recipe.delayed():
            return None, None
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        # linear_fc2 sets up its FP8 state (scales, amax history, quantizers) at the start of its forward, which
        # has not run yet: do it now, so the very first micro-batch takes this path as every other one does
        # (TE's own forward then finds it done; the amaxes still join the reduction there).
        fc2.init_fp8_metadata()
        if not all(m.fp8_initialized and m.fp8_meta.get("recipe") == recipe for m in (fc1, fc2)):
            return None, None  # not expected: linear_fc1 ran under this recipe a moment ago
        out_quantizer = fc2.quantizers["scaling_fwd"][FP8FwdTensorIdx.GEMM1_INPUT].copy()
        if in_fp8_activation_recompute_phase():
            _first_forward_scale(out_quantizer, fc2, FP8FwdTensorIdx.GEMM1_INPUT)
        # Row-wise data only, as linear_fc2 keeps of an input it casts itself: its wgrad transposes it in backward.
        out_quantizer.set_usage(rowwise=True, columnwise=False)
        grad_quantizer = fc1.quantizers["scaling_bwd"][FP8BwdTensorIdx.GRAD_OUTPUT1].copy()
        grad_quantizer.set_usage(rowwise=True, columnwise=True)  # dgrad and wgrad GEMMs, as linear_fc1 asks for
        for quantizer in (out_quantizer, grad_quantizer):
            quantizer.internal = False  # torch.Tensor subclasses (Float8Tensor), which autograd passes along
        return out_quantizer, grad_quantizer

    def forward(self, x: torch.Tensor, first_microbatch: bool | None) -> torch.Tensor:
        # 2-D tokens x features through the MLP: TE's reshape of an FP8 tensor to 2-D drops its transpose, and
        # linear_fc1's backward reshapes its output gradient (FP8 from `_SwiGLU`) so.
        shape = x.shape
        h = self.linear_fc1(x.reshape(-1, shape[-1]), is_first_microbatch=first_microbatch)
        fc2 = self.linear_fc2
        if not self.swiglu:
            h = self.activation(h)
        elif getattr(fc2, "smooth_input", False):
            # --smooth-swiglu: under delayed scaling one kernel each way scales by s and casts to FP8 (swiglu_kernel);
            # otherwise the SwiGLU output leaves TE's kernel in bf16 to be scaled by s before TE casts it (the
            # kernel still writes linear_fc1's FP8 output gradient), which keeps the bf16 layers bit for bit the
            # plain ones
            out_quantizer, grad_quantizer = self._fp8_quantizers()
            if out_quantizer is not None and h.is_cuda and swiglu_kernel.available():
                h = swiglu_kernel.smooth_swiglu(
                    h, fc2.smooth_scale, fc2.smooth_amax, self.training, out_quantizer, grad_quantizer
                )
            else:
                h = _SwiGLU.apply(h, None, grad_quantizer)
                h = smooth_input(h, fc2.smooth_scale, fc2.smooth_amax, self.training)
        else:
            h = _SwiGLU.apply(h, *self._fp8_quantizers())
        out = fc2(h, is_first_microbatch=first_microbatch)
        return out.view(*shape[:-1], out.shape[-1])


def _first_forward_scale(quantizer: Any, module: nn.Module, index: int) -> None:
    """Point `quantizer` (a copy of one of `module`'s delayed-scaling quantizers) at the scale the first forward
    used, and at an amax of its own, for a kernel that writes `module`'s input during a recomputation.

    TE's checkpoint stashes each module's scales and amax history when the module's forward starts in the first
    forward, and swaps them in when the module's forward starts in the recomputation; a kernel that runs before
    the module (the fused SwiGLU writing linear_fc2's FP8 input) would otherwise quantize with the scales updated
    since, and record an amax that the next update would count a second time. The stash to be swapped in next is
    the oldest of the module's queue (TE pops it in order)."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    queue = FP8GlobalStateManager.quantization_state.fp8_tensors_recompute_buffer
    _, scale = queue[module.fp8_meta["global_fp8_buffer_pos_fwd_recompute"]][0]
    quantizer.scale = scale[index]
    quantizer.amax = torch.zeros(1, dtype=torch.float32, device=scale.device)
