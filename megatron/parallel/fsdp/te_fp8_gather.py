"""FP8 all-gather of Transformer Engine's weights under FSDP2 (--fp8-param-gather with --use-megatron-fsdp and
--transformer-impl transformer_engine).

The shard is handled as the local layers' (fp8_gather.py): an fp32 main weight (or bf16 under
--use-precision-aware-optimizer) cast to E4M3 once per step, when the ranks agree its scale (fp8_max / amax of the
whole weight), into the bytes every all-gather of the step moves: one byte per element. What differs is the gathered
weight: a TE `Float8Tensor` over the gathered bytes, which TE's linears take as an already-quantized weight (as the
weights `quantized_model_init` builds) and feed to the FP8 GEMM without casting anything.

On Hopper the backward's dgrad GEMM reads the weight transposed, and TE writes that transpose into the tensor's
`_transpose` (`update_usage(columnwise_usage=True)`, in the backward only: the weight's quantizer asks for rows
alone). Left to TE, that would be a new allocation per weight, kept by the gathered parameter after FSDP has freed
its bytes, until the next all-gather: every layer's transpose alive at the end of the backward. Here the transpose
goes into a buffer returned to FSDP beside the gathered bytes, which FSDP allocates before each all-gather of the
unit and frees when it reshards the unit, so a transpose lives as long as its gathered weight. Under optim_grads
(gathered once per step) it is made at the first backward and reused by the step's later micro-batches. The one
exception is a weight's first all-gather, whose tensor FSDP copies into its parameter (see `fsdp_post_all_gather`):
there TE allocates the transpose, until the unit's next all-gather.

transformer_engine is imported inside functions only: importing this module on a CPU machine is harmless.
"""

from __future__ import annotations

from typing import Any

import torch

from .fp8_gather import Fp8ShardWeight, GatherScale, gathered_bytes


class TeGather:
    """What a TE weight's gathered FP8 tensor reuses from one all-gather to the next: its transpose buffer (None
    until the first all-gather, or where the GPU's FP8 GEMMs read the data itself: Blackwell)."""

    def __init__(self) -> None:
        self.transpose: torch.Tensor | None = None


class TeFp8ShardWeight(Fp8ShardWeight):
    """A shard of a TE linear's weight whose all-gather moves E4M3 bytes and yields a TE `Float8Tensor`."""

    _gather: TeGather

    def __init__(self, tensor: torch.Tensor, scale: GatherScale, gather: TeGather | None = None):
        super().__init__(tensor, scale)
        self._gather = gather or TeGather()

    def rewrap(self, tensor: torch.Tensor) -> TeFp8ShardWeight:
        return TeFp8ShardWeight(tensor, self._scale, self._gather)

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        inputs, metadata = super().fsdp_pre_all_gather(mesh, orig_size, contiguous_orig_stride, module, mp_policy)
        if metadata is None:  # gathered in the training dtype (its layer moved to bf16 by the FP8 guard)
            return inputs, None
        return inputs, (metadata[0], tuple(orig_size))

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """The gathered Float8Tensor (first gather; with the inner tensors FSDP frees at reshard and allocates
        again before the next gather: the bytes and the transpose buffer), or `out` pointed at this gather's bytes,
        its transpose to be rebuilt. Gathered in the training dtype: the plain weight TE's bf16 GEMM reads."""
        if metadata is None:
            return super().fsdp_post_all_gather(outputs, metadata, param_dtype, out=out)
        (padded,) = outputs
        scale_inv, orig_size = metadata
        data = gathered_rows(padded, orig_size)
        gather = self._gather
        if out is None:
            weight = _float8_tensor(data, scale_inv.reshape(1), param_dtype)
            if _needs_transpose():
                gather.transpose = torch.empty(orig_size[::-1], dtype=torch.uint8, device=data.device)
            inner = (padded,) if gather.transpose is None else (padded, gather.transpose)
        else:  # (its scale_inv is the weight's `GatherScale` tensor already, which `agree` updates)
            weight, inner = out, None
            weight._data = data
        # TE's backward fills the transpose through `out=`: into FSDP's buffer, not a new tensor. Not at the first
        # gather: FSDP makes its parameter from this tensor through TE's as_strided and detach, whose copies (TE's
        # `make_like`, 2.20) keep a buffer but not its invalid mark, and a unit kept gathered into its backward (the
        # last layer unit under optim_grads_params, all under optim_grads) would run its dgrad on the buffer as
        # allocated (on two H100s FSDP's first step then left the weights as they were). A valid buffer would not
        # do either: TE's as_strided views it with the data's strides. So that backward has TE allocate the
        # transpose, kept until the unit's next gather.
        if out is not None:
            weight._transpose, weight._transpose_invalid = gather.transpose, True
        return None if out is not None else (weight, inner)


def gathered_rows(padded: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The weight [out, in] in FSDP's gathered output, whose shards are padded to equal rows: a view of its bytes
    (gathered as a wider dtype: `fsdp_params.gather_view`)."""
    return gathered_bytes(padded).view(-1)[: shape[0] * shape[1]].view(shape)


def _float8_tensor(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> Any:
    """A TE Float8Tensor of E4M3 `data` (uint8) with `scale_inv`, nominally `dtype`, whose quantizer asks for the
    row-wise data only (the forward's; TE asks for the transpose itself in the backward)."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer, Float8Tensor

    ones, zeros = torch.ones(1, device=data.device), torch.zeros(1, device=data.device)
    quantizer = Float8Quantizer(ones, zeros, tex.DType.kFloat8E4M3, rowwise=True, columnwise=False)
    return Float8Tensor(
        shape=data.shape,
        dtype=dtype,
        data=data,
        fp8_scale_inv=scale_inv,
        fp8_dtype=tex.DType.kFloat8E4M3,
        quantizer=quantizer,
        requires_grad=False,
        device=data.device,
    )


def _needs_transpose() -> bool:
    """Hopper's FP8 GEMMs read both operands row-major ("TN"): the dgrad needs the weight's transpose."""
    from transformer_engine.pytorch.utils import is_non_tn_fp8_gemm_supported

    return not is_non_tn_fp8_gemm_supported()


def wrap_te_fp8_weight(weight: torch.Tensor, device: torch.device | None = None) -> torch.nn.Parameter:
    """A TE linear's (fp32 or bf16) weight as a parameter whose FSDP2 all-gather moves E4M3 bytes and yields a TE
    Float8Tensor; its scale is fp8_max / amax of the whole weight, agreed each step (`Fp8GatherScales`), and lives
    on `device` (default: the weight's; see `wrap_fp8_weight`)."""
    scale = GatherScale(weight.device if device is None else device, None)
    return torch.nn.Parameter(TeFp8ShardWeight(weight.detach(), scale))
