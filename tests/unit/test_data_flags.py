"""Megatron-LM's data flags: --no-mmap-bin-files reads the same samples by file reads, the loader builds no attention
mask with --no-create-attention-mask-in-dataloader, and --split takes the quoted value the llama3 script sends."""

import numpy as np
import pytest
import torch

from megatron.config import ConfigError, parse_args
from megatron.config.data import parse_split
from megatron.data import build_datasets, build_tokenizer
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from tests.assets.data_helpers import config, write_documents

EOD = 100_000


def flags(prefix, cache, extra=""):
    return (
        f"--data-path {prefix} --data-cache-path {cache} --vocab-size {EOD} --seq-length 16 --micro-batch-size 2"
        f" --global-batch-size 4 --train-iters 10 --eval-iters 2 {extra}"
    )


def samples(cfg):
    datasets = build_datasets(cfg, build_tokenizer(cfg.data), EOD + 96)
    return [ds[i] for ds in (datasets.train, datasets.valid) for i in range(len(ds))]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
def test_file_reads_return_what_the_memory_map_holds(tmp_path, dtype):
    prefix = str(tmp_path / "d")
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 60_000, size=n) for n in (5, 0, 17, 1, 40)]
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc in documents:
            writer.add_document(doc)
    mapped, read = IndexedDataset(prefix), IndexedDataset(prefix, mmap=False)
    for i, doc in enumerate(documents):
        assert read.get(i).dtype == mapped.get(i).dtype
        assert read.get(i).tolist() == mapped.get(i).tolist() == doc.tolist()
        if len(doc) > 3:
            assert read.get(i, 2, 2).tolist() == doc[2:4].tolist()
    assert read._bin is None  # nothing was mapped


def test_no_mmap_bin_files_gives_the_same_samples(tmp_path):
    prefix = write_documents(tmp_path / "d", [int(n) for n in np.random.default_rng(1).integers(3, 50, 80)], eod=EOD)
    cfg_map = config(flags(prefix, tmp_path / "cache", "--mmap-bin-files"))
    cfg_read = config(flags(prefix, tmp_path / "cache", "--no-mmap-bin-files"))
    assert cfg_map.data.mmap_bin_files and config(flags(prefix, tmp_path / "cache")).data.mmap_bin_files
    assert not cfg_read.data.mmap_bin_files
    mapped, read = samples(cfg_map), samples(cfg_read)
    assert len(mapped) == len(read) > 0
    for a, b in zip(mapped, read):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_no_attention_mask_in_the_loader(tmp_path):
    prefix = write_documents(tmp_path / "d", [30] * 40, eod=EOD)
    for extra in ("", "--no-create-attention-mask-in-dataloader"):
        cfg = config(flags(prefix, tmp_path / "cache", extra))
        assert cfg.data.create_attention_mask_in_dataloader is not bool(extra)
        assert all("attention_mask" not in s for s in samples(cfg))  # the attention applies the causal mask itself
    cfg = config(flags(prefix, tmp_path / "cache", "--reset-attention-mask"))
    assert all(s["attention_mask"].shape == (1, 16, 16) for s in samples(cfg))
    with pytest.raises(ConfigError, match="--reset-attention-mask needs .* drop --no-create-attention-mask") as err:
        config(flags(prefix, tmp_path / "cache", "--reset-attention-mask --no-create-attention-mask-in-dataloader"))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("value", ["99,1,0", "'99,1,0'", '"99,1,0"', " '99,1,0' "])
def test_split_accepts_the_quoted_value_of_the_llama3_script(value):
    assert parse_split(value) == pytest.approx([0.99, 0.01, 0.0])
    assert parse_args(["--mock-data", "--vocab-size", "8", "--split", value]).data.split == value


@pytest.mark.parametrize("value", ["'99,1,0", "'99'1'", "99,1,0,1", "a,b"])
def test_split_still_rejects_malformed_values(value):
    with pytest.raises(ValueError, match="--split"):
        parse_split(value)
