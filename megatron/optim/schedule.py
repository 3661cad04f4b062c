"""Learning-rate schedule (Megatron-LM's OptimizerParamScheduler, for the decay styles we expose).

    warmup (step < W):           lr = max_lr * step / W
    after decay (step > D):      lr = min_lr
    otherwise, r = (step - W) / (D - W):
        constant:                lr = max_lr
        linear:                  lr = min_lr + (max_lr - min_lr) * (1 - r)
        cosine:                  lr = min_lr + (max_lr - min_lr) * 0.5 * (cos(pi * r) + 1)

`step` counts optimizer steps taken so far, so the first step runs at lr(0) (= 0 with warmup, as in Megatron).
"""

from __future__ import annotations

import math

from megatron.config import OptimizerConfig


def learning_rate(step: int, cfg: OptimizerConfig) -> float:
    max_lr, min_lr = cfg.lr, cfg.min_lr
    warmup, decay = cfg.lr_warmup_iters, cfg.lr_decay_iters
    assert decay is not None, "finalize the configuration first"
    if warmup > 0 and step <= warmup:
        return max_lr * step / warmup
    if cfg.lr_decay_style == "constant":
        return max_lr
    if step > decay:
        return min_lr
    ratio = (step - warmup) / max(decay - warmup, 1)
    if cfg.lr_decay_style == "linear":
        coeff = 1.0 - ratio
    else:
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)
