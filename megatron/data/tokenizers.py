"""Tokenizers. Each exposes `vocab_size`, `eod` (end-of-document id), `tokenize(text) -> list[int]` and
`detokenize(ids) -> str`."""

from __future__ import annotations

from megatron.config import DataConfig


class NullTokenizer:
    """The data already is token ids; ids 0..vocab_size-2 are tokens and vocab_size-1 is the end-of-document id."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)


def build_tokenizer(cfg: DataConfig):
    """The tokenizer named by --tokenizer-type."""
    if cfg.tokenizer_type == "NullTokenizer":
        return NullTokenizer(cfg.vocab_size)
    raise NotImplementedError(f"--tokenizer-type {cfg.tokenizer_type} is not implemented yet")


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int = 1) -> int:
    """Round the tokenizer's vocabulary up to a multiple of divisible_by x tensor-parallel size (Megatron-LM's rule),
    so the embedding splits evenly and its GEMMs get friendly shapes."""
    multiple = divisible_by * tensor_parallel_size
    return -(-vocab_size // multiple) * multiple
