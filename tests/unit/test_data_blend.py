"""Weighted blends: proportions hold in every prefix of the blend, the layout is Megatron-Core's, each dataset's
samples are used in order, and `--data-path` blends build end to end (and reject malformed weight lists)."""

import numpy as np
import pytest

from megatron.config import ConfigError, parse_args
from megatron.data import build_datasets, build_tokenizer
from megatron.data.blended_dataset import BlendedDataset, blend_indices
from megatron.data.errors import DataError
from tests.assets.data_helpers import config, write_documents


@pytest.mark.parametrize("weights", [[0.2, 0.3, 0.5], [0.7, 0.3], [0.01, 0.99], [1 / 3] * 3, [0.05, 0.15, 0.3, 0.5]])
def test_every_prefix_holds_the_proportions(weights):
    n, k = 20_000, len(weights)
    index = blend_indices(weights, n)
    counts = np.cumsum(np.eye(k, dtype=np.int64)[index["dataset_index"]], axis=0)  # [n, k] counts per prefix
    ideal = np.arange(1, n + 1)[:, None] * np.asarray(weights)[None, :]
    assert np.abs(counts - ideal).max() <= (k + 1) / 2
    for d in range(k):  # each dataset's samples are taken 0, 1, 2, ... in order
        taken = index["dataset_sample_index"][index["dataset_index"] == d]
        assert taken.tolist() == list(range(len(taken)))


def test_layout_follows_megatron_cores_greedy_rule_by_hand():
    # Sample i goes to the first k maximizing w_k * max(i, 1) - taken_k (samples 0 and 1 both use 1; ties: lower k).
    index = blend_indices([0.25, 0.75], 8)
    assert index["dataset_index"].tolist() == [1, 0, 1, 1, 0, 1, 1, 1]
    assert index["dataset_sample_index"].tolist() == [0, 0, 1, 2, 1, 3, 4, 5]
    np.testing.assert_array_equal(blend_indices([0.25, 0.75], 5000)["dataset_index"][:8], index["dataset_index"])


def test_data_path_blend_end_to_end(tmp_path):
    a = write_documents(tmp_path / "a", [50] * 40)
    b = write_documents(tmp_path / "b", [50] * 40, first_token=10_000)
    cfg = config(
        f"--data-path 1 {a} 3 {b} --data-cache-path {tmp_path / 'cache'} --vocab-size 20000 --seq-length 16"
        " --micro-batch-size 4 --global-batch-size 8 --train-iters 25 --eval-iters 1 --split 90,10,0"
    )
    datasets = build_datasets(cfg, build_tokenizer(cfg.data), 20_096)
    train = datasets.train
    assert isinstance(train, BlendedDataset) and len(train) == 200 and datasets.test is None
    from_b = [train[i]["tokens"][0].item() >= 10_000 for i in range(len(train))]
    assert sum(from_b) == 150  # weights 1:3 normalized to 0.25 / 0.75
    # Each component was built for its share and Megatron-LM's 0.5% surplus (whole windows of its epochs).
    assert len(train.datasets[0]) >= 51 and len(train.datasets[1]) >= 151
    assert len(datasets.valid) == 8


@pytest.mark.parametrize(
    "data_path, message",
    [
        ("0.3 /a 0.7", "takes weight/prefix pairs"),
        ("/a /b", r"'/a' should be the weight of '/b'"),
        ("0.3 /a -1 /b", "the weight of /b must be > 0"),
    ],
)
def test_malformed_blends_are_config_errors(data_path, message):
    with pytest.raises(ConfigError, match=message):
        config(f"--data-path {data_path} --vocab-size 10")


def test_full_validation_holds_every_validation_window_of_every_prefix(tmp_path):
    a = write_documents(tmp_path / "a", [50] * 40)
    b = write_documents(tmp_path / "b", [50] * 40, first_token=10_000)
    flags = (
        f"--data-cache-path {tmp_path / 'cache'} --vocab-size 20000 --seq-length 16 --micro-batch-size 4"
        " --train-iters 25 --eval-iters 1 --eval-interval 5 --split 80,20,0 --full-validation"
    )

    def datasets(extra: str):
        cfg = config(f"{flags} {extra}")
        return build_datasets(cfg, build_tokenizer(cfg.data), 20_096)

    # 8 documents of 50 tokens: (400 - 1) // 16 windows, once each, whatever the number of evaluations.
    assert len(datasets(f"--data-path {a} --global-batch-size 8").valid) == 24
    blend = datasets(f"--data-path 1 {a} 3 {b} --global-batch-size 8").valid
    assert len(blend) == 48  # both prefixes' splits in full, not sampled by weight
    assert sum(blend[i]["tokens"][0].item() >= 10_000 for i in range(48)) == 24
    with pytest.raises(DataError, match="--full-validation: the validation split holds 24 samples"):
        datasets(f"--data-path {a} --global-batch-size 32")


def test_missing_data_and_tokenizer_files_are_config_errors_before_anything_is_built(tmp_path):
    a = write_documents(tmp_path / "a", [50] * 4)
    flags = "--vocab-size 100 --data-path"
    config(f"{flags} {a}")
    (tmp_path / "b.idx").write_bytes(b"")  # half a pair: its .bin is missing
    with pytest.raises(ConfigError, match=rf"^--data-path {tmp_path}/b: {tmp_path}/b\.bin not found; "):
        config(f"{flags} 0.5 {a} 0.5 {tmp_path / 'b'}")
    with pytest.raises(ConfigError, match=r"c\.bin and .*c\.idx not found; .* \(.*/a, .*/b in its folder\)$"):
        config(f"{flags} {tmp_path / 'c'}")
    with pytest.raises(ConfigError, match=rf"takes the prefix without \.bin/\.idx: {a}$"):
        config(f"{flags} {a}.bin")
    bpe = f"--mock-data --tokenizer-type GPT2BPETokenizer --vocab-file {tmp_path / 'vocab.json'} --merge-file {a}.bin"
    with pytest.raises(ConfigError, match=r"^--vocab-file .*vocab\.json: no such file$"):
        config(bpe)
    assert parse_args(bpe.split(), check_files=False).data.vocab_file.endswith("vocab.json")  # flags alone
