"""Converted checkpoints train: a Megatron-LM legacy checkpoint (mcore names, TP=2 x PP=2) converted by
tools/checkpoint/convert.py loads with --load --finetune, at TP=1 and (two gloo ranks) TP=2, with the same losses;
without --finetune the run is told what to add."""

import json
import sys
from pathlib import Path

import pytest
import torch

from megatron.checkpoint import CheckpointError
from megatron.config import parse_args
from megatron.convert.state import model_config
from megatron.training import Trainer
from tests.dist_utils import run_distributed
from tests.unit.test_convert_checkpoint import LLAMA, full_of, write_megatron_lm

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "checkpoint"))
import convert as tool  # noqa: E402

FLAGS = (
    "--mock-data --vocab-size 99 --num-layers 4 --hidden-size 32 --num-attention-heads 4 --group-query-attention"
    " --num-query-groups 2 --swiglu --ffn-hidden-size 48 --normalization RMSNorm --position-embedding-type rope"
    " --rotary-base 5000 --disable-bias-linear --untie-embeddings-and-output-weights --hidden-dropout 0"
    " --attention-dropout 0 --seq-length 16 --transformer-impl local --micro-batch-size 2 --global-batch-size 4"
    " --lr 1e-3 --train-iters 3 --eval-iters 0 --log-interval 1"
)


def convert(src: Path, dst: Path, tp: int, divisible_by: int = 128) -> None:
    argv = (
        f"--loader mcore --saver native --load-dir {src} --save-dir {dst} --target-tensor-parallel-size {tp}"
        " --target-pipeline-parallel-size 1"
        f" --make-vocab-size-divisible-by {divisible_by}"
    )
    tool.convert(tool.parse(argv.split()), log=lambda *_: None)


def _tp2_body(rank, world_size, ckpt, out):
    cfg = parse_args(f"{FLAGS} --load {ckpt} --finetune --tensor-model-parallel-size 2".split(), world_size=2)
    losses = Trainer(cfg).train().losses
    if rank == 0:
        Path(out).write_text(json.dumps(losses))


def test_megatron_lm_checkpoint_converts_and_trains(tmp_path):
    model = write_megatron_lm(tmp_path / "mlm", model_config(**LLAMA), tp=2, pp=2, te_spec=True)
    # The same padded vocabulary (256 rows) at both sizes: padding rows take part in the softmax.
    convert(tmp_path / "mlm", tmp_path / "tp1", tp=1, divisible_by=256)
    convert(tmp_path / "mlm", tmp_path / "tp2", tp=2)

    tp1 = f"{FLAGS} --load {tmp_path / 'tp1'} --make-vocab-size-divisible-by 256"
    trainer = Trainer(parse_args(f"{tp1} --finetune --save {tmp_path / 'trained'}".split()))
    loaded = full_of(trainer.model).state
    for name, tensor in full_of(model).state.items():
        torch.testing.assert_close(loaded[name], tensor, atol=0, rtol=0, msg=name)
    losses = trainer.train().losses
    assert sorted(losses) == [1, 2, 3] and all(4 < v < 6 for v in losses.values())  # ln(256) = 5.5: random tokens

    run_distributed(_tp2_body, world_size=2, args=(str(tmp_path / "tp2"), str(tmp_path / "tp2.json")))
    tp2 = {int(k): v for k, v in json.loads((tmp_path / "tp2.json").read_text()).items()}
    assert tp2 == pytest.approx(losses, abs=1e-5)

    # The trainer's own checkpoint (optimizer, RNG, no recorded vocabulary size) exports: same logits in transformers.
    hf = tmp_path / "hf"
    tool.convert(tool.parse(f"--loader native --saver hf --load-dir {tmp_path / 'trained'} --save-dir {hf}".split()))
    tokens = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        ours = trainer.model.eval()(tokens)[..., :100]
        theirs = transformers.LlamaForCausalLM.from_pretrained(hf).eval()(tokens).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)

    with pytest.raises(CheckpointError, match="holds weights only .* add --finetune, or --no-load-optim"):
        Trainer(parse_args(tp1.split()))
    kept = Trainer(parse_args(f"{tp1} --no-load-optim --no-load-rng --train-iters 52".split()))
    assert kept.state.iteration == 50 and kept.state.consumed_samples == 400
