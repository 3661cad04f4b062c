"""Learning-rate schedule (Megatron-LM's OptimizerParamScheduler), counted in consumed samples.

With n samples consumed before the step, warmup W and decay end D (both in samples), init = --lr-warmup-init:

    warmup (W > 0, n <= W):      lr = init + (max_lr - init) * n / W
    constant:                    lr = max_lr
    after decay (n > D):         lr = min_lr
    inverse-square-root:         lr = max(min_lr, max_lr * sqrt(max(W, 1) / max(n, 1)))
    otherwise, r = (n - W) / (D - W), lr = min_lr + (max_lr - min_lr) * c with
        linear:                  c = 1 - r
        cosine:                  c = (cos(pi * r) + 1) / 2
        WSD, annealing the last A samples: c = 1 while n <= D - A; after it, with a = (n - (D - A)) / A,
            exponential 2 * 0.5^a - 1 | linear 1 - a | cosine (cos(pi * a) + 1) / 2 | minus_sqrt 1 - sqrt(a)

Iteration-based flags become samples at the (final) global batch size G: W = --lr-warmup-iters x G, D =
--lr-decay-iters x G, A = --lr-wsd-decay-iters x G; so with a constant batch size the curve is the iteration-based
one, and under a batch-size ramp the schedule follows the samples actually consumed (Megatron-LM's behaviour).
--lr-warmup-fraction sets W = fraction x D. The embedding and output layer follow the same curve between
--decoupled-lr and --decoupled-min-lr when those are given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron.config import OptimizerConfig

DEFAULT, DECOUPLED = "default", "decoupled"
"""Learning-rate groups: every parameter, and (with --decoupled-lr) the input embedding and output layer."""


def lr_group(name: str) -> str:
    """The learning-rate group of a model parameter, by its name in GPTModel: the word embeddings and the output
    layer's weight are Megatron-LM's `is_embedding_or_output_parameter`s (position embeddings are not)."""
    return DECOUPLED if name in ("embedding.word_embeddings.weight", "output_layer.weight") else DEFAULT


@dataclass(frozen=True)
class LearningRates:
    """The learning rate of each group for one step."""

    default: float
    decoupled: float

    def of(self, group: str) -> float:
        return self.decoupled if group == DECOUPLED else self.default


@dataclass(frozen=True)
class LRSchedule:
    max_lr: float
    min_lr: float
    init_lr: float
    warmup: float
    """Warmup length in samples."""
    decay: float
    """Consumed samples at which decay ends."""
    style: str
    wsd_decay: float | None = None
    """WSD's annealing length in samples."""
    wsd_style: str = "exponential"
    decoupled_max_lr: float | None = None
    decoupled_min_lr: float | None = None

    @classmethod
    def from_config(cls, cfg: OptimizerConfig, global_batch_size: int = 1) -> LRSchedule:
        """The schedule of a finalized configuration; `global_batch_size` converts iteration-based flags."""
        if cfg.lr_decay_iters is not None:  # iteration-based
            decay = cfg.lr_decay_iters * global_batch_size
            warmup = cfg.lr_warmup_iters * global_batch_size
            wsd = None if cfg.lr_wsd_decay_iters is None else cfg.lr_wsd_decay_iters * global_batch_size
        else:
            assert cfg.lr_decay_samples is not None, "finalize the configuration first"
            decay, warmup, wsd = cfg.lr_decay_samples, cfg.lr_warmup_samples, cfg.lr_wsd_decay_samples
        if cfg.lr_warmup_fraction is not None:
            warmup = cfg.lr_warmup_fraction * decay
        decoupled_min = cfg.min_lr if cfg.decoupled_min_lr is None else cfg.decoupled_min_lr
        return cls(
            max_lr=cfg.lr,
            min_lr=cfg.min_lr,
            init_lr=cfg.lr_warmup_init,
            warmup=warmup,
            decay=decay,
            style=cfg.lr_decay_style,
            wsd_decay=wsd,
            wsd_style=cfg.lr_wsd_decay_style,
            decoupled_max_lr=cfg.decoupled_lr,
            decoupled_min_lr=decoupled_min if cfg.decoupled_lr is not None else None,
        )

    def lr(self, samples: float, max_lr: float | None = None, min_lr: float | None = None) -> float:
        """The learning rate after `samples` consumed samples, between `max_lr` and `min_lr` (default: --lr and
        --min-lr)."""
        max_lr = self.max_lr if max_lr is None else max_lr
        min_lr = self.min_lr if min_lr is None else min_lr
        if self.warmup > 0 and samples <= self.warmup:
            return self.init_lr + (max_lr - self.init_lr) * samples / self.warmup
        if self.style == "constant":
            return max_lr
        if samples > self.decay:
            return min_lr
        if self.style == "inverse-square-root":
            return max(min_lr, max_lr * math.sqrt(max(self.warmup, 1)) / math.sqrt(max(samples, 1)))
        ratio = (samples - self.warmup) / max(self.decay - self.warmup, 1)
        if self.style == "linear":
            coeff = 1.0 - ratio
        elif self.style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD
            assert self.wsd_decay is not None
            anneal_start = self.decay - self.wsd_decay
            coeff = (
                1.0 if samples <= anneal_start else _anneal(self.wsd_style, (samples - anneal_start) / self.wsd_decay)
            )
        return min_lr + coeff * (max_lr - min_lr)

    def at(self, samples: float) -> LearningRates:
        """Every group's learning rate after `samples` consumed samples."""
        default = self.lr(samples)
        if self.decoupled_max_lr is None:
            return LearningRates(default, default)
        return LearningRates(default, self.lr(samples, self.decoupled_max_lr, self.decoupled_min_lr))


def _anneal(style: str, ratio: float) -> float:
    if style == "exponential":
        return 2.0 * 0.5**ratio - 1.0
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return 1.0 - math.sqrt(ratio)  # minus_sqrt
