"""Megatron-LM checkpoints -> FullModel: the legacy `--ckpt-format torch` layout with Megatron-Core key names.

    LOAD_DIR/latest_checkpointed_iteration.txt        an iteration number, or `release`
    LOAD_DIR/iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt
        args               the run's argparse Namespace: the model configuration is read from it
        model              Megatron-Core state dict of this rank (layers numbered within the pipeline stage)
        iteration, checkpoint_version, optimizer, opt_param_scheduler, rng_state, ...

Megatron-Core's names are this project's, except under its `local` layer spec, whose norms are separate modules
(`input_layernorm`, `pre_mlp_layernorm`) rather than fused into linear_qkv / linear_fc1 (TE spec): both are read.
Its QKV rows (per query group: the group's query heads, its key, its value) and SwiGLU shards ([gate_r; up_r] per
tensor-parallel rank) are laid out as here. A pipeline's last stage holds `output_layer.weight` also with tied
embeddings (its copy of the word embeddings): dropped then.

Megatron-LM's `torch_dist` checkpoints (iter_XXXXXXX/.metadata, *.distcp; the args in common.pt or, since 2026,
in the DCP's `common_state` object) are read with torch.distributed.checkpoint in one process (mlm_dist.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from megatron.config.data import TOKENIZER_TYPES, DataConfig
from megatron.data.tokenizers import build_tokenizer
from megatron.errors import UserError

from .files import load_torch_file
from .mlm_dist import MegatronDist, is_megatron_dist, unstack
from .ours import detect_layout, find_iteration, merge_layout
from .state import ConvertError, FullModel, check_complete, model_config, unpad_vocab

_RENAMES = [
    (re.compile(r"\.input_layernorm\.(weight|bias)$"), r".self_attention.linear_qkv.layer_norm_\1"),
    (re.compile(r"\.pre_mlp_layernorm\.(weight|bias)$"), r".mlp.linear_fc1.layer_norm_\1"),
]

# Megatron-LM settings this project's model does not have: a checkpoint using them is another architecture.
_UNSUPPORTED = {
    "num_experts": "mixture of experts",
    "multi_latent_attention": "multi-latent attention",
    "rotary_interleaved": "interleaved RoPE",
    "use_rope_scaling": "Llama 3 RoPE scaling",
    "apply_residual_connection_post_layernorm": "post-norm residuals",
    "virtual_pipeline_model_parallel_size": "a virtual pipeline (several model chunks per rank)",
    "pipeline_model_parallel_layout": "a custom pipeline layout (--pipeline-model-parallel-layout)",
    "add_qkv_bias": None,  # checked against add_bias_linear below
}


def _arg(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def config_from_args(args: Any) -> dict[str, Any]:
    """This project's ModelConfig fields from Megatron-LM's args."""
    for name, what in _UNSUPPORTED.items():
        if what and _arg(args, name):
            raise ConvertError(
                f"another architecture: the Megatron-LM checkpoint uses {what} (--{name.replace('_', '-')})"
            )
    bias = _arg(args, "add_bias_linear", True)
    if _arg(args, "add_qkv_bias", False) and not bias:
        raise ConvertError("another architecture: the Megatron-LM checkpoint has --add-qkv-bias without linear biases")
    position = _arg(args, "position_embedding_type", "learned_absolute")
    if _arg(args, "use_rotary_position_embeddings"):
        position = "rope"
    if position not in ("learned_absolute", "rope"):
        raise ConvertError(f"another architecture: --position-embedding-type {position}")
    heads = args.num_attention_heads
    groups = _arg(args, "num_query_groups") if _arg(args, "group_query_attention") else None
    return dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=_arg(args, "ffn_hidden_size"),
        num_attention_heads=heads, group_query_attention=bool(groups and groups != heads),
        num_query_groups=groups if groups and groups != heads else None, kv_channels=_arg(args, "kv_channels"),
        seq_length=_arg(args, "seq_length", 2048), max_position_embeddings=_arg(args, "max_position_embeddings"),
        position_embedding_type=position, rotary_base=_arg(args, "rotary_base", 10000),
        rotary_percent=_arg(args, "rotary_percent", 1.0), normalization=_arg(args, "normalization", "LayerNorm"),
        norm_epsilon=_arg(args, "norm_epsilon", _arg(args, "layernorm_epsilon", 1e-5)),
        apply_layernorm_1p=_zero_centered(args), qk_layernorm=bool(_arg(args, "qk_layernorm")),
        swiglu=bool(_arg(args, "swiglu")), squared_relu=bool(_arg(args, "squared_relu")),
        disable_bias_linear=not bias,
        untie_embeddings_and_output_weights=bool(_arg(args, "untie_embeddings_and_output_weights")),
        init_method_std=_arg(args, "init_method_std", 0.02), hidden_dropout=_arg(args, "hidden_dropout", 0.1),
        attention_dropout=_arg(args, "attention_dropout", 0.1),
    )  # fmt: skip


def _zero_centered(args: Any) -> bool:
    """Zero-centred norm weights: today's Megatron-LM stores --apply-layernorm-1p as `layernorm_zero_centered_gamma`
    (its TransformerConfig name); older checkpoints as `apply_layernorm_1p`."""
    return bool(_arg(args, "apply_layernorm_1p") or _arg(args, "layernorm_zero_centered_gamma"))


def _tokenizer(args: Any) -> dict[str, Any]:
    kind = _arg(args, "tokenizer_type")
    if kind == "Llama2Tokenizer":  # Megatron-LM's SentencePiece tokenizer for Llama 2: the model's own eos
        kind = "GPTSentencePieceTokenizer"
    if kind not in TOKENIZER_TYPES:
        return {}
    data = {"tokenizer_type": kind}
    for name in ("vocab_size", "vocab_file", "merge_file", "tokenizer_model"):
        if _arg(args, name) is not None:
            data[name] = _arg(args, name)
    return data


def _vocab_size(args: Any, data: dict[str, Any], rows: int, given: int | None, log) -> int:
    if given is not None:
        return given
    try:
        return build_tokenizer(DataConfig(**data)).vocab_size if data else rows
    except (UserError, OSError, TypeError) as exc:
        log(f"> note: the run's tokenizer does not load here ({exc}); keeping all {rows} embedding rows as the"
            " vocabulary (pass --true-vocab-size to drop the padding)")  # fmt: skip
        return rows


def _read_legacy(folder: Path) -> tuple[Any, dict[str, Any], tuple[int, int]]:
    """(args, merged Megatron-Core state dict, (tp, pp)) of a legacy `torch` checkpoint folder."""
    if any(len(p.name.split("_")) > 4 for p in folder.glob("mp_rank_*")):
        raise ConvertError(f"another architecture: {folder} has expert-parallel shards (mixture of experts)")
    tp, pp = detect_layout(folder)

    def name(t: int, p: int) -> str:
        return f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"

    states = {
        (t, p): load_torch_file(folder / name(t, p) / "model_optim_rng.pt", foreign=True)
        for p in range(pp)
        for t in range(tp)
    }
    first = states[(0, 0)]
    args = _check_args(first.get("args"), folder)
    if "model" not in first:
        chunks = sorted(k for k in first if re.fullmatch(r"model\d+", k))
        raise ConvertError(
            f"another architecture: {folder} holds {len(chunks)} model chunks per rank (virtual pipeline)"
        )
    if (_arg(args, "tensor_model_parallel_size", tp), _arg(args, "pipeline_model_parallel_size", pp)) != (tp, pp):
        raise ConvertError(
            f"{folder} is incomplete: its args name tensor x pipeline {args.tensor_model_parallel_size} x"
            f" {args.pipeline_model_parallel_size}, the folder holds mp_rank_* folders for {tp} x {pp}"
        )
    cfg = model_config(**config_from_args(args))
    first_layers = _arg(args, "decoder_first_pipeline_num_layers")
    last_layers = _arg(args, "decoder_last_pipeline_num_layers")
    state = merge_layout({k: s["model"] for k, s in states.items()}, cfg, tp, pp, first_layers, last_layers)
    return args, state, (tp, pp)


def _check_args(args: Any, folder: Path) -> Any:
    """Megatron-LM's args (an argparse Namespace), with the fields that shape the model present and of their type."""
    if args is None or not hasattr(args, "num_layers"):
        raise ConvertError(f"{folder} holds no Megatron-LM args: not a Megatron-LM checkpoint")
    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        value = getattr(args, name, None)
        if type(value) is not int or value <= 0:
            raise ConvertError(
                f"{folder}: its Megatron-LM args have {name} = {str(value)[:40]!r}, not a positive integer (damaged,"
                " or not a Megatron-LM checkpoint)"
            )
    for name in ("ffn_hidden_size", "num_query_groups", "kv_channels", "seq_length", "max_position_embeddings",
                 "tensor_model_parallel_size", "pipeline_model_parallel_size", "padded_vocab_size"):  # fmt: skip
        value = getattr(args, name, None)
        if value is not None and (type(value) is not int or value <= 0):
            raise ConvertError(
                f"{folder}: its Megatron-LM args have {name} = {str(value)[:40]!r}, not a positive integer"
            )
    return args


_MODEL_KEY = re.compile(r"^(embedding|decoder|output_layer)\.")


def _read_torch_dist(folder: Path) -> tuple[Any, dict[str, Any], tuple[int, int]]:
    """(args, Megatron-Core state dict, (tp, pp)) of a `torch_dist` checkpoint folder, either generation
    (megatron/convert/mlm_dist.py)."""
    ckpt = MegatronDist(folder)
    args = _check_args(ckpt.common().get("args"), folder)
    keys = [k for k in ckpt.tensor_keys() if _MODEL_KEY.match(k) and "_extra_state" not in k]
    state = unstack(ckpt.tensors(keys))
    return args, state, (_arg(args, "tensor_model_parallel_size", 1), _arg(args, "pipeline_model_parallel_size", 1))


def to_ours(state: dict[str, Any], cfg: Any) -> dict[str, Any]:
    """Megatron-Core names -> this project's (the local spec's separate norms fused into the next linear), without
    a later pipeline stage's copy of tied word embeddings (`output_layer.weight`)."""
    out = {}
    for key, value in state.items():
        if key == "output_layer.weight" and not cfg.untie_embeddings_and_output_weights:
            continue
        for pattern, replacement in _RENAMES:
            key = pattern.sub(replacement, key)
        out[key] = value
    return out


def read_mlm_folder(folder: Path) -> tuple[Any, Any, dict[str, Any], tuple[int, int]]:
    """(args, ModelConfig, weights by this project's names with the vocabulary still padded, (tp, pp)) of one
    Megatron-LM checkpoint folder (iter_XXXXXXX), either format."""
    dist = (folder / ".metadata").exists() or is_megatron_dist(folder)
    args, state, layout = _read_torch_dist(folder) if dist else _read_legacy(folder)
    cfg = model_config(**config_from_args(args))
    return args, cfg, to_ours(state, cfg), layout


def read_mlm(root: str | Path, true_vocab_size: int | None = None, log=print) -> FullModel:
    """The newest checkpoint under a Megatron-LM --save folder (legacy `torch` or `torch_dist`) as a FullModel."""
    root = Path(root)
    iteration, folder = find_iteration(root, "Megatron-LM checkpoint")
    args, cfg, state, layout = read_mlm_folder(folder)
    if _arg(args, "openai_gelu") and not cfg.swiglu:
        log("> note: Megatron-LM's --openai-gelu (tanh approximation) runs as exact GELU here; logits differ slightly")
    source = f"Megatron-LM checkpoint {root} (iteration {iteration})"
    data = _tokenizer(args)
    rows = state["embedding.word_embeddings.weight"].shape[0] if "embedding.word_embeddings.weight" in state else 0
    padded = _arg(args, "padded_vocab_size")
    if padded is not None and rows and padded != rows:
        raise ConvertError(f"vocabulary mismatch: {source} has {rows} embedding rows, its args say {padded}")
    vocab = _vocab_size(args, data, rows, true_vocab_size, log)
    unpad_vocab(state, vocab, source)
    consumed = int(_arg(args, "consumed_train_samples", 0) or 0)
    valid = int(_arg(args, "consumed_valid_samples", 0) or 0)
    iteration = 0 if iteration == "release" else int(iteration)
    full = FullModel(cfg, vocab, state, source, iteration, consumed, data, layout, valid)
    check_complete(full)
    return full
