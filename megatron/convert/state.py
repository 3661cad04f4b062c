"""The whole model in one place, whatever layout it was saved in, and the tensor-parallel rules that cut it.

Every loader of tools/checkpoint/convert.py produces a `FullModel` and every saver consumes one:

    model        this project's ModelConfig (finalized), which decides the architecture
    vocab_size   the tokenizer's vocabulary: the embedding and output rows hold exactly this many (padding removed)
    state        parameter name -> tensor, named as a single-process GPTModel names them (layers by global index
                 `decoder.layers.{n-1}`), without TE's `_extra_state` entries

Tensor-parallel layout of this project's (and Megatron-Core's) parameters, by name:

    word_embeddings.weight, output_layer.weight    rows (vocabulary) split: dim 0
    linear_qkv.weight / .bias                       rows split: dim 0 (whole query groups per rank)
    linear_fc1.weight / .bias                       rows split: dim 0; with SwiGLU gate and up each split, so a
                                                    shard is [gate_r; up_r]
    linear_proj.weight, linear_fc2.weight           columns split: dim 1
    linear_fc2.smooth_scale (--smooth-swiglu)       split: dim 0, as linear_fc2's columns
    everything else (norms, row-parallel biases,    the same on every rank
    position embeddings)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron.config import ModelConfig
from megatron.errors import UserError


class ConvertError(UserError, RuntimeError):
    """A checkpoint that cannot be converted (another architecture, missing tensors, a vocabulary mismatch, a
    half-written directory). The message is one line naming the problem."""


@dataclass
class FullModel:
    model: ModelConfig
    vocab_size: int
    state: dict[str, torch.Tensor]
    source: str
    """What it was read from, for the log and the written checkpoint (`converted_from`)."""
    iteration: int = 0
    consumed_samples: int = 0
    data: dict[str, Any] = field(default_factory=dict)
    """Tokenizer settings (DataConfig fields) the source names, carried into the written config."""
    layout: tuple[int, int] | None = None
    """The source's (tensor, pipeline) parallel sizes, where it has them: the saver's default layout."""
    consumed_valid_samples: int = 0
    """Validation samples the source run had read (Megatron-LM's consumed_valid_samples; 0: not recorded)."""


def model_config(**values: Any) -> ModelConfig:
    """A finalized ModelConfig; a value it refuses is reported as a conversion error."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = ModelConfig(**{k: v for k, v in values.items() if k in known})
    try:
        cfg.finalize()
    except UserError as exc:
        raise ConvertError(f"the source's model settings do not form a valid model here: {exc}") from None
    return cfg


def partition(name: str, cfg: ModelConfig) -> tuple[int, int] | None:
    """(dim, parts) along which `name` is split over tensor-parallel ranks, or None when every rank holds it whole."""
    if name.endswith("word_embeddings.weight") or name == "output_layer.weight":
        return 0, 1
    if ".linear_qkv." in name and name.endswith((".weight", ".bias")) and ".layer_norm_" not in name:
        return 0, 1
    if ".linear_fc1." in name and name.endswith((".weight", ".bias")) and ".layer_norm_" not in name:
        return 0, 2 if cfg.swiglu else 1
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1, 1
    if name.endswith("linear_fc2.smooth_scale"):
        return 0, 1
    return None


def merge_tp(name: str, shards: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """The whole tensor from its tensor-parallel shards (rank order)."""
    split = partition(name, cfg)
    if split is None or len(shards) == 1:
        return shards[0]
    dim, parts = split
    pieces = [shard.chunk(parts, dim) for shard in shards]
    return torch.cat([torch.cat([p[i] for p in pieces], dim) for i in range(parts)], dim)


def split_tp(name: str, tensor: torch.Tensor, cfg: ModelConfig, tp: int) -> list[torch.Tensor]:
    """Each tensor-parallel rank's shard of `tensor` (clones: a shard never keeps the whole tensor alive)."""
    split = partition(name, cfg)
    if split is None or tp == 1:
        return [tensor] * tp
    dim, parts = split
    size = tensor.shape[dim]
    if size % (parts * tp):
        raise ConvertError(f"{name} ({size} along dim {dim}) does not split over tensor-parallel size {tp}")
    chunks = [part.chunk(tp, dim) for part in tensor.chunk(parts, dim)]
    return [torch.cat([c[r] for c in chunks], dim).clone() for r in range(tp)]


def own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` contiguous and alone in its storage: a view into a larger tensor (a split, a stacked layer, a
    shared parameter buffer) would otherwise write that whole storage into the file."""
    tensor = tensor.contiguous()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def pad_vocab(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Vocabulary rows padded to `rows` with zeros (Megatron-LM pads with copies of the mean; the padded ids never
    occur in data, so their value only matters for the softmax, where a zero row is a neutral logit)."""
    if tensor.shape[0] == rows:
        return tensor
    pad = tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])
    return torch.cat([tensor, pad], 0)


def unpad_vocab(state: dict[str, torch.Tensor], vocab_size: int, source: str) -> None:
    """Cut the vocabulary padding off the embedding and output rows, in place."""
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in state:
            rows = state[name].shape[0]
            if vocab_size > rows:
                raise ConvertError(
                    f"vocabulary mismatch: {source} has {rows} embedding rows, fewer than the vocabulary size"
                    f" {vocab_size}; check --true-vocab-size"
                )
            state[name] = state[name][:vocab_size]


def full_model_of(
    cfg: ModelConfig, model_state: dict[str, torch.Tensor], vocab_size: int, source: str, **fields: Any
) -> FullModel:
    """The FullModel of a single-process GPTModel's state dict (a model in memory): TE's `_extra_state` entries
    dropped, the vocabulary padding cut off; `fields` are FullModel's others (iteration, consumed_samples, data)."""
    state = {name: t for name, t in model_state.items() if not name.endswith("_extra_state")}
    unpad_vocab(state, vocab_size, source)
    full = FullModel(cfg, vocab_size, state, source, **fields)
    check_complete(full)
    return full


def expected_names(cfg: ModelConfig) -> list[str]:
    """The parameter names a single-process GPTModel of `cfg` holds (the key set a FullModel must have)."""
    names = ["embedding.word_embeddings.weight"]
    if cfg.position_embedding_type == "learned_absolute":
        names.append("embedding.position_embeddings.weight")
    norm = ["weight", "bias"] if cfg.normalization == "LayerNorm" else ["weight"]
    linear = ["weight", "bias"] if cfg.add_bias else ["weight"]
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        for module in ("self_attention.linear_qkv", "mlp.linear_fc1"):
            names += [f"{p}{module}.layer_norm_{n}" for n in norm] + [f"{p}{module}.{n}" for n in linear]
        names += [f"{p}self_attention.linear_proj.{n}" for n in linear]
        names += [f"{p}mlp.linear_fc2.{n}" for n in linear]
        if cfg.smooth_swiglu:
            names.append(f"{p}mlp.linear_fc2.smooth_scale")
        if cfg.qk_layernorm:
            names += [f"{p}self_attention.{q}_layernorm.{n}" for q in "qk" for n in norm]
    names += [f"decoder.final_layernorm.{n}" for n in norm]
    if cfg.untie_embeddings_and_output_weights:
        names.append("output_layer.weight")
    return names


def check_complete(full: FullModel) -> None:
    """Every tensor the model needs is there, with the shape it needs, and nothing else: one line naming the
    first few problems."""
    cfg, state = full.model, full.state
    want = expected_names(cfg)
    missing = [n for n in want if n not in state]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ConvertError(f"missing tensors in {full.source}: {', '.join(missing[:3])}{more}")
    extra = sorted(set(state) - set(want))
    if extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise ConvertError(f"unexpected tensors in {full.source} for this architecture: {', '.join(extra[:3])}{more}")
    h, heads, groups, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    fc1 = cfg.ffn_hidden_size * (2 if cfg.swiglu else 1)
    shapes = {
        "embedding.word_embeddings.weight": (full.vocab_size, h),
        "output_layer.weight": (full.vocab_size, h),
        "embedding.position_embeddings.weight": (cfg.max_position_embeddings, h),
        "self_attention.linear_qkv.weight": ((heads + 2 * groups) * d, h),
        "self_attention.linear_proj.weight": (h, heads * d),
        "mlp.linear_fc1.weight": (fc1, h),
        "mlp.linear_fc2.weight": (h, cfg.ffn_hidden_size),
        "mlp.linear_fc2.smooth_scale": (cfg.ffn_hidden_size,),
    }
    for name in want:
        key = name if name in shapes else name.split(".", 3)[-1] if name.startswith("decoder.layers.") else name
        if key in shapes and tuple(state[name].shape) != shapes[key]:
            what = "vocabulary mismatch" if "word_embeddings" in key or "output_layer" in key else "shape mismatch"
            raise ConvertError(
                f"{what} in {full.source}: {name} is {list(state[name].shape)}, the model needs {list(shapes[key])}"
            )


def fold_smoothing(full: FullModel) -> FullModel:
    """`full` without its Smooth-SwiGLU scales, for a format whose model has no such op (Hugging Face, Megatron-LM).
    The fold into the weights is already done: the model divides linear_fc2's stored weight by the scales on the
    fly and multiplies its input by them (megatron/model/smooth_swiglu.py), so the stored weight is the plain one,
    and the plain model of the same weights computes the same function."""
    if not full.model.smooth_swiglu:
        return full
    state = {name: t for name, t in full.state.items() if not name.endswith(".smooth_scale")}
    model = dataclasses.replace(full.model, smooth_swiglu=False)
    return dataclasses.replace(full, model=model, state=state)
