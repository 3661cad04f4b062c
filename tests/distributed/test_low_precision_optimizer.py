"""FP8-LM / MS-AMP style training on 2 gloo ranks: FP8 gradient communication (--fp8-grad-reduce, O1), bf16 gradient
buffers, and the precision-aware optimizer's low-precision states (O2: fp16 masters, FP8 first moment, fp16 second
moment, bf16 gradients; fp32 gradients in one run), with and without the distributed optimizer. A small GPT trained
100 steps ends within 1% of the fp32-state run on the same data; a resumed O2 run continues with the same losses; a
checkpoint saved with other state dtypes is converted on load, and the log says so. Resumes are checked in both
checkpoint formats (other layouts under torch_dist: tests/distributed/test_dist_checkpoint_states.py). The encodings
themselves: tests/unit/test_optim_states.py; the FP8 reduction's error bound: tests/distributed/test_fp8_reduce.py."""

from pathlib import Path

import pytest
import torch

from megatron.training import Trainer
from tests.dist_utils import run_distributed
from tests.distributed.test_parallel_layouts import BASE, _parse

STEPS = 100
# the schedule fixed by --lr-decay-iters, so that runs of any length (a resumed one too) share it
FLAGS = f"{BASE} --bf16 --lr 3e-3 --lr-warmup-iters 10 --lr-decay-iters {STEPS} --min-lr 3e-4 --log-interval 100"
DISTOPT = "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 3000"
# (the distributed optimizer with fp32 states computes what the plain one does: test_distributed_optimizer.py)
RUNS = {
    "fp32_states": "",
    "o1": "--fp8-optimizer-level O1",
    "o2": "--fp8-optimizer-level O2",
    # O2's states with fp32 gradient buffers, spelled out
    "o2_fp32_grads_distopt": "--fp8-grad-reduce --use-precision-aware-optimizer --main-params-dtype fp16"
    f" --exp-avg-dtype fp8 --exp-avg-sq-dtype fp16 {DISTOPT}",
}


def _final_loss(state, last: int = 20) -> float:
    return sum(state.losses[i] for i in range(STEPS - last + 1, STEPS + 1)) / last


def _training_body(rank, world_size, out_dir):
    for name, extra in RUNS.items():
        state = Trainer(_parse(f"{FLAGS} --train-iters {STEPS} {extra}", world_size)).train()
        if rank == 0:
            torch.save(_final_loss(state), Path(out_dir, f"{name}.pt"))


def test_o1_and_o2_end_within_one_percent_of_fp32_states(tmp_path):
    run_distributed(_training_body, world_size=2, args=(str(tmp_path),))
    loss = {name: torch.load(tmp_path / f"{name}.pt") for name in RUNS}
    for name in ("o1", "o2", "o2_fp32_grads_distopt"):
        assert abs(loss[name] / loss["fp32_states"] - 1) < 0.01, (name, loss)
    assert loss["fp32_states"] < 0.9 * 4.85, loss  # it learned: the first loss is ln(vocab) ~ 4.85


def _resume_body(rank, world_size, out_dir, extra):
    out = Path(out_dir)
    flags = f"{FLAGS} --fp8-optimizer-level O2 {extra}"
    whole = Trainer(_parse(f"{flags} --train-iters 6", world_size)).train()
    Trainer(_parse(f"{flags} --train-iters 3 --save {out / 'ckpt'}", world_size)).train()
    resumed = Trainer(_parse(f"{flags} --train-iters 6 --load {out / 'ckpt'}", world_size)).train()
    assert [resumed.losses[i] for i in (4, 5, 6)] == [whole.losses[i] for i in (4, 5, 6)]


# torch_dist (the default) saves the encoded states, their scales and each rank's stochastic-rounding generator as
# they are (megatron/checkpoint/dist_optimizer.py); pipeline stages: the last stage's copy of tied embeddings too
@pytest.mark.parametrize(
    "extra",
    [
        "--ckpt-format torch",
        f"--ckpt-format torch {DISTOPT}",
        "--ckpt-format torch_dist",
        f"--ckpt-format torch_dist {DISTOPT}",
        "--ckpt-format torch_dist --pipeline-model-parallel-size 2",
    ],
)
def test_o2_resumes_exactly(tmp_path, extra):
    run_distributed(_resume_body, world_size=2, args=(str(tmp_path), extra))


def _convert_body(rank, world_size, out_dir):
    out = Path(out_dir)
    Trainer(_parse(f"{FLAGS} --train-iters 2 --save {out / 'fp32'}", world_size)).train()
    o2 = f"{FLAGS} --fp8-optimizer-level O2 --train-iters 4 --load {out / 'fp32'} --save {out / 'o2'}"
    state = Trainer(_parse(o2, world_size)).train()
    assert all(torch.isfinite(torch.tensor(state.losses[i])) for i in (3, 4))
    back = Trainer(_parse(f"{FLAGS} --train-iters 5 --load {out / 'o2'}", world_size))  # O2 -> fp32 states
    assert back.state.iteration == 4 and torch.isfinite(torch.tensor(back.train().losses[5]))


def test_a_checkpoint_with_other_state_dtypes_is_converted_and_said(tmp_path, capfd):
    run_distributed(_convert_body, world_size=2, args=(str(tmp_path),))
    out = capfd.readouterr().out
    assert out.count("optimizer states converted") == 2, out[-3000:]
