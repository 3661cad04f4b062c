"""Process groups, tensor/sequence-parallel collectives, the pipeline schedule and data-parallel gradients."""

from .data_parallel import GradientBuffers
from .dims import ParallelDims, init_distributed, world_size_from_env
from .grads import grad_norm, reduce_model_parallel_grads

__all__ = [
    "GradientBuffers",
    "ParallelDims",
    "grad_norm",
    "init_distributed",
    "reduce_model_parallel_grads",
    "world_size_from_env",
]
