"""Verified checkpoints: checksums at save, fall-back at load, --save-retain-last, no non-finite checkpoint."""

import json

import pytest
import torch

from megatron.checkpoint import CheckpointError, latest_iteration, load_checkpoint, save_checkpoint
from megatron.checkpoint.integrity import all_finite, file_checksum
from megatron.config import ConfigError, parse_args
from megatron.training import Trainer


def _save(root, iteration, retain=None):
    save_checkpoint(str(root), iteration, {"x": torch.full((64,), float(iteration))}, writer=True, retain=retain)


def test_checksums_are_recorded_and_damage_falls_back_naming_the_file(tmp_path, capsys):
    _save(tmp_path, 2)
    _save(tmp_path, 4)
    path = tmp_path / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt"
    recorded = json.loads((tmp_path / "iter_0000004" / "metadata.json").read_text())["checksums"]
    assert recorded["mp_rank_00/model_optim_rng.pt"] == {"size": path.stat().st_size, "crc32": file_checksum(path)}
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1  # one flipped bit
    path.write_bytes(bytes(data))
    assert load_checkpoint(str(tmp_path))["iteration"] == 2
    out = capsys.readouterr().out
    assert sum(str(path) in line for line in out.splitlines()) == 1 and "falling back" in out
    (tmp_path / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no checkpoint in .* verifies") as err:
        load_checkpoint(str(tmp_path))  # never silently from scratch
    assert "\n" not in str(err.value)


def test_checkpoint_without_checksums_loads_with_a_note(tmp_path, capsys):
    _save(tmp_path, 3)
    (tmp_path / "iter_0000003" / "metadata.json").write_text('{"layout": {"tp": 1, "pp": 1, "dp": 1}}')
    assert load_checkpoint(str(tmp_path))["iteration"] == 3
    assert "predates checksums" in capsys.readouterr().out


def test_pointer_to_a_missing_folder_falls_back(tmp_path):
    _save(tmp_path, 3)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("9")
    assert load_checkpoint(str(tmp_path))["iteration"] == 3


def test_save_retain_last_keeps_the_newest(tmp_path):
    for iteration in (1, 2, 3, 4, 5):
        _save(tmp_path, iteration, retain=2)
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000004", "iter_0000005"]
    _save(tmp_path, 3, retain=1)  # resumed from an older one: the newer folders are not this save's to delete
    assert latest_iteration(str(tmp_path)) == 3
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000003", "iter_0000004", "iter_0000005"]
    with pytest.raises(ConfigError, match="--save-retain-last must be >= 1"):
        parse_args("--mock-data --vocab-size 128 --save x --save-retain-last 0".split())


def test_all_finite_is_one_fused_check():
    good = [torch.ones(3), torch.zeros(2, dtype=torch.bfloat16), torch.full((4,), 3e38)]
    assert all_finite(good)
    assert not all_finite(good + [torch.tensor([1.0, float("nan")])])
    assert not all_finite(good + [torch.tensor([float("-inf")], dtype=torch.bfloat16)])


def test_non_finite_state_is_never_saved(tmp_path, capsys):
    flags = "--mock-data --vocab-size 64 --num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 16"
    flags += f" --micro-batch-size 2 --global-batch-size 4 --train-iters 2 --eval-iters 0 --save {tmp_path}"
    trainer = Trainer(parse_args(flags.split()))
    trainer.train()
    assert latest_iteration(str(tmp_path)) == 2
    trainer.state.iteration = 3
    with torch.no_grad():
        next(trainer.model.parameters())[0] = float("nan")
    trainer.checkpoints.save()
    assert latest_iteration(str(tmp_path)) == 2 and not (tmp_path / "iter_0000003").exists()
    assert "not saving the checkpoint of iteration 3" in capsys.readouterr().out
