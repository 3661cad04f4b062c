"""Training loop, logging, FLOPs accounting."""

from .trainer import Trainer, TrainState, pretrain

__all__ = ["TrainState", "Trainer", "pretrain"]
