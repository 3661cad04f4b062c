"""FullModel -> Megatron-LM checkpoints (`convert.py --saver mcore`): what Megatron-LM (main, 2026) loads with
`--load DIR` for a GPTModel of Megatron-Core's transformer_engine layer spec, in either of its formats.

    --ckpt-format torch        DIR/latest_checkpointed_iteration.txt
                               DIR/iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt per tensor x pipeline rank:
                                 args, checkpoint_version 3.0, iteration, num_floating_point_operations_so_far and
                                 `model`, the rank's GPTModel.state_dict(): layers numbered within the stage, TE's
                                 `_extra_state` entries (empty: no FP8 state), the last stage's copy of tied word
                                 embeddings as output_layer.weight
    --ckpt-format torch_dist   DIR/iter_NNNNNNN/ a torch.distributed.checkpoint (.metadata, __0_0.distcp) keyed as
                                 Megatron-Core's sharded_state_dict names a GPTModel: whole tensors, the layers
                                 stacked on a leading layer axis (`decoder.layers.<name>`, TransformerBlock's default
                                 homogeneous layout), TE `_extra_state` as byte objects `<key>/shard_<layer>_<layers>`,
                                 the common state (args, iteration, ...) as the byte object `common_state/shard_0_1`
                               DIR/iter_NNNNNNN/metadata.json {"sharded_backend": "torch_dist", ...}

The names are this project's (they are Megatron-Core's under the TE spec: norms fused into linear_qkv / linear_fc1).
The checkpoint holds weights only (its args say `no_save_optim` and `no_save_rng`): Megatron-LM continues from it
with `--no-load-optim --no-load-rng` (keeping the iteration and consumed samples) or `--finetune`.
Every pickle written is plain data that Megatron-LM's weights-only unpickler accepts: tensors, containers, numbers,
strings and the args as an argparse.Namespace (Megatron-LM registers it as a safe global).
"""

from __future__ import annotations

import argparse
import io
import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from megatron.checkpoint.checkpointing import LATEST, iteration_dir, model_parallel_name
from megatron.config import ModelConfig
from megatron.config.pipeline_split import stage_layer_numbers
from megatron.data.tokenizers import padded_vocab_size

from .ours import shard_state
from .state import FullModel, fold_smoothing, own_storage, pad_vocab

MLM_CHECKPOINT_VERSION = 3.0
"""Megatron-LM's `checkpoint_version` (3.0 since its query/key/value row order became today's)."""

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def extra_state_modules(cfg: ModelConfig, ckpt_format: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(modules of each layer, modules outside the layers) that carry a TE `_extra_state` (FP8 metadata) in a
    GPTModel of the transformer_engine spec: the TE linears, TE's norms (TENorm: final_layernorm, q/k_layernorm), and
    in the torch format also TEDotProductAttention (Megatron-Core leaves it out of the sharded state dict) and the
    output layer's (None: ColumnParallelLinear keeps it for TE compatibility; GPTModel drops it from torch_dist)."""
    layer = ["self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"]
    if cfg.qk_layernorm:
        layer += ["self_attention.q_layernorm", "self_attention.k_layernorm"]
    if ckpt_format == "torch":
        layer.append("self_attention.core_attention")
    return tuple(layer), ("decoder.final_layernorm",)


def empty_extra_state() -> torch.Tensor:
    """What TE's `get_extra_state` returns for a module without FP8 state (and `set_extra_state` accepts)."""
    return torch.empty(0, dtype=torch.uint8)


def megatron_args(
    full: FullModel, tp: int, pp: int, padded: int, divisible_by: int, ckpt_format: str
) -> argparse.Namespace:
    """Megatron-LM's args for the written checkpoint: what its load path reads (check_checkpoint_args, the
    parallel sizes, consumed samples, no_save_optim / no_save_rng) and what --use-checkpoint-args takes over (the
    model's shape), under Megatron-LM's argument names (`layernorm_epsilon`, `layernorm_zero_centered_gamma` for
    --norm-epsilon, --apply-layernorm-1p; `apply_layernorm_1p` too, the name --use-checkpoint-args reads). The
    values are plain (numbers, strings, None), never Megatron-LM's enums or torch dtypes."""
    cfg = full.model
    groups = cfg.num_query_groups if cfg.group_query_attention else None
    data = full.data
    values: dict[str, Any] = dict(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, group_query_attention=bool(groups),
        num_query_groups=groups or cfg.num_attention_heads, kv_channels=cfg.kv_channels,
        seq_length=cfg.seq_length, max_position_embeddings=cfg.max_position_embeddings,
        position_embedding_type=cfg.position_embedding_type, add_position_embedding=True,
        use_rotary_position_embeddings=False, rotary_base=cfg.rotary_base,
        rotary_percent=cfg.rotary_percent, rotary_interleaved=False, use_rope_scaling=False,
        normalization=cfg.normalization, layernorm_epsilon=cfg.norm_epsilon,
        layernorm_zero_centered_gamma=cfg.apply_layernorm_1p, apply_layernorm_1p=cfg.apply_layernorm_1p,
        qk_layernorm=cfg.qk_layernorm, swiglu=cfg.swiglu, squared_relu=cfg.squared_relu, openai_gelu=False,
        add_bias_linear=not cfg.disable_bias_linear, add_qkv_bias=not cfg.disable_bias_linear,
        untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
        apply_residual_connection_post_layernorm=False, apply_query_key_layer_scaling=False,
        init_method_std=cfg.init_method_std, hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout, num_experts=None, multi_latent_attention=False,
        mtp_num_layers=None, spec=None, hybrid_layer_pattern=None, transformer_impl="transformer_engine",
        tokenizer_type=data.get("tokenizer_type"), vocab_size=data.get("vocab_size"),
        vocab_file=data.get("vocab_file"), merge_file=data.get("merge_file"),
        tokenizer_model=data.get("tokenizer_model"), padded_vocab_size=padded,
        make_vocab_size_divisible_by=divisible_by, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=None,
        decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
        expert_model_parallel_size=1, context_parallel_size=1, data_parallel_size=1, world_size=tp * pp,
        data_parallel_random_init=False, ckpt_format=ckpt_format, use_dist_ckpt=ckpt_format == "torch_dist",
        async_save=False, no_save_optim=True, no_save_rng=True,
        iteration=full.iteration, consumed_train_samples=full.consumed_samples, skipped_train_samples=0,
        consumed_valid_samples=full.consumed_valid_samples,
    )  # fmt: skip
    return argparse.Namespace(**values)


def _model_name(name: str, tied_last: bool) -> str:
    """A single-process name -> the name Megatron-Core's GPTModel of a stage uses: a pipeline's last stage holds
    tied word embeddings as its output layer (it builds no embedding module)."""
    return "output_layer.weight" if tied_last and name == "embedding.word_embeddings.weight" else name


def write_mcore_torch(full: FullModel, out: Path, tp: int, pp: int, divisible_by: int = 128) -> None:
    """`full` as a Megatron-LM `--ckpt-format torch` checkpoint at tp x pp in the (empty, temporary) folder `out`."""
    padded = padded_vocab_size(full.vocab_size, divisible_by, tp)
    args = megatron_args(full, tp, pp, padded, divisible_by, "torch")
    tied = not full.model.untie_embeddings_and_output_weights
    layer_modules, other_modules = extra_state_modules(full.model, "torch")
    folder = iteration_dir(out, full.iteration)
    for (t, p), shard in shard_state(full, tp, pp, padded).items():
        model: dict[str, Any] = {}
        for name, tensor in shard.items():
            model[_model_name(name, tied and p == pp - 1 and p > 0)] = own_storage(tensor)
        for i in range(len(stage_layer_numbers(full.model.num_layers, pp, p))):
            for module in layer_modules:
                model[f"decoder.layers.{i}.{module}._extra_state"] = empty_extra_state()
        if p == pp - 1:
            for module in other_modules:
                model[f"{module}._extra_state"] = empty_extra_state()
            model["output_layer._extra_state"] = None  # ColumnParallelLinear's get_extra_state
        rank_dir = folder / model_parallel_name(t, p, pp)
        rank_dir.mkdir(parents=True)
        payload = {
            "args": args,
            "checkpoint_version": MLM_CHECKPOINT_VERSION,
            "iteration": full.iteration,
            "model": model,
            "num_floating_point_operations_so_far": 0.0,
        }
        torch.save(payload, rank_dir / "model_optim_rng.pt")
    (out / LATEST).write_text(f"{full.iteration}")


def sharded_tensors(full: FullModel, padded: int) -> dict[str, torch.Tensor]:
    """The model's ShardedTensor keys (Megatron-Core's default sharded_state_dict of a GPTModel) -> global tensors:
    layers stacked on a leading axis, vocabulary padded, tied output weights not repeated."""
    cfg = full.model
    layers: dict[str, list[torch.Tensor | None]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in full.state.items():
        match = _LAYER.match(name)
        if match:
            layers.setdefault(match.group(2), [None] * cfg.num_layers)[int(match.group(1))] = tensor
        elif name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            tensors[name] = pad_vocab(tensor, padded)
        else:
            tensors[name] = tensor
    for rest, stack in layers.items():
        tensors[f"decoder.layers.{rest}"] = torch.stack(stack)  # check_complete saw every layer
    return tensors


def sharded_objects(full: FullModel) -> dict[str, Any]:
    """The model's ShardedObject unique keys -> data: TE `_extra_state`s, `<key>/shard_<offset>_<shape>` (a layer's
    offset and shape are its number and the number of layers, as its ShardedTensors' leading axis)."""
    layers = full.model.num_layers
    layer_modules, other_modules = extra_state_modules(full.model, "torch_dist")
    objects = {
        f"decoder.layers.{module}._extra_state/shard_{i}_{layers}": empty_extra_state()
        for module in layer_modules
        for i in range(layers)
    }
    objects.update({f"{module}._extra_state/shard_0_1": empty_extra_state() for module in other_modules})
    return objects


def common_state(full: FullModel, args: argparse.Namespace) -> dict[str, Any]:
    """What Megatron-LM's dist_checkpointing.save keeps outside the sharded tensors (`common_state`)."""
    return {
        "args": args,
        "checkpoint_version": MLM_CHECKPOINT_VERSION,
        "iteration": full.iteration,
        "num_floating_point_operations_so_far": 0.0,
        # how the sharded state dict was built: what Megatron-LM's _build_sharded_state_dict_metadata records by
        # default, also when it saves no optimizer (the optimizer's layout then names nothing: none is stored)
        "content_metadata": {
            "distrib_optim_sharding_type": "dp_reshardable",
            "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True,
        },
    }


def _pickled(obj: Any) -> io.BytesIO:
    """A ShardedObject as Megatron-Core stores it: torch.save of the list of the objects of its key."""
    buffer = io.BytesIO()
    torch.save([obj], buffer)
    buffer.seek(0)
    return buffer


def write_mcore_dist(full: FullModel, out: Path, tp: int, pp: int, divisible_by: int = 128) -> None:
    """`full` as a Megatron-LM `--ckpt-format torch_dist` checkpoint (for a run at tp x pp, whose padded vocabulary
    the embedding rows take) in the (empty, temporary) folder `out`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

    class BytesAsIs(DefaultSavePlanner):
        """Byte objects are written as given (Megatron-Core's MCoreSavePlanner): DCP's default would pickle the
        BytesIO once more, and Megatron-Core unpickles exactly once."""

        def transform_object(self, write_item: Any, object: Any) -> Any:
            return object

    class Writer(FileSystemWriter):
        """DCP's writer, naming the checkpoint by its folder (as a string) in the index: the folder it writes is
        renamed when the conversion completes, and a path object would be one more class in the pickle."""

        def storage_meta(self) -> Any:
            meta = super().storage_meta()
            if meta is not None:
                meta.checkpoint_id = folder.name
            return meta

    padded = padded_vocab_size(full.vocab_size, divisible_by, tp)
    args = megatron_args(full, tp, pp, padded, divisible_by, "torch_dist")
    folder = iteration_dir(out, full.iteration)
    state: dict[str, Any] = {key: own_storage(t) for key, t in sharded_tensors(full, padded).items()}
    state.update({key: _pickled(obj) for key, obj in sharded_objects(full).items()})
    state["common_state/shard_0_1"] = _pickled(common_state(full, args))
    with warnings.catch_warnings():  # DCP warns that it saves in a single process: that is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=Writer(str(folder)), planner=BytesAsIs(flatten_state_dict=False), no_dist=True)
    config = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
    (folder / "metadata.json").write_text(json.dumps(config))
    (out / LATEST).write_text(f"{full.iteration}")


WRITERS = {"torch": write_mcore_torch, "torch_dist": write_mcore_dist}


def write_mcore(full: FullModel, out: Path, tp: int, pp: int, ckpt_format: str, divisible_by: int = 128) -> None:
    """`full` as a Megatron-LM checkpoint of `ckpt_format` (torch or torch_dist) for a run at tp x pp."""
    for p in range(pp):  # Megatron-LM splits the layers evenly (ConfigError naming the sizes otherwise)
        stage_layer_numbers(full.model.num_layers, pp, p)
    WRITERS[ckpt_format](fold_smoothing(full), out, tp, pp, divisible_by)
