"""Shared helpers of the data tests: build small indexed datasets and load the tools/ scripts in-process."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megatron.config import Config, parse_args
from megatron.data.indexed_dataset import IndexedDatasetWriter
from tests.assets.scripts import load_file

ROOT = Path(__file__).resolve().parents[2]  # the repository


def load_tool(name: str):
    """tools/{name}.py as a module (the tools are scripts, not a package); call its main(argv)."""
    return load_file("tools", name)


def write_documents(prefix: str | Path, lengths: list[int], first_token: int = 0, eod: int | None = None) -> str:
    """Documents of the given lengths whose tokens count up from `first_token` (each token id is unique, so a test
    can tell where every token came from), each ended by `eod` when given. Returns the prefix."""
    next_token = first_token
    with IndexedDatasetWriter(str(prefix), np.int32) as writer:
        for length in lengths:
            doc = list(range(next_token, next_token + length))
            next_token += length
            writer.add_document(doc + ([eod] if eod is not None else []))
    return str(prefix)


def config(flags: str) -> Config:
    return parse_args(flags.split())
