"""Tokenizers: GPT-2 BPE ids equal HF `tokenizers`' byte-level BPE on varied Unicode text, Megatron-LM's special-token
rules for SentencePiece and the null tokenizer, HF tokenizer.json loading, vocabulary padding, and bad-file errors."""

import json

import pytest

from megatron.config import DataConfig
from megatron.data.default_corpus import MERGE_FILE, VOCAB_FILE
from megatron.data.errors import DataError
from megatron.data.tokenizers import (
    GPT2BPETokenizer,
    GPTSentencePieceTokenizer,
    HuggingFaceTokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    padded_vocab_size,
)
from tests.assets.data_helpers import load_tool

tokenizers = pytest.importorskip("tokenizers")

TEXTS = [
    "Hello, world! It's 2026; we'll see what they've done.",
    "Héllo wörld — naïve café, Straße, ÆØÅ æøå, İstanbul",
    "你好，世界。日本語のテキスト、한국어 텍스트",
    "Emoji 🎉🎉 family 👩‍👩‍👧 flags 🇫🇷 skin 👍🏽",
    "Arabic العربية Hebrew עברית Hindi हिन्दी Thai ภาษาไทย",
    "  leading spaces,\ttabs,\r\nwindows newlines\n\n\n   trailing   ",
    "math ∀x∈ℝ: x² ≥ 0, ∑ᵢ aᵢ, ½ ⅔ ①②",
    "code: def f(x):\n    return x**2  # comment\n",
    "ligature ﬁ, nbsp\u00a0here, zero\u200bwidth, soft\u00adhyphen, BOM\ufeff",
    "numbers 1234567890 3.14159 1e-9 0xDEADBEEF",
    "<|endoftext|> is plain text to the encoder",
    "'s 't 're 've 'm 'll 'd ''quoted'' I'M DON'T",
    "",
    "\x00\x01 control \x7f bytes",
]


def hf_byte_level(vocab, merges):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def corpus_file(tmp_path, texts, name="corpus.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def train_tokenizer(*args):
    assert load_tool("train_tokenizer").main([str(a) for a in args]) == 0


def test_gpt2_bpe_matches_hf_tokenizers_on_the_default_tokenizer():
    ours, hf = GPT2BPETokenizer(VOCAB_FILE, MERGE_FILE), hf_byte_level(VOCAB_FILE, MERGE_FILE)
    assert ours.vocab_size == 8192 and ours.eod == 0
    for text in TEXTS:
        ids = ours.tokenize(text)
        assert ids == hf.encode(text).ids, text
        assert ours.detokenize(ids) == text
    assert ours.eod not in ours.tokenize("<|endoftext|>")


def test_trained_bpe_matches_hf_on_text_unlike_its_training_data(tmp_path):
    # A small BPE from train_tokenizer.py: many merges are unseen in the test texts, which stresses merge order.
    texts = [t * 3 for t in TEXTS[:6]] * 4
    train_tokenizer(
        "--input", corpus_file(tmp_path, texts), "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-size", "400", "--output-dir", tmp_path / "bpe",
    )  # fmt: skip
    vocab, merges = tmp_path / "bpe" / "vocab.json", tmp_path / "bpe" / "merges.txt"
    ours, hf = GPT2BPETokenizer(str(vocab), str(merges)), hf_byte_level(vocab, merges)
    assert ours.vocab_size == 400
    for text in TEXTS + ["Ünïcödé everywhere: 🎉 ∀ 你好 " * 3]:
        assert ours.tokenize(text) == hf.encode(text).ids, text


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sp")
    texts = [f"{t} sentence number {i}." for i in range(30) for t in TEXTS[:6]]
    train_tokenizer(
        "--input", corpus_file(tmp, texts), "--tokenizer-type", "SentencePieceTokenizer",
        "--vocab-size", "400", "--output-dir", tmp,
    )  # fmt: skip
    return str(tmp / "tokenizer.model")


def test_sentencepiece_follows_megatron_special_tokens(sentencepiece_model):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=sentencepiece_model)
    tok = SentencePieceTokenizer(sentencepiece_model)
    # The model has unk/bos/eos (<unk>, <s>, </s>) and no pad: Megatron appends <CLS> <SEP> <EOD> <MASK> <PAD>.
    assert tok.vocab_size == 400 + 5
    assert tok.special["<EOD>"] == tok.eod == 402
    assert tok.special["<s>"] == 1 and tok.special["</s>"] == 2 and tok.special["<PAD>"] == 404
    text = "Hello world<EOD>second <MASK>doc"
    expected = sp.encode_as_ids("Hello world") + [402] + sp.encode_as_ids("second ") + [403]
    assert tok.tokenize(text) == expected + sp.encode_as_ids("doc")
    assert tok.detokenize(sp.encode_as_ids("Hello world")) == "Hello world"

    gpt = GPTSentencePieceTokenizer(sentencepiece_model)
    assert gpt.vocab_size == 400 and gpt.eod == 2
    for text in TEXTS[:6]:
        assert gpt.tokenize(text) == sp.encode_as_ids(text)


def test_huggingface_tokenizer_json_and_its_end_of_document(tmp_path):
    hf = hf_byte_level(VOCAB_FILE, MERGE_FILE)
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = HuggingFaceTokenizer(str(tmp_path))  # a folder
    assert tok.vocab_size == 8192 and tok.eod == 0  # <|endoftext|> found by name
    assert tok.tokenize(TEXTS[1]) == hf.encode(TEXTS[1]).ids and tok.detokenize(tok.tokenize(TEXTS[1])) == TEXTS[1]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "Ġthe"}}))
    assert HuggingFaceTokenizer(str(tmp_path / "tokenizer.json")).eod == hf.token_to_id("Ġthe")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<not-there>"}))
    with pytest.raises(DataError, match="cannot tell the end-of-document token"):
        HuggingFaceTokenizer(str(tmp_path))


def test_null_tokenizer_uses_megatron_ids():
    tok = NullTokenizer(1000)
    assert tok.vocab_size == 1001 and tok.eod == 1000
    assert tok.tokenize("3 1 4 1000") == [3, 1, 4, 1000] and tok.detokenize([3, 1]) == "3 1"


def test_padded_vocab_size():
    assert padded_vocab_size(50257, 128) == 50304
    assert padded_vocab_size(50257, 128, tensor_parallel_size=8) == 51200
    assert padded_vocab_size(8192, 128) == 8192 and padded_vocab_size(1, 128) == 128


def test_build_tokenizer_and_bad_files(tmp_path, sentencepiece_model):
    cfg = DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=VOCAB_FILE, merge_file=MERGE_FILE)
    assert isinstance(build_tokenizer(cfg), GPT2BPETokenizer)
    cfg = DataConfig(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=sentencepiece_model)
    assert build_tokenizer(cfg).eod == 2

    missing = DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path / "no.json"), merge_file=MERGE_FILE)
    with pytest.raises(DataError, match=r"--vocab-file .*no\.json: no such file"):
        build_tokenizer(missing)
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1}))
    with pytest.raises(DataError, match=r"vocab\.json has no <\|endoftext\|> entry"):
        GPT2BPETokenizer(str(tmp_path / "vocab.json"), MERGE_FILE)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(DataError, match=r"broken\.json: not a GPT-2 vocab\.json"):
        GPT2BPETokenizer(str(tmp_path / "broken.json"), MERGE_FILE)
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\nthree parts here\n")
    with pytest.raises(DataError, match=r"merges\.txt:3: a merge rule is two symbols"):
        GPT2BPETokenizer(VOCAB_FILE, str(tmp_path / "merges.txt"))
    with pytest.raises(DataError, match=r"merges\.txt: not a SentencePiece model"):
        SentencePieceTokenizer(str(tmp_path / "merges.txt"))
    with pytest.raises(DataError, match=r"vocab\.json: not a HF tokenizer\.json"):
        HuggingFaceTokenizer(str(tmp_path / "vocab.json"))
