"""Data and tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

from .base import option, require


@dataclass
class DataConfig:
    mock_data: bool = False
    """Train on a deterministic synthetic token stream instead of --data-path (no files needed)."""
    data_path: list[str] | None = option(None, nargs="+")
    """Dataset prefix (path without .bin/.idx), or a weighted blend: `0.3 /data/a 0.7 /data/b`."""
    split: str = "969,30,1"
    """Train/validation/test proportions of --data-path, comma-separated."""
    tokenizer_type: str = option(
        "NullTokenizer",
        choices=["NullTokenizer", "GPT2BPETokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer"],
    )
    """Tokenizer: NullTokenizer (ids are the data; needs --vocab-size), GPT2BPETokenizer, SentencePieceTokenizer,
    HuggingFaceTokenizer."""
    vocab_size: int | None = None
    """Vocabulary size for NullTokenizer (the end-of-document id is vocab_size - 1)."""
    vocab_file: str | None = None
    """GPT-2 BPE vocabulary (vocab.json)."""
    merge_file: str | None = None
    """GPT-2 BPE merges (merges.txt)."""
    tokenizer_model: str | None = None
    """SentencePiece model file, or a tokenizer.json / folder for HuggingFaceTokenizer."""
    make_vocab_size_divisible_by: int = 128
    """Pad the model's vocabulary to a multiple of this (times the tensor-parallel size)."""
    num_workers: int = 0
    """Data-loader worker processes."""

    def finalize(self) -> None:
        require(self.make_vocab_size_divisible_by >= 1, "--make-vocab-size-divisible-by must be >= 1")
        require(self.num_workers >= 0, "--num-workers must be >= 0")
        require(
            self.mock_data or self.data_path,
            "no training data: pass --data-path PREFIX (or a weighted blend), or --mock-data",
        )
        require(not (self.mock_data and self.data_path), "--mock-data and --data-path exclude each other; pick one")
        if self.tokenizer_type == "NullTokenizer":
            require(
                self.vocab_size is not None and self.vocab_size >= 2,
                "--tokenizer-type NullTokenizer needs --vocab-size N (N >= 2)",
            )
