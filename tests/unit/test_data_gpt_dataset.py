"""The GPT dataset: every token of an epoch read once, deterministic orders (Megatron-Core's), exact resume
through the Megatron sampler, masks for --reset-*/--eod-mask-loss, the index cache, splits and bad-input errors."""

import multiprocessing
import os

import numpy as np
import pytest
import torch

from megatron.config import ConfigError, parse_args
from megatron.data import PretrainingSampler, build_datasets, build_tokenizer
from megatron.data.builder import split_bounds
from megatron.data.errors import DataError
from megatron.data.gpt_dataset import GPTDataset, ltor_masks
from megatron.data.index_cache import load_or_build
from megatron.data.indexed_dataset import IndexedDataset
from tests.assets.data_helpers import config, write_documents

EOD = 100_000
LENGTHS = [int(n) for n in np.random.default_rng(0).integers(1, 40, size=60)]


def gpt(prefix, cache, num_samples, seq=16, seed=1234, **kwargs):
    indexed = IndexedDataset(prefix)
    return GPTDataset(indexed, 0, indexed.num_documents, num_samples, seq, seed, EOD, str(cache), **kwargs)


def test_ltor_masks_by_hand():
    e = EOD
    tokens = np.array([1, 2, e, 3, 4, e, 5])
    loss_mask, positions, mask = ltor_masks(tokens, e, True, True, True)
    assert loss_mask.tolist() == [1, 1, 0, 1, 1, 0, 1] and loss_mask.dtype == np.float32
    assert positions.tolist() == [0, 1, 2, 0, 1, 2, 0]
    segment = [0, 0, 0, 1, 1, 1, 2]
    expected = [[k <= q and segment[k] == segment[q] for k in range(7)] for q in range(7)]
    assert mask.shape == (1, 7, 7) and mask.dtype == bool and mask[0].tolist() == expected
    loss_mask, positions, mask = ltor_masks(tokens, e, False, False, False)
    assert loss_mask.tolist() == [1] * 7 and positions.tolist() == list(range(7)) and mask is None


def test_one_epoch_reads_every_token_once(tmp_path):
    prefix = write_documents(tmp_path / "d", LENGTHS)  # token ids 0..T-1, each unique
    total = sum(LENGTHS)
    ds = gpt(prefix, tmp_path / "cache", num_samples=1)
    seq, samples = 16, (total - 1) // 16
    assert ds.num_epochs == 1 and len(ds) == ds.samples_per_epoch == samples
    assert sorted(ds.document_index.tolist()) == list(range(len(LENGTHS)))  # each document once
    stream = np.concatenate([np.arange(sum(LENGTHS[:d]), sum(LENGTHS[: d + 1])) for d in ds.document_index])
    seen = []
    for i in range(len(ds)):
        sample = ds[i]
        assert sample["tokens"].dtype == torch.long and sample["tokens"].shape == (seq,)
        assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
        seen += sample["tokens"].tolist()
    # Inputs: the stream's first S*seq tokens, each exactly once; the rest (< seq tokens) waits for no one.
    assert sorted(seen) == sorted(stream[: samples * seq].tolist()) and len(set(seen)) == len(seen)
    assert total - samples * seq <= seq
    # Consecutive samples come from shuffled places, not stream order.
    assert [int(s) for s in ds.shuffle_index] != list(range(samples))


def test_orders_are_deterministic_and_shuffle_the_final_epoch_apart(tmp_path):
    prefix = write_documents(tmp_path / "d", LENGTHS)
    a = gpt(prefix, tmp_path / "a", num_samples=250)
    b = gpt(prefix, tmp_path / "b", num_samples=250)  # built again from scratch elsewhere
    other_seed = gpt(prefix, tmp_path / "c", num_samples=250, seed=99)
    total, per_epoch = sum(LENGTHS), a.samples_per_epoch
    assert a.num_epochs == -(-(250 * 16 + 1) // total) == 4 and len(a) == (4 * total - 1) // 16 >= 250
    assert all(torch.equal(a[i]["tokens"], b[i]["tokens"]) for i in range(len(a)))
    assert not all(torch.equal(a[i]["tokens"], other_seed[i]["tokens"]) for i in range(10))
    # The last epoch gives fewer than 80% of an epoch's samples to the 250: as in Megatron-Core, its documents and
    # windows are shuffled apart from the first three epochs' (which are shuffled together).
    before_final = (3 * total - 1) // 16
    assert 250 - before_final < int(0.8 * per_epoch)
    docs = a.document_index.tolist()
    assert sorted(docs[-len(LENGTHS) :]) == list(range(len(LENGTHS)))
    assert np.bincount(docs[: -len(LENGTHS)]).tolist() == [3] * len(LENGTHS)
    assert sorted(docs[: len(LENGTHS)]) != list(range(len(LENGTHS)))  # epochs 0..2 mixed
    shuffle = a.shuffle_index.tolist()
    assert sorted(shuffle[:before_final]) == list(range(before_final))
    assert sorted(shuffle[before_final:]) == list(range(before_final, len(a)))


def test_resume_continues_without_replay_or_skip(tmp_path):
    prefix = write_documents(tmp_path / "d", LENGTHS)
    total, micro, dp = 96, 2, 2
    full = gpt(prefix, tmp_path / "cache", num_samples=total)

    def read(dataset, consumed):
        out = []
        for rank in range(dp):
            for batch in PretrainingSampler(total, consumed, micro, rank, dp):
                out += [(i, dataset[i]["tokens"].tolist()) for i in batch]
        return sorted(out)

    uninterrupted = read(full, 0)
    resumed = gpt(prefix, tmp_path / "cache", num_samples=total)  # a new process would load the same cache
    assert not resumed.built_index
    after = read(resumed, 40)
    assert [i for i, _ in after] == list(range(40, total))
    assert after == [x for x in uninterrupted if x[0] >= 40]


def _build_in_child(cache, queue):
    def build():
        with open(os.path.join(cache, "builds.log"), "a") as f:
            f.write(f"{os.getpid()}\n")
        return {"values": np.arange(1000) * 3}

    arrays, built = load_or_build(cache, "entry", {"k": 1}, build)
    queue.put((built, int(arrays["values"].sum())))


def test_index_cache_is_built_once_by_concurrent_processes_and_rebuilt_when_stale(tmp_path):
    ctx = multiprocessing.get_context("fork")
    queue, cache = ctx.Queue(), str(tmp_path)
    children = [ctx.Process(target=_build_in_child, args=(cache, queue)) for _ in range(4)]
    for child in children:
        child.start()
    results = [queue.get(timeout=60) for _ in children]
    for child in children:
        child.join()
    assert sum(built for built, _ in results) == 1 and {total for _, total in results} == {3 * 999 * 1000 // 2}
    assert len(open(tmp_path / "builds.log").read().split()) == 1
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]

    prefix = write_documents(tmp_path / "d", LENGTHS)
    assert gpt(prefix, tmp_path / "c", 10).built_index and not gpt(prefix, tmp_path / "c", 10).built_index
    write_documents(tmp_path / "d", LENGTHS[::-1])  # the data changed: the old entry must not be reused
    stat = os.stat(prefix + ".idx")
    os.utime(prefix + ".idx", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert gpt(prefix, tmp_path / "c", 10).built_index


def flags(prefix, cache, extra=""):
    return (
        f"--data-path {prefix} --data-cache-path {cache} --vocab-size {EOD} --seq-length 16 --micro-batch-size 2"
        f" --global-batch-size 4 --train-iters 10 --eval-iters 2 {extra}"
    )


def test_build_datasets_splits_documents(tmp_path):
    prefix = write_documents(tmp_path / "d", [30] * 100, eod=EOD)
    cfg = config(flags(prefix, tmp_path / "cache", "--split 8,1,1 --reset-attention-mask --eod-mask-loss"))
    datasets = build_datasets(cfg, build_tokenizer(cfg.data), 100_096)
    assert split_bounds([0.8, 0.1, 0.1], 100) == [0, 80, 90, 100]
    assert len(datasets.train) >= 40 and len(datasets.valid) >= 8 and len(datasets.test) >= 8
    for dataset, (first, last) in zip(datasets.__dict__.values(), [(0, 80), (80, 90), (90, 100)]):
        for i in range(len(dataset)):
            sample = dataset[i]
            documents = {t // 30 for t in sample["tokens"].tolist() if t != EOD}
            assert documents <= set(range(first, last))
            assert sample["attention_mask"].shape == (1, 16, 16)
            assert sample["loss_mask"][sample["tokens"] == EOD].sum() == 0
    cfg = config(flags(prefix, tmp_path / "cache", "--split 1,0,0 --eval-iters 0"))
    assert build_datasets(cfg, build_tokenizer(cfg.data), 100_096).valid is None
    cfg = config(flags(prefix, tmp_path / "cache", "--split 98,1,1 --seq-length 32"))
    with pytest.warns(UserWarning) as warned:
        datasets = build_datasets(cfg, build_tokenizer(cfg.data), 100_096)
    assert datasets.valid is None and datasets.test is None
    assert [str(w.message).split(": ", 1)[1] for w in warned] == [
        f"the {name} split (documents {d}..{d}) holds 31 tokens, too few for one sample of --seq-length 32 + 1;"
        f" {name} leaves it out"
        for name, d in (("valid", 98), ("test", 99))
    ]


def test_bad_data_errors_name_the_cause(tmp_path):
    prefix = write_documents(tmp_path / "d", [5] * 10)
    cfg = config(flags(prefix, tmp_path / "cache", "--seq-length 64"))
    with pytest.raises(DataError, match=r"d: the train split \(documents 0..9\) holds 50 tokens, too few for one"):
        build_datasets(cfg, build_tokenizer(cfg.data), 100_096)
    cfg = config(flags(prefix, tmp_path / "cache", "--split 0,1,0"))
    with pytest.raises(DataError, match="leaves no documents for training"):
        build_datasets(cfg, build_tokenizer(cfg.data), 100_096)
    big = write_documents(tmp_path / "big", [100] * 3, first_token=200_000)
    cfg = config(flags(big, tmp_path / "cache", "--split 1,0,0"))
    with pytest.raises(DataError, match=r"big: token id 2\d{5} is outside the model's vocabulary of 100096"):
        build_datasets(cfg, build_tokenizer(cfg.data), 100_096).train[0]
    with pytest.raises(ConfigError, match=r"missing\.bin and .*missing\.idx not found"):  # with the flags
        config(flags(tmp_path / "missing", tmp_path / "cache"))
    cfg = parse_args(flags(tmp_path / "missing", tmp_path / "cache").split(), check_files=False)
    with pytest.raises(DataError, match=r"missing\.idx: no such file"):  # files gone after the flags were read
        build_datasets(cfg, build_tokenizer(cfg.data), 100_096)
