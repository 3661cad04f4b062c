"""Build the embedded default corpus (docs of the running Python, no download) and tokenize it for training.

    python tools/build_default_corpus.py --output-dir data
    # prints the --data-path prefix, e.g. data/python3.11-docs_text_document; train with the default tokenizer:
    #   --tokenizer-type GPT2BPETokenizer --vocab-file megatron/data/assets/stdlib-bpe-vocab.json
    #   --merge-file megatron/data/assets/stdlib-bpe-merges.txt

Nothing is rebuilt when the files are already there. --jsonl-only stops after the JSON lines (to train a tokenizer).
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron.data import default_corpus


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="data", help="Where the .jsonl, .bin and .idx go.")
    parser.add_argument("--workers", type=int, default=1, help="Tokenizer processes.")
    parser.add_argument("--jsonl-only", action="store_true", help="Only write the JSON lines; print their path.")
    args = parser.parse_args(argv)
    if args.jsonl_only:
        os.makedirs(args.output_dir, exist_ok=True)
        path = os.path.join(args.output_dir, default_corpus.corpus_name() + ".jsonl")
        documents, size = default_corpus.write_jsonl(path)
        print(f"{documents} documents, {size / 1e6:.2f} MB of text", file=sys.stderr)
        print(path)
        return 0
    print(default_corpus.prepare(args.output_dir, args.workers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
