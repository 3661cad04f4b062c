"""Data and tokenizer."""

from __future__ import annotations

import argparse
import glob
import os
from dataclasses import dataclass

from .base import ConfigError, option, require

TOKENIZER_TYPES = [
    "NullTokenizer",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "TikTokenizer",
]
# The special tokens every TikTokenizer vocabulary starts with, in Megatron-LM's order (`</s>` ends documents).
TIKTOKEN_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]


def parse_blend(data_path: list[str]) -> list[tuple[float, str]]:
    """`--data-path` as (weight, prefix) pairs with weights summing to 1: one prefix is weight 1, several prefixes
    each follow their weight (`0.3 /data/a 0.7 /data/b`). Raises ValueError with a one-line cause and fix."""
    if len(data_path) == 1:
        return [(1.0, data_path[0])]
    if len(data_path) % 2:
        raise ValueError("--data-path with several prefixes takes weight/prefix pairs: `0.3 /data/a 0.7 /data/b`")
    pairs = []
    for weight, prefix in zip(data_path[::2], data_path[1::2]):
        try:
            value = float(weight)
        except ValueError:
            raise ValueError(f"--data-path: {weight!r} should be the weight of {prefix!r}: `0.3 /data/a`") from None
        if not value > 0:
            raise ValueError(f"--data-path: the weight of {prefix} must be > 0, got {weight}")
        pairs.append((value, prefix))
    total = sum(w for w, _ in pairs)
    return [(w / total, p) for w, p in pairs]


def _prefix_hint(prefix: str) -> str:
    """How to name the dataset: the prefix without .bin/.idx, as tools/preprocess_data.py prints it (with the
    prefixes found in the named folder, when it holds some)."""
    stem = prefix[:-4] if prefix.endswith((".bin", ".idx")) else prefix
    if stem != prefix and os.path.isfile(stem + ".idx"):
        return f"--data-path takes the prefix without .bin/.idx: {stem}"
    found = sorted(path[:-4] for path in glob.glob(os.path.join(os.path.dirname(stem) or ".", "*.idx")))
    hint = "--data-path takes the prefix tools/preprocess_data.py printed, without .bin/.idx"
    return f"{hint} ({', '.join(found[:3])}{', ...' if len(found) > 3 else ''} in its folder)" if found else hint


def parse_split(split: str) -> list[float]:
    """`--split 969,30,1` as train/valid/test fractions summing to 1 (missing entries are 0). One pair of quotes
    around the whole value is dropped: Megatron-LM's llama3 script expands `"--split '99,1,0'"` unquoted, so the
    program receives `'99,1,0'` quotes included, and Megatron-LM accepts it."""
    text = split.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    try:
        parts = [float(s) for s in text.replace("/", ",").split(",")]
    except ValueError:
        raise ValueError(f"--split {split!r}: give up to three comma-separated numbers, e.g. 969,30,1") from None
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"--split {split!r}: give up to three non-negative numbers with a positive sum, e.g. 969,30,1")
    parts += [0.0] * (3 - len(parts))
    return [p / sum(parts) for p in parts]


@dataclass
class DataConfig:
    mock_data: bool = False
    """Train on a deterministic synthetic token stream instead of --data-path (no files needed)."""
    data_path: list[str] | None = option(None, nargs="+")
    """Dataset prefix (path without .bin/.idx, as written by tools/preprocess_data.py), or a weighted blend:
    `0.3 /data/a 0.7 /data/b` (weights are normalized)."""
    split: str = "969,30,1"
    """Train/validation/test proportions of the documents of every --data-path prefix, comma-separated."""
    data_cache_path: str | None = None
    """Directory for the cached sample-index arrays; defaults to `index-cache/` beside each dataset's files."""
    tokenizer_type: str | None = option(None, choices=TOKENIZER_TYPES)
    """Default: GPT2BPETokenizer when --vocab-file is given (Megatron-LM's pretrain_gpt.py default), else
    NullTokenizer. Tokenizer: NullTokenizer (ids are the data; needs --vocab-size), GPT2BPETokenizer (--vocab-file,
    --merge-file), SentencePieceTokenizer (Megatron's: adds <EOD> etc.; --tokenizer-model),
    GPTSentencePieceTokenizer (the model's eos ends documents; --tokenizer-model), HuggingFaceTokenizer
    (a tokenizer.json or its folder in --tokenizer-model), TikTokenizer (Megatron-LM's tiktoken vocabulary in
    --tokenizer-model; needs `pip install tiktoken`; `</s>` ends documents)."""
    vocab_size: int | None = None
    """NullTokenizer's number of token ids N: ids 0..N-1 are tokens, N is the end-of-document id (N + 1 in all,
    as in Megatron-LM). TikTokenizer: the whole vocabulary, special tokens included; the file's entries past it
    are cut (unset: all of the file, at most 131072 ids in all, Megatron-LM's default)."""
    vocab_file: str | None = None
    """GPT-2 BPE vocabulary (vocab.json)."""
    merge_file: str | None = None
    """GPT-2 BPE merges (merges.txt)."""
    tokenizer_model: str | None = None
    """SentencePiece model file, a tokenizer.json / folder for HuggingFaceTokenizer, or TikTokenizer's vocabulary
    (Megatron-LM's JSON list of {rank, token_bytes (base64), token_str} entries)."""
    make_vocab_size_divisible_by: int = 128
    """Pad the model's vocabulary to a multiple of this (times the tensor-parallel size)."""
    reset_position_ids: bool = False
    """Restart position ids at 0 after every end-of-document token inside a sample."""
    reset_attention_mask: bool = False
    """Stop attention across documents inside a sample: each sample carries an attention_mask [1, s, s] (True =
    the query may attend to the key; causal and block-diagonal by document)."""
    eod_mask_loss: bool = False
    """Exclude from the loss the positions whose input token is the end-of-document token (the prediction of the
    next document's first token)."""
    num_workers: int = 0
    """Data-loader worker processes."""
    create_attention_mask_in_dataloader: bool = option(
        True, flag="--no-create-attention-mask-in-dataloader", action="store_false"
    )
    """Whether the data loader may build attention masks. Here the attention applies the causal mask itself, so
    the loader builds one only for --reset-attention-mask (Megatron-LM's loader builds a causal [1, s, s] mask for
    every sample, which its fused attention then ignores). `--no-create-attention-mask-in-dataloader`: samples
    never carry a mask; with --reset-attention-mask that is an error (Megatron-LM would silently let documents
    attend to each other)."""
    mmap_bin_files: bool = option(True, action=argparse.BooleanOptionalAction)
    """Memory-map the .bin token files (the default). `--no-mmap-bin-files` (Megatron-LM's flag) reads each
    sample's tokens from the file with ordinary reads instead, for file systems where memory maps are slow or
    unreliable; the samples are the same."""
    tiktoken_pattern: str | None = option(None, choices=["v1", "v2"])
    """TikTokenizer's pre-tokenization regex (Megatron-LM's v1 or v2; v2 when unset). Other tokenizers ignore it,
    as in Megatron-LM (its llama3 example passes it with NullTokenizer)."""
    tiktoken_num_special_tokens: int = 1000
    """TikTokenizer: ids 0..N-1 are special tokens (--tokenizer-special-tokens, then `<SPECIAL_k>` fillers up to
    N); the vocabulary file's entries follow from id N. Other tokenizers ignore it."""
    special_tokens: list[str] | None = option(None, flag="--tokenizer-special-tokens", nargs="+")
    """TikTokenizer's special tokens, ids 0, 1, ...; must include <unk> <s> </s> <mask> <pad> <cls> <sep> (the
    default list, in that order). Only TikTokenizer takes it here."""

    def finalize(self) -> None:
        require(self.make_vocab_size_divisible_by >= 1, "--make-vocab-size-divisible-by must be >= 1")
        require(self.num_workers >= 0, "--num-workers must be >= 0")
        require(
            self.create_attention_mask_in_dataloader or not self.reset_attention_mask,
            "--reset-attention-mask needs the per-document attention mask the data loader builds: drop"
            " --no-create-attention-mask-in-dataloader or --reset-attention-mask",
        )
        require(
            self.mock_data or self.data_path,
            "no training data: pass --data-path PREFIX (or a weighted blend), or --mock-data",
        )
        require(not (self.mock_data and self.data_path), "--mock-data and --data-path exclude each other; pick one")
        try:
            if self.data_path:
                parse_blend(self.data_path)
            parse_split(self.split)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        self.check_tokenizer()

    def check_files(self) -> None:
        """The files the run will read exist: the .bin/.idx pair of every --data-path prefix and the tokenizer's
        files, checked with the flags, before anything is built."""
        for _, prefix in parse_blend(self.data_path) if self.data_path else []:
            missing = [path for path in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(path)]
            require(not missing, f"--data-path {prefix}: {' and '.join(missing)} not found; {_prefix_hint(prefix)}")
        if self.tokenizer_type == "GPT2BPETokenizer":
            files = {"--vocab-file": self.vocab_file, "--merge-file": self.merge_file}
        elif self.tokenizer_type != "NullTokenizer":
            files = {"--tokenizer-model": self.tokenizer_model}
        else:
            files = {}
        for flag, path in files.items():
            require(path is None or os.path.exists(path), f"{flag} {path}: no such file")

    def check_tokenizer(self) -> None:
        """The tokenizer flags alone (tools/preprocess_data.py checks them too)."""
        if self.tokenizer_type is None:
            self.tokenizer_type = "GPT2BPETokenizer" if self.vocab_file is not None else "NullTokenizer"
        if self.tokenizer_type == "NullTokenizer":
            require(
                self.vocab_size is not None and self.vocab_size >= 1,
                "--tokenizer-type NullTokenizer needs --vocab-size N (N >= 1 token ids; N is the end-of-document id)",
            )
        elif self.tokenizer_type == "GPT2BPETokenizer":
            require(
                self.vocab_file is not None and self.merge_file is not None,
                "--tokenizer-type GPT2BPETokenizer needs --vocab-file vocab.json and --merge-file merges.txt",
            )
        else:
            require(self.tokenizer_model is not None, f"--tokenizer-type {self.tokenizer_type} needs --tokenizer-model")
        if self.tokenizer_type == "TikTokenizer":
            self._check_tiktoken()
        else:
            require(
                self.special_tokens is None,
                f"--tokenizer-special-tokens is supported with --tokenizer-type TikTokenizer only, not"
                f" {self.tokenizer_type}",
            )

    def _check_tiktoken(self) -> None:
        special, count = self.special_tokens or TIKTOKEN_SPECIAL_TOKENS, self.tiktoken_num_special_tokens
        missing = [t for t in TIKTOKEN_SPECIAL_TOKENS if t not in special]
        require(not missing, f"--tokenizer-special-tokens must include {' '.join(missing)} (TikTokenizer needs them)")
        require(len(set(special)) == len(special), "--tokenizer-special-tokens lists a token twice")
        require(
            len(special) <= count,
            f"--tiktoken-num-special-tokens ({count}) must be >= the {len(special)} --tokenizer-special-tokens",
        )
        require(
            self.vocab_size is None or self.vocab_size >= count + 256,
            f"--vocab-size ({self.vocab_size}) must cover the {count} special tokens and the 256 byte tokens of"
            " TikTokenizer's vocabulary",
        )
