"""Optimizer, learning-rate schedule, gradient clipping."""

from .optimizer import MixedPrecisionAdamW

__all__ = ["MixedPrecisionAdamW"]
