"""A start-of-run memory estimate, per GPU (Megatron-LM's accounting, before fragmentation and workspaces).

Weights and optimizer: parameter bytes (2 in bf16, 4 in fp32) + fp32 main copy (bf16 only) + fp32 gradient
(accumulation buffer) + two fp32 Adam moments; the distributed optimizer keeps 1/dp of the main copy and moments.
Activations of one micro-batch without recomputation, Korthikanti et al. (2022), for 16-bit activations: per layer
s * b * h * (34 + 5 * a * s / h) bytes; SDPA's fused kernels do not keep the a * s * s attention matrix, so we drop
that term. With tensor parallelism t that is s * b * h * (10 + 24 / t), and 34 * s * b * h / t with sequence
parallelism; only this pipeline stage's layers count. Plus the fp32 logits and their gradient (8 * s * b * V / t).
"""

from __future__ import annotations

import torch

from megatron.config import Config


def _size(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def memory_estimate_lines(
    cfg: Config, num_params: int, vocab_size: int, dtype: torch.dtype, num_layers: int | None = None
) -> list[str]:
    """`num_params`: this rank's parameters; `num_layers`: this pipeline stage's layers (default: all)."""
    param_bytes = 2 if dtype == torch.bfloat16 else 4
    weights = num_params * param_bytes
    shards = cfg.data_parallel_size if cfg.optimizer.use_distributed_optimizer else 1
    main_copy = num_params * 4 / shards if dtype == torch.bfloat16 else 0
    grads = num_params * 4
    adam = num_params * 8 / shards
    m = cfg.model
    s, b, h = m.seq_length, cfg.training.micro_batch_size, m.hidden_size
    act_scale = 1.0 if dtype == torch.bfloat16 else 2.0
    tp = cfg.parallel.tensor_model_parallel_size
    per_layer = 34 / tp if cfg.parallel.sequence_parallel else 10 + 24 / tp
    layers = m.num_layers if num_layers is None else num_layers
    activations = layers * per_layer * s * b * h * act_scale
    logits = 8 * s * b * vocab_size / tp
    return [
        f"memory estimate per GPU: weights {_size(weights)}, fp32 main params {_size(main_copy)},"
        f" grads {_size(grads)}, Adam states {_size(adam)}, activations ~{_size(activations + logits)} per"
        f" micro-batch (total ~{_size(weights + main_copy + grads + adam + activations + logits)})"
    ]
