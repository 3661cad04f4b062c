"""Tokenizers, Megatron-LM's indexed datasets, the GPT dataset with blending, and the order in which ranks read."""

from .blended_dataset import BlendedDataset
from .builder import Datasets, build_datasets
from .errors import DataError
from .gpt_dataset import GPTDataset
from .indexed_dataset import IndexedDataset, IndexedDatasetError, IndexedDatasetWriter
from .sampler import PretrainingSampler
from .tokenizers import build_tokenizer, padded_vocab_size

__all__ = [
    "BlendedDataset",
    "DataError",
    "Datasets",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetError",
    "IndexedDatasetWriter",
    "PretrainingSampler",
    "build_datasets",
    "build_tokenizer",
    "padded_vocab_size",
]
