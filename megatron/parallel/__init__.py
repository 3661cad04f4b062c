"""Process groups, tensor/sequence-parallel collectives, the pipeline schedule and data-parallel gradients."""

from .data_parallel import GradientBuffers
from .dims import ParallelDims, init_distributed, world_size_from_env

__all__ = ["GradientBuffers", "ParallelDims", "init_distributed", "world_size_from_env"]
