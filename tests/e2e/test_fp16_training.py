"""--fp16 with loss scaling, end to end on the CPU tiny model: it trains to bf16's loss, skips overflow steps and
lowers the scale, logs the scale like Megatron-LM, and resumes the scaler from checkpoints."""

import re

import pytest
import torch

from megatron.checkpoint import latest_iteration
from tests.e2e.test_training import train

QUIET = "--hidden-dropout 0 --attention-dropout 0"


@pytest.mark.slow
def test_fp16_reaches_bf16_loss_within_one_percent():
    bf16 = train(f"--train-iters 200 --bf16 {QUIET}")
    # 2^20 overflows at first: the dynamic scaler backs off (after its hysteresis) to a scale that fits.
    fp16 = train(f"--train-iters 200 --fp16 --initial-loss-scale 1048576 {QUIET}")
    assert fp16.skipped_iters > 0 and fp16.nan_iters == 0
    last = lambda state: sum(state.losses[i] for i in range(191, 201)) / 10  # noqa: E731
    assert abs(last(fp16) - last(bf16)) / last(bf16) < 0.01, (last(fp16), last(bf16))


def test_overflow_skips_the_step_and_halves_the_scale(capsys):
    state = train(f"--train-iters 6 --fp16 --initial-loss-scale 4294967296 --hysteresis 1 --log-interval 1 {QUIET}")
    out = capsys.readouterr().out
    scales = [float(x) for x in re.findall(r"loss scale: ([\d.]+) \|", out)]
    assert scales[:3] == [2.0**31, 2.0**30, 2.0**29]  # every step overflows at these scales and is skipped
    assert state.skipped_iters == 6 and state.nan_iters == 0
    assert all(torch.isfinite(torch.tensor(list(state.losses.values()))))


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_resume_restores_the_loss_scale(tmp_path, fmt):
    flags = f"--train-iters 12 --fp16 --initial-loss-scale 1048576 --loss-scale-window 3 {QUIET} --ckpt-format {fmt}"
    full = train(flags)
    train(f"{flags} --exit-interval 6 --save {tmp_path}")
    assert latest_iteration(str(tmp_path)) == 6
    if fmt == "torch":
        saved = torch.load(tmp_path / "iter_0000006" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
        assert set(saved["loss_scaler"]) == {"scale", "growth_tracker", "hysteresis_tracker"}
    resumed = train(f"{flags} --load {tmp_path}")
    assert [resumed.losses[i] for i in range(7, 13)] == [full.losses[i] for i in range(7, 13)]
