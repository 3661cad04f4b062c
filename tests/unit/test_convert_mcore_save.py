"""tools/checkpoint/convert.py --saver mcore: checkpoints Megatron-LM loads, in its torch and torch_dist formats.

Round trips native -> mcore -> native give identical tensors at tensor-parallel sizes 1 and 2 (and a pipeline);
every pickle written is plain data (loads with torch.load(weights_only=True), the args' argparse.Namespace being
the one class Megatron-LM registers for it); the names, shapes and layout are Megatron-Core's."""

from __future__ import annotations

import argparse
import io
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

from megatron.config.pipeline_split import stage_layer_numbers
from megatron.convert import FullModel, atomic_output_dir, read_ours, write_mcore, write_torch
from megatron.convert.state import ConvertError, expected_names, full_model_of, model_config
from megatron.data import padded_vocab_size
from megatron.model.gpt import GPTModel, Stage
from megatron.parallel.tensor_parallel import TensorParallel

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "checkpoint"))
import convert as tool  # noqa: E402

VOCAB = 100  # NullTokenizer --vocab-size 99: ids 0..98 and the end-of-document id 99
GPT = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=16,
    max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0, transformer_impl="local",
)  # fmt: skip
LLAMA = dict(
    GPT, num_layers=4, group_query_attention=True, num_query_groups=2, swiglu=True, ffn_hidden_size=48,
    normalization="RMSNorm", position_embedding_type="rope", rotary_base=5000, disable_bias_linear=True,
    untie_embeddings_and_output_weights=True, max_position_embeddings=None,
)  # fmt: skip
TE_EXTRA = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def run(argv: str) -> None:
    tool.convert(tool.parse(argv.split()), log=lambda *_: None)


def source(tmp: Path, arch: dict, tp: int = 1, pp: int = 1) -> FullModel:
    """A native checkpoint of a randomly initialized model at tp x pp under tmp/native; returns its FullModel."""
    cfg = model_config(**arch)
    torch.manual_seed(0)
    stage = Stage(stage_layer_numbers(cfg.num_layers, 1, 0), pre_process=True, post_process=True)
    model = GPTModel(cfg, padded_vocab_size(VOCAB, 128, 1), tp=TensorParallel(None, 1, 0), stage=stage)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):  # not the ones and zeros they start as
                param.normal_()
    data = {"tokenizer_type": "NullTokenizer", "vocab_size": VOCAB - 1}
    full = full_model_of(
        cfg, model.state_dict(), VOCAB, "test", iteration=30, consumed_samples=240, data=data, consumed_valid_samples=48
    )
    with atomic_output_dir(tmp / "native") as out:
        write_torch(full, out, tp, pp)
    return read_ours(tmp / "native")


def weights_only(data: bytes | Path) -> object:
    """torch.load as Megatron-LM does it (weights only, argparse.Namespace registered)."""
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(io.BytesIO(data) if isinstance(data, bytes) else data, weights_only=True)


def dcp_entries(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, bytes]]:
    """A torch_dist folder's tensors (whole) and its byte objects (raw: nothing unpickled by DCP)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    class RawBytes(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            self.original_state_dict[read_item.dest_index.fqn] = value.read()

    entries = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype) if isinstance(meta, TensorStorageMetadata) else None
        for key, meta in entries.items()
    }
    reader, planner = FileSystemReader(str(folder)), RawBytes(flatten_state_dict=False)
    with warnings.catch_warnings():  # DCP's note that it loads in one process
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    return tensors, {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}


@pytest.mark.parametrize(
    "fmt,tp,pp,arch",
    [
        ("torch", 1, 1, LLAMA),
        ("torch", 2, 1, LLAMA),
        ("torch", 2, 2, dict(LLAMA, untie_embeddings_and_output_weights=False)),
        ("torch_dist", 1, 1, LLAMA),
        ("torch_dist", 2, 1, dict(GPT, qk_layernorm=True)),
    ],
)
def test_round_trip_gives_identical_tensors(tmp_path, fmt, tp, pp, arch):
    """native (tp 2) -> mcore at tp x pp -> --loader mcore -> native: the same tensors, iteration, samples, vocab."""
    full = source(tmp_path, arch, tp=2)
    run(
        f"--loader native --saver mcore --ckpt-format {fmt} --load-dir {tmp_path / 'native'}"
        f" --save-dir {tmp_path / 'mlm'} --target-tensor-parallel-size {tp} --target-pipeline-parallel-size {pp}"
    )
    assert (tmp_path / "mlm" / "latest_checkpointed_iteration.txt").read_text() == "30"
    run(f"--loader mcore --saver native --load-dir {tmp_path / 'mlm'} --save-dir {tmp_path / 'back'}")
    back = read_ours(tmp_path / "back")
    assert (back.vocab_size, back.iteration, back.consumed_samples, back.layout) == (VOCAB, 30, 240, (tp, pp))
    assert back.consumed_valid_samples == 48  # the validation position travels both ways (Megatron-LM restores it)
    assert back.state.keys() == full.state.keys()
    for name, tensor in full.state.items():
        assert back.state[name].dtype == tensor.dtype
        torch.testing.assert_close(back.state[name], tensor, atol=0, rtol=0, msg=name)


def megatron_core_names(cfg, pp_rank: int, pp: int) -> set[str]:
    """The keys of Megatron-Core's GPTModel.state_dict() on one pipeline stage, transformer_engine spec."""
    numbers = stage_layer_numbers(cfg.num_layers, pp, pp_rank)
    names = set()
    for name in expected_names(cfg):
        parts = name.split(".")
        if name.startswith("decoder.layers."):
            number = int(parts[2]) + 1
            if number in numbers:
                names.add(".".join(["decoder", "layers", str(numbers.index(number)), *parts[3:]]))
        elif name.startswith("embedding.") and pp_rank == 0:
            names.add(name)
        elif not name.startswith(("embedding.", "decoder.layers.")) and pp_rank == pp - 1:
            names.add(name)
    tied = not cfg.untie_embeddings_and_output_weights
    for i in range(len(numbers)):
        names |= {f"decoder.layers.{i}.{m}._extra_state" for m in ("self_attention.core_attention", *TE_EXTRA)}
    if pp_rank == pp - 1:
        names |= {"output_layer._extra_state", "decoder.final_layernorm._extra_state"}
        if tied and pp > 1:
            names.add("output_layer.weight")
    return names


def test_torch_format_files(tmp_path):
    """Per rank: Megatron-Core's names and TP shard shapes, stage-local layer numbers, plain data throughout, and
    the args Megatron-LM's load path reads (check_checkpoint_args, the layout, no optimizer or RNG state)."""
    full = source(tmp_path, dict(LLAMA, untie_embeddings_and_output_weights=False))
    run(
        f"--loader native --saver mcore --ckpt-format torch --load-dir {tmp_path / 'native'}"
        f" --save-dir {tmp_path / 'mlm'} --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2"
    )
    cfg, padded = full.model, padded_vocab_size(VOCAB, 128, 2)
    for p in range(2):
        for t in range(2):
            path = tmp_path / "mlm" / "iter_0000030" / f"mp_rank_{t:02d}_{p:03d}" / "model_optim_rng.pt"
            payload = weights_only(path)
            assert set(payload) == {"args", "checkpoint_version", "iteration", "model",
                                    "num_floating_point_operations_so_far"}  # fmt: skip
            assert (payload["checkpoint_version"], payload["iteration"]) == (3.0, 30)
            model = payload["model"]
            assert set(model) == megatron_core_names(cfg, p, 2)
            embedding = model["embedding.word_embeddings.weight" if p == 0 else "output_layer.weight"]
            assert embedding.shape == (padded // 2, 32)
            assert model["decoder.layers.1.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 8 // 2, 32)
            assert model["decoder.layers.1.mlp.linear_fc2.weight"].shape == (32, 24)
            assert model["decoder.layers.0.mlp.linear_fc1._extra_state"].numel() == 0
            args = payload["args"]
            assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
            assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (4, 32, 4)
            assert (args.padded_vocab_size, args.make_vocab_size_divisible_by, args.add_position_embedding) == (
                padded, 128, True)  # fmt: skip
            assert (args.tokenizer_type, args.vocab_size, args.consumed_train_samples) == ("NullTokenizer", 99, 240)
            assert args.consumed_valid_samples == 48
            assert args.no_save_optim and args.no_save_rng and not args.add_bias_linear and args.swiglu
            assert all(type(v) in (int, float, str, bool, type(None)) for v in vars(args).values())


def test_torch_dist_files(tmp_path):
    """One DCP of whole tensors under Megatron-Core's sharded keys (layers stacked), TE extra states as byte
    objects per layer, the common state inside it (no common.pt), metadata.json; every byte object plain data."""
    full = source(tmp_path, LLAMA)
    run(
        f"--loader native --saver mcore --load-dir {tmp_path / 'native'} --save-dir {tmp_path / 'mlm'}"
        " --target-tensor-parallel-size 2"
    )
    folder = tmp_path / "mlm" / "iter_0000030"
    assert json.loads((folder / "metadata.json").read_text()) == {
        "sharded_backend": "torch_dist", "sharded_backend_version": 1}  # fmt: skip
    assert not (folder / "common.pt").exists()
    tensors, objects = dcp_entries(folder)
    layers = {name.split(".", 3)[3] for name in full.state if name.startswith("decoder.layers.")}
    others = {name for name in full.state if not name.startswith("decoder.layers.")}
    assert set(tensors) == {f"decoder.layers.{rest}" for rest in layers} | others
    assert tensors["decoder.layers.mlp.linear_fc1.weight"].shape == (4, 96, 32)  # [gate; up] of every layer
    assert tensors["embedding.word_embeddings.weight"].shape == (padded_vocab_size(VOCAB, 128, 2), 32)
    for i in range(4):
        torch.testing.assert_close(
            tensors["decoder.layers.self_attention.linear_qkv.weight"][i],
            full.state[f"decoder.layers.{i}.self_attention.linear_qkv.weight"], atol=0, rtol=0,
        )  # fmt: skip
    want = {f"decoder.layers.{m}._extra_state/shard_{i}_4" for m in TE_EXTRA for i in range(4)}
    want.add("decoder.final_layernorm._extra_state/shard_0_1")
    assert set(objects) == want | {"common_state/shard_0_1"}
    for key in want:
        (extra,) = weights_only(objects[key])
        assert isinstance(extra, torch.Tensor) and extra.numel() == 0
    (common,) = weights_only(objects["common_state/shard_0_1"])
    assert (common["iteration"], common["checkpoint_version"]) == (30, 3.0)
    assert common["content_metadata"]["singleton_local_shards"] is False
    args = common["args"]
    assert (args.tensor_model_parallel_size, args.ckpt_format, args.no_save_optim, args.no_save_rng) == (
        2, "torch_dist", True, True)  # fmt: skip


def test_flags_and_layouts_refused(tmp_path, capsys):
    source(tmp_path, LLAMA)
    base = f"--loader native --load-dir {tmp_path / 'native'}"
    with pytest.raises(ConvertError, match="--ckpt-format torch_dist does not apply to --saver native"):
        run(f"{base} --saver native --ckpt-format torch_dist --save-dir {tmp_path / 'x'}")
    with pytest.raises(ConvertError, match="apply to --saver native and mcore only"):
        run(f"{base} --saver hf --target-tensor-parallel-size 2 --save-dir {tmp_path / 'x'}")
    argv = f"{base} --saver mcore --target-pipeline-parallel-size 3 --save-dir {tmp_path / 'x'}"
    assert tool.main(argv.split()) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("convert.py: error:") and "\n" not in err and not (tmp_path / "x").exists()


# What Megatron-LM itself wrote for a tiny Llama at TP=2 (tests/assets/megatron_lm_layout.py says how it was made).
LAYOUT = json.loads((ROOT / "tests" / "assets" / "megatron_lm_layout.json").read_text())
NOT_WRITTEN = ("optimizer", "opt_param_scheduler", "rng_state", "rerun_state_machine")  # weights only


def test_same_layout_as_megatron_lm_writes(tmp_path):
    """The same model converted for TP=2 gives Megatron-LM's key names, shapes, dtypes, entries and model args, in
    both formats; only the optimizer, scheduler, RNG and rerun-machine entries of a training run are left out."""
    arch = dict(
        num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, group_query_attention=True,
        num_query_groups=2, seq_length=128, max_position_embeddings=128, position_embedding_type="rope",
        normalization="RMSNorm", swiglu=True, disable_bias_linear=True, untie_embeddings_and_output_weights=True,
        transformer_impl="local",
    )  # fmt: skip
    cfg = model_config(**arch)
    stage = Stage(stage_layer_numbers(cfg.num_layers, 1, 0), pre_process=True, post_process=True)
    model = GPTModel(cfg, 1024, tp=TensorParallel(None, 1, 0), stage=stage)
    bf16 = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    data = {"tokenizer_type": "NullTokenizer", "vocab_size": 1023}
    full = full_model_of(cfg, bf16, 1024, "test", iteration=4, consumed_samples=16, data=data)
    for fmt in ("torch", "torch_dist"):
        with atomic_output_dir(tmp_path / fmt) as out:
            write_mcore(full, out, tp=2, pp=1, ckpt_format=fmt)

    want = LAYOUT["torch"]
    for rank in ("mp_rank_00", "mp_rank_01"):
        payload = weights_only(tmp_path / "torch" / "iter_0000004" / rank / "model_optim_rng.pt")
        assert sorted(payload) == [k for k in want[rank]["keys"] if k not in NOT_WRITTEN]
        assert payload["checkpoint_version"] == want[rank]["checkpoint_version"]
        entries = {k: [list(v.shape), str(v.dtype)] if v is not None else None for k, v in payload["model"].items()}
        assert entries == want[rank]["model"]
        assert {k: getattr(payload["args"], k) for k in want["args"]} == want["args"]

    want = LAYOUT["torch_dist"]
    folder = tmp_path / "torch_dist" / "iter_0000004"
    assert json.loads((folder / "metadata.json").read_text()) == want["metadata.json"]
    tensors, objects = dcp_entries(folder)
    assert {k: [list(v.shape), str(v.dtype)] for k, v in tensors.items()} == {
        k: v for k, v in want["tensors"].items() if not k.startswith(NOT_WRITTEN)}  # fmt: skip
    assert sorted(objects) == [k for k in want["objects"] if not k.startswith(NOT_WRITTEN)]
    (common,) = weights_only(objects["common_state/shard_0_1"])
    assert sorted(common) == [k for k in want["common_state"] if k not in NOT_WRITTEN]
    assert common["content_metadata"] == want["content_metadata"]
    assert {k: getattr(common["args"], k) for k in want["args"]} == want["args"]


def test_megatron_lm_checkpoint_here_and_back_is_unchanged(tmp_path):
    """A checkpoint Megatron-LM saved (tests/assets/mlm_checkpoint, TP=2, bf16) -> --loader mcore -> native ->
    --saver mcore (torch_dist) holds Megatron-LM's model tensors bit for bit under the same keys, shapes and dtypes,
    and its TE `_extra_state` objects (empty: the FP8 scaling state is not carried) and common state."""
    source = ROOT / "tests" / "assets" / "mlm_checkpoint" / "td_fp8_weights"
    run(f"--loader mcore --saver native --load-dir {source} --save-dir {tmp_path / 'native'}")
    run(
        f"--loader native --saver mcore --load-dir {tmp_path / 'native'} --save-dir {tmp_path / 'back'}"
        " --target-tensor-parallel-size 2"
    )
    theirs, their_objects = dcp_entries(source / "iter_0000004")
    ours, our_objects = dcp_entries(tmp_path / "back" / "iter_0000004")
    assert ours.keys() == theirs.keys()
    for key, tensor in theirs.items():
        assert ours[key].dtype == tensor.dtype and torch.equal(ours[key], tensor), key
    assert sorted(our_objects) == sorted(k for k in their_objects if not k.startswith(("rerun_state_machine", "rng")))
    (common,) = weights_only(our_objects["common_state/shard_0_1"])
    assert (common["iteration"], common["args"].consumed_train_samples, common["args"].padded_vocab_size) == (
        4, 16, 1024)  # fmt: skip
