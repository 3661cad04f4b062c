"""The worker of test_fuzz_structured.py: one process that runs every seeded case in turn under a memory cap
(RLIMIT_AS) and a per-case time cap, printing `start ID` before a case and `loaded ID` / `refused ID` / `FAIL ID
reason` after it, so that a case that kills the process is named by its `start` line. A case is reproducible
alone: `python -m tests.unit.fuzz_worker WORKDIR SEED CASE_ID`.

Each case writes one hostile file (tests/unit/fuzz_structures.py) where a real one lies and calls the function that
training or conversion reads it with. It must return, or raise the project's one-line error (UserError; TE's
extra-state check raises UnsafeTePickle, which its callers report in one line) naming the file; anything else (a
traceback's exception, a signal, MemoryError under the cap, a case over the time cap) is a failure."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import resource
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron.errors import UserError
from tests.unit import fuzz_structures as fs

MEMORY_CAP = 2 << 30  # bytes of address space a case may add to the worker's own; no real input here needs 100 MB
CASE_TIMEOUT_S = 30  # generous (a loaded 2-core machine runs the slowest case in 7 s): it catches hangs and huge loops

ROOT = Path(__file__).resolve().parents[2]
COUNTS = {  # cases per file kind: 5,900 in all
    "DCP .metadata": 900,
    "foreign pickle (Megatron-LM, HF .bin)": 900,
    "own pickle (weights only)": 700,
    "TE extra state": 300,
    "vocab.json": 250,
    "tiktoken vocabulary": 250,
    "tokenizer.json": 250,
    "tokenizer_config.json": 250,
    "checkpoint metadata.json": 250,
    "HF config.json": 250,
    "preprocess line": 250,
    "index cache .json": 250,
    "index cache .npy": 500,
    ".idx/.bin": 600,
}


class Fixtures:
    """The real files each kind's cases mutate, written once under `root`."""

    def __init__(self, root: Path):
        from torch.distributed.checkpoint import metadata as dcp_metadata

        from megatron.checkpoint.safe_load import SafeReader

        self.root = root
        source = ROOT / "tests" / "assets" / "old_checkpoints" / "torch_dist" / "iter_0000004"
        SafeReader(str(source)).read_metadata()  # the fixture is an index the loader accepts
        self.index = pickle.loads((source / ".metadata").read_bytes())  # with its real classes, to be pickled again
        assert isinstance(self.index, dcp_metadata.Metadata)
        self.index_dir = root / "dcp"
        self.index_dir.mkdir()
        rng_state = {"random_rng_state": random.Random(1).getstate(), "np_rng_state": np.random.RandomState(1)
                     .get_state(), "torch_rng_state": torch.zeros(4, dtype=torch.uint8)}  # fmt: skip
        self.foreign = {
            "args": argparse.Namespace(num_layers=2, hidden_size=16, seq_length=8, params_dtype=torch.float32),
            "checkpoint_version": 3.0,
            "iteration": 50,
            "rng_state": [rng_state],
            "model": {"decoder.weight": torch.ones(2, 2)},
            "opt_param_scheduler": {"max_lr": np.float64(1e-3), "num_steps": np.int64(5)},
        }
        self.own = {"iteration": 4, "rng": rng_state, "consumed": [1, 2, 3], "scaler": {"scale": 65536.0}}
        self.te = {"scale": torch.ones(1), "amax_history": torch.zeros(2, 1), "extra_fp8_variables": {"n": 1}}
        self._tokenizers()
        self._checkpoint()
        self._data()

    def _tokenizers(self) -> None:
        from tokenizers import Tokenizer, models, pre_tokenizers

        folder = self.root / "tok"
        folder.mkdir()
        self.vocab = {"<|endoftext|>": 0, "a": 1, "b": 2, "Ġ": 3, "ab": 4}
        (folder / "vocab.json").write_text(json.dumps(self.vocab))
        (folder / "merges.txt").write_text("#version: 0.2\na b\n")
        self.tiktoken = [{"rank": i, "token_bytes": __import__("base64").b64encode(bytes([i])).decode()}
                         for i in range(256)]  # fmt: skip
        hf = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "a": 1, "b": 2, "[UNK]": 3}, unk_token="[UNK]"))
        hf.pre_tokenizer = pre_tokenizers.Whitespace()
        self.hf_folder = self.root / "hf_tok"
        self.hf_folder.mkdir()
        hf.save(str(self.hf_folder / "tokenizer.json"))
        self.hf_tokenizer = json.loads((self.hf_folder / "tokenizer.json").read_text())
        self.hf_config = {"eos_token": {"content": "<|endoftext|>"}, "model_max_length": 8}
        self.tok_folder = folder

    def _checkpoint(self) -> None:
        from megatron.checkpoint.integrity import local_checksums, record_checksums

        self.ckpt_root = self.root / "ckpt"
        folder = self.ckpt_root / "iter_0000001"
        folder.mkdir(parents=True)
        (self.ckpt_root / "latest_checkpointed_iteration.txt").write_text("1\n")
        (folder / "state.bin").write_bytes(b"\x01" * 64)
        (folder / "metadata.json").write_text(json.dumps({"format": "torch", "layout": {"tp": 1, "pp": 1, "dp": 1}}))
        record_checksums(folder, local_checksums(folder))
        self.ckpt_metadata = json.loads((folder / "metadata.json").read_text())
        self.hf_model = self.root / "hf_model"
        self.hf_model.mkdir()
        self.hf_model_config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16,
                                "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32,
                                "vocab_size": 64, "rms_norm_eps": 1e-5, "max_position_embeddings": 8}  # fmt: skip

    def _data(self) -> None:
        from megatron.data.index_cache import load_or_build

        self.cache = self.root / "cache"
        self.arrays = {"order": np.arange(10, dtype=np.int64), "starts": np.arange(10, dtype=np.int32)}
        load_or_build(str(self.cache), "entry", {"k": 1}, lambda: dict(self.arrays), ("order", "starts"))
        self.cache_json = next(self.cache.glob("entry-*.json"))
        self.cache_npy = next(self.cache.glob("entry-*-order.npy"))
        self.cache_doc = json.loads(self.cache_json.read_text())
        self.npy = self.cache_npy.read_bytes()
        self.prefix = str(self.root / "docs")


def _pickle_case(fx: Fixtures, kind: str, rng: random.Random) -> Callable[[], Any]:
    from megatron.checkpoint.safe_load import SafeReader, first_line, load_foreign, load_own
    from megatron.checkpoint.te_state import verify_te_pickles

    if kind == "DCP .metadata":
        (fx.index_dir / ".metadata").write_bytes(fs.hostile_index(fx.index, rng))

        def read_index() -> None:  # as dist.py's load does, then what the planner touches
            try:
                metadata = SafeReader(str(fx.index_dir)).read_metadata()
            except Exception as exc:
                raise UserError(f"cannot read {fx.index_dir / '.metadata'}: {first_line(exc)}") from None
            repr(metadata)
            for entry in metadata.state_dict_metadata.values():
                if hasattr(entry, "size"):
                    torch.Size(entry.size).numel()
                    [(torch.Size(c.offsets), torch.Size(c.sizes)) for c in entry.chunks]

        return read_index
    raw = rng.random() < 0.08
    if kind == "foreign pickle (Megatron-LM, HF .bin)":
        file = fx.root / "model_optim_rng.pt"
        if raw:
            file.write_bytes(fs.raw_pickle(rng))
        else:
            torch.save(fs.place(fx.foreign, fs.hostile_node(rng), rng), file)
        return lambda: repr(load_foreign(file, str(file)))
    if kind == "own pickle (weights only)":
        buffer = __import__("io").BytesIO()
        if raw:
            buffer.write(fs.raw_pickle(rng))
        else:
            torch.save(fs.place(fx.own, fs.hostile_node(rng), rng), buffer)

        def read_own() -> None:
            buffer.seek(0)
            repr(load_own(buffer, "entry train_state of own.pt"))

        return read_own
    data = fs.raw_pickle(rng) if raw else pickle.dumps(fs.place(fx.te, fs.hostile_node(rng), rng))
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return lambda: verify_te_pickles({"layers.0.linear_qkv._extra_state": tensor})


def _json_case(fx: Fixtures, kind: str, rng: random.Random) -> tuple[Callable[[], Any], str]:
    from megatron.checkpoint.checkpointing import read_metadata, select_checkpoint
    from megatron.config import parse_args
    from megatron.convert.hf import read_hf
    from megatron.data.index_cache import load_or_build
    from megatron.data.tiktoken_tokenizer import build_tiktokenizer
    from megatron.data.tokenizers import GPT2BPETokenizer, HuggingFaceTokenizer

    if kind == "vocab.json":
        file = fx.tok_folder / "vocab.json"
        file.write_bytes(fs.hostile_json(fx.vocab, rng))
        return lambda: GPT2BPETokenizer(str(file), str(fx.tok_folder / "merges.txt")).tokenize("ab a"), str(file)
    if kind == "tiktoken vocabulary":
        file = fx.tok_folder / "tiktoken.json"
        file.write_bytes(fs.hostile_json(fx.tiktoken, rng))
        cfg = parse_args(f"--mock-data --tokenizer-type TikTokenizer --tokenizer-model {file}".split()).data
        return lambda: build_tiktokenizer(cfg, str(file)).tokenize("ab"), str(file)
    if kind in ("tokenizer.json", "tokenizer_config.json"):
        (fx.hf_folder / "tokenizer.json").write_text(json.dumps(fx.hf_tokenizer))
        (fx.hf_folder / "tokenizer_config.json").write_text(json.dumps(fx.hf_config))
        file = fx.hf_folder / kind
        file.write_bytes(fs.hostile_json(fx.hf_tokenizer if kind == "tokenizer.json" else fx.hf_config, rng))
        return lambda: HuggingFaceTokenizer(str(fx.hf_folder)).tokenize("a b"), str(fx.hf_folder)
    if kind == "checkpoint metadata.json":
        folder = fx.ckpt_root / "iter_0000001"
        (folder / "metadata.json").write_bytes(fs.hostile_json(fx.ckpt_metadata, rng))

        def select_and_read() -> None:  # what --load does before it reads tensors
            if select_checkpoint(str(fx.ckpt_root)) == 1:
                read_metadata(folder)

        return select_and_read, str(fx.ckpt_root)
    if kind == "HF config.json":  # read and checked before the (absent) weights are looked for
        (fx.hf_model / "config.json").write_bytes(fs.hostile_json(fx.hf_model_config, rng))
        return lambda: read_hf(fx.hf_model, log=lambda *_: None), str(fx.hf_model)
    if kind == "preprocess line":
        from megatron.data.preprocess import _Encoder

        null = parse_args("--mock-data --tokenizer-type NullTokenizer --vocab-size 64".split()).data
        encoder = fx.__dict__.setdefault("encoder", _Encoder(null, ["text"], False))
        line = fs.hostile_json({"text": "1 2 3"}, rng)

        def encode() -> None:  # a bad line is reported (one line) and skipped, never raised
            _, _, out = encoder.encode((7, line))
            if isinstance(out, str) and "\n" in out:
                raise AssertionError(f"a bad line's report of more than one line: {out[:200]!r}")

        return encode, "line"
    fx.cache_json.write_bytes(fs.hostile_json(fx.cache_doc, rng))
    return _cache_read(fx, load_or_build), str(fx.cache)


def _cache_read(fx: Fixtures, load_or_build: Callable) -> Callable[[], None]:
    def read() -> None:  # derived data: a damaged entry is rebuilt, with a warning, never an error (bytes that are
        # another valid array of the recorded dtype and length cannot be told from the real one)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            arrays, _ = load_or_build(str(fx.cache), "entry", {"k": 1}, lambda: dict(fx.arrays), ("order", "starts"))
        if any((arrays[k].dtype, arrays[k].shape) != (v.dtype, v.shape) for k, v in fx.arrays.items()):
            raise AssertionError("the index cache returned arrays of other dtypes or lengths than it builds")

    return read


def make_case(fx: Fixtures, kind: str, rng: random.Random) -> tuple[Callable[[], Any], str]:
    """(the reading call, what its refusal must name) of one case, its hostile file written."""
    pickles = {
        "DCP .metadata": str(fx.index_dir),
        "foreign pickle (Megatron-LM, HF .bin)": str(fx.root / "model_optim_rng.pt"),
        "own pickle (weights only)": "own.pt",
        "TE extra state": "_extra_state",
    }
    if kind in pickles:
        return _pickle_case(fx, kind, rng), pickles[kind]
    if kind == "index cache .npy":
        from megatron.data.index_cache import load_or_build

        fx.cache_json.write_text(json.dumps(fx.cache_doc))
        fx.cache_npy.write_bytes(fs.hostile_npy(rng, fx.npy))
        return _cache_read(fx, load_or_build), str(fx.cache)
    if kind == ".idx/.bin":
        from megatron.data.indexed_dataset import IndexedDataset

        idx, bin_ = fs.hostile_idx(rng)
        Path(fx.prefix + ".idx").write_bytes(idx)
        Path(fx.prefix + ".bin").write_bytes(bin_)

        def read_dataset() -> None:
            dataset = IndexedDataset(fx.prefix)
            for i in range(min(len(dataset), 3)):
                dataset.get(i)

        return read_dataset, fx.prefix
    return _json_case(fx, kind, rng)


def plan(seed: int) -> list[tuple[str, str]]:
    """(case id, kind) of every case, kinds interleaved so that a slow kind shows early."""
    cases = [(f"{kind}#{i}", kind) for kind, n in COUNTS.items() for i in range(n)]
    random.Random(seed).shuffle(cases)
    return cases


def _cap_memory() -> None:
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + MEMORY_CAP, resource.getrlimit(resource.RLIMIT_AS)[1]))


def _timeout(*_: Any) -> None:
    raise TimeoutError(f"over the {CASE_TIMEOUT_S} s a case may take")


def run(workdir: Path, seed: int, only: str | None = None) -> None:
    from megatron.checkpoint.te_state import UnsafeTePickle

    torch.set_num_threads(1)
    fixtures = Fixtures(workdir)
    _cap_memory()
    signal.signal(signal.SIGALRM, _timeout)
    for case_id, kind in plan(seed):
        if only is not None and case_id != only:
            continue
        print(f"start {case_id}", flush=True)
        start = time.perf_counter()
        rng = random.Random(f"{seed}:{case_id}")
        for _ in range(20):  # a draw the generator itself cannot write (a dataclass that refuses to pickle): redraw
            try:
                call, name = make_case(fixtures, kind, rng)
                break
            except Exception:  # noqa: BLE001
                continue
        signal.setitimer(signal.ITIMER_REAL, CASE_TIMEOUT_S)
        try:
            try:
                call()
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            outcome, detail = "loaded", ""
        except (UserError, UnsafeTePickle) as exc:
            message = str(exc).strip()
            ok = "\n" not in message and name in message
            outcome, detail = ("refused", message[:300]) if ok else ("FAIL", f"the refusal {message[:400]!r}")
        except BaseException as exc:  # noqa: BLE001 - everything else is what the fuzzing looks for
            where = traceback.extract_tb(exc.__traceback__)[-1]
            detail = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''} at {where.filename}"
            outcome, detail = "FAIL", f"{detail}:{where.lineno}"
        line = f"{outcome} {case_id} {time.perf_counter() - start:.3f} {detail}".replace("\n", " ")
        print(line.encode("utf-8", "backslashreplace").decode(), flush=True)  # a file's lone surrogates
    shutil.rmtree(workdir / "dcp", ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
