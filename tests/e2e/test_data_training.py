"""Training on real preprocessed text: the loss goes down, and resuming from a checkpoint reads exactly the samples
the uninterrupted run reads (same losses), with document resets and the attention mask in play."""

import itertools
import json

import pytest

from megatron.config import parse_args
from megatron.data.default_corpus import iter_documents, tokenizer_config
from megatron.data.preprocess import preprocess_jsonl
from megatron.training import Trainer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The first 40 documents of the default corpus (Python's help topics), tokenized with the default tokenizer."""
    tmp = tmp_path_factory.mktemp("corpus")
    with open(tmp / "docs.jsonl", "w", encoding="utf-8") as f:
        for doc in itertools.islice(iter_documents(), 40):
            f.write(json.dumps(doc) + "\n")
    preprocess_jsonl(str(tmp / "docs.jsonl"), str(tmp / "docs"), tokenizer_config(), append_eod=True)
    return str(tmp / "docs_text_document")


def train(corpus, flags):
    cfg = tokenizer_config()
    argv = (
        f"--data-path {corpus} --tokenizer-type GPT2BPETokenizer --vocab-file {cfg.vocab_file}"
        f" --merge-file {cfg.merge_file} --split 95,5,0 --num-layers 2 --hidden-size 32 --num-attention-heads 4"
        " --seq-length 64 --micro-batch-size 4 --global-batch-size 8 --lr 3e-3 --lr-warmup-iters 2"
        " --eval-iters 1 --eval-interval 1000 --log-interval 5 " + flags
    )
    return Trainer(parse_args(argv.split())).train()


def test_loss_goes_down_on_real_text(corpus):
    state = train(corpus, "--train-iters 30 --hidden-dropout 0 --attention-dropout 0")
    assert state.losses[30] < state.losses[1] - 1.0, (state.losses[1], state.losses[30])  # ln(8192) = 9.01 at start


def test_resume_reads_the_same_samples_as_an_uninterrupted_run(corpus, tmp_path):
    flags = "--train-iters 8 --reset-position-ids --reset-attention-mask --eod-mask-loss"
    full = train(corpus, flags)
    train(corpus, f"{flags} --exit-interval 4 --save {tmp_path}")
    resumed = train(corpus, f"{flags} --load {tmp_path}")
    assert [resumed.losses[i] for i in range(5, 9)] == [full.losses[i] for i in range(5, 9)]
