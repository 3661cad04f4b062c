"""Runtime and logging flags on tiny CPU runs: the wall-clock budget, manual garbage collection, the optional
log-line statistics (counted once over every layout), the torch.profiler trace of the profiling window, the
distributed timeout of every group."""

import gc
import json
import math
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import pretrain_gpt
from megatron.checkpoint import latest_iteration
from megatron.config import parse_args
from megatron.parallel import ParallelDims, init_distributed
from megatron.training import Trainer, runtime
from tests.dist_utils import run_distributed

TINY = (
    "--mock-data --vocab-size 128 --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32"
    " --micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --lr-warmup-iters 2 --log-interval 5 --eval-iters 1"
    " --eval-interval 1000"
)


def _minutes_clock(monkeypatch, minutes_per_call: float) -> None:
    """The budget's clock advances this many minutes at each reading."""
    calls = [0]

    def now():
        calls[0] += 1
        return runtime.PROGRAM_START + 60 * minutes_per_call * calls[0]

    monkeypatch.setattr(runtime, "now", now)


def test_exit_duration_saves_and_exits_normally(tmp_path, monkeypatch, capsys):
    _minutes_clock(monkeypatch, 1.0)  # minute 1 after step 1, ... : over a 2-minute budget after step 3
    argv = f"{TINY} --train-iters 20 --exit-duration-in-mins 2 --save {tmp_path} --save-interval 10".split()
    assert pretrain_gpt.main(argv) == 0
    out = capsys.readouterr().out
    assert "exiting program after 3.00 minutes (--exit-duration-in-mins 2)" in out
    assert latest_iteration(str(tmp_path)) == 3
    assert "validation loss" not in out  # the time limit skips the final evaluation, as in Megatron-LM
    assert json.loads(out.strip().splitlines()[-1])["final_iteration"] == 3


def _exit_body(rank, world_size):
    # Rank 1's clock runs out after its second step, rank 0's never: both must stop after step 2.
    calls = [0]

    def now():
        calls[0] += 1
        return runtime.PROGRAM_START + (600 if rank == 1 and calls[0] >= 2 else 0)

    runtime.now = now
    cfg = parse_args(f"{TINY} --train-iters 10 --exit-duration-in-mins 5".split(), world_size=world_size)
    assert Trainer(cfg).train().iteration == 2


def test_exit_duration_ranks_agree():
    run_distributed(_exit_body, world_size=2)


def test_manual_gc(monkeypatch):
    calls = []
    real_collect = gc.collect

    def collect(generation=2):
        calls.append((generation, gc.isenabled()))
        return real_collect(generation)

    monkeypatch.setattr(gc, "collect", collect)
    # The test session's heap (every imported test module, torch's) set aside while the runs collect: each of their
    # sixteen full collections scans what the training made, not the whole pytest process (3.5 s of them before)
    gc.freeze()
    try:
        train = f"{TINY} --train-iters 6 --eval-interval 3 --manual-gc --manual-gc-interval 2"
        Trainer(parse_args(train.split())).train()
        assert gc.isenabled()  # handed back after training
        assert all(not enabled for _, enabled in calls)
        # start; steps 2, 4, 6; around the evaluations at steps 3 and 6 (the final validation) and the test split
        assert [g for g, _ in calls] == [2, 2, 2, 0, 2, 2, 2, 0, 2, 0]
        calls.clear()
        Trainer(parse_args(f"{train} --no-manual-gc-eval".split())).train()
        assert [g for g, _ in calls] == [2, 2, 2, 2]
    finally:
        gc.unfreeze()


def test_empty_unused_memory_points(monkeypatch):
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    for level, expected in [(0, 0), (1, 2), (2, 3)]:
        cfg = parse_args(f"{TINY} --empty-unused-memory-level {level}".split())
        rt = runtime.Runtime(cfg, 0, torch.device("cuda"))
        emptied.clear()
        rt.empty_cache(1)  # after the forward-backward pass
        rt.empty_cache(2)  # after the optimizer step
        rt.after_evaluation()
        assert len(emptied) == expected, level
        runtime.Runtime(cfg, 0, torch.device("cpu")).empty_cache(1)  # a CPU has no cache
        assert len(emptied) == expected


def test_log_line_statistics_and_tensorboard(tmp_path, capsys):
    flags = (
        f"--train-iters 5 --tensorboard-dir {tmp_path} --log-params-norm --log-num-zeros-in-grad --timing-log-level 2"
        " --log-timers-to-tensorboard --log-throughput --log-validation-ppl-to-tensorboard"
        " --untie-embeddings-and-output-weights"
    )
    trainer = Trainer(parse_args(f"{TINY} {flags}".split()))
    trainer.train()
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "iteration        5/" in x)
    params_norm = math.sqrt(sum(float(p.detach().double().square().sum()) for p in trainer.model.parameters()))
    assert "| grad norm: " in line and f"| params norm: {params_norm:.3f} | number of skipped" in line
    zeros = int(line.split("num zeros: ")[1].split(" ")[0])
    assert zeros >= 128 * 32  # at least the padded vocabulary's embedding rows (vocab 129 -> 256)
    block = out.split(line)[1].splitlines()
    assert block[1] == "(min, max) time across ranks (ms):"
    assert [b.split()[0] for b in block[2:7]] == [
        "forward-backward",
        "all-grads-sync",
        "optimizer",
        "forward-compute",
        "backward-compute",
    ]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set(EventAccumulator(str(tmp_path)).Reload().Tags()["scalars"])
    expected = {"params-norm", "num-zeros", "forward-backward-time", "optimizer-time", "throughput"}
    assert expected | {"lm loss validation", "lm loss validation ppl"} <= tags


def test_validation_ppl_only_with_its_flag(tmp_path):
    Trainer(parse_args(f"{TINY} --train-iters 2 --tensorboard-dir {tmp_path}".split())).train()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set(EventAccumulator(str(tmp_path)).Reload().Tags()["scalars"])
    assert "lm loss validation" in tags and "lm loss validation ppl" not in tags
    assert "params-norm" not in tags and "forward-backward-time" not in tags


def test_pytorch_profiler_trace_holds_the_window_only(tmp_path):
    flags = "--train-iters 6 --profile --use-pytorch-profiler --profile-step-start 2 --profile-step-end 4"
    Trainer(parse_args(f"{TINY} {flags} --tensorboard-dir {tmp_path}".split())).train()
    (trace,) = Path(tmp_path).glob("rank0.*.pt.trace.json")
    names = [e.get("name") for e in json.loads(trace.read_text())["traceEvents"]]
    assert sorted(n for n in names if n and n.startswith("iteration ")) == ["iteration 3", "iteration 4"]
    assert names.count("forward-backward") == 2 and names.count("optimizer") == 2


def _stats_body(rank, world_size, expected):
    for layout in [
        "--tensor-model-parallel-size 2",
        "--pipeline-model-parallel-size 2",
        "--use-distributed-optimizer",
    ]:
        cfg = parse_args(f"{TINY} {STATS} {layout}".split(), world_size=world_size)
        trainer = Trainer(cfg)
        norm = trainer.stats.params_norm()
        trainer.train_step(iter(trainer.loader(trainer.datasets.train, 0)), 0.0)
        fields, _ = trainer.stats.report()
        got = (norm, int(fields[0].split(": ")[1]))
        # Zeros: a duplicate counted twice would add thousands (a whole embedding or norm); a layout's summation
        # order may leave a couple of elements exactly zero (pp2: 2 of 4576).
        assert math.isclose(got[0], expected[0], rel_tol=1e-6) and abs(got[1] - expected[1]) <= 8, (layout, got)


STATS = "--log-params-norm --log-num-zeros-in-grad --untie-embeddings-and-output-weights --hidden-dropout 0"


def test_statistics_count_every_element_once_in_every_layout():
    trainer = Trainer(parse_args(f"{TINY} {STATS}".split()))
    norm = trainer.stats.params_norm()
    trainer.train_step(iter(trainer.loader(trainer.datasets.train, 0)), 0.0)
    zeros = int(trainer.stats.report()[0][0].split(": ")[1])
    run_distributed(_stats_body, world_size=2, args=((norm, zeros),))


def test_distributed_timeout_reaches_every_group(monkeypatch):
    seen = []
    monkeypatch.setattr(dist, "new_group", lambda ranks, timeout=None: seen.append(timeout) or object())
    ParallelDims.create(4, 0, 2, 2, timeout=timedelta(minutes=60))
    assert seen and set(seen) == {timedelta(minutes=60)}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, timeout, device_id: seen.append((backend, timeout)))
    init_distributed(parse_args(f"{TINY} --distributed-timeout-minutes 60".split(), world_size=2))
    assert seen[-1] == ("gloo", timedelta(minutes=60))
