"""Training loop, logging, FLOPs accounting."""

from .train_state import TrainState
from .trainer import Trainer, pretrain

__all__ = ["TrainState", "Trainer", "pretrain"]
