"""What Megatron-LM itself writes, as a small JSON (megatron_lm_layout.json) the saver's tests compare against: key
names, shapes and dtypes of a `--ckpt-format torch` rank file and of a `torch_dist` checkpoint, their other entries,
and the args that shape the model.

The source: checkpoints that Megatron-LM main (d98e8a64, 2026-11-26; TE 2.20.2, torch 2.11, H200) saved at iteration
4 of a tiny Llama (2 layers, hidden 64, ffn 256 SwiGLU, 4 heads, 2 query groups, seq 128, RMSNorm, RoPE, no biases,
untied, bf16, --transformer-impl transformer_engine, --use-distributed-optimizer, NullTokenizer --vocab-size 1023,
mbs 2, gbs 4) at TP=2 (+SP): `torch_bf16` (--ckpt-format torch) and `td_bf16` (torch_dist). Regenerate with

    python tests/assets/megatron_lm_layout.py FIXTURES_DIR > tests/assets/megatron_lm_layout.json

Megatron-LM's pickles name its own classes (enums, signal.Signals in the args): they are read here with stand-ins
that keep the data, and nothing of Megatron-LM is imported.
"""

from __future__ import annotations

import io
import json
import pickle
import sys
import types
from pathlib import Path

import torch

#: args that describe the model and its layout (compared by value with the saver's)
MODEL_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
    "num_query_groups", "kv_channels", "seq_length", "max_position_embeddings", "position_embedding_type",
    "add_position_embedding", "use_rotary_position_embeddings", "rotary_base", "rotary_percent", "normalization",
    "layernorm_epsilon", "layernorm_zero_centered_gamma", "qk_layernorm", "swiglu", "squared_relu", "add_bias_linear",
    "add_qkv_bias", "untie_embeddings_and_output_weights", "tokenizer_type", "vocab_size", "padded_vocab_size",
    "make_vocab_size_divisible_by", "tensor_model_parallel_size", "pipeline_model_parallel_size", "world_size",
    "data_parallel_size", "transformer_impl", "consumed_train_samples",
)  # fmt: skip


class _StandIn:
    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module.split(".")[0] in ("torch", "collections", "builtins", "argparse", "numpy", "_codecs"):
            return super().find_class(module, name)
        return type(f"{module}.{name}", (_StandIn,), {})


_PICKLE = types.ModuleType("megatron_lm_stand_ins")
_PICKLE.Unpickler = _Unpickler
_PICKLE.load = lambda f, **kw: _Unpickler(f, **kw).load()


def _load(data: bytes | Path) -> object:
    source = io.BytesIO(data) if isinstance(data, bytes) else data
    return torch.load(source, weights_only=False, pickle_module=_PICKLE, map_location="cpu")


def _entry(value: object) -> list | None:
    return [list(value.shape), str(value.dtype)] if isinstance(value, torch.Tensor) else None


def _plain(value: object) -> object:
    return value if isinstance(value, (int, float, str, bool, type(None))) else repr(type(value).__name__)


def describe(root: Path) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out: dict = {"source": __doc__.split("\n\n")[1].replace("\n", " ")}
    legacy = root / "torch_bf16" / "iter_0000004"
    out["torch"] = {}
    for rank in sorted(p.name for p in legacy.glob("mp_rank_*")):
        payload = _load(legacy / rank / "model_optim_rng.pt")
        out["torch"][rank] = {
            "keys": sorted(payload),
            "checkpoint_version": payload["checkpoint_version"],
            "model": {k: _entry(v) for k, v in payload["model"].items()},
        }
        args = vars(payload["args"])
        out["torch"]["args"] = {name: _plain(args.get(name, "<absent>")) for name in MODEL_ARGS}

    class RawBytes(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            self.original_state_dict[read_item.dest_index.fqn] = value.read()

    folder = root / "td_bf16" / "iter_0000004"
    entries = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    tensors = {k: [list(m.size), str(m.properties.dtype)] for k, m in entries.items()
               if isinstance(m, TensorStorageMetadata)}  # fmt: skip
    state = {"common_state/shard_0_1": None}
    dcp.load(state, storage_reader=FileSystemReader(str(folder)), planner=RawBytes(flatten_state_dict=False),
             no_dist=True)  # fmt: skip
    (common,) = _load(state["common_state/shard_0_1"])
    out["torch_dist"] = {
        "metadata.json": json.loads((folder / "metadata.json").read_text()),
        "tensors": dict(sorted(tensors.items())),
        "objects": sorted(k for k in entries if k not in tensors),
        "common_state": sorted(common),
        "content_metadata": common["content_metadata"],
        "args": {name: _plain(vars(common["args"]).get(name, "<absent>")) for name in MODEL_ARGS},
    }
    return out


if __name__ == "__main__":
    print(json.dumps(describe(Path(sys.argv[1])), indent=1))
