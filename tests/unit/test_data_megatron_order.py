"""The GPT datasets give Megatron-Core's samples in Megatron-Core's order: compared against what Megatron-Core itself
built on the same documents (tests/assets/megatron_core_samples.json; tests/assets/megatron_core_samples.py says
how it was made), for one prefix over one and several epochs (with and without its separate final epoch) and for a
weighted blend, every split, from sample 0 and from consumed sample 320 on."""

import json

import numpy as np
import pytest

from megatron.data import PretrainingSampler, build_datasets, build_tokenizer
from megatron.data.builder import split_sizes
from tests.assets.data_helpers import ROOT, config, write_documents
from tests.assets.megatron_core_samples import GBS, SEQ, describe, lengths, window_hash

RECORDED = json.loads((ROOT / "tests/assets/megatron_core_samples.json").read_text())
VOCAB = 2_000_000


def window_of(dataset, i):
    sample = dataset[i]
    return np.concatenate([sample["tokens"].numpy(), sample["labels"].numpy()[-1:]])


def build(tmp_path, name):
    case = RECORDED["cases"][name]
    paths = []
    for k, (seed, count, first) in enumerate(case["prefixes"]):
        prefix = write_documents(tmp_path / f"{name}_{k}", lengths(seed, count), first_token=first)
        paths += [str(case["weights"][k]), prefix] if case["weights"] else [prefix]
    cfg = config(
        f"--data-path {' '.join(paths)} --split {case['split']} --data-cache-path {tmp_path / 'cache'}"
        f" --vocab-size {VOCAB - 1} --seq-length {SEQ} --micro-batch-size 2 --global-batch-size {GBS}"
        f" --train-iters {case['train_iters']} --eval-interval {case['eval_interval']}"
        f" --eval-iters {case['eval_iters']} --seed {case['seed']}"
    )
    return case, cfg, build_datasets(cfg, build_tokenizer(cfg.data), VOCAB)


@pytest.mark.parametrize("name", sorted(RECORDED["cases"]))
def test_samples_and_order_equal_megatron_core(tmp_path, name):
    case, cfg, datasets = build(tmp_path, name)
    assert list(split_sizes(cfg)) == case["sizes"]  # Megatron-LM's train/valid/test sample counts
    for split, recorded in case["splits"].items():
        ours = describe(getattr(datasets, split), window_of)
        assert ours["len"] == recorded["len"], split
        assert ours["samples"] == recorded["samples"], split
        assert ours["digest"] == recorded["digest"], split


def test_a_resumed_run_reads_megatron_cores_next_samples(tmp_path):
    """After 40 steps of 8 (consumed samples 320), the sampler's next global batches are Megatron-Core's samples
    320..335, on every data-parallel rank."""
    case, _, datasets = build(tmp_path, "single")
    recorded = case["splits"]["train"]["samples"]
    train = datasets.train
    for dp in (1, 2, 4):
        read = []
        for rank in range(dp):
            batches = iter(PretrainingSampler(len(train), 320, GBS // dp, rank, dp))
            read += [(i, window_hash(window_of(train, i))) for _ in range(2) for i in next(batches)]
        assert sorted(read) == [(i, recorded[str(i)]) for i in range(320, 320 + 2 * GBS)]
