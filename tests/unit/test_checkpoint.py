"""Checkpoint layout: folder names, metadata, the layout check and corrupt pointers."""

import pytest
import torch

from megatron.checkpoint import CheckpointError, load_checkpoint, model_parallel_name, save_checkpoint


def test_shard_folder_names_follow_megatron():
    assert model_parallel_name(0, 0, 1) == "mp_rank_00"
    assert model_parallel_name(1, 2, 4) == "mp_rank_01_002"


def test_other_parallel_layout_is_refused_with_the_flags_to_use(tmp_path):
    save_checkpoint(str(tmp_path), 5, {"x": torch.ones(1)}, writer=True, layout={"tp": 2, "pp": 1, "dp": 1})
    assert (tmp_path / "iter_0000005" / "metadata.json").exists()
    with pytest.raises(CheckpointError, match="--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1"):
        load_checkpoint(str(tmp_path), layout={"tp": 1, "pp": 2, "dp": 1})
    # Another data-parallel size loads: replicas are identical.
    state = load_checkpoint(str(tmp_path), layout={"tp": 2, "pp": 1, "dp": 4})
    assert state["iteration"] == 5


def test_corrupt_pointer_and_missing_shard(tmp_path):
    assert load_checkpoint(str(tmp_path)) is None
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("garbage")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(str(tmp_path))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(CheckpointError, match="missing"):
        load_checkpoint(str(tmp_path))


def test_truncated_file_is_reported(tmp_path):
    save_checkpoint(str(tmp_path), 1, {"x": torch.ones(100)}, writer=True)
    path = tmp_path / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(str(tmp_path))
