"""--ckpt-format torch_dist: a checkpoint saved under TP=2 x PP=2 resumes under TP=2 x DP=2 with the distributed
optimizer and in one process (TP=1 x PP=1), and one saved with the distributed optimizer (DP=2, written by
--async-save on 4 ranks) resumes in one process; the next steps' losses equal the uninterrupted run's (fp32, at the
cross-layout tolerance of test_parallel_layouts.py: only reduction orders differ). In one process: local FP8 delayed
scaling resumes with its scales, the precision-aware optimizer resumes, other vocabulary padding loads the rows both
have, --async-save moves the latest pointer only once the write is complete and resumes like a synchronous save,
damaged checkpoints fail with one line, and the format on disk decides how a checkpoint loads (--auto-detect-ckpt-
format)."""

import json
import math
import threading
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from megatron.checkpoint import CheckpointError, latest_iteration
from megatron.training import Trainer
from tests.dist_utils import run_distributed
from tests.distributed.test_parallel_layouts import BASE, FP8, _parse

FLAGS = f"{BASE} --ckpt-format torch_dist"
TP2_PP2 = "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"
# Megatron-LM's flags for what torch_dist does here anyway: the optimizer state reshards over TP, PP and DP, every rank
# reads only its chunks
RESHARDABLE = "--dist-ckpt-optim-fully-reshardable --ckpt-fully-parallel-load"
TP2_DP2_DISTOPT = f"--tensor-model-parallel-size 2 --use-distributed-optimizer {RESHARDABLE}"
LOSS_RTOL = 1e-5


def _close(got: dict[int, float], want: dict[int, float], steps: range, label: str) -> None:
    for i in steps:
        assert math.isclose(got[i], want[i], rel_tol=LOSS_RTOL), (label, i, got, want)


def _four_rank_body(rank, world_size, out):
    a, b = Path(out, "tp2_pp2"), Path(out, "tp2_dp2")
    losses = Trainer(_parse(f"{FLAGS} {TP2_PP2} --train-iters 6 --save-interval 2 --save {a}", 4)).train().losses
    torch.save(losses, Path(out, "reference.pt"))
    torch.distributed.barrier()
    if rank == 0:
        (a / "latest_checkpointed_iteration.txt").write_text("2\n")  # resume from iteration 2
    torch.distributed.barrier()
    # the same --train-iters as the reference (the learning-rate schedule depends on it), stopping and saving at 4
    flags = f"{FLAGS} {TP2_DP2_DISTOPT} --train-iters 6 --exit-interval 4 --load {a} --save {b} --async-save"
    resumed = Trainer(_parse(flags, 4)).train().losses
    assert set(resumed) == {3, 4}
    _close(resumed, losses, range(3, 5), "tp2_pp2 -> tp2_dp2 distopt")


def test_resharding_across_layouts(tmp_path):
    run_distributed(_four_rank_body, world_size=4, args=(str(tmp_path),))
    reference = torch.load(tmp_path / "reference.pt")
    flags = f"{FLAGS} --train-iters 6 --exit-interval 4 --load {tmp_path / 'tp2_pp2'}"
    single = Trainer(_parse(flags, 1)).train().losses
    _close(single, reference, range(3, 5), "tp2_pp2 -> one process")
    # the TP=2 x DP=2 distributed-optimizer checkpoint of iteration 4, in one process without it
    single = Trainer(_parse(f"{FLAGS} {RESHARDABLE} --train-iters 6 --load {tmp_path / 'tp2_dp2'}", 1)).train().losses
    _close(single, reference, range(5, 7), "tp2_dp2 distopt -> one process")


def _resume_matches(tmp_path: Path, flags: str, name: str) -> Trainer:
    """Save at iteration 2 of 4, resume, compare with the uninterrupted run; returns the resumed trainer."""
    full = Trainer(_parse(f"{flags} --train-iters 4", 1)).train().losses
    ckpt = tmp_path / name
    Trainer(_parse(f"{flags} --train-iters 4 --exit-interval 2 --save {ckpt}", 1)).train()
    resumed = Trainer(_parse(f"{flags} --train-iters 4 --load {ckpt}", 1))
    losses = resumed.train().losses
    assert [losses[i] for i in (3, 4)] == [full[i] for i in (3, 4)], (name, losses, full)
    return resumed


def test_fp8_delayed_scaling_resumes_with_its_scales(tmp_path):
    flags = f"{FLAGS} {FP8}"
    ckpt = tmp_path / "fp8"
    saver = Trainer(_parse(f"{flags} --train-iters 2 --save {ckpt}", 1))
    saver.train()
    loader = Trainer(_parse(f"{flags} --train-iters 2 --load {ckpt}", 1))
    assert torch.equal(loader.fp8.amax.scale, saver.fp8.amax.scale)
    assert torch.equal(loader.fp8.amax.history, saver.fp8.amax.history)
    assert (saver.fp8.amax.scale != 1).any()  # the scales moved during training: the check can fail
    _resume_matches(tmp_path, flags, "fp8_resume")


def test_precision_aware_optimizer_resumes(tmp_path):
    flags = f"{FLAGS} --bf16 --use-precision-aware-optimizer --exp-avg-dtype fp16 --exp-avg-sq-dtype fp16"
    _resume_matches(tmp_path, flags, "precision_aware")


def test_other_vocabulary_padding_loads_the_common_rows(tmp_path, capsys):
    ckpt = tmp_path / "wide"
    saver = Trainer(_parse(f"{FLAGS} --train-iters 1 --make-vocab-size-divisible-by 256 --save {ckpt}", 1))
    saver.train()
    loader = Trainer(_parse(f"{FLAGS} --train-iters 1 --load {ckpt}", 1))  # 128 rows instead of 256
    saved = saver.model.embedding.word_embeddings.weight
    assert torch.equal(loader.model.embedding.word_embeddings.weight, saved[:128])
    assert "vocabulary padded to 256 rows in the checkpoint, 128 here" in capsys.readouterr().out


def test_async_save_moves_the_pointer_only_when_written(tmp_path, monkeypatch):
    release, entered = threading.Event(), threading.Event()
    write_data = FileSystemWriter.write_data

    def slow_write(self, plan, planner):
        entered.set()
        assert release.wait(60)
        return write_data(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", slow_write)
    ckpt = tmp_path / "async"
    trainer = Trainer(_parse(f"{FLAGS} --train-iters 2 --async-save --save {ckpt}", 1))
    trainer.train_step(iter(trainer.loader(trainer.datasets.train, 0)), 1e-2)
    trainer.state.iteration, trainer.state.consumed_samples = 2, 8
    weight = trainer.model.decoder.final_layernorm.weight
    saved_value = weight.detach().clone()
    trainer.checkpoints.save()
    with torch.no_grad():
        weight.add_(1.0)  # training goes on: the checkpoint holds the state of the save
    assert entered.wait(60)
    trainer.checkpointer.poll()
    assert latest_iteration(str(ckpt)) is None and not (ckpt / "iter_0000002").exists()
    release.set()
    trainer.checkpointer.finalize()
    assert latest_iteration(str(ckpt)) == 2
    loaded = Trainer(_parse(f"{FLAGS} --train-iters 2 --load {ckpt}", 1))
    assert torch.equal(loaded.model.decoder.final_layernorm.weight, saved_value)
    monkeypatch.undo()
    _resume_matches(tmp_path, f"{FLAGS} --async-save", "async_resume")


def test_async_saves_reuse_their_host_buffers(tmp_path):
    """Two --async-save saves in one process: both are written and published, the second into the host buffers
    of the first (DCP's own stager, kept across saves, failed at the second save under torch 2.11)."""
    ckpt = tmp_path / "twice"
    trainer = Trainer(_parse(f"{FLAGS} --train-iters 2 --async-save --save {ckpt}", 1))
    data = iter(trainer.loader(trainer.datasets.train, 0))
    buffers = []
    for iteration in (1, 2):
        trainer.train_step(data, 1e-2)
        trainer.state.iteration, trainer.state.consumed_samples = iteration, 4 * iteration
        trainer.checkpoints.save()
        buffers.append({key: t.data_ptr() for key, t in trainer.checkpointer.saver._stager.buffers.items()})
    trainer.checkpointer.finalize()
    assert latest_iteration(str(ckpt)) == 2 and (ckpt / "iter_0000001").is_dir()
    assert buffers[0] and buffers[0] == buffers[1]
    loaded = Trainer(_parse(f"{FLAGS} --train-iters 2 --load {ckpt}", 1))
    assert torch.equal(loaded.model.decoder.final_layernorm.weight, trainer.model.decoder.final_layernorm.weight)


def test_damaged_checkpoints_fail_with_one_line(tmp_path):
    ckpt = tmp_path / "ckpt"
    Trainer(_parse(f"{FLAGS} --train-iters 1 --save {ckpt}", 1)).train()
    with pytest.raises(CheckpointError, match="does not match the model .*hidden|does not match the model"):
        Trainer(_parse(f"{FLAGS.replace('--hidden-size 32', '--hidden-size 64')} --train-iters 2 --load {ckpt}", 1))
    (ckpt / "latest_checkpointed_iteration.txt").write_text("7\n")  # a pointer to a missing folder: falls back
    assert Trainer(_parse(f"{FLAGS} --train-iters 2 --load {ckpt}", 1)).state.iteration == 1
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1\n")
    data = next((ckpt / "iter_0000001").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"verifies.*\.distcp is damaged: 1000 bytes"):
        Trainer(_parse(f"{FLAGS} --train-iters 2 --load {ckpt}", 1))
    info = ckpt / "iter_0000001" / "metadata.json"  # as written before checksums: DCP's own errors
    info.write_text(json.dumps({k: v for k, v in json.loads(info.read_text()).items() if k != "checksums"}))
    with pytest.raises(CheckpointError, match="cannot read torch_dist checkpoint"):
        Trainer(_parse(f"{FLAGS} --train-iters 2 --load {ckpt}", 1))
    (ckpt / "iter_0000001" / ".metadata").write_bytes(b"")
    with pytest.raises(CheckpointError, match="cannot read the torch_dist checkpoint index"):
        Trainer(_parse(f"{FLAGS} --train-iters 2 --load {ckpt}", 1))


def test_the_format_on_disk_decides_the_load(tmp_path, capsys):
    """Megatron-LM's rule: under --ckpt-format torch_dist (the default) a torch checkpoint loads as such and the run
    goes on saving torch_dist; under --ckpt-format torch a torch_dist checkpoint needs --auto-detect-ckpt-format."""
    torch_format = FLAGS.replace("torch_dist", "torch")
    legacy, dist = tmp_path / "legacy", tmp_path / "dist"
    full = Trainer(_parse(f"{FLAGS} --train-iters 4", 1)).train().losses
    Trainer(_parse(f"{torch_format} --train-iters 4 --exit-interval 2 --save {legacy}", 1)).train()
    resumed = Trainer(_parse(f"{BASE} --train-iters 4 --exit-interval 3 --load {legacy} --save {legacy}", 1))
    out = capsys.readouterr().out
    assert f"{legacy} holds a torch checkpoint: loading it as such (saves use --ckpt-format torch_dist)" in out
    assert f"successfully loaded checkpoint from {legacy} at iteration 2 (torch) in " in out
    assert resumed.train().losses[3] == full[3]
    assert (legacy / "iter_0000003" / ".metadata").exists() and latest_iteration(str(legacy)) == 3

    Trainer(_parse(f"{FLAGS} --train-iters 4 --exit-interval 2 --save {dist}", 1)).train()
    with pytest.raises(
        CheckpointError,
        match="holds a torch_dist checkpoint and --ckpt-format is torch: add"
        " --auto-detect-ckpt-format .* or use --ckpt-format torch_dist",
    ):
        Trainer(_parse(f"{torch_format} --train-iters 4 --load {dist}", 1))
    detected = Trainer(_parse(f"{torch_format} --auto-detect-ckpt-format --train-iters 4 --load {dist}", 1))
    assert detected.train().losses[3] == full[3]

    foreign = tmp_path / "megatron_lm"  # DCP files without this project's metadata.json
    (foreign / "iter_0000005").mkdir(parents=True)
    (foreign / "iter_0000005" / ".metadata").write_bytes(b"")
    (foreign / "latest_checkpointed_iteration.txt").write_text("5\n")
    with pytest.raises(CheckpointError, match="torch_dist checkpoint of another program .* --loader mcore"):
        Trainer(_parse(f"{FLAGS} --train-iters 4 --load {foreign}", 1))
