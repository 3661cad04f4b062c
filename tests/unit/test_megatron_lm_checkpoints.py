"""Checkpoints written by Megatron-LM itself (tests/assets/mlm_checkpoint/README.md says how), read by
`convert.py --loader mcore` and resumed by `pretrain_gpt.py --load`: the weights are the checkpoint's tensors, the
optimizer moments land on their parameters (against the raw DCP tensors of Megatron-LM's model-space layout), the
iteration, consumed samples and Adam step are restored, and training continues.

The asset (weights only, today's torch_dist with FP8 metadata) is in git; the same run's checkpoints with optimizer
state (3.5-3.8 MB each) are read from $MLM_FIXTURES when present (see the README)."""

import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron.config import parse_args
from megatron.convert import read_mlm
from megatron.training import Trainer
from tests.unit.mlm_writer import by_name

ASSET = Path(__file__).resolve().parents[1] / "assets" / "mlm_checkpoint" / "td_fp8_weights"
FIXTURES = Path(os.environ.get("MLM_FIXTURES", "/work/wt/mlm_fixtures"))
# The run's flags, here (local layers: Megatron-Core's TE-spec names are this project's)
FLAGS = (
    "--num-layers 2 --hidden-size 64 --ffn-hidden-size 256 --num-attention-heads 4 --group-query-attention"
    " --num-query-groups 2 --seq-length 128 --max-position-embeddings 128 --position-embedding-type rope"
    " --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights"
    " --attention-dropout 0 --hidden-dropout 0 --bf16 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine"
    " --lr-warmup-iters 1 --weight-decay 0.1 --clip-grad 1.0 --seed 1234 --micro-batch-size 2 --global-batch-size 4"
    " --mock-data --tokenizer-type NullTokenizer --vocab-size 1023 --train-iters 6 --lr-decay-iters 4 --eval-iters 1"
    " --eval-interval 1000 --log-interval 1 --use-distributed-optimizer --transformer-impl local"
)


def raw(root: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """Tensors of Megatron-LM's DCP as DCP itself reads them (its own reader: the files are the test's own)."""
    folder = next(root.glob("iter_*"))
    metadata = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    state = {k: torch.empty(metadata[k].size, dtype=metadata[k].properties.dtype) for k in keys}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return state


LAYER_KEYS = ["self_attention.linear_qkv.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]


def check_weights(weights: dict[str, torch.Tensor], root: Path) -> None:
    keys = ["embedding.word_embeddings.weight", "output_layer.weight"] + [f"decoder.layers.{k}" for k in LAYER_KEYS]
    saved = raw(root, keys)
    for key in keys[:2]:
        torch.testing.assert_close(weights[key], saved[key], atol=0, rtol=0)
    for key in LAYER_KEYS:
        for layer in range(2):
            torch.testing.assert_close(weights[f"decoder.layers.{layer}.{key}"], saved[f"decoder.layers.{key}"][layer])


def test_convert_reads_todays_torch_dist():
    full = read_mlm(ASSET, log=lambda *_: None)
    assert (full.iteration, full.consumed_samples, full.vocab_size, full.layout) == (4, 16, 1024, (2, 1))
    assert full.model.swiglu and full.model.untie_embeddings_and_output_weights and full.model.num_query_groups == 2
    check_weights(full.state, ASSET)


def test_weights_only_checkpoint_resumes_with_a_fresh_optimizer(capsys):
    trainer = Trainer(parse_args(f"{FLAGS} --load {ASSET}".split(), world_size=1))
    assert (trainer.state.iteration, trainer.state.consumed_samples) == (4, 16)
    weights, states, step = by_name(trainer.model, trainer.optimizer)
    check_weights(weights, ASSET)
    assert step == 0 and all(float(t.abs().max()) == 0 for t in states["exp_avg"].values())
    out = capsys.readouterr().out
    assert "holds no optimizer state (saved with --no-save-optim)" in out and "FP8 scaling state" in out
    losses = trainer.train().losses
    assert set(losses) == {5, 6} and all(6.5 < v < 7.2 for v in losses.values()), losses


OPTIM = ["td_bf16", "td_full", "torch_bf16", "td_dp2", "torch_dp2"]
needs_fixtures = pytest.mark.skipif(
    not (FIXTURES / "td_full").is_dir(), reason=f"no Megatron-LM fixtures in {FIXTURES}"
)


@needs_fixtures
@pytest.mark.parametrize("name", OPTIM)
def test_megatron_lm_optimizer_state_lands_on_its_parameters(name):
    """Every layout's moments equal the raw model-space tensors Megatron-LM saved under each parameter's own name
    (td_full: the same run as td_bf16 and torch_bf16, bitwise; the DP=2 runs against each other), and the main
    params round to the weights."""
    trainer = Trainer(parse_args(f"{FLAGS} --load {FIXTURES / name}".split(), world_size=1))
    assert (trainer.state.iteration, trainer.state.consumed_samples) == (4, 16)
    weights, states, step = by_name(trainer.model, trainer.optimizer)
    assert step == 4
    if not name.endswith("dp2"):
        check_weights(weights, FIXTURES / ("td_bf16" if name == "torch_bf16" else name))  # the same run, bitwise
        keys = [f"optimizer.state.{s}.decoder.layers.{k}" for s in ("exp_avg", "exp_avg_sq") for k in LAYER_KEYS]
        keys += ["optimizer.state.exp_avg.output_layer.weight"]
        keys += ["optimizer.state.exp_avg_sq.decoder.final_layernorm.weight"]
        saved = raw(FIXTURES / "td_full", keys)
        for key, tensor in saved.items():
            kind, name_ = key.split(".")[2], key.split(".", 3)[3]
            if name_.startswith("decoder.layers."):
                rest = name_[len("decoder.layers.") :]
                for layer in range(2):
                    got = states[kind][f"decoder.layers.{layer}.{rest}"]
                    torch.testing.assert_close(got, tensor[layer], atol=0, rtol=0, msg=key)
            else:
                torch.testing.assert_close(states[kind][name_], tensor, atol=0, rtol=0, msg=key)
    for pname, weight in weights.items():
        assert torch.equal(states["main"][pname].to(weight.dtype), weight), pname
    assert float(states["exp_avg_sq"]["decoder.layers.1.mlp.linear_fc2.weight"].abs().max()) > 0
    losses = trainer.train().losses
    assert set(losses) == {5, 6} and all(6.5 < v < 7.2 for v in losses.values()), losses


@needs_fixtures
def test_dp2_layouts_agree():
    """Megatron-LM's two flat layouts of the same DP=2 state (torch_dist buckets, torch's coalesced distrib_optim.pt)
    read to the same moments."""
    a = by_name(*_loaded(FIXTURES / "td_dp2"))[1]
    b = by_name(*_loaded(FIXTURES / "torch_dp2"))[1]
    for kind in a:
        for name, tensor in a[kind].items():
            torch.testing.assert_close(tensor, b[kind][name], atol=0, rtol=0)


def _loaded(root: Path):
    trainer = Trainer(parse_args(f"{FLAGS} --load {root}".split(), world_size=1))
    return trainer.model, trainer.optimizer
