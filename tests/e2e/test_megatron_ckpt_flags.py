"""Megatron-LM's checkpoint and scheduler flags in runs of the tiny CPU model: the schedule on resume with a
changed --lr, which checkpoints --save-retain-interval keeps, and --verify-integrity refusing a damaged one."""

import pytest

from megatron.checkpoint import CheckpointError
from tests.e2e.test_training import train


def _losses(state, iterations):
    return [state.losses[i] for i in iterations]


def test_resume_with_a_changed_lr_follows_each_scheduler_flag(tmp_path, capsys):
    train(f"--train-iters 6 --exit-interval 3 --save {tmp_path} --save-interval 3")
    resumed = _losses(train(f"--train-iters 6 --load {tmp_path}"), range(4, 7))
    ckpt = _losses(
        train(f"--train-iters 6 --load {tmp_path} --lr 1e-2 --use-checkpoint-opt_param-scheduler"), range(4, 7)
    )
    assert ckpt == resumed  # the checkpoint's --lr 3e-3, bit for bit
    assert "--use-checkpoint-opt_param-scheduler: the checkpoint's schedule is used" in capsys.readouterr().out
    override = _losses(
        train(f"--train-iters 6 --load {tmp_path} --lr 1e-2 --override-opt_param-scheduler"), range(4, 7)
    )
    assert override[0] == resumed[0] and override[1:] != resumed[1:]  # the first step after resuming uses 1e-2
    assert "WARNING" not in capsys.readouterr().out
    default = _losses(train(f"--train-iters 6 --load {tmp_path} --lr 1e-2"), range(4, 7))
    assert default == override  # the flags win without either flag too, with a warning listing the difference
    assert "--lr 0.01 (checkpoint: 0.003)" in capsys.readouterr().out


@pytest.mark.parametrize("last, kept", [(None, [4, 8, 10]), (3, [4, 6, 8, 10])])
def test_save_retain_interval_keeps_its_multiples(tmp_path, last, kept):
    extra = f" --save-retain-last {last}" if last else ""
    train(f"--train-iters 10 --save {tmp_path} --save-interval 2 --save-retain-interval 4{extra}")
    assert sorted(int(p.name[5:]) for p in tmp_path.glob("iter_*")) == kept


def test_verify_integrity_refuses_a_damaged_checkpoint_in_one_line(tmp_path):
    train(f"--train-iters 4 --save {tmp_path} --save-interval 2")
    data_file = sorted((tmp_path / "iter_0000004").glob("*.distcp"))[0]
    data = bytearray(data_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    data_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"^--verify-integrity: .*iteration 4 .*CRC-32") as err:
        train(f"--train-iters 6 --load {tmp_path} --verify-integrity")
    assert "\n" not in str(err.value)
    assert min(train(f"--train-iters 6 --load {tmp_path}").losses) == 3  # without it: from iteration 2
