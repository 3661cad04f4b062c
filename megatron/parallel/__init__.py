"""Process groups and the collectives of data parallelism."""

from .data_parallel import allreduce_gradients
from .dims import ParallelDims, init_distributed, world_size_from_env

__all__ = ["ParallelDims", "allreduce_gradients", "init_distributed", "world_size_from_env"]
