"""JSON lines -> Megatron indexed datasets: the engine of tools/preprocess_data.py.

The main process reads the input's lines and writes the .bin/.idx files; `workers` processes parse the JSON and
tokenize (workers=1 does both in the main process, with no inter-process traffic). Output order is input order,
so the result does not depend on the number of workers.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from megatron.config import DataConfig
from megatron.untrusted import MAX_JSON_BYTES, LimitExceeded, parse_json

from .errors import DataError
from .indexed_dataset import IndexedDatasetWriter, optimal_dtype
from .tokenizers import build_tokenizer


class BadLineError(DataError):
    """A line of the input that is not a JSON object with a string under every --json-keys key."""


@dataclass
class PreprocessStats:
    documents: int = 0
    skipped: int = 0
    blank: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def docs_per_second(self) -> float:
        return self.documents / max(self.seconds, 1e-9)

    @property
    def megabytes_per_second(self) -> float:
        return self.bytes / 1e6 / max(self.seconds, 1e-9)


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron-LM's naming: `{output_prefix}_{key}_document` (the prefix to give --data-path)."""
    return f"{output_prefix}_{key}_document"


class _Encoder:
    """Parses and tokenizes one line; built once per worker process (the tokenizer is not shipped per line)."""

    def __init__(self, tokenizer_cfg: DataConfig, json_keys: list[str], append_eod: bool):
        self.tokenizer = build_tokenizer(tokenizer_cfg)
        self.json_keys, self.append_eod = json_keys, append_eod
        self.dtype = optimal_dtype(self.tokenizer.vocab_size)

    def encode(self, item: tuple[int, bytes | int]) -> tuple[int, int, dict[str, np.ndarray] | str | None]:
        """(line number, bytes, {key: ids}), or an error message in place of the ids, or None for a blank line."""
        number, raw = item
        if isinstance(raw, int):  # the length of a line over the limit (_numbered_lines)
            return number, raw, f"{raw:,} bytes long, over the limit of {MAX_JSON_BYTES:,} for one JSON line"
        if not raw.strip():
            return number, len(raw), None
        try:
            record = parse_json(raw, "the line")
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return number, len(raw), f"not valid JSON ({err})"
        except LimitExceeded as err:
            return number, len(raw), str(err)
        if not isinstance(record, dict):
            return number, len(raw), f"not a JSON object ({type(record).__name__})"
        out = {}
        for key in self.json_keys:
            text = record.get(key)
            if not isinstance(text, str):
                what = "is missing" if key not in record else f"holds {type(text).__name__}, not a string"
                return number, len(raw), f"key {key!r} {what}"
            try:
                ids = self.tokenizer.tokenize(text)
            except DataError as err:  # text the tokenizer cannot read (NullTokenizer's ids)
                return number, len(raw), str(err)
            if self.append_eod:
                ids.append(self.tokenizer.eod)
            out[key] = np.asarray(ids, dtype=self.dtype)
        return number, len(raw), out


_worker_encoder: _Encoder | None = None


def _init_worker(tokenizer_cfg: DataConfig, json_keys: list[str], append_eod: bool) -> None:
    global _worker_encoder
    _worker_encoder = _Encoder(tokenizer_cfg, json_keys, append_eod)


def _encode_in_worker(item: tuple[int, bytes]):
    assert _worker_encoder is not None
    return _worker_encoder.encode(item)


def _numbered_lines(path: str) -> Iterator[tuple[int, bytes | int]]:
    """(line number, its bytes), or (number, its length) for a line longer than MAX_JSON_BYTES, which is skipped
    over in pieces rather than read into memory whole."""
    with open(path, "rb") as f:
        for number, line in enumerate(iter(lambda: f.readline(MAX_JSON_BYTES + 1), b""), 1):
            size = len(line)
            while len(line) > MAX_JSON_BYTES and not line.endswith(b"\n"):
                line = f.readline(MAX_JSON_BYTES + 1)
                size += len(line)
            yield (number, size) if size > MAX_JSON_BYTES else (number, line)


def preprocess_jsonl(
    input_path: str,
    output_prefix: str,
    tokenizer_cfg: DataConfig,
    json_keys: list[str] | tuple[str, ...] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    on_bad_line: str = "fail",
    log_interval: int = 10000,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> PreprocessStats:
    """Tokenize every line of `input_path` and write one dataset per key to `output_prefix_for(prefix, key)`.

    A bad line raises BadLineError naming `file:line` (on_bad_line="fail", nothing is written), or is reported
    through `log` and skipped (on_bad_line="skip"). Blank lines are counted and ignored.
    """
    if on_bad_line not in ("fail", "skip"):
        raise ValueError(f"on_bad_line must be 'fail' or 'skip', got {on_bad_line!r}")
    json_keys = list(json_keys)
    encoder = _Encoder(tokenizer_cfg, json_keys, append_eod)  # also validates the tokenizer flags up front
    writers = {key: IndexedDatasetWriter(output_prefix_for(output_prefix, key), encoder.dtype) for key in json_keys}
    stats, start = PreprocessStats(), time.perf_counter()
    pool = None
    if workers > 1:
        pool = multiprocessing.get_context("fork").Pool(
            workers, initializer=_init_worker, initargs=(tokenizer_cfg, json_keys, append_eod)
        )
        results = pool.imap(_encode_in_worker, _numbered_lines(input_path), chunksize=64)
    else:
        results = map(encoder.encode, _numbered_lines(input_path))
    try:
        for number, size, encoded in results:
            stats.bytes += size
            if encoded is None:
                stats.blank += 1
                continue
            if isinstance(encoded, str):
                message = f"{input_path}:{number}: {encoded}"
                if on_bad_line == "fail":
                    raise BadLineError(message + " (pass --on-bad-line skip to skip such lines)")
                log(f"skipping {message}")
                stats.skipped += 1
                continue
            for key, ids in encoded.items():
                writers[key].add_document(ids)
                stats.tokens += ids.size
            stats.documents += 1
            if stats.documents % log_interval == 0:
                stats.seconds = time.perf_counter() - start
                log(
                    f"processed {stats.documents} documents ({stats.docs_per_second:.1f} docs/s,"
                    f" {stats.megabytes_per_second:.2f} MB/s)"
                )
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
    for writer in writers.values():
        writer.finalize()
    stats.seconds = time.perf_counter() - start
    return stats
