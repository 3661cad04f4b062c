"""Process groups, tensor/sequence-parallel collectives, the pipeline schedule and data-parallel gradients."""

from .data_parallel import GradientBuffers
from .dims import ParallelDims, init_distributed, world_size_from_env
from .grads import counts_in_grad_norm, grad_norm, reduce_sequence_parallel_grads, reduce_tied_embedding_grads

__all__ = [
    "GradientBuffers",
    "ParallelDims",
    "counts_in_grad_norm",
    "grad_norm",
    "init_distributed",
    "reduce_sequence_parallel_grads",
    "reduce_tied_embedding_grads",
    "world_size_from_env",
]
