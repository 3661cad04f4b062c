"""A resume whose model has other tensor shapes than the checkpoint's stops with one line naming the flag, in both
formats; a vocabulary padded differently (another tensor-parallel size) still loads (tests/distributed/
test_dist_checkpoint.py), another vocabulary is never truncated to the rows both have."""

import pytest

from megatron.checkpoint import CheckpointError
from megatron.checkpoint.model_shape import vocab_rows_fit
from megatron.config import parse_args
from megatron.training import Trainer

TINY = (
    "--mock-data --num-layers 1 --num-attention-heads 2 --seq-length 8 --micro-batch-size 1 --global-batch-size 1"
    " --lr 1e-3 --train-iters 1 --eval-iters 0 --log-interval 100"
)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize(
    "saved,resumed,named",
    [
        ("--vocab-size 1000", "--vocab-size 100", "--vocab-size 100 (checkpoint: --vocab-size 1000)"),
        ("--hidden-size 8", "--hidden-size 16", "--hidden-size 16 (checkpoint: --hidden-size 8)"),
    ],
)
def test_other_shapes_are_refused_naming_the_flag(tmp_path, fmt, saved, resumed, named):
    ckpt = tmp_path / "ckpt"
    other = "--vocab-size 100" if "hidden" in saved else "--hidden-size 8"
    Trainer(parse_args(f"{TINY} {other} {saved} --ckpt-format {fmt} --save {ckpt}".split())).train()
    with pytest.raises(CheckpointError, match="does not match the model") as err:
        Trainer(parse_args(f"{TINY} {other} {resumed} --ckpt-format {fmt} --load {ckpt}".split()))
    assert named in str(err.value) and "relaunch with the saved run's model flags" in str(err.value)
    assert "\n" not in str(err.value)


def test_vocabulary_rows_fit_only_as_two_paddings_of_one_vocabulary():
    flags = f"{TINY} --hidden-size 8 --tokenizer-type GPT2BPETokenizer --vocab-file v --merge-file m"
    cfg = parse_args(flags.split(), check_files=False)  # the flags alone: no tokenizer is read
    saved = {"data": {"vocab_size": None, "make_vocab_size_divisible_by": 128}}
    assert vocab_rows_fit(51200, 50304, saved, 8, cfg)  # 50257 tokens under tp 8 and tp 1
    assert vocab_rows_fit(50304, 50304, saved, 1, cfg)
    assert not vocab_rows_fit(1024, 128, saved, 1, cfg)  # another tokenizer: 1000 rows lost
    assert not vocab_rows_fit(1024, 128, None, 1, cfg)  # not recorded: Megatron-LM's default padding at most
    mock = parse_args(f"{TINY} --hidden-size 8 --vocab-size 100".split())
    assert not vocab_rows_fit(256, 128, {"data": {"vocab_size": 120}}, 2, mock)  # --vocab-size differs
    assert vocab_rows_fit(256, 128, {"data": {"vocab_size": 100}}, 2, mock)
