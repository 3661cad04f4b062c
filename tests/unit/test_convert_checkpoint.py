"""tools/checkpoint/convert.py: Hugging Face Llama / GPT-2 both ways with identical logits, our checkpoints under
any tensor x pipeline layout (and TE's names), Megatron-LM legacy checkpoints, and the one-line errors."""

from __future__ import annotations

import argparse
import io
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from megatron.checkpoint import check_model_state, load_checkpoint
from megatron.config.pipeline_split import stage_layer_numbers
from megatron.convert import ConvertError, FullModel, atomic_output_dir, read_hf, read_mlm, read_ours, write_hf
from megatron.convert.files import load_torch_file, partial_dir
from megatron.convert.ours import shard_state, write_torch
from megatron.convert.state import model_config
from megatron.data import padded_vocab_size
from megatron.model.gpt import GPTModel, Stage
from megatron.parallel.tensor_parallel import TensorParallel

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "checkpoint"))
import convert as tool  # noqa: E402

VOCAB = 100  # padded to 128 (x tensor-parallel size) in our checkpoints
LLAMA = dict(
    num_layers=4, hidden_size=32, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
    swiglu=True, ffn_hidden_size=48, normalization="RMSNorm", position_embedding_type="rope", rotary_base=5000,
    disable_bias_linear=True, untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
    seq_length=16, transformer_impl="local",
)  # fmt: skip


def run(argv: str) -> None:
    tool.convert(tool.parse(argv.split()), log=lambda *_: None)


def our_model(cfg, tp: int = 1, tp_rank: int = 0, pp: int = 1, pp_rank: int = 0, seed: int = 0) -> GPTModel:
    """A GPTModel of `cfg` (or one rank's part of it): every layout draws the same weights for a seed."""
    torch.manual_seed(seed)
    numbers = stage_layer_numbers(cfg.num_layers, pp, pp_rank)
    stage = Stage(numbers, pre_process=pp_rank == 0, post_process=pp_rank == pp - 1)
    tp_ = TensorParallel(None, tp, tp_rank)
    return GPTModel(cfg, padded_vocab_size(VOCAB, 128, tp), tp=tp_, stage=stage).eval()


def logits_of(model: GPTModel, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens)[..., :VOCAB]


def load_ours(path: Path, cfg) -> GPTModel:
    state = load_checkpoint(str(path))
    model = our_model(cfg, seed=1)
    check_model_state(state["model"], model.state_dict(), str(path))
    model.load_state_dict(state["model"])
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


def hf_llama(tmp: Path, **overrides) -> tuple[Path, torch.nn.Module]:
    config = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )  # fmt: skip
    config.update(overrides)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    with torch.no_grad():  # norms away from 1, biases away from 0, so a swapped tensor shows
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(tmp / "hf")
    return tmp / "hf", model


def hf_gpt2(tmp: Path, **overrides) -> tuple[Path, torch.nn.Module]:
    config = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, activation_function="gelu",
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    config.update(overrides)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "ln" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(tmp / "hf")
    return tmp / "hf", model


def check_round_trip(tmp: Path, hf_dir: Path, hf_model, cls) -> None:
    """HF -> ours at TP=2 x PP=2 -> merged -> ours at TP=1 and HF again: same logits everywhere (fp32)."""
    x = tokens()
    expected = hf_model(x).logits.detach()
    run(f"--loader hf --saver native --load-dir {hf_dir} --save-dir {tmp / 'tp2pp2'} --target-tensor-parallel-size 2"
        " --target-pipeline-parallel-size 2")  # fmt: skip
    run(f"--loader native --saver native --load-dir {tmp / 'tp2pp2'} --save-dir {tmp / 'same'}")  # default: same layout
    assert sorted(p.name for p in (tmp / "same" / "iter_0000000").glob("mp_rank_*"))[-1] == "mp_rank_01_001"
    run(
        f"--loader native --saver native --load-dir {tmp / 'same'} --save-dir {tmp / 'tp1'}"
        " --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1"
    )
    cfg = model_config(**load_checkpoint(str(tmp / "tp1"))["config"]["model"])
    cfg.hidden_dropout = cfg.attention_dropout = 0.0
    torch.testing.assert_close(logits_of(load_ours(tmp / "tp1", cfg), x), expected, atol=1e-5, rtol=0)
    run(f"--loader native --saver hf --load-dir {tmp / 'tp2pp2'} --save-dir {tmp / 'back'}")
    back = cls.from_pretrained(tmp / "back").eval()
    torch.testing.assert_close(back(x).logits.detach(), expected, atol=0, rtol=0)


def test_llama_gqa_untied_round_trip(tmp_path):
    hf_dir, model = hf_llama(tmp_path)
    check_round_trip(tmp_path, hf_dir, model, transformers.LlamaForCausalLM)


def test_llama_tied_with_biases_and_kv_channels_round_trip(tmp_path):
    hf_dir, model = hf_llama(tmp_path, tie_word_embeddings=True, num_key_value_heads=4, attention_bias=True,
                             mlp_bias=True, head_dim=16)  # fmt: skip
    check_round_trip(tmp_path, hf_dir, model, transformers.LlamaForCausalLM)


def test_gpt2_round_trip(tmp_path):
    hf_dir, model = hf_gpt2(tmp_path)
    check_round_trip(tmp_path, hf_dir, model, transformers.GPT2LMHeadModel)


def full_of(model: GPTModel, vocab: int = VOCAB) -> FullModel:
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in state:
            state[name] = state[name][:vocab]
    return FullModel(model.cfg, vocab, state, "test")


@pytest.mark.parametrize("tied", [False, True])
def test_shards_are_what_each_rank_of_the_model_holds(tmp_path, tied):
    """Written at TP=2 x PP=2, each file holds exactly the state dict the model builds on that rank (weights are
    drawn layout-independently), and reading them back gives the single-process model."""
    cfg = model_config(**dict(LLAMA, untie_embeddings_and_output_weights=not tied))
    full = full_of(our_model(cfg))
    with atomic_output_dir(tmp_path / "ckpt") as out:
        write_torch(full, out, tp=2, pp=2)
    for pp_rank in range(2):
        for tp_rank in range(2):
            folder = tmp_path / "ckpt" / "iter_0000000" / f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
            shard = torch.load(folder / "model_optim_rng.pt", weights_only=False)["model"]
            want = our_model(cfg, 2, tp_rank, 2, pp_rank).state_dict()
            assert shard.keys() == want.keys()
            for name in want:
                got, ref = shard[name], want[name]
                if "word_embeddings" in name or "output_layer" in name:  # padding rows: ours are zeros
                    rows = max(0, VOCAB - 128 * tp_rank)
                    assert torch.all(got[rows:] == 0)
                    got, ref = got[:rows], ref[:rows]
                torch.testing.assert_close(got, ref, atol=0, rtol=0, msg=name)
    back = read_ours(tmp_path / "ckpt")
    assert back.state.keys() == full.state.keys() and back.vocab_size == VOCAB
    for name in full.state:
        torch.testing.assert_close(back.state[name], full.state[name], atol=0, rtol=0)


def test_transformer_engine_checkpoint_and_layernorm_1p_export(tmp_path):
    """A checkpoint of the TE layers (their `_extra_state` entries besides the same weight names) exports; with
    --apply-layernorm-1p, Hugging Face gets 1 + w and computes the same logits."""
    cfg = model_config(**dict(LLAMA, apply_layernorm_1p=True))
    model = our_model(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    full = full_of(model)
    with atomic_output_dir(tmp_path / "ckpt") as out:
        write_torch(full, out, tp=2, pp=1)
    for tp_rank in range(2):  # add what TE's modules save: pickled FP8 metadata per module
        path = tmp_path / "ckpt" / "iter_0000000" / f"mp_rank_{tp_rank:02d}" / "model_optim_rng.pt"
        payload = torch.load(path, weights_only=False)
        for i in range(cfg.num_layers):
            for module in ("self_attention.linear_qkv", "self_attention.core_attention", "mlp.linear_fc2"):
                payload["model"][f"decoder.layers.{i}.{module}._extra_state"] = io.BytesIO(b"fp8 metadata")
        payload["config"]["model"]["transformer_impl"] = "transformer_engine"
        torch.save(payload, path)
    run(f"--loader native --saver hf --load-dir {tmp_path / 'ckpt'} --save-dir {tmp_path / 'hf'}")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = tokens()
    torch.testing.assert_close(hf(x).logits.detach(), logits_of(model, x), atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------------- Megatron-LM


def write_megatron_lm(root: Path, cfg, tp: int, pp: int, te_spec: bool, iteration: int = 50) -> GPTModel:
    """A Megatron-LM legacy checkpoint (mcore names) of our model's weights at tp x pp, as Megatron-LM lays it out:
    args Namespace (with one of Megatron-Core's enums, whose module is not installed here), stage-local layer
    numbers, separate norms under the local spec, TE `_extra_state`s under the TE spec, the last stage's copy of
    tied embeddings as `output_layer.weight`. Returns the single-process model."""
    enums = types.ModuleType("megatron.core.transformer.enums")
    AttnBackend = type("AttnBackend", (), {"__module__": enums.__name__})
    enums.AttnBackend = AttnBackend
    sys.modules[enums.__name__] = enums
    args = argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, group_query_attention=True, num_query_groups=2, kv_channels=8,
        seq_length=16, max_position_embeddings=16, position_embedding_type="rope", rotary_base=cfg.rotary_base,
        rotary_percent=1.0, normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True, add_bias_linear=False,
        untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        padded_vocab_size=padded_vocab_size(VOCAB, 128, tp), tokenizer_type="NullTokenizer", vocab_size=VOCAB - 1,
        consumed_train_samples=400, attention_backend=AttnBackend(), num_experts=None, ckpt_format="torch",
    )  # fmt: skip
    folder = root / f"iter_{iteration:07d}"
    try:
        for p in range(pp):
            for t in range(tp):
                state = our_model(cfg, tp, t, pp, p).state_dict()
                if not te_spec:
                    state = {
                        k.replace("self_attention.linear_qkv.layer_norm_", "input_layernorm.").replace(
                            "mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."
                        ): v
                        for k, v in state.items()
                    }
                else:
                    for k in [k for k in state if k.endswith("linear_fc1.weight")]:
                        state[k.replace(".weight", "._extra_state")] = io.BytesIO(b"te")
                if p == pp - 1 and p > 0 and not cfg.untie_embeddings_and_output_weights:
                    state["output_layer.weight"] = state.pop("embedding.word_embeddings.weight")
                shard = folder / (f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}")
                shard.mkdir(parents=True)
                payload = {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": state}
                torch.save(payload, shard / "model_optim_rng.pt")
    finally:
        del sys.modules[enums.__name__]
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return our_model(cfg)


@pytest.mark.parametrize("te_spec,tied", [(True, False), (False, True)])
def test_megatron_lm_legacy_checkpoint_imports(tmp_path, te_spec, tied):
    cfg = model_config(**dict(LLAMA, untie_embeddings_and_output_weights=not tied))
    model = write_megatron_lm(tmp_path / "mlm", cfg, tp=2, pp=2, te_spec=te_spec)
    full = read_mlm(tmp_path / "mlm", log=lambda *_: None)
    assert full.vocab_size == VOCAB and full.iteration == 50 and full.consumed_samples == 400  # NullTokenizer: 99 + 1
    assert full.data["tokenizer_type"] == "NullTokenizer"
    want = full_of(model).state
    assert full.state.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(full.state[name], want[name], atol=0, rtol=0)


@pytest.mark.parametrize("singleton_swiglu,common_pt", [(False, True), (True, True), (False, False)])
def test_megatron_lm_torch_dist_checkpoint_imports(tmp_path, singleton_swiglu, common_pt):
    """Megatron-Core's torch_dist layout: whole tensors by name, homogeneous layers stacked on a leading axis,
    linear_fc1 as [gate; up] (or `_w` / `_v` with singleton local shards), TE `_extra_state` as byte objects, the
    args in common.pt (older Megatron-Core) or in the DCP's `common_state` object (today's)."""
    import torch.distributed.checkpoint as dcp

    cfg = model_config(**LLAMA)
    model = our_model(cfg)
    write_megatron_lm(tmp_path / "legacy", cfg, tp=1, pp=1, te_spec=True)  # for its args
    args = load_torch_file(tmp_path / "legacy/iter_0000050/mp_rank_00/model_optim_rng.pt", foreign=True)["args"]
    args.attention_backend = "auto"  # the stand-in for Megatron-Core's enum does not pickle again
    state, layers = {}, {}
    for name, tensor in model.state_dict().items():
        if name.startswith("decoder.layers."):
            rest = name.split(".", 3)[3]
            layers.setdefault(rest, []).append(tensor)
        else:
            state[name] = tensor
    for rest, tensors in layers.items():
        stacked = torch.stack(tensors)
        if singleton_swiglu and rest == "mlp.linear_fc1.weight":
            gate, up = stacked.chunk(2, 1)
            state[f"decoder.layers.{rest}_w"], state[f"decoder.layers.{rest}_v"] = gate.clone(), up.clone()
        else:
            state[f"decoder.layers.{rest}"] = stacked
    state["decoder.layers.self_attention.linear_qkv._extra_state/shard_0_4"] = io.BytesIO(b"te")
    common = {"args": args, "iteration": 20, "checkpoint_version": 3.0}
    if not common_pt:  # a ShardedObject: a one-item list, as a bytes entry (DCP torch.saves it)
        state["common_state/shard_0_1"] = [common]
    folder = tmp_path / "dist" / "iter_0000020"
    dcp.save(state, checkpoint_id=str(folder), planner=dcp.DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
    if common_pt:
        torch.save(common, folder / "common.pt")
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    (tmp_path / "dist" / "latest_checkpointed_iteration.txt").write_text("20")
    full = read_mlm(tmp_path / "dist", log=lambda *_: None)
    want = full_of(model).state
    assert full.iteration == 20 and full.state.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(full.state[name], want[name], atol=0, rtol=0)


# -------------------------------------------------------------------------------------------------- errors


def test_another_architecture(tmp_path):
    hf_dir, _ = hf_llama(tmp_path)
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps(dict(config, model_type="mixtral", architectures=["MixtralX"])))
    with pytest.raises(ConvertError, match="another architecture: .* holds MixtralX"):
        read_hf(hf_dir)
    cfg = model_config(**dict(LLAMA, qk_layernorm=True))
    with pytest.raises(ConvertError, match="another architecture: --qk-layernorm"):
        write_hf(full_of(our_model(cfg)), tmp_path)
    cfg = model_config(**dict(LLAMA, swiglu=False, squared_relu=True))
    with pytest.raises(ConvertError, match="another architecture"):
        write_hf(full_of(our_model(cfg)), tmp_path)


def test_missing_tensors_and_vocabulary_mismatch(tmp_path):
    import safetensors.torch

    hf_dir, _ = hf_llama(tmp_path)
    weights = safetensors.torch.load_file(hf_dir / "model.safetensors")
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps(dict(config, vocab_size=VOCAB + 1)))
    with pytest.raises(ConvertError, match=r"vocabulary mismatch .* embed|vocabulary mismatch.*word_embeddings"):
        read_hf(hf_dir)
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConvertError, match="vocabulary mismatch: --true-vocab-size 90"):
        read_hf(hf_dir, true_vocab_size=90)
    del weights["model.layers.1.mlp.up_proj.weight"]
    safetensors.torch.save_file(weights, hf_dir / "model.safetensors")
    with pytest.raises(ConvertError, match="missing tensors in .*: model.layers.1.mlp.up_proj.weight"):
        read_hf(hf_dir)


def test_half_written_input_and_output(tmp_path, capsys):
    cfg = model_config(**LLAMA)
    with atomic_output_dir(tmp_path / "ckpt") as out:
        write_torch(full_of(our_model(cfg)), out, tp=2, pp=1)
    # The output: never over an existing one; a failure leaves nothing; an earlier interrupted run's remains go.
    assert (
        tool.main(f"--loader native --saver hf --load-dir {tmp_path / 'ckpt'} --save-dir {tmp_path / 'ckpt'}".split())
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("convert.py: error:") and "already exists" in err and "\n" not in err
    with pytest.raises(RuntimeError, match="boom"), atomic_output_dir(tmp_path / "out") as out:
        (out / "half").write_text("x")
        raise RuntimeError("boom")
    assert not (tmp_path / "out").exists() and not partial_dir(tmp_path / "out").exists()
    partial_dir(tmp_path / "out").mkdir()
    run(f"--loader native --saver hf --load-dir {tmp_path / 'ckpt'} --save-dir {tmp_path / 'out'}")
    assert (tmp_path / "out" / "model.safetensors").exists() and not partial_dir(tmp_path / "out").exists()
    # The input: a save that never finished, a shard missing.
    (tmp_path / "ckpt" / "iter_0000000").rename(tmp_path / "ckpt" / "iter_0000000.tmp")
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").unlink()
    with pytest.raises(ConvertError, match="half-written checkpoint"):
        read_ours(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "iter_0000000.tmp").rename(tmp_path / "ckpt" / "iter_0000000")
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("0")
    (tmp_path / "ckpt" / "iter_0000000" / "mp_rank_01" / "model_optim_rng.pt").unlink()
    with pytest.raises(ConvertError, match="missing: the checkpoint is incomplete"):
        read_ours(tmp_path / "ckpt")


def test_vocabulary_rows_and_padding():
    cfg = model_config(**LLAMA)
    full = full_of(our_model(cfg))
    shards = shard_state(full, tp=2, pp=1, padded=256)
    assert shards[(0, 0)]["embedding.word_embeddings.weight"].shape == (128, 32)
    assert torch.all(shards[(1, 0)]["output_layer.weight"][VOCAB - 128 :] == 0)


def test_torch_dist_checkpoint_reads_as_the_torch_one(tmp_path):
    """The same run saved in both formats converts to the same weights (SwiGLU's fc1 stored [2, ffn, hidden] and its
    bias [2, ffn] in torch_dist come back [gate; up]); the HF export of the torch_dist one loads in transformers."""
    import pretrain_gpt

    flags = (
        "--mock-data --vocab-size 100 --num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention"
        " --num-query-groups 2 --swiglu --ffn-hidden-size 48 --normalization RMSNorm --position-embedding-type rope"
        " --seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 --train-iters 2 --eval-iters 0"
        " --hidden-dropout 0 --attention-dropout 0 --untie-embeddings-and-output-weights --transformer-impl local"
    )
    for fmt in ("torch", "torch_dist"):
        assert pretrain_gpt.main(f"{flags} --ckpt-format {fmt} --save {tmp_path / fmt}".split()) == 0
    plain, dist = read_ours(tmp_path / "torch"), read_ours(tmp_path / "torch_dist")
    assert dist.state.keys() == plain.state.keys() and (dist.iteration, dist.vocab_size) == (2, plain.vocab_size)
    for name in plain.state:
        torch.testing.assert_close(dist.state[name], plain.state[name], atol=0, rtol=0, msg=name)
    run(f"--loader native --saver hf --load-dir {tmp_path / 'torch_dist'} --save-dir {tmp_path / 'hf'}")
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf") is not None
