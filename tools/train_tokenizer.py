"""Train a tokenizer on a JSON-lines corpus, offline.

    # GPT-2 style byte-level BPE -> OUT/vocab.json + OUT/merges.txt (for --tokenizer-type GPT2BPETokenizer)
    python tools/train_tokenizer.py --input corpus.jsonl --tokenizer-type GPT2BPETokenizer --vocab-size 8192 \\
        --output-dir OUT
    # SentencePiece -> OUT/tokenizer.model (for --tokenizer-type GPTSentencePieceTokenizer or SentencePieceTokenizer)
    python tools/train_tokenizer.py --input corpus.jsonl --tokenizer-type SentencePieceTokenizer --vocab-size 8000 \\
        --output-dir OUT

Byte-level BPE is trained with HF `tokenizers` (pip install tokenizers); its vocabulary starts from the 256 byte
symbols plus `<|endoftext|>`, so any text encodes with no unknown token. SentencePiece (unigram or BPE, with byte
fallback) comes with `sentencepiece`; its ids are unk 0, bos 1, eos 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator

from megatron.data.gpt2_bpe import END_OF_TEXT
from megatron.untrusted import LimitExceeded, parse_json


def iter_texts(paths: list[str], keys: list[str]) -> Iterator[str]:
    """The strings under `keys` of every JSON line; a bad line stops with its file and line number."""
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = parse_json(line, "the line")
                    texts = [record[key] for key in keys]
                except (json.JSONDecodeError, KeyError, TypeError, LimitExceeded) as err:
                    raise SystemExit(f"error: {path}:{number}: not a JSON object with keys {keys} ({err!r})") from None
                yield from (t for t in texts if isinstance(t, str))


def train_byte_level_bpe(texts: Iterator[str], vocab_size: int, output_dir: str) -> None:
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise SystemExit("error: byte-level BPE training needs HF tokenizers: pip install tokenizers") from None
    tokenizer = Tokenizer(models.BPE())
    # GPT-2's pre-tokenization (its regular expression, no prefix space), the same our GPT2BPETokenizer applies.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.model.save(output_dir)  # vocab.json, merges.txt


def train_sentencepiece(texts: Iterator[str], vocab_size: int, output_dir: str, model_type: str) -> None:
    import sentencepiece

    # SentencePiece trains on "sentences" of at most max_sentence_length bytes: feed it the documents' lines.
    lines = (line for text in texts for line in text.splitlines() if line.strip())
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=lines,
            model_prefix=os.path.join(output_dir, "tokenizer"),
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=True,
            character_coverage=0.9995,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            minloglevel=2,
        )
    except RuntimeError as err:  # e.g. a vocabulary smaller than the corpus's characters + 256 byte pieces
        raise SystemExit(f"error: SentencePiece training failed: {str(err).splitlines()[0]}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="JSON-lines files, one document per line.")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="Keys whose strings are trained on.")
    parser.add_argument("--tokenizer-type", choices=["GPT2BPETokenizer", "SentencePieceTokenizer"], required=True)
    parser.add_argument("--vocab-size", type=int, required=True, help="Entries in the trained vocabulary.")
    parser.add_argument("--sentencepiece-model-type", choices=["unigram", "bpe"], default="unigram")
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args(argv)
    if args.tokenizer_type == "GPT2BPETokenizer" and args.vocab_size < 257:
        parser.error("--vocab-size must be > 257 for byte-level BPE (256 byte symbols + <|endoftext|>)")
    for path in args.input:
        if not os.path.isfile(path):
            parser.error(f"--input {path}: no such file")
    os.makedirs(args.output_dir, exist_ok=True)
    texts = iter_texts(args.input, args.json_keys)
    if args.tokenizer_type == "GPT2BPETokenizer":
        train_byte_level_bpe(texts, args.vocab_size, args.output_dir)
        print(f"wrote {args.output_dir}/vocab.json and merges.txt: --tokenizer-type GPT2BPETokenizer", file=sys.stderr)
    else:
        train_sentencepiece(texts, args.vocab_size, args.output_dir, args.sentencepiece_model_type)
        print(f"wrote {args.output_dir}/tokenizer.model: --tokenizer-type GPTSentencePieceTokenizer", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
