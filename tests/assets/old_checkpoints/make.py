"""Writes the checkpoints of tests/assets/old_checkpoints with the code of another commit (see README.md there):

    git -C /work/main worktree add --detach /tmp/old 1d946b9
    cd /tmp/old && PYTHONPATH=/tmp/old python <this repo>/tests/assets/old_checkpoints/make.py <this folder>

Per format (torch, torch_dist): a tiny Llama (FP8 delayed, distributed optimizer) trained 4 iterations and saved,
and the losses of iterations 5 and 6 of an uninterrupted 6-iteration run, which a resume must reproduce exactly."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import megatron
from megatron.config import parse_args
from megatron.training import Trainer

FLAGS = (
    "--mock-data --vocab-size 64 --make-vocab-size-divisible-by 64 --num-layers 1 --hidden-size 16"
    " --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 --global-batch-size 4 --lr 3e-3"
    " --lr-warmup-iters 2 --log-interval 1 --eval-iters 1 --eval-interval 1000 --position-embedding-type rope"
    " --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights"
    " --transformer-impl local --use-distributed-optimizer --fp8-format hybrid --fp8-recipe delayed --seed 1234"
)


def train(flags: str):
    return Trainer(parse_args(f"{FLAGS} {flags}".split(), world_size=1)).train()


def main(out: Path) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    losses = {}
    for fmt in ("torch", "torch_dist"):
        target = out / fmt
        shutil.rmtree(target, ignore_errors=True)
        train(f"--train-iters 6 --exit-interval 4 --ckpt-format {fmt} --save {target} --save-interval 4")
        (target / "config.json").unlink(missing_ok=True)  # the run's resolved flags; not part of the checkpoint
        full = train(f"--train-iters 6 --ckpt-format {fmt}")
        losses[fmt] = {str(i): full.losses[i] for i in (5, 6)}
    info = {"commit": commit, "megatron": megatron.__file__, "flags": FLAGS, "losses": losses}
    (out / "expected.json").write_text(json.dumps(info, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
