"""tools/preprocess_data.py: JSON lines in, Megatron datasets out, the same bytes with any number of workers; bad
lines reported with their line number (fail or skip), never dropped silently; and the default corpus's pieces."""

import json
import os
import re

import pytest

from megatron.data.default_corpus import MERGE_FILE, VOCAB_FILE, iter_documents, module_document
from megatron.data.indexed_dataset import IndexedDataset
from megatron.data.tokenizers import GPT2BPETokenizer
from tests.assets.data_helpers import load_tool

TOKENIZER = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", VOCAB_FILE, "--merge-file", MERGE_FILE]
DOCS = [
    {"text": "The quick brown fox.", "title": "Fox"},
    {"text": "Ünïcödé: 你好 🎉\nsecond line", "title": "Unicode"},
    {"text": "", "title": "Empty"},
    {"text": "def f(x):\n    return x\n" * 20, "title": "Code"},
]


@pytest.fixture(scope="module")
def preprocess():
    return load_tool("preprocess_data").main


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def test_round_trip_with_two_keys_and_any_worker_count(tmp_path, preprocess, capsys):
    corpus = write_lines(tmp_path / "c.jsonl", [json.dumps(d, ensure_ascii=False) for d in DOCS[:2]] + [""] + [
        json.dumps(d) for d in DOCS[2:]
    ])  # fmt: skip
    tokenizer = GPT2BPETokenizer(VOCAB_FILE, MERGE_FILE)
    outputs = {}
    for workers in (1, 2):
        prefix = str(tmp_path / f"w{workers}")
        argv = ["--input", corpus, "--output-prefix", prefix, "--json-keys", "text", "title", "--append-eod"]
        assert preprocess(argv + ["--workers", str(workers), "--log-interval", "2"] + TOKENIZER) == 0
        out, err = capsys.readouterr()
        assert out.split() == [f"{prefix}_text_document", f"{prefix}_title_document"]
        assert "processed 2 documents (" in err and " docs/s, " in err and " MB/s)" in err
        assert "done: 4 documents" in err and "skipped 0 bad and 1 blank lines" in err
        for key in ("text", "title"):
            ds = IndexedDataset(f"{prefix}_{key}_document")
            assert ds.dtype.name == "uint16" and ds.num_documents == 4
            assert [ds[i].tolist() for i in range(4)] == [tokenizer.tokenize(d[key]) + [tokenizer.eod] for d in DOCS]
            outputs.setdefault(key, []).append(
                (open(f"{prefix}_{key}_document.bin", "rb").read(), open(f"{prefix}_{key}_document.idx", "rb").read())
            )
    assert outputs["text"][0] == outputs["text"][1] and outputs["title"][0] == outputs["title"][1]


BAD_LINES = [
    ('{"text": "unterminated', r"bad\.jsonl:2: not valid JSON"),
    ('["a", "list"]', r"bad\.jsonl:2: not a JSON object \(list\)"),
    ('{"body": "no text key"}', r"bad\.jsonl:2: key 'text' is missing"),
    ('{"text": 42}', r"bad\.jsonl:2: key 'text' holds int, not a string"),
]


@pytest.mark.parametrize("line, message", BAD_LINES)
def test_bad_lines_fail_or_skip_with_their_line_number(tmp_path, preprocess, capsys, line, message):
    corpus = write_lines(tmp_path / "bad.jsonl", ['{"text": "good one"}', line, '{"text": "good two"}'])
    prefix = str(tmp_path / "out")
    assert preprocess(["--input", corpus, "--output-prefix", prefix] + TOKENIZER) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: " in err and "--on-bad-line skip" in err
    assert re.search(message, err)
    assert not [f for f in os.listdir(tmp_path) if f.startswith("out")]  # nothing half-written

    workers = "2" if "list" in line else "1"  # the report comes through the worker pool too
    argv = ["--input", corpus, "--output-prefix", prefix, "--on-bad-line", "skip", "--workers", workers]
    assert preprocess(argv + TOKENIZER) == 0
    err = capsys.readouterr().err
    assert re.search("skipping .*" + message, err) and "skipped 1 bad" in err
    assert IndexedDataset(f"{prefix}_text_document").num_documents == 2


def test_tool_rejects_bad_flags(tmp_path, preprocess, capsys):
    corpus = write_lines(tmp_path / "c.jsonl", ['{"text": "x"}'])
    argv = ["--input", corpus, "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "GPT2BPETokenizer"]
    assert preprocess(argv) == 1
    assert "needs --vocab-file vocab.json and --merge-file merges.txt" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        preprocess(["--input", str(tmp_path / "none.jsonl"), "--output-prefix", "o"] + TOKENIZER)
    assert re.search(r"--input .*none\.jsonl: no such file", capsys.readouterr().err)


def test_default_corpus_pieces():
    source = '''"""Module summary.\n\nMore words."""\nclass A(Base):\n    """A class."""\n    def m(self, x=1):\n
        """A method."""\ndef _private():\n    """Kept too."""\ndef undocumented(): pass\n'''
    text = module_document("pkg.mod", source)
    assert text == (
        "Module pkg.mod\n\nModule summary.\n\nMore words.\n\nclass A(Base)\n\nA class.\n\n"
        "A.m(self, x=1)\n\nA method.\n\n_private()\n\nKept too."
    )
    assert module_document("broken", "def (:") is None and module_document("bare", "x = 1") is None
    first = next(iter_documents())
    assert set(first) == {"text", "source"} and len(first["text"]) > 100
