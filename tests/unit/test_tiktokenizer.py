"""TikTokenizer: Megatron-LM's vocabulary file and ids (special tokens first, file entries shifted after them), the
v1/v2 patterns, --vocab-size cutting, flag checks, the preprocessing tool, and one-line errors."""

import base64
import json
import sys

import pytest

from megatron.config import ConfigError, DataConfig, parse_args
from megatron.data import IndexedDataset, build_tokenizer
from megatron.data.errors import DataError
from tests.assets.data_helpers import load_tool

pytest.importorskip("tiktoken")

MERGES = [b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b"AB", b"bC", b"CD"]


def write_vocab(path, merges=MERGES, first_bytes=256):
    tokens = [bytes([i]) for i in range(first_bytes)] + list(merges)
    entries = [
        {"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("utf-8", "replace")}
        for i, t in enumerate(tokens)
    ]
    path.write_text(json.dumps(entries))
    return path


def tiktokenizer(path, extra=""):
    cfg = parse_args(
        ["--mock-data", "--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(path), *extra.split()]
    )
    return build_tokenizer(cfg.data)


def test_ids_follow_megatrons_layout(tmp_path):
    vocab = write_vocab(tmp_path / "vocab.json")
    tok = tiktokenizer(vocab, "--tiktoken-num-special-tokens 10")
    n = 10
    assert tok.vocab_size == n + 256 + len(MERGES)
    assert tok.eod == 2  # </s>, third of <unk> <s> </s> <mask> <pad> <cls> <sep>
    assert tok.tokenize("A") == [n + ord("A")]
    assert tok.tokenize("the") == [n + 256 + MERGES.index(b"the")]
    # BPE merges by rank: " thing" -> " " "th" "i" "n" "g" -> " " "th" "in" "g" -> " " "th" "ing"
    merged = [n + 256 + MERGES.index(t) for t in (b"the", b"th", b"ing")]
    assert tok.tokenize("the thing") == [merged[0], n + ord(" "), merged[1], merged[2]]
    assert tok.tokenize("x</s><SPECIAL_9>") == [n + ord("x"), 2, 9]  # special tokens in the text are themselves
    text = "the thing, Straße 🎉 </s> ok"
    assert tok.detokenize(tok.tokenize(text)) == text
    default = tiktokenizer(vocab)  # 1000 special tokens, vocabulary size from the file
    assert default.vocab_size == 1000 + 256 + len(MERGES) and default.tokenize("A") == [1000 + ord("A")]


def test_custom_special_tokens_and_vocab_size_cut(tmp_path):
    vocab = write_vocab(tmp_path / "vocab.json")
    special = "<s> </s> <unk> <mask> <pad> <cls> <sep> <|im_start|>"
    tok = tiktokenizer(vocab, f"--tiktoken-num-special-tokens 8 --tokenizer-special-tokens {special}")
    assert tok.eod == 1 and tok.tokenize("<|im_start|>") == [7]
    cut = tiktokenizer(vocab, "--tiktoken-num-special-tokens 8 --vocab-size 266")  # the bytes, th, he
    assert cut.vocab_size == 266 and cut.tokenize("the") == [8 + 256 + 0, 8 + ord("e")]
    entries = 256 + len(MERGES)
    with pytest.raises(DataError, match=rf"400 needs 392 entries .* has {entries}; use --vocab-size {8 + entries} or"):
        tiktokenizer(vocab, "--tiktoken-num-special-tokens 8 --vocab-size 400")


def test_patterns_v1_and_v2_split_differently(tmp_path):
    vocab = write_vocab(tmp_path / "vocab.json")
    v1 = tiktokenizer(vocab, "--tiktoken-num-special-tokens 10 --tiktoken-pattern v1")
    v2 = tiktokenizer(vocab, "--tiktoken-num-special-tokens 10 --tiktoken-pattern v2")
    assert tiktokenizer(vocab, "--tiktoken-num-special-tokens 10").tokenize("abCD") == v2.tokenize("abCD")
    # v2 cuts a word where lower case turns upper (ab|CD), so "bC" cannot merge; v1 keeps the letters together.
    assert v1.tokenize("abCD") == [10 + ord("a"), 10 + 256 + MERGES.index(b"bC"), 10 + ord("D")]
    assert v2.tokenize("abCD") == [10 + ord("a"), 10 + ord("b"), 10 + 256 + MERGES.index(b"CD")]


def test_flag_checks_are_one_line(tmp_path):
    vocab = str(write_vocab(tmp_path / "vocab.json"))
    base = ["--mock-data", "--tokenizer-type", "TikTokenizer", "--tokenizer-model", vocab]
    for extra, match in [
        (["--tokenizer-special-tokens", "<s>", "</s>"], "must include <unk> <mask> <pad> <cls> <sep>"),
        (["--tiktoken-num-special-tokens", "5"], r"--tiktoken-num-special-tokens \(5\) must be >= the 7"),
        (["--vocab-size", "1100"], r"--vocab-size \(1100\) must cover the 1000 special tokens and the 256 byte"),
        (["--tiktoken-pattern", "v3"], "invalid choice"),
    ]:
        with pytest.raises(ConfigError, match=match) as err:
            parse_args(base + extra)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="--tokenizer-special-tokens is supported with --tokenizer-type TikTokenizer"):
        parse_args(["--mock-data", "--vocab-size", "8", "--tokenizer-special-tokens", "<s>"])
    with pytest.raises(ConfigError, match="--tokenizer-type TikTokenizer needs --tokenizer-model"):
        parse_args(["--mock-data", "--tokenizer-type", "TikTokenizer"])


def test_tiktoken_pattern_with_null_tokenizer_is_ignored_as_in_megatron():
    cfg = parse_args(
        ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--tiktoken-pattern", "v2"]
    )
    tok = build_tokenizer(cfg.data)
    assert (tok.vocab_size, tok.eod) == (129, 128)


def test_bad_vocabulary_files(tmp_path):
    (tmp_path / "notjson.json").write_text("{not json")
    (tmp_path / "dict.json").write_text(json.dumps({"a": 1}))
    write_vocab(tmp_path / "short.json", merges=[], first_bytes=100)
    entries = json.loads(write_vocab(tmp_path / "order.json").read_text())
    entries[3]["rank"] = 7
    (tmp_path / "order.json").write_text(json.dumps(entries))
    for name, match in [
        ("notjson.json", "not a TikTokenizer vocabulary"),
        ("dict.json", "is a JSON list"),
        ("short.json", "entries; a byte-level vocabulary needs at least the 256 bytes"),
        ("order.json", "entry 3 should be"),
    ]:
        with pytest.raises(DataError, match=match):
            tiktokenizer(tmp_path / name, "--tiktoken-num-special-tokens 10")
    with pytest.raises(ConfigError, match="--tokenizer-model .*: no such file"):
        tiktokenizer(tmp_path / "missing.json")


def test_missing_package_names_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(DataError, match="needs the tiktoken package: pip install tiktoken"):
        tiktokenizer(write_vocab(tmp_path / "vocab.json"))


def test_preprocess_tool_takes_the_tiktoken_flags(tmp_path):
    vocab = write_vocab(tmp_path / "vocab.json")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["the thing", "abCD"]))
    args = f"--input {corpus} --output-prefix {tmp_path / 'out'} --append-eod --tokenizer-type TikTokenizer"
    args += f" --tokenizer-model {vocab} --tiktoken-num-special-tokens 10 --tiktoken-pattern v1"
    assert load_tool("preprocess_data").main(args.split()) == 0
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    tok = build_tokenizer(
        DataConfig(
            tokenizer_type="TikTokenizer",
            tokenizer_model=str(vocab),
            tiktoken_num_special_tokens=10,
            tiktoken_pattern="v1",
        )
    )
    assert ds.get(0).tolist() == tok.tokenize("the thing") + [2]
    assert ds.get(1).tolist() == tok.tokenize("abCD") + [2]
