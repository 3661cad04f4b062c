"""Configuration: grouped dataclasses exposed as Megatron-LM flags, validated in one place."""

from .base import ConfigError
from .cli import all_flags, build_parser, parse_args
from .config import Config
from .data import DataConfig
from .model import ModelConfig
from .optimizer import OptimizerConfig
from .parallel import ParallelConfig
from .precision import PrecisionConfig
from .training import CheckpointConfig, LoggingConfig, TrainingConfig

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "TrainingConfig",
    "all_flags",
    "build_parser",
    "parse_args",
]
