"""Every malformed input is one line, part two (part one: test_fuzz_inputs.py): what the converter reads (Megatron-LM
args, Hugging Face config.json and safetensors headers) and what training reads besides checkpoints (.bin/.idx
datasets, tokenizer files, --data-path blends), fed to the entry functions convert.py and pretrain_gpt.py call."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
from pathlib import Path

import pytest
import torch

from megatron.checkpoint.safe_load import load_foreign
from megatron.config import parse_args
from megatron.data import build_datasets, build_tokenizer
from tests.assets.data_helpers import write_documents
from tests.unit.fuzz_mutations import STRINGS, Tally, mutate_bytes, mutate_tree, random_value

pytest.importorskip("transformers")
from tests.unit.test_convert_checkpoint import LLAMA, hf_llama, tool, write_megatron_lm  # noqa: E402

SEED = 20261126
TALLY = Tally()


def _convert(loader: str, load: Path, out: Path):
    def case() -> None:
        try:
            tool.convert(tool.parse(f"--loader {loader} --saver native --load-dir {load} --save-dir {out}".split()),
                         log=lambda *_: None)  # fmt: skip
        except BaseException:
            assert not out.exists(), "a failed conversion left its output"
            raise
        shutil.rmtree(out)

    return case


def test_fuzz_megatron_lm_args(tmp_path):
    from megatron.convert.state import model_config

    rng = random.Random(SEED)
    root = tmp_path / "mlm"
    write_megatron_lm(root, model_config(**dict(LLAMA, num_layers=2)), tp=1, pp=1, te_spec=False)
    file = root / "iter_0000050" / "mp_rank_00" / "model_optim_rng.pt"
    payload = load_foreign(file, str(file))  # Megatron-Core's enum comes back as a stand-in, which is not saved
    payload["args"].attention_backend = "auto"
    payload["model"] = {k: v.clone() for k, v in payload["model"].items()}  # not the mapped file rewritten below
    fields = sorted(vars(payload["args"]))
    for i in range(100):  # a field deleted, or given a value of another type
        args = type(payload["args"])(**vars(payload["args"]))
        name = fields[i % len(fields)] if i < len(fields) else rng.choice(fields)
        if rng.random() < 0.3:
            delattr(args, name)
        else:
            setattr(args, name, random_value(rng))
        torch.save(dict(payload, args=args), file)
        TALLY.run("Megatron-LM args", _convert("mcore", root, tmp_path / "out"), [str(root)])
    assert TALLY.total("Megatron-LM args") == 100


def _safetensors_header(data: bytes) -> tuple[dict, bytes]:
    (size,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + size]), data[8 + size :]


def test_fuzz_hugging_face_config_and_safetensors(tmp_path):
    rng = random.Random(SEED + 1)
    folder, _ = hf_llama(tmp_path)
    config, weights = folder / "config.json", folder / "model.safetensors"
    original_config, original_weights = config.read_bytes(), weights.read_bytes()
    header, body = _safetensors_header(original_weights)
    for i in range(120):
        if i % 2 == 0:  # config.json: bytes, or a field deleted or retyped
            text = json.loads(original_config)
            data = mutate_bytes(original_config, rng) if i % 4 == 0 else json.dumps(mutate_tree(text, rng)).encode()
            config.write_bytes(data)
        else:  # safetensors: the header's size field, its JSON (dtype, shape, offsets), or the bytes
            kind = rng.randrange(3)
            if kind == 0:
                data = struct.pack("<Q", rng.choice((0, 7, 2**40, len(original_weights)))) + original_weights[8:]
            elif kind == 1:
                changed = json.dumps(mutate_tree(header, rng)).encode()
                data = struct.pack("<Q", len(changed)) + changed + body
            else:
                data = mutate_bytes(original_weights, rng)
            weights.write_bytes(data)
        TALLY.run("Hugging Face config.json / safetensors", _convert("hf", folder, tmp_path / "out"), [str(folder)])
        config.write_bytes(original_config)
        weights.write_bytes(original_weights)


def _data_flags(extra: str) -> str:
    return (
        "--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --micro-batch-size 1"
        f" --global-batch-size 1 --train-iters 2 --eval-iters 1 --vocab-size 64 --tokenizer-type NullTokenizer {extra}"
    )


def _build(flags: str):
    cfg = parse_args(flags.split())
    tokenizer = build_tokenizer(cfg.data)
    build_datasets(cfg, tokenizer, tokenizer.vocab_size)


def test_fuzz_indexed_datasets(tmp_path):
    rng = random.Random(SEED + 2)
    prefix = write_documents(tmp_path / "docs", [5, 9, 3, 12, 7, 20, 4, 6])
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    originals = {idx: idx.read_bytes(), bin_: bin_.read_bytes()}
    for i in range(120):
        file = idx if i % 3 else bin_
        data = originals[file]
        if file is idx and i % 2:  # a header field: magic, version, dtype code, sequence and document counts
            at = rng.choice((0, 9, 17, 18, 26)) if len(data) > 34 else 0
            data = data[:at] + bytes(rng.randrange(256) for _ in range(rng.choice((1, 4, 8)))) + data[at + 8 :]
        else:
            data = mutate_bytes(data, rng)
        file.write_bytes(data)
        cache = tmp_path / f"cache{i}"
        TALLY.run(".bin/.idx", lambda c=cache: _build(_data_flags(f"--data-path {prefix} --data-cache-path {c}")),
                  [prefix])  # fmt: skip
        file.write_bytes(originals[file])


def test_fuzz_tokenizer_files(tmp_path):
    import sentencepiece as spm

    rng = random.Random(SEED + 3)
    assets = Path(__file__).resolve().parents[2] / "megatron" / "data" / "assets"
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    shutil.copy(assets / "stdlib-bpe-vocab.json", vocab)
    shutil.copy(assets / "stdlib-bpe-merges.txt", merges)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"the sentence number {i} says {w}" for i in range(200) for w in ("a", "bc", "d e")))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=40,
                                   minloglevel=2)  # fmt: skip
    model = tmp_path / "sp.model"
    tiktoken_file = tmp_path / "tiktoken.json"
    import base64

    entries = [{"rank": i, "token_bytes": base64.b64encode(bytes([i])).decode()} for i in range(256)]
    tiktoken_file.write_text(json.dumps(entries))
    cases = [
        (vocab, "GPT2BPETokenizer", f"--vocab-file {vocab} --merge-file {merges}", True),
        (merges, "GPT2BPETokenizer", f"--vocab-file {vocab} --merge-file {merges}", False),
        (model, "SentencePieceTokenizer", f"--tokenizer-model {model}", False),
        (tiktoken_file, "TikTokenizer", f"--tokenizer-model {tiktoken_file}", True),
    ]
    for file, kind, flags, is_json in cases:
        original = file.read_bytes()
        for i in range(35):
            if is_json and i % 2:
                data = json.dumps(mutate_tree(json.loads(original), rng)).encode()
            else:
                data = mutate_bytes(original, rng)
            file.write_bytes(data)

            def case(kind=kind, flags=flags) -> None:
                cfg = parse_args(f"--mock-data --tokenizer-type {kind} {flags}".split())
                tokenizer = build_tokenizer(cfg.data)
                tokenizer.tokenize("the sentence number 7 says d e")

            TALLY.run(f"tokenizer {file.name}", case, [str(file)])
        file.write_bytes(original)


def test_fuzz_data_path_blends(tmp_path):
    rng = random.Random(SEED + 4)
    prefixes = [write_documents(tmp_path / f"d{i}", [9, 12, 30, 8]) for i in range(2)]
    words = prefixes + ["0.5", "1", "0", "-1", "nan", "inf", "1e400", "0x1", str(tmp_path / "missing"), *STRINGS]
    for i in range(100):
        spec = [rng.choice(words) for _ in range(rng.randint(1, 5))]
        if i % 3 == 0:  # weights and prefixes in pairs, as a blend is written
            spec = [w for p in rng.sample(prefixes, 2) for w in (rng.choice(words[2:9]), p)]
        cache = tmp_path / f"cache{i}"
        flags = _data_flags(f"--data-cache-path {cache} --data-path").split() + spec

        def case(flags=flags) -> None:
            cfg = parse_args(flags)
            tokenizer = build_tokenizer(cfg.data)
            build_datasets(cfg, tokenizer, tokenizer.vocab_size)

        TALLY.run("--data-path blend", case, ["--data-path", *spec])


def test_fuzz_report():
    """Runs last in this module: the counts per format."""
    for fmt, counts in sorted(TALLY.counts.items()):
        print(f"\n  {fmt}: {sum(counts.values())} ({counts['refused']} refused, {counts['loaded']} loaded)", end="")
    print()
    if os.environ.get("FUZZ_MESSAGES"):
        for fmt, messages in sorted(TALLY.messages.items()):
            for m in sorted(set(m[:200] for m in messages))[:: max(1, len(set(messages)) // 10)]:
                print(f"    {fmt}: {m}")
