"""Tokenizers, datasets and the order in which ranks read them."""

from .builder import Datasets, build_datasets
from .sampler import PretrainingSampler
from .tokenizers import build_tokenizer, padded_vocab_size

__all__ = ["Datasets", "PretrainingSampler", "build_datasets", "build_tokenizer", "padded_vocab_size"]
