"""Optimizer, learning-rate schedule, gradient clipping."""

from .optimizer import MixedPrecisionAdamW, global_grad_norm
from .schedule import learning_rate

__all__ = ["MixedPrecisionAdamW", "global_grad_norm", "learning_rate"]
