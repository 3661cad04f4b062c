"""Megatron-LM's TikTokenizer: a byte-level BPE vocabulary stored as JSON, encoded by the `tiktoken` package.

The vocabulary file (`--tokenizer-model`) is a JSON list; entry i is

    {"rank": i, "token_bytes": "<base64 of the token's bytes>", "token_str": "<readable form>"}

where the rank is the merge priority and entries 0..255 are the single bytes 0..255 in order (so any text
encodes). Ids, as in Megatron-LM: the special tokens come first (ids 0..N-1 with N = --tiktoken-num-special-tokens:
--tokenizer-special-tokens, then `<SPECIAL_k>` fillers), then entry i of the file is id N + i. --vocab-size is the
whole vocabulary; file entries beyond it are cut. `</s>` ends documents. Special tokens written in the text encode
to their own ids (Megatron-LM encodes with every special token allowed).
"""

from __future__ import annotations

import base64
import json
import os

from megatron.config import DataConfig
from megatron.config.data import TIKTOKEN_SPECIAL_TOKENS
from megatron.untrusted import read_json

from .errors import DataError

# The pre-tokenization regexes Megatron-LM calls v1 and v2. They decide where BPE may merge, so they are part of the
# ids' definition and must match character for character.
PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}
MAX_VOCAB = 2**17  # Megatron-LM's default vocabulary size for TikTokenizer


def load_ranks(path: str, max_entries: int | None) -> dict[bytes, int]:
    """The file's tokens (its first `max_entries`, all when None) as {bytes: rank}; DataError on a malformed file."""
    try:
        entries = read_json(path, "--tokenizer-model")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(
            f"{path}: not a TikTokenizer vocabulary (JSON list of rank/token_bytes entries): {err}"
        ) from None
    if not isinstance(entries, list):
        raise DataError(f"{path}: a TikTokenizer vocabulary is a JSON list of {{rank, token_bytes, token_str}}")
    ranks: dict[bytes, int] = {}
    for i, entry in enumerate(entries[:max_entries]):
        if not isinstance(entry, dict) or entry.get("rank") != i or "token_bytes" not in entry:
            raise DataError(f"{path}: entry {i} should be {{'rank': {i}, 'token_bytes': ..., 'token_str': ...}}")
        try:
            token = base64.b64decode(entry["token_bytes"], validate=True)
        except (ValueError, TypeError):  # binascii.Error, or a str of other than ASCII
            raise DataError(f"{path}: entry {i}: token_bytes is not base64") from None
        if i < 256 and token != bytes([i]):
            raise DataError(f"{path}: entry {i} must be the single byte {i} (entries 0..255 are the 256 bytes)")
        if token in ranks:
            raise DataError(f"{path}: entry {i} repeats the token of entry {ranks[token]}")
        ranks[token] = i
    if len(ranks) < 256:
        raise DataError(f"{path}: {len(ranks)} entries; a byte-level vocabulary needs at least the 256 bytes")
    return ranks


class TikTokenizer:
    """Megatron-LM's `TikTokenizer` ids and `eod` (see the module docstring); `tiktoken` runs the BPE."""

    def __init__(
        self,
        path: str,
        pattern: str | None = None,
        num_special_tokens: int = 1000,
        special_tokens: list[str] | None = None,
        vocab_size: int | None = None,
    ):
        try:
            import tiktoken
        except ImportError:
            raise DataError("--tokenizer-type TikTokenizer needs the tiktoken package: pip install tiktoken") from None
        special = list(special_tokens or TIKTOKEN_SPECIAL_TOKENS)
        special += [f"<SPECIAL_{i}>" for i in range(len(special), num_special_tokens)]
        limit = (vocab_size if vocab_size is not None else MAX_VOCAB) - num_special_tokens
        ranks = load_ranks(path, limit)
        if vocab_size is not None and len(ranks) < limit:
            raise DataError(
                f"--vocab-size {vocab_size} needs {limit} entries in {path} after the {num_special_tokens} special"
                f" tokens, it has {len(ranks)}; use --vocab-size {num_special_tokens + len(ranks)} or less"
            )
        # Shifting every rank by the same amount keeps the merge order; the special tokens take the ids below.
        mergeable = {token: rank + num_special_tokens for token, rank in ranks.items()}
        self.special = {token: i for i, token in enumerate(special)}
        self.encoding = tiktoken.Encoding(
            name=os.path.basename(path),
            pat_str=PATTERNS[pattern or "v2"],
            mergeable_ranks=mergeable,
            special_tokens=self.special,
        )
        self.vocab_size = num_special_tokens + len(ranks)
        self.eod = self.special["</s>"]

    def tokenize(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special="all")

    def detokenize(self, ids: list[int]) -> str:
        return self.encoding.decode([int(i) for i in ids])


def build_tiktokenizer(cfg: DataConfig, path: str) -> TikTokenizer:
    return TikTokenizer(
        path,
        pattern=cfg.tiktoken_pattern,
        num_special_tokens=cfg.tiktoken_num_special_tokens,
        special_tokens=cfg.special_tokens,
        vocab_size=cfg.vocab_size,
    )
