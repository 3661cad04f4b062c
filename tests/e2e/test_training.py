"""End-to-end CPU training: loss goes down, resume is exact, checkpoints survive crashes, bad checkpoints are
refused with a clear message, and data parallelism trains the same model as one process."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pretrain_gpt
from megatron.checkpoint import CheckpointError, latest_iteration
from megatron.config import parse_args
from megatron.training import Trainer, pretrain
from megatron.training.startup import outputs_line
from tests.dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[2]
TINY = (
    "--mock-data --vocab-size 128 --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32"
    " --micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --lr-warmup-iters 2 --log-interval 5 --eval-iters 1"
    " --eval-interval 1000"
)


def train(flags: str, world_size: int = 1):
    cfg = parse_args(f"{TINY} {flags}".split(), world_size=world_size)
    return Trainer(cfg).train()


def test_loss_decreases_and_log_line_is_megatron_format(capsys):
    state = train("--train-iters 40 --hidden-dropout 0 --attention-dropout 0")
    first, last = state.losses[1], state.losses[40]
    assert last < first - 0.5, (first, last)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "iteration       40/      40" in x)
    pattern = (
        r"iteration\s+40/\s+40 \| consumed samples:\s+320 \| elapsed time per iteration \(ms\): [\d.]+ \|"
        r" throughput per GPU \(TFLOP/s/GPU\): [\d.]+ \| tokens/s: \d+ \| learning rate: [\d.]+E[+-]\d+ \|"
        r" global batch size:\s+8 \| lm loss: \d\.\d{6}E[+-]\d\d \| loss scale: 1.0 \| grad norm: [\d.]+ \|"
        r" number of skipped iterations:\s+0 \| number of nan iterations:\s+0 \|"
    )
    assert re.search(pattern, line), line
    assert "validation loss at iteration 40" in out and "number of parameters" in out and "memory estimate" in out


def test_startup_lines_are_megatrons_in_its_order_then_our_phases(capsys):
    train("--train-iters 3 --log-interval 1")
    lines = capsys.readouterr().out.splitlines()
    megatron_lines = [
        "time to initialize megatron (seconds): ",
        "[after megatron is initialized] datetime: ",
        "[after model, optimizer, and learning rate scheduler are built] datetime: ",
        "[after dataloaders are built] datetime: ",
        "done with setup ...",
        "(min, max) time across ranks (ms):",
        "    model-and-optimizer-setup ",
        "    train/valid/test-data-iterators-setup ",
        "> start-up: ",
        ">   model built, its weights drawn on the CPU ",
        ">   model moved to cpu in float32 ",
        ">   gradient buffers ",
        ">   optimizer ",
        ">   datasets ",
        "training ...",
        "[before the start of training step] datetime: ",
        " [",  # the first progress line
        "> first step ",
    ]
    at = [next(i for i, line in enumerate(lines) if line.startswith(start)) for start in megatron_lines]
    assert at == sorted(at), [lines[i] for i in at]
    assert re.fullmatch(r"time to initialize megatron \(seconds\): \d+\.\d{3}", lines[at[0]])
    assert re.fullmatch(r"\[after dataloaders are built\] datetime: \d{4}-\d\d-\d\d [\d:.]+ ", lines[at[3]])
    assert re.fullmatch(r"    model-and-optimizer-setup \.+: \([\d.]+, [\d.]+\)", lines[at[6]])
    assert re.fullmatch(r">   optimizer \.+: \([\d.]+, [\d.]+\)", lines[at[12]])
    assert sum(line.startswith("> first step ") for line in lines) == 1
    assert not any(line.startswith(">   checkpoint") for line in lines)  # no --load: no checkpoint phase


def test_first_steps_line_names_the_warm_up_cost_only_when_there_is_one():
    from megatron.training.startup_times import first_steps_line

    warm_up = first_steps_line(1.78, 0.93)
    assert warm_up.startswith("> first step 1.78 s, second 0.93 s: the first one's extra time 0.85 s (its allocations")
    slower = "> first step 1.78 s, second 1.93 s: the first took no longer than the second (no warm-up cost measured)"
    assert first_steps_line(1.78, 1.93) == slower  # no negative extra time
    assert "extra time" not in first_steps_line(1.0, 1.001)


def test_load_of_a_folder_without_a_checkpoint_starts_afresh_or_stops_with_exit_on_missing_checkpoint(tmp_path, capsys):
    empty, save = tmp_path / "empty", tmp_path / "save"
    empty.mkdir()
    state = pretrain(parse_args(f"{TINY} --train-iters 2 --load {empty} --save {save}".split()))
    assert set(state.losses) == {1, 2}
    out = capsys.readouterr().out
    assert f"> no checkpoint found in {empty}: starting from scratch (--exit-on-missing-checkpoint stops" in out
    assert re.search(r"\n>   checkpoint looked for \(none in --load\) \.+: \([\d.]+, [\d.]+\)\n", out), out
    assert "checkpoint loaded" not in out
    outputs = f"> outputs: checkpoints in {save}; no TensorBoard events (--tensorboard-dir DIR); config.json in {save}"
    assert outputs in out
    resumed = train(f"--train-iters 4 --load {save}")  # a checkpoint there: its row says it was loaded
    assert set(resumed.losses) == {3, 4}
    assert re.search(r"\n>   checkpoint loaded \.+: ", capsys.readouterr().out)

    argv = f"{TINY} --train-iters 2 --load {empty} --exit-on-missing-checkpoint".split()
    assert pretrain_gpt.main(argv) == 1  # Megatron-LM's exit status
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"pretrain_gpt.py: error: --exit-on-missing-checkpoint: no checkpoint in --load {empty}")
    assert "\n" not in err
    assert pretrain_gpt.main(f"{TINY} --exit-on-missing-checkpoint".split()) == 2
    assert "--exit-on-missing-checkpoint applies to --load DIR" in capsys.readouterr().err


def test_resume_reproduces_uninterrupted_run_exactly(tmp_path):
    # Dropout on: resuming must restore the RNG streams too, not only weights and optimizer.
    full = train("--train-iters 20")
    first = train(f"--train-iters 20 --exit-interval 10 --save {tmp_path} --save-interval 5")
    assert latest_iteration(str(tmp_path)) == 10
    resumed = train(f"--train-iters 20 --load {tmp_path}")
    assert [first.losses[i] for i in range(1, 11)] == [full.losses[i] for i in range(1, 11)]
    assert [resumed.losses[i] for i in range(11, 21)] == [full.losses[i] for i in range(11, 21)]
    assert set(resumed.losses) == set(range(11, 21))


def test_checkpoint_holds_everything(tmp_path, capsys):
    train(f"--train-iters 4 --ckpt-format torch --save {tmp_path}")
    assert "\n>   checkpoint" not in capsys.readouterr().out  # --save alone: no checkpoint phase at start-up
    state = torch.load(tmp_path / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert {"model", "optimizer", "scheduler", "rng", "iteration", "consumed_samples", "config"} <= set(state)
    assert state["iteration"] == 4 and state["consumed_samples"] == 32
    assert state["config"]["model"]["hidden_size"] == 32
    assert json.loads((tmp_path / "config.json").read_text())["training"]["train_iters"] == 4


def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    # the torch format's writer dies mid-file (torch_dist: kill and ENOSPC trials in tests/e2e/checkpoint_faults.py)
    train(f"--train-iters 4 --ckpt-format torch --save {tmp_path}")
    real_save = torch.save

    def crash(obj, path, *args, **kwargs):
        real_save(obj, path, *args, **kwargs)
        with open(path, "r+b") as f:  # leave a half-written file behind, then die
            f.truncate(100)
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        train(f"--train-iters 8 --ckpt-format torch --load {tmp_path} --save {tmp_path}")
    monkeypatch.setattr(torch, "save", real_save)
    assert latest_iteration(str(tmp_path)) == 4
    resumed = train(f"--train-iters 6 --load {tmp_path}")  # the previous checkpoint still loads and trains on
    assert set(resumed.losses) == {5, 6}
    train(f"--train-iters 8 --ckpt-format torch --load {tmp_path} --save {tmp_path}")  # a later save cleans up
    assert latest_iteration(str(tmp_path)) == 8
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_mismatched_checkpoint_lists_the_differences(tmp_path, fmt):
    train(f"--train-iters 2 --ckpt-format {fmt} --save {tmp_path}")
    with pytest.raises(CheckpointError) as info:
        flags = f"--train-iters 4 --ckpt-format {fmt} --load {tmp_path}"
        train(f"{flags} --hidden-size 64 --untie-embeddings-and-output-weights")
    message = str(info.value)
    assert "missing in checkpoint: " in message and "output_layer.weight" in message
    assert re.search(r"weight: checkpoint \[(\d+, )?32\] vs model \[(\d+, )?64\]", message), message
    assert "\n" not in message


def test_finetune_and_no_load_optim(tmp_path):
    train(f"--train-iters 4 --save {tmp_path}")
    fine = train(f"--train-iters 2 --load {tmp_path} --finetune")
    assert set(fine.losses) == {1, 2}
    no_optim = train(f"--train-iters 6 --load {tmp_path} --no-load-optim --no-load-rng")
    assert set(no_optim.losses) == {5, 6}


def test_bf16_mixed_precision_trains_with_fp32_main_params():
    cfg = parse_args(f"{TINY} --train-iters 30 --bf16 --hidden-dropout 0 --attention-dropout 0".split())
    trainer = Trainer(cfg)
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    assert all(m.dtype == torch.float32 for m in trainer.optimizer.main_params)
    state = trainer.train()
    assert state.losses[30] < state.losses[1] - 0.5


def test_tensorboard_gets_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(f"--train-iters 10 --tensorboard-dir {tmp_path}")
    outputs = outputs_line(parse_args(f"{TINY} --tensorboard-dir {tmp_path}".split()))
    assert outputs.startswith(f"> outputs: no checkpoint (--save DIR keeps one); TensorBoard events in {tmp_path} (")
    assert outputs.endswith(f" --logdir {tmp_path}); config.json in {tmp_path}")
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "grad-norm", "throughput/tokens-per-s", "lm loss validation"} <= tags
    assert [e.step for e in events.Scalars("lm loss")] == [5, 10]


def _data_parallel_body(rank, world_size, out_dir):
    for name, extra in (("dp", ""), ("dp_overlap", " --overlap-grad-reduce --ddp-bucket-size 2000")):
        state = train("--train-iters 4 --hidden-dropout 0 --attention-dropout 0" + extra, world_size=world_size)
        if rank == 0:
            Path(out_dir, f"{name}.json").write_text(json.dumps(state.losses))


def test_data_parallel_matches_single_process(tmp_path):
    """DP=2 (each rank reads half of every global batch) and DP=2 with bucket all-reduce overlapping backward
    train the same model as one process."""
    single = train("--train-iters 4 --hidden-dropout 0 --attention-dropout 0")
    run_distributed(_data_parallel_body, world_size=2, args=(str(tmp_path),))
    for name in ("dp", "dp_overlap"):
        dp = {int(k): v for k, v in json.loads((tmp_path / f"{name}.json").read_text()).items()}
        for it in range(1, 5):
            assert dp[it] == pytest.approx(single.losses[it], rel=1e-5, abs=1e-6), name


def test_cli_errors_are_one_line_with_exit_code_2(capsys):
    assert pretrain_gpt.main(["--mock-data", "--vocab-size", "64", "--hidden-size", "30"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pretrain_gpt.py: error:") and "--num-attention-heads" in err and "\n" not in err


@pytest.mark.parametrize("env", [{"RANK": "1", "LOCAL_RANK": "1"}, {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4"}])
def test_a_flag_error_is_printed_by_the_first_rank_only(monkeypatch, capsys, env):
    # Before any process group exists the launcher's variables say which rank this is (torchrun's, or srun's).
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(pretrain_gpt, "QUIET_RANK_EXIT_DELAY_S", 0.0)
    monkeypatch.setenv("SLURM_LOCALID", "0")
    flags = ["--mock-data", "--vocab-size", "64", "--hidden-size", "30"]
    assert pretrain_gpt.main(flags) == 2 and capsys.readouterr().err == ""
    monkeypatch.setenv("RANK" if "RANK" in env else "SLURM_PROCID", "0")
    assert pretrain_gpt.main(flags) == 2 and "--num-attention-heads" in capsys.readouterr().err


def test_a_missing_data_path_fails_before_anything_is_built(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(pretrain_gpt, "pretrain", lambda cfg: pytest.fail("built a run for a missing --data-path"))
    assert pretrain_gpt.main(["--data-path", str(tmp_path / "corpus"), "--vocab-size", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pretrain_gpt.py: error: --data-path {tmp_path}/corpus: {tmp_path}/corpus.bin and ")
    assert err.count("\n") == 1


def _torchrun(flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "pretrain_gpt.py", *flags.split()]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
def test_torchrun_two_processes(tmp_path):
    result = _torchrun(f"{TINY} --train-iters 3 --save {tmp_path}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "data-parallel size 2" in result.stdout and "iteration        3/       3" in result.stdout
    assert latest_iteration(str(tmp_path)) == 3
    failed = _torchrun(f"{TINY} --hidden-size 30")  # a flag error: said once, by rank 0
    assert failed.returncode != 0 and failed.stderr.count("pretrain_gpt.py: error:") == 1, failed.stderr[-2000:]
