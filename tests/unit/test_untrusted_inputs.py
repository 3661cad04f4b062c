"""Files that are not what they should be, answered in one line or handled: JSON past the limits (megatron/untrusted.py)
in every reader, a directory where a file is expected, a damaged index-cache entry (rebuilt, as it is derived data),
and a blend of hundreds of --data-path prefixes under a small open-file limit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

from megatron.config import parse_args
from megatron.data import build_datasets, build_tokenizer
from megatron.data.index_cache import load_or_build
from megatron.errors import UserError
from megatron.untrusted import MAX_JSON_DEPTH, LimitExceeded, json_depth, parse_json, read_json
from tests.assets.data_helpers import write_documents

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "megatron" / "data" / "assets"


def test_json_depth_is_counted_outside_strings():
    text = json.dumps({"a": ["[[[{{", {"b": ['\\"]]]', [1, "\\\\"]]}], "c": "}}}"})
    assert json_depth(text.encode()) == 5
    assert json_depth((ASSETS / "stdlib-bpe-vocab.json").read_bytes()) == 1
    assert parse_json(text, "x") == json.loads(text)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[" * 100_000 + "]" * 100_000, f"nests JSON 100000 deep, over the limit of {MAX_JSON_DEPTH}"),
        ('{"a":' * 5_000 + "1" + "}" * 5_000, "nests JSON 5000 deep"),
        ("1" * 100_000, "Exceeds the limit"),  # Python's limit on an integer's digits
    ],
)
def test_json_past_the_limits_is_one_line(tmp_path, text, message):
    file = tmp_path / "config.json"
    file.write_text(text)
    with pytest.raises(LimitExceeded, match=message) as info:
        read_json(file)
    assert str(file) in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(json.JSONDecodeError):  # invalid JSON stays json's error, for the callers' own messages
        parse_json("[1,", "x")


def _tokenizer(flags: str):
    return build_tokenizer(parse_args(f"--mock-data {flags}".split()).data)


def test_tokenizer_files_that_are_directories_or_nest_too_deep_are_one_line(tmp_path):
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_bytes((ASSETS / "stdlib-bpe-vocab.json").read_bytes())
    merges.write_bytes((ASSETS / "stdlib-bpe-merges.txt").read_bytes())
    folder = tmp_path / "folder"
    folder.mkdir()
    gpt2 = "--tokenizer-type GPT2BPETokenizer"
    for flags, flag in (
        (f"{gpt2} --vocab-file {folder} --merge-file {merges}", "--vocab-file"),
        (f"{gpt2} --vocab-file {vocab} --merge-file {folder}", "--merge-file"),
        (f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {folder}", "--tokenizer-model"),
        (f"--tokenizer-type TikTokenizer --tokenizer-model {folder}", "--tokenizer-model"),
    ):
        with pytest.raises(UserError, match=rf"^{flag} {folder} is a directory, not a file"):
            _tokenizer(flags)
    vocab.write_text("[" * 50_000 + "]" * 50_000)
    with pytest.raises(UserError, match=rf"^{vocab} nests JSON 50000 deep"):
        _tokenizer(f"{gpt2} --vocab-file {vocab} --merge-file {merges}")
    pytest.importorskip("tokenizers")
    hf = tmp_path / "tokenizer.json"
    hf.write_text('{"a":' * 3_000 + "1" + "}" * 3_000)
    with pytest.raises(UserError, match=rf"^{hf}: not a HF tokenizer.json \({hf} nests JSON 3000 deep"):
        _tokenizer(f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {tmp_path}")


def test_a_data_prefix_file_that_is_a_directory_is_one_line(tmp_path):
    prefix = write_documents(tmp_path / "docs", [9, 12, 30])
    Path(prefix + ".idx").unlink()
    Path(prefix + ".idx").mkdir()
    # the dataset's own check (the flags' check at parse time refuses it first, in one line too)
    cfg = parse_args(f"--vocab-size 64 --tokenizer-type NullTokenizer --data-path {prefix}".split(), check_files=False)
    with pytest.raises(UserError, match=rf"^{prefix}.idx: a directory, not a file; --data-path takes the prefix"):
        build_datasets(cfg, None, 64)


def _entry(cache: Path) -> dict[str, np.ndarray]:
    def build():
        return {"order": np.arange(10, dtype=np.int64), "starts": np.arange(5, dtype=np.int32)}

    arrays, built = load_or_build(str(cache), "entry", {"k": 1}, build, ("order", "starts"))
    return {k: np.array(v) for k, v in arrays.items()} | {"built": built}


@pytest.mark.parametrize(
    "damage",
    ["truncated npy", "garbage npy", "object npy", "missing npy", "garbage json", "deep json", "json lacks an array"],
)
def test_a_damaged_index_cache_entry_is_rebuilt_with_a_warning(tmp_path, damage):
    first = _entry(tmp_path)
    assert first["built"]
    npy, done = next(tmp_path.glob("entry-*-order.npy")), next(tmp_path.glob("entry-*.json"))
    if damage == "truncated npy":
        npy.write_bytes(npy.read_bytes()[:-9])
    elif damage == "garbage npy":
        npy.write_bytes(b"\x93NUMPY\x01\x00" + b"\xff" * 60)
    elif damage == "object npy":
        np.save(npy, np.array([None, 1], dtype=object), allow_pickle=True)
    elif damage == "missing npy":
        npy.unlink()
    elif damage == "garbage json":
        done.write_bytes(b"\x00{")
    elif damage == "deep json":
        done.write_text("[" * 10_000 + "]" * 10_000)
    else:
        done.write_text(json.dumps({"arrays": ["starts"]}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = _entry(tmp_path)
    assert again["built"] and any("is damaged" in str(w.message) and "rebuilding it" in str(w.message) for w in caught)
    assert all(np.array_equal(first[k], again[k]) for k in ("order", "starts"))
    assert not _entry(tmp_path)["built"]  # the rebuilt entry reads back


def test_a_blend_of_hundreds_of_prefixes_runs_under_a_small_open_file_limit(tmp_path):
    """300 prefixes (a .bin, an .idx and three cached arrays each) under `ulimit -n 256`: the data is mapped
    without holding its files open."""
    first = write_documents(tmp_path / "d0", [40, 25, 33])
    prefixes = [first] + [str(tmp_path / f"d{i}") for i in range(1, 300)]
    for prefix in prefixes[1:]:
        for suffix in (".bin", ".idx"):
            shutil.copyfile(first + suffix, prefix + suffix)
    blend = " ".join(f"1 {p}" for p in prefixes)
    script = textwrap.dedent(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        from megatron.config import parse_args
        from megatron.data import build_datasets, build_tokenizer
        flags = ("--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --micro-batch-size 1"
                 " --global-batch-size 1 --train-iters 1000 --eval-iters 0 --vocab-size 128"
                 " --tokenizer-type NullTokenizer --split 100,0,0 --data-cache-path {tmp_path / "cache"}"
                 " --data-path {blend}")
        cfg = parse_args(flags.split())
        train = build_datasets(cfg, build_tokenizer(cfg.data), 128).train
        print("samples", len(train), sum(int(train[i]["tokens"].sum()) for i in range(0, len(train), 97)))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("samples ")


def test_preprocess_reports_json_lines_past_the_limits(tmp_path, monkeypatch):
    from megatron.data import preprocess

    monkeypatch.setattr(preprocess, "MAX_JSON_BYTES", 4096)
    lines = [json.dumps({"text": "1 2 3"}), "[" * 1_500 + "]" * 1_500, json.dumps({"text": "1 " * 5_000}), "{}"]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    cfg = parse_args("--mock-data --tokenizer-type NullTokenizer --vocab-size 128".split()).data
    logged: list[str] = []
    preprocess.preprocess_jsonl(str(source), str(tmp_path / "out"), cfg, on_bad_line="skip", log=logged.append)
    text = "\n".join(logged)
    assert f"{source}:2: the line nests JSON 1500 deep" in text
    assert f"{source}:3: {len(lines[2]) + 1:,} bytes long, over the limit of 4,096 for one JSON line" in text


def test_a_checkpoints_metadata_json_nested_too_deep_is_no_traceback(tmp_path):
    from megatron.checkpoint.checkpointer import folder_format
    from megatron.checkpoint.checkpointing import CheckpointError, read_metadata

    folder = tmp_path / "iter_0000001"
    folder.mkdir()
    (folder / "metadata.json").write_text("[" * 100_000 + "]" * 100_000)
    assert folder_format(folder) is None  # neither format's files: nothing to tell
    (folder / ".metadata").write_bytes(b"")
    assert folder_format(folder) == "torch_dist"  # the files still tell
    with pytest.raises(CheckpointError, match="metadata.json is damaged"):
        read_metadata(folder)
