"""Training runs with activation recomputation through the trainer (CPU, local engine): the same losses as without
it under bf16 with FP8 delayed scaling, FP8 weights (--fp8-param-gather) and the FP8 monitor; a checkpoint saved
with recomputation on resumes exactly; the startup log says what is recomputed and that TFLOP/s count model FLOPs."""

from megatron.config import parse_args
from megatron.training import Trainer

TINY = (
    "--mock-data --vocab-size 128 --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32"
    " --micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --log-interval 1 --eval-iters 0 --bf16"
    " --fp8-format hybrid --fp8-recipe delayed --fp8-param-gather --fp8-stats-interval 2"
)
FULL = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
SELECTIVE = "--recompute-granularity selective --recompute-modules core_attn mlp layernorm"


def train(flags: str):
    return Trainer(parse_args(f"{TINY} {flags}".split())).train()


def test_recomputation_trains_like_no_recomputation_and_resumes(tmp_path, capsys):
    plain = train("--train-iters 4")
    capsys.readouterr()
    full = train(f"--train-iters 4 {FULL} --save {tmp_path} --save-interval 2 --exit-interval 2")
    out = capsys.readouterr().out
    assert "activation recomputation: full, uniform" in out and "count model FLOPs" in out
    assert [full.losses[i] for i in (1, 2)] == [plain.losses[i] for i in (1, 2)]
    resumed = train(f"--train-iters 4 {FULL} --load {tmp_path}")
    assert set(resumed.losses) == {3, 4} and [resumed.losses[i] for i in (3, 4)] == [plain.losses[i] for i in (3, 4)]
    selective = train(f"--train-iters 2 {SELECTIVE}")
    assert [selective.losses[i] for i in (1, 2)] == [plain.losses[i] for i in (1, 2)]
