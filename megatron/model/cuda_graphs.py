"""CUDA graphs for the Transformer Engine layers (`--cuda-graph-impl transformer_engine`).

Applied to a built model: `capture_te_layer_graphs(model, ...)` captures each transformer layer's forward and
backward with TE's `make_graphed_callables` and makes the layer replay them in training. Why: a TE layer issues
hundreds of kernels per micro-batch, each behind Python (module hooks, FP8 quantizer bookkeeping, autograd); when
the kernels are short (llama-1b, or any layer split by tensor parallelism) the GPU waits on that host work. A replay
is one launch per layer each way.

What stays right, and where:
  * FP8 delayed scaling: the graphs read the scaling factors in place, TE registers each graphed module's amaxes
    when the layer is called, and the amax reduction and scale update run outside the graphs, as in eager mode
    (forward: when the model's outer FP8 autocast exits; backward: after the first layer's backward).
  * FP8 weight casts once per step: TE's `cache_quantized_params`, driven by the layer's `is_first_microbatch`
    (weights with FP8 storage, --fp8-param-gather, have no cast to cache).
  * Gradients: the wgrad GEMMs captured write into the fp32 `main_grad` buffers, whose addresses never change
    (they are zeroed in place after each step); weights marked `fused_wgrad_accumulation` tell the buffers' hook
    that the gradient it sees is TE's placeholder. The hook still fires per parameter after each layer's backward
    replay, so overlapped data-parallel reduction works as in eager mode.
  * The capture's own warm-up passes run on random inputs and must leave no trace: the caller pauses the gradient
    buffers around it; TE restores its FP8 state and the RNG.

One graph per layer holds one micro-batch's activations, so a micro-batch's forward and backward must finish before
the next forward of that layer (true for the schedule without pipeline parallelism; the config refuses pipelines).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from .gpt import GPTModel


class _LayerBody(nn.Module):
    """What a graph holds: one layer's residual blocks, without its FP8 autocast (`make_graphed_callables` enters
    its own, per callable, while capturing) and with `is_first_microbatch=False` (during capture TE turns weight
    caching over to a device-side flag that each replay sets)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor, rotary: torch.Tensor | None = None) -> torch.Tensor:
        return self.layer._forward(x, rotary, None, False)


def capture_te_layer_graphs(
    model: GPTModel, micro_batch_size: int, dtype: torch.dtype, num_warmup_iters: int = 3
) -> float:
    """Capture every transformer layer of `model` (TE implementation, one pipeline stage) for micro-batches of
    `micro_batch_size` sequences of activations in `dtype`; returns the seconds it took. Call with the model in
    training mode and its gradient buffers paused (`GradientBuffers.paused`)."""
    import transformer_engine.pytorch as te

    start = time.perf_counter()
    cfg, tp = model.cfg, model.tp
    layers = list(model.decoder.layers)
    seq = cfg.seq_length // tp.size if tp.sequence_parallel else cfg.seq_length  # each rank's input rows
    device = torch.device("cuda", torch.cuda.current_device())
    rotary = () if model.rotary is None else (model.rotary(cfg.seq_length, None),)
    sample_args = tuple(
        (torch.randn(seq, micro_batch_size, cfg.hidden_size, dtype=dtype, device=device, requires_grad=True), *rotary)
        for _ in layers
    )
    for layer in layers:
        layer._sync_wgrad_fusion()  # decides which wgrad GEMMs write into main_grad: fixed once captured
    fp8 = model.te_fp8
    enabled = tuple(fp8 is not None and layer.layer_number in fp8.fp8_layers for layer in layers)
    graphed = te.make_graphed_callables(
        tuple(_LayerBody(layer) for layer in layers),
        sample_args,
        num_warmup_iters=num_warmup_iters,
        enabled=enabled,
        recipe=fp8.recipe if any(enabled) else None,
        amax_reduction_group=fp8.amax_group if any(enabled) else None,
        cache_quantized_params=any(enabled) and not fp8.fp8_params,
        # The buffers' hook consumes each returned gradient before the next replay can overwrite it.
        clone_param_grads_on_return=False,
    )
    for layer, body in zip(layers, graphed):
        # The body's forward is now TE's replay; holding the function (not the module) keeps the body out of the
        # layer's submodules (it contains the layer).
        layer.use_graph(body.forward)
    torch.cuda.synchronize()
    return time.perf_counter() - start
