"""Model FLOPs and MFU, with Megatron-LM's dense-GPT formula (`num_floating_point_operations` in its training.py).

Per iteration of B sequences of length s, L layers, hidden h, q = kv_channels * heads, ffn width f, vocab V:

    FLOPs = 12 * B * s * L * h^2 * [ (1 + groups/heads + s/h) * q/h      attention: QKV + proj GEMMs, QK^T and AV
                                     + (f/h) * (3/2 if SwiGLU else 1)     MLP GEMMs
                                     + V / (2 * L * h) ]                  output logits

12 = 2 (multiply-add) x 3 (forward, data gradient, weight gradient) x 2 (two GEMMs per block). Attention
convention: the s/h term counts the *full* s x s score and value matrices, with no halving for the causal mask (as
Megatron-LM releases up to Megatron-Core 0.9 do, and as most published MFU numbers assume). Activation
recomputation is not counted (model FLOPs, not hardware FLOPs).
"""

from __future__ import annotations

import torch

from megatron.config import ModelConfig

#: Dense bf16 tensor-core peak per device, TFLOP/s (vendor datasheets, without sparsity).
PEAK_BF16_TFLOPS = {
    "H100": 989.0,
    "H200": 989.0,
    "H800": 989.0,
    "GH200": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "B200": 2250.0,
    "GB200": 2500.0,
    "L40S": 362.0,
}


def num_floating_point_operations(cfg: ModelConfig, batch_size: int, padded_vocab_size: int) -> float:
    h, s, layers = cfg.hidden_size, cfg.seq_length, cfg.num_layers
    query_ratio = cfg.kv_channels * cfg.num_attention_heads / h
    gated = 1.5 if cfg.swiglu else 1.0
    per_layer = (
        (1 + cfg.num_query_groups / cfg.num_attention_heads + s / h) * query_ratio
        + (cfg.ffn_hidden_size / h) * gated
        + padded_vocab_size / (2 * layers * h)
    )
    return 12.0 * batch_size * s * layers * h * h * per_layer


def peak_tflops(device: torch.device) -> float | None:
    """The bf16 peak of this device from PEAK_BF16_TFLOPS, or None when unknown (CPU, other GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).upper()
    # Longest key first, so "GH200" is not taken for "H200".
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_TFLOPS[key]
    return None
