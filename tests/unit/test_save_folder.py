"""The --save folder (megatron/checkpoint/save_folder.py): links planted in it are replaced, never written through;
a folder that is read-only, full or not a folder stops the run at start in one line; a failed save leaves no
`iter_N.tmp`; a re-save killed between its renames loads from `iter_N.old`."""

import errno
import os
from pathlib import Path

import pytest

from megatron.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, save_folder
from megatron.checkpoint.save_folder import SaveFolderError, check_save_folder
from megatron.config import parse_args
from megatron.training import Trainer

TINY = (
    "--mock-data --vocab-size 32 --num-layers 1 --hidden-size 8 --num-attention-heads 2 --seq-length 8"
    " --micro-batch-size 1 --global-batch-size 1 --lr 1e-3 --eval-iters 0 --log-interval 100"
)
PLANTED = ["config.json", "latest_checkpointed_iteration.txt", "latest_checkpointed_iteration.txt.tmp"]


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_links_planted_in_save_are_replaced_not_followed(tmp_path, fmt):
    save, outside = tmp_path / "save", tmp_path / "outside"
    save.mkdir()
    outside.mkdir()
    for name in PLANTED:
        (outside / name).write_text("precious\n")
        (save / name).symlink_to(outside / name)
    for name in ("iter_0000002.tmp", "iter_0000002.old", "iter_0000001.tmp"):  # folders a killed save leaves
        (outside / name).mkdir()
        (outside / name / "keep").write_text("precious\n")
        (save / name).symlink_to(outside / name)
    flags = f"{TINY} --train-iters 2 --save-interval 2 --ckpt-format {fmt} --save {save}"
    Trainer(parse_args(flags.split())).train()

    assert sorted(p.name for p in outside.rglob("*") if p.is_file()) == sorted(PLANTED + ["keep"] * 3)
    assert all(p.read_text() == "precious\n" for p in outside.rglob("*") if p.is_file())
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "2\n"
    assert not any(p.is_symlink() for p in save.iterdir()), list(save.iterdir())
    assert (save / "iter_0000002" / "metadata.json").is_file()
    assert '"ckpt_format"' in (save / "config.json").read_text()


def _failing(monkeypatch, call: str, code: int) -> None:
    """Make os.`call` fail with `code` on the start check's probe file only (the tests run as root, which ignores
    permissions, and a full disk cannot be had on demand)."""
    real = getattr(os, call)

    def failing(target, *args, **kwargs):
        name = os.readlink(f"/proc/self/fd/{target}") if isinstance(target, int) else os.fspath(target)
        if ".write-probe-" in name:
            raise OSError(code, os.strerror(code), name)
        return real(target, *args, **kwargs)

    monkeypatch.setattr(os, call, failing)


@pytest.mark.parametrize(
    "call,code,match",
    [
        ("open", errno.EROFS, r"is not writable \(Read-only file system\): give a folder this user can write"),
        ("open", errno.EACCES, r"is not writable \(Permission denied\)"),
        ("write", errno.ENOSPC, r"has no room \(No space left on device: a 64 KiB probe write failed\): free space"),
    ],
)
def test_an_unwritable_save_folder_stops_the_run_before_anything_is_built(tmp_path, monkeypatch, call, code, match):
    save = tmp_path / "save"
    _failing(monkeypatch, call, code)
    built = []
    monkeypatch.setattr(Trainer, "_build", lambda self: built.append(self))
    for fmt in ("torch", "torch_dist"):
        with pytest.raises(SaveFolderError, match=match) as err:
            Trainer(parse_args(f"{TINY} --train-iters 2 --ckpt-format {fmt} --save {save}".split()))
        assert "\n" not in str(err.value) and str(save) in str(err.value)
    assert not built
    assert list(save.iterdir()) == []  # no probe, no iter_N.tmp, no config.json


def test_a_save_folder_that_is_a_file_or_under_one_is_refused(tmp_path):
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(SaveFolderError, match=r"is a file, not a folder: give a folder for the checkpoints"):
        check_save_folder(str(file))
    with pytest.raises(SaveFolderError, match=rf"cannot be a folder: {file} is a file"):
        check_save_folder(str(file / "a" / "b"))
    check_save_folder(str(tmp_path / "new" / "folder"))  # created, probed, left empty
    assert list((tmp_path / "new" / "folder").iterdir()) == []


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_save_failing_on_its_first_file_leaves_no_tmp_folder(tmp_path, monkeypatch, fmt):
    save = tmp_path / "save"
    trainer = Trainer(parse_args(f"{TINY} --train-iters 2 --ckpt-format {fmt} --save {save}".split()))
    real = save_folder.write_new

    def full(path: Path, data: bytes, sync: bool = False) -> None:
        if path.name == "metadata.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(path, data, sync)

    monkeypatch.setattr(save_folder, "write_new", full)
    monkeypatch.setattr("megatron.checkpoint.checkpointing.write_new", full)
    trainer.state.iteration = 2
    with pytest.raises(CheckpointError, match=r"\(No space left on device\); no checkpoint was kept") as err:
        trainer.checkpoints.save()
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in save.iterdir()) == ["config.json"]


def test_a_re_save_killed_between_its_renames_loads_the_old_copy(tmp_path):
    save_checkpoint(str(tmp_path), 4, {"version": 1}, writer=True)
    iteration = tmp_path / "iter_0000004"
    os.replace(iteration, tmp_path / "iter_0000004.old")  # the first rename of a re-save of iteration 4
    assert load_checkpoint(str(tmp_path))["version"] == 1
    save_checkpoint(str(tmp_path), 6, {"version": 2}, writer=True)  # the next save puts it back
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000004",
        "iter_0000006",
        "latest_checkpointed_iteration.txt",
    ]
    assert load_checkpoint(str(tmp_path))["version"] == 2
