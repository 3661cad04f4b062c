"""Tokenizers, with Megatron-LM's ids so corpora preprocessed there train here unchanged.

Each exposes `vocab_size`, `eod` (the end-of-document id), `tokenize(text) -> list[int]` and
`detokenize(ids) -> str`. The model's vocabulary is `padded_vocab_size(...)`, at least `vocab_size`.
"""

from __future__ import annotations

import os

from megatron.config import DataConfig
from megatron.untrusted import check_json_file, read_json, require_file

from .errors import DataError
from .gpt2_bpe import END_OF_TEXT, ByteLevelBPE
from .tiktoken_tokenizer import build_tiktokenizer


class NullTokenizer:
    """The data already is token ids (Megatron-LM's rule): `--vocab-size N` makes ids 0..N-1 tokens and N the
    end-of-document id, so the vocabulary holds N + 1 entries. Text is ids separated by spaces."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size + 1
        self.eod = vocab_size

    def tokenize(self, text: str) -> list[int]:
        words = text.split()
        ids = [int(w) if w.isascii() and w.isdigit() else -1 for w in words]
        bad = next((w for w, i in zip(words, ids) if not 0 <= i < self.vocab_size), None)
        if bad is not None:  # else a traceback (int("x")) or an id the dataset's dtype cannot hold
            raise DataError(f"NullTokenizer reads ids 0..{self.vocab_size - 1} separated by spaces, got {bad!r:.40}")
        return ids

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class GPT2BPETokenizer:
    """Byte-level BPE from GPT-2's `vocab.json` + `merges.txt`; `<|endoftext|>` (which must be in the vocabulary)
    ends documents. Encoding never produces it from text: it is appended by `--append-eod`."""

    def __init__(self, vocab_file: str, merge_file: str):
        self.bpe = ByteLevelBPE(vocab_file, merge_file)
        if END_OF_TEXT not in self.bpe.encoder:
            raise DataError(f"{vocab_file} has no {END_OF_TEXT} entry, the end-of-document token GPT-2 BPE uses")
        self.vocab_size = len(self.bpe.encoder)
        self.eod = self.bpe.encoder[END_OF_TEXT]

    def tokenize(self, text: str) -> list[int]:
        return self.bpe.encode(text)

    def detokenize(self, ids: list[int]) -> str:
        return self.bpe.decode(ids)


class SentencePieceTokenizer:
    """Megatron-LM's `SentencePieceTokenizer`: the model's pieces, then the special tokens `<CLS>`, `<SEP>`, `<EOD>`,
    `<MASK>` and the pad/bos/eos pieces appended after the last piece when the model lacks them. `<EOD>` ends
    documents, and special tokens written in the text encode to their own ids."""

    def __init__(self, model_file: str):
        self.sp = _load_sentencepiece(model_file)
        vocab = {self.sp.id_to_piece(i): i for i in range(self.sp.get_piece_size())}
        self.special: dict[str, int] = {}
        for token in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"):
            self._add_special(vocab, token)
        # The model's own pad/bos/eos pieces when it defines them (id >= 0), else Megatron's fallback names.
        for model_id, fallback in zip(
            (self.sp.pad_id(), self.sp.bos_id(), self.sp.eos_id()), ("<PAD>", "<BOS>", "<EOS>")
        ):
            self._add_special(vocab, self.sp.id_to_piece(model_id) if model_id >= 0 else fallback)
        self.vocab_size = len(vocab)
        self.eod = self.special["<EOD>"]
        self.special_by_id = {i: t for t, i in self.special.items()}

    def _add_special(self, vocab: dict[str, int], token: str) -> None:
        if token not in vocab:
            vocab[token] = len(vocab)
        self.special[token] = vocab[token]

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        start = 0
        while True:
            # The earliest special token in the rest of the text; ties go to the first-registered token.
            found = [(text.find(token, start), token) for token in self.special]
            found = [(pos, token) for pos, token in found if pos >= 0]
            if not found:
                break
            pos, token = min(found, key=lambda item: item[0])
            ids += self.sp.encode_as_ids(text[start:pos]) + [self.special[token]]
            start = pos + len(token)
        return ids + self.sp.encode_as_ids(text[start:])

    def detokenize(self, ids: list[int]) -> str:
        pieces, run = [], []
        for i in map(int, ids):
            if i in self.special_by_id:
                pieces += [self.sp.decode_ids(run), self.special_by_id[i]]
                run = []
            else:
                run.append(i)
        pieces.append(self.sp.decode_ids(run))
        return " ".join(p for p in pieces if p)


class GPTSentencePieceTokenizer:
    """Megatron-LM's `GPTSentencePieceTokenizer`: the SentencePiece model as it is; its `</s>` (eos) ends documents."""

    def __init__(self, model_file: str):
        self.sp = _load_sentencepiece(model_file)
        if self.sp.eos_id() < 0:
            raise DataError(f"{model_file} has no eos piece; use --tokenizer-type SentencePieceTokenizer (adds <EOD>)")
        self.vocab_size = self.sp.get_piece_size()
        self.eod = self.sp.eos_id()

    def tokenize(self, text: str) -> list[int]:
        return self.sp.encode_as_ids(text)

    def detokenize(self, ids: list[int]) -> str:
        return self.sp.decode_ids([int(i) for i in ids])


# Names an end-of-document token goes by, tried in order when tokenizer_config.json does not name one.
_EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<EOD>")


class HuggingFaceTokenizer:
    """A `tokenizer.json` read by HF `tokenizers` (no `transformers` needed). `--tokenizer-model` is the file or a
    folder holding it. The end-of-document token is the `eos_token` of a `tokenizer_config.json` beside it, else the
    first of <|endoftext|>, </s>, <|end_of_text|>, <eos>, <|eot_id|>, <EOD> in the vocabulary. Encoding applies
    the file's post-processor (e.g. a BOS token), as `transformers` does by default."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(
                "--tokenizer-type HuggingFaceTokenizer needs HF tokenizers: pip install tokenizers"
            ) from None
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        try:
            check_json_file(file, "--tokenizer-model")  # sized and nested within the limits
            self.tokenizer = Tokenizer.from_file(file)
        except OSError as err:
            raise DataError(f"{file}: cannot be read ({err.strerror})") from None
        except Exception as err:  # tokenizers raises a bare Exception on malformed files
            raise DataError(f"{file}: not a HF tokenizer.json ({err})") from None
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        eos = _configured_eos(os.path.join(folder, "tokenizer_config.json"))
        candidates = [eos] if eos is not None else [name for name in _EOS_NAMES if name in vocab]
        if not candidates or candidates[0] not in vocab:
            raise DataError(
                f"{file}: cannot tell the end-of-document token; add a tokenizer_config.json naming its eos_token"
            )
        self.eod = vocab[candidates[0]]

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def _load_sentencepiece(model_file: str):
    import sentencepiece

    try:
        return sentencepiece.SentencePieceProcessor(model_file=model_file)
    except (OSError, RuntimeError) as err:
        raise DataError(f"{model_file}: not a SentencePiece model ({err})") from None


def _configured_eos(config_file: str) -> str | None:
    if not os.path.isfile(config_file):
        return None
    try:
        config = read_json(config_file)
    except ValueError as err:  # not JSON, not UTF-8
        raise DataError(f"{config_file}: not JSON ({err})") from None
    eos = config.get("eos_token") if isinstance(config, dict) else None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if eos is not None and not isinstance(eos, str):
        raise DataError(f"{config_file}: its eos_token is a {type(eos).__name__}, not the token's text")
    return eos


def _need_file(path: str | None, flag: str, tokenizer_type: str) -> str:
    if path is None:
        raise DataError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    if not os.path.exists(path):
        raise DataError(f"{flag} {path}: no such file")
    if tokenizer_type != "HuggingFaceTokenizer":  # whose --tokenizer-model may be the folder holding tokenizer.json
        require_file(path, flag)
    return path


def build_tokenizer(cfg: DataConfig):
    """The tokenizer named by --tokenizer-type, built from the file flags it needs."""
    if cfg.tokenizer_type is None:  # a DataConfig not finalized: resolve the default as finalize() does
        cfg.check_tokenizer()
    kind = cfg.tokenizer_type
    if kind == "NullTokenizer":
        return NullTokenizer(cfg.vocab_size)
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(
            _need_file(cfg.vocab_file, "--vocab-file", kind), _need_file(cfg.merge_file, "--merge-file", kind)
        )
    if kind == "SentencePieceTokenizer":
        return SentencePieceTokenizer(_need_file(cfg.tokenizer_model, "--tokenizer-model", kind))
    if kind == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(_need_file(cfg.tokenizer_model, "--tokenizer-model", kind))
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(_need_file(cfg.tokenizer_model, "--tokenizer-model", kind))
    if kind == "TikTokenizer":
        return build_tiktokenizer(cfg, _need_file(cfg.tokenizer_model, "--tokenizer-model", kind))
    raise DataError(f"unknown --tokenizer-type {kind}")


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int = 1) -> int:
    """Round the tokenizer's vocabulary up to a multiple of divisible_by x tensor-parallel size (Megatron-LM's rule),
    so the embedding splits evenly and its GEMMs get friendly shapes:
    padded = ceil(vocab_size / (divisible_by * tp)) * divisible_by * tp."""
    multiple = divisible_by * tensor_parallel_size
    return -(-vocab_size // multiple) * multiple
