"""Tokenize a JSON-lines corpus into Megatron-LM's indexed-dataset format (.bin/.idx), in parallel.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt --append-eod --workers 2

writes data/corpus_text_document.bin/.idx; train on it with `--data-path data/corpus_text_document` and the same
tokenizer flags. Each input line is one document: a JSON object whose --json-keys hold strings.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from megatron.config import ConfigError, DataConfig
from megatron.config.base import field_docs, flag_name
from megatron.config.cli import scalar_type
from megatron.data.preprocess import BadLineError, output_prefix_for, preprocess_jsonl

TOKENIZER_FIELDS = (
    "tokenizer_type",
    "vocab_size",
    "vocab_file",
    "merge_file",
    "tokenizer_model",
    "tiktoken_pattern",
    "tiktoken_num_special_tokens",
    "special_tokens",
)


def add_tokenizer_flags(parser: argparse.ArgumentParser) -> None:
    """The training script's tokenizer flags, with the same names, choices and help."""
    group = parser.add_argument_group("tokenizer (as in training)")
    docs, fields = field_docs(DataConfig), {f.name: f for f in dataclasses.fields(DataConfig)}
    for name in TOKENIZER_FIELDS:
        field = fields[name]
        kwargs = dict(field.metadata.get("argparse", {}))
        kwargs.setdefault("type", scalar_type(field.type))
        group.add_argument(flag_name(field), dest=name, default=field.default, help=docs[name], **kwargs)


def tokenizer_config(args: argparse.Namespace) -> DataConfig:
    cfg = DataConfig(**{name: getattr(args, name) for name in TOKENIZER_FIELDS})
    cfg.check_tokenizer()  # the same checks as training (e.g. GPT2BPETokenizer needs --vocab-file and --merge-file)
    return cfg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="JSON-lines file, one document per line.")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="Keys to tokenize; one dataset per key.")
    parser.add_argument("--output-prefix", required=True, help="Writes {prefix}_{key}_document.bin/.idx.")
    parser.add_argument("--append-eod", action="store_true", help="End every document with the end-of-document id.")
    parser.add_argument("--workers", type=int, default=1, help="Tokenizer processes (1: tokenize in this process).")
    parser.add_argument("--log-interval", type=int, default=10000, help="Report progress every this many documents.")
    parser.add_argument(
        "--on-bad-line",
        choices=["fail", "skip"],
        default="fail",
        help="A line that is not a JSON object with string --json-keys: stop with its line number (fail), or "
        "report it with its line number and go on (skip).",
    )
    add_tokenizer_flags(parser)
    args = parser.parse_args(argv)
    if args.workers < 1 or args.log_interval < 1:
        parser.error("--workers and --log-interval must be >= 1")
    if not os.path.isfile(args.input):
        parser.error(f"--input {args.input}: no such file")
    try:
        cfg = tokenizer_config(args)
        os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
        stats = preprocess_jsonl(
            args.input,
            args.output_prefix,
            cfg,
            args.json_keys,
            args.append_eod,
            args.workers,
            args.on_bad_line,
            args.log_interval,
        )
    except (BadLineError, ConfigError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(
        f"done: {stats.documents} documents, {stats.tokens} tokens, {stats.bytes / 1e6:.2f} MB in"
        f" {stats.seconds:.2f} s ({stats.docs_per_second:.1f} docs/s, {stats.megabytes_per_second:.2f} MB/s,"
        f" {args.workers} workers); skipped {stats.skipped} bad and {stats.blank} blank lines",
        file=sys.stderr,
    )
    for key in args.json_keys:
        print(output_prefix_for(args.output_prefix, key))
    return 0


if __name__ == "__main__":
    sys.exit(main())
