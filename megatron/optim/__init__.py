"""Optimizer, learning-rate schedule, gradient clipping."""

from .optimizer import MixedPrecisionAdamW
from .schedule import learning_rate

__all__ = ["MixedPrecisionAdamW", "learning_rate"]
