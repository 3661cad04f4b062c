"""GPT-2's byte-level BPE, in plain Python: reads the usual `vocab.json` + `merges.txt` pair.

Encoding a text:
  1. pre-tokenize with GPT-2's regular expression (contractions, letter runs, digit runs, punctuation runs, spaces;
     a single leading space sticks to the following word), through the `regex` package for `\\p{L}` / `\\p{N}`;
  2. map each chunk's UTF-8 bytes to printable characters (`byte_to_unicode`), so every byte is a vocabulary symbol;
  3. merge adjacent symbols, always the pair with the lowest rank in `merges.txt` first, until no pair is mergeable;
  4. look the final symbols up in `vocab.json`.
Ids equal HF `tokenizers`' byte-level BPE on the same files (tests/unit/test_tokenizers.py checks it).
"""

from __future__ import annotations

import functools
import json

import regex

from megatron.untrusted import read_json

from .errors import DataError

# GPT-2's pre-tokenization pattern.
PRETOKENIZE_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
END_OF_TEXT = "<|endoftext|>"


@functools.cache
def byte_to_unicode() -> dict[int, str]:
    """A reversible map from the 256 byte values to printable characters.

    Printable Latin-1 bytes ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for themselves; the other 68 bytes (controls,
    space, soft hyphen) take the code points 256, 257, ... in byte order, so no symbol is whitespace or invisible.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def read_merges(path: str) -> list[tuple[str, str]]:
    """The merge rules of merges.txt, best first; a `#version` header line and blank lines are skipped."""
    merges = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not a GPT-2 merges.txt (not UTF-8 text: {err})") from None
    for number, line in enumerate(lines, 1):
        if not line or line.startswith("#version"):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise DataError(f"{path}:{number}: a merge rule is two symbols separated by one space, got {line!r}")
        merges.append((parts[0], parts[1]))
    return merges


class ByteLevelBPE:
    """Encoder/decoder for a GPT-2 style vocabulary (`vocab.json`: symbol -> id) and merge list."""

    def __init__(self, vocab_file: str, merge_file: str):
        try:
            self.encoder: dict[str, int] = read_json(vocab_file, "--vocab-file")
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise DataError(f"{vocab_file}: not a GPT-2 vocab.json (a JSON object of symbol: id): {err}") from None
        if not isinstance(self.encoder, dict) or not all(
            isinstance(s, str) and type(i) is int and i >= 0 for s, i in self.encoder.items()
        ):
            raise DataError(f"{vocab_file}: not a GPT-2 vocab.json (a JSON object of symbol: non-negative id)")
        self.decoder = {i: s for s, i in self.encoder.items()}
        self.ranks = {pair: rank for rank, pair in enumerate(read_merges(merge_file))}
        self.byte_encoder = byte_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self.pattern = regex.compile(PRETOKENIZE_PATTERN)
        self._cache: dict[str, list[int]] = {}

    def _bpe(self, word: str) -> list[str]:
        """Merge the symbols of one pre-token, lowest-ranked pair first, every occurrence left to right."""
        symbols = list(word)
        while len(symbols) > 1:
            best = min(zip(symbols, symbols[1:]), key=lambda pair: self.ranks.get(pair, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and symbols[i] == best[0] and symbols[i + 1] == best[1]:
                    merged.append(best[0] + best[1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        return symbols

    def _encode_word(self, word: str) -> list[int]:
        ids = self._cache.get(word)
        if ids is None:
            symbols = "".join(self.byte_encoder[b] for b in word.encode("utf-8"))
            try:
                ids = [self.encoder[s] for s in self._bpe(symbols)]
            except KeyError as err:
                raise DataError(f"symbol {err.args[0]!r} comes out of the merges but is not in vocab.json") from err
            if len(self._cache) < 1_000_000:  # bounded: a pathological corpus must not eat the memory
                self._cache[word] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for word in self.pattern.findall(text):
            ids.extend(self._encode_word(word))
        return ids

    def decode(self, ids: list[int]) -> str:
        data = bytes(self.byte_decoder[c] for i in ids for c in self.decoder[int(i)])
        return data.decode("utf-8", errors="replace")
