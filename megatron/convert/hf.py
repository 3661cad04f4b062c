"""Hugging Face `transformers` checkpoints (`LlamaForCausalLM`, `GPT2LMHeadModel`) <-> FullModel.

A Hugging Face model folder is `config.json` plus `model.safetensors` (or shards with `model.safetensors.index.json`,
or the older `pytorch_model.bin`). What changes between the two naming schemes:

    ours                                  Llama                                   GPT-2
    embedding.word_embeddings             model.embed_tokens                      transformer.wte
    embedding.position_embeddings         -                                       transformer.wpe
    linear_qkv.layer_norm_weight / _bias  input_layernorm                         h.N.ln_1
    linear_qkv [per query group:          q_proj, k_proj, v_proj                  c_attn ([q; k; v], transposed:
                its q heads, k, v]                                                GPT-2's Conv1D stores [in, out])
    linear_proj                           o_proj                                  attn.c_proj (transposed)
    linear_fc1.layer_norm_weight / _bias  post_attention_layernorm                h.N.ln_2
    linear_fc1 ([gate; up] with SwiGLU)   gate_proj, up_proj                      mlp.c_fc (transposed)
    linear_fc2                            down_proj                               mlp.c_proj (transposed)
    decoder.final_layernorm               model.norm                              transformer.ln_f
    output_layer (untied only)            lm_head                                 lm_head

Both use RoPE's rotate-half layout (Llama) as Megatron-Core does, so no head permutation is needed. With
--apply-layernorm-1p a stored norm weight w means 1 + w; Hugging Face gets 1 + w.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from megatron.checkpoint.safe_load import first_line, load_foreign
from megatron.untrusted import read_json

from .state import ConvertError, FullModel, check_complete, fold_smoothing, model_config, own_storage

INSTALL = "pip install -e .[hf] (transformers, safetensors)"


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise ConvertError(f"Hugging Face checkpoints need the safetensors package: {INSTALL}") from None
    return safetensors


# ------------------------------------------------------------------------------------------------------ export


def _norm(full: FullModel, tensor: torch.Tensor, is_weight: bool = True) -> torch.Tensor:
    return tensor + 1 if is_weight and full.model.apply_layernorm_1p else tensor


def architecture(full: FullModel) -> str:
    """`llama` or `gpt2`: the Hugging Face class this model is, or a one-line error saying why it is neither."""
    cfg = full.model
    if cfg.qk_layernorm:
        raise ConvertError("another architecture: --qk-layernorm has no Llama or GPT-2 counterpart")
    if cfg.swiglu and cfg.normalization == "RMSNorm" and cfg.position_embedding_type == "rope":
        if cfg.rotary_percent != 1.0:
            raise ConvertError("another architecture: Llama rotates every channel, this model has --rotary-percent")
        return "llama"
    if not cfg.swiglu and not cfg.squared_relu and cfg.normalization == "LayerNorm":
        if cfg.position_embedding_type != "learned_absolute":
            raise ConvertError("another architecture: GPT-2 has learned position embeddings, this model uses RoPE")
        if (
            cfg.num_query_groups != cfg.num_attention_heads
            or cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size
        ):
            raise ConvertError("another architecture: GPT-2 has neither grouped-query attention nor --kv-channels")
        return "gpt2"
    raise ConvertError(
        "another architecture: Hugging Face export covers Llama (RMSNorm, SwiGLU, RoPE) and GPT-2 (LayerNorm, GELU,"
        f" learned positions); this model has {cfg.normalization}, {'SwiGLU' if cfg.swiglu else 'no SwiGLU'},"
        f" {cfg.position_embedding_type}"
    )


def _split_qkv(full: FullModel, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our per-group QKV rows -> (q, k, v) rows, each in head order."""
    cfg = full.model
    groups, d = cfg.num_query_groups, cfg.kv_channels
    per_group = cfg.num_attention_heads // groups
    grouped = tensor.reshape(groups, (per_group + 2) * d, *tensor.shape[1:])
    q, k, v = grouped.split([per_group * d, d, d], dim=1)
    return tuple(t.reshape(-1, *tensor.shape[1:]) for t in (q, k, v))  # type: ignore[return-value]


def _hf_llama(full: FullModel) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    cfg, s = full.model, full.state
    out = {"model.embed_tokens.weight": s["embedding.word_embeddings.weight"]}
    for i in range(cfg.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = _norm(full, s[src + "self_attention.linear_qkv.layer_norm_weight"])
        for suffix in ("weight", "bias") if cfg.add_bias else ("weight",):
            q, k, v = _split_qkv(full, s[f"{src}self_attention.linear_qkv.{suffix}"])
            out.update({f"{dst}self_attn.{n}_proj.{suffix}": t for n, t in zip("qkv", (q, k, v))})
            out[f"{dst}self_attn.o_proj.{suffix}"] = s[f"{src}self_attention.linear_proj.{suffix}"]
            gate, up = s[f"{src}mlp.linear_fc1.{suffix}"].chunk(2, 0)
            out[f"{dst}mlp.gate_proj.{suffix}"], out[f"{dst}mlp.up_proj.{suffix}"] = gate, up
            out[f"{dst}mlp.down_proj.{suffix}"] = s[f"{src}mlp.linear_fc2.{suffix}"]
        out[dst + "post_attention_layernorm.weight"] = _norm(full, s[src + "mlp.linear_fc1.layer_norm_weight"])
    out["model.norm.weight"] = _norm(full, s["decoder.final_layernorm.weight"])
    if cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = s["output_layer.weight"]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": full.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.kv_channels,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.norm_epsilon,
        "rope_theta": float(cfg.rotary_base),
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rotary_base)},
        "attention_bias": cfg.add_bias,
        "mlp_bias": cfg.add_bias,
        "attention_dropout": cfg.attention_dropout,
        "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
    }
    return config, out


def _hf_gpt2(full: FullModel) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    cfg, s = full.model, full.state
    h = cfg.hidden_size
    out = {
        "transformer.wte.weight": s["embedding.word_embeddings.weight"],
        "transformer.wpe.weight": s["embedding.position_embeddings.weight"],
    }

    def bias(name: str, size: int) -> torch.Tensor:  # GPT-2's Conv1D always has a bias: zeros stand for none
        ref = s["embedding.word_embeddings.weight"]
        return s[name] if name in s else torch.zeros(size, dtype=ref.dtype)

    for i in range(cfg.num_layers):
        src, dst = f"decoder.layers.{i}.", f"transformer.h.{i}."
        for ours, theirs in (("self_attention.linear_qkv", "ln_1"), ("mlp.linear_fc1", "ln_2")):
            out[f"{dst}{theirs}.weight"] = _norm(full, s[f"{src}{ours}.layer_norm_weight"])
            out[f"{dst}{theirs}.bias"] = s[f"{src}{ours}.layer_norm_bias"]
        q, k, v = _split_qkv(full, s[src + "self_attention.linear_qkv.weight"])
        out[dst + "attn.c_attn.weight"] = torch.cat([q, k, v], 0).t()
        qb, kb, vb = _split_qkv(full, bias(src + "self_attention.linear_qkv.bias", 3 * h))
        out[dst + "attn.c_attn.bias"] = torch.cat([qb, kb, vb], 0)
        out[dst + "attn.c_proj.weight"] = s[src + "self_attention.linear_proj.weight"].t()
        out[dst + "attn.c_proj.bias"] = bias(src + "self_attention.linear_proj.bias", h)
        out[dst + "mlp.c_fc.weight"] = s[src + "mlp.linear_fc1.weight"].t()
        out[dst + "mlp.c_fc.bias"] = bias(src + "mlp.linear_fc1.bias", cfg.ffn_hidden_size)
        out[dst + "mlp.c_proj.weight"] = s[src + "mlp.linear_fc2.weight"].t()
        out[dst + "mlp.c_proj.bias"] = bias(src + "mlp.linear_fc2.bias", h)
    out["transformer.ln_f.weight"] = _norm(full, s["decoder.final_layernorm.weight"])
    out["transformer.ln_f.bias"] = s["decoder.final_layernorm.bias"]
    if cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = s["output_layer.weight"]
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": full.vocab_size,
        "n_embd": h,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_attention_heads,
        "n_inner": cfg.ffn_hidden_size,
        "n_positions": cfg.max_position_embeddings,
        "activation_function": "gelu",  # exact GELU, as this project's MLP (GPT-2's own is the tanh approximation)
        "layer_norm_epsilon": cfg.norm_epsilon,
        "resid_pdrop": cfg.hidden_dropout,
        "embd_pdrop": cfg.hidden_dropout,
        "attn_pdrop": cfg.attention_dropout,
        "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
    }
    return config, out


def write_hf(full: FullModel, out: Path) -> str:
    """`full` as a Hugging Face model folder in the (empty, temporary) folder `out`; returns the class name."""
    safetensors = _safetensors()
    full = fold_smoothing(full)
    arch = architecture(full)
    config, tensors = _hf_llama(full) if arch == "llama" else _hf_gpt2(full)
    dtypes = {t.dtype for t in tensors.values()}
    config["torch_dtype"] = str(max(dtypes, key=lambda d: torch.finfo(d).bits)).removeprefix("torch.")
    tensors = {name: own_storage(tensor) for name, tensor in tensors.items()}
    safetensors.torch.save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config["architectures"][0]


# ------------------------------------------------------------------------------------------------------ import


class _Weights:
    """The tensors of a Hugging Face folder, read by name when asked for (safetensors files are memory-mapped)."""

    def __init__(self, folder: Path):
        self.folder, self.files = folder, {}
        index = folder / "model.safetensors.index.json"
        if (folder / "model.safetensors").exists():
            self.names = {n: "model.safetensors" for n in self._open("model.safetensors").keys()}
        elif index.exists():
            self.names = read_json(index)["weight_map"]
            for file in sorted(set(self.names.values())):
                if not (folder / file).exists():
                    raise ConvertError(f"{folder / file} is missing: the download or copy is incomplete")
        elif (folder / "pytorch_model.bin").exists():
            bin_file = folder / "pytorch_model.bin"
            self.bin = load_foreign(bin_file, str(bin_file), ConvertError)  # data only (safe_load.py)
            if not isinstance(self.bin, dict):
                raise ConvertError(f"{bin_file} holds a {type(self.bin).__name__}, not a dict of tensors")
            self.names = {n: "pytorch_model.bin" for n in self.bin}
        else:
            raise ConvertError(f"{folder} has config.json but no model.safetensors or pytorch_model.bin")

    def _open(self, file: str) -> Any:
        if file not in self.files:
            _safetensors()
            from safetensors import safe_open

            try:
                self.files[file] = safe_open(str(self.folder / file), framework="pt")
            except Exception as exc:
                raise ConvertError(f"cannot read {self.folder / file} (truncated?): {first_line(exc)}") from None
        return self.files[file]

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise ConvertError(f"missing tensors in {self.folder}: {name}")
        file = self.names[name]
        if file == "pytorch_model.bin":
            return self.bin[name]
        try:
            return self._open(file).get_tensor(name)
        except Exception as exc:  # safetensors' own error type: a header naming bytes the file lacks
            raise ConvertError(f"cannot read {name} from {self.folder / file}: {first_line(exc)}") from None


def _from_llama(c: dict[str, Any], w: _Weights, source: str) -> FullModel:
    if c.get("hidden_act", "silu") != "silu":
        raise ConvertError(f"another architecture: Llama with hidden_act {c['hidden_act']} (only silu is SwiGLU)")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ConvertError(
            f"another architecture: rope scaling {rope.get('rope_type', rope.get('type'))} is not supported"
        )
    theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
    attn_bias, mlp_bias = c.get("attention_bias", False), c.get("mlp_bias", False)
    if attn_bias != mlp_bias:
        raise ConvertError("another architecture: biases on attention but not the MLP (or the reverse)")
    heads, h = c["num_attention_heads"], c["hidden_size"]
    groups = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or h // heads
    cfg = model_config(
        num_layers=c["num_hidden_layers"], hidden_size=h, ffn_hidden_size=c["intermediate_size"],
        num_attention_heads=heads, group_query_attention=groups != heads, num_query_groups=groups,
        kv_channels=head_dim, seq_length=c.get("max_position_embeddings", 4096),
        max_position_embeddings=c.get("max_position_embeddings", 4096), position_embedding_type="rope",
        rotary_base=int(theta) if float(theta).is_integer() else theta, normalization="RMSNorm",
        norm_epsilon=c.get("rms_norm_eps", 1e-6), swiglu=True, disable_bias_linear=not attn_bias,
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False), hidden_dropout=0.0,
        attention_dropout=c.get("attention_dropout", 0.0),
    )  # fmt: skip
    state = {"embedding.word_embeddings.weight": w["model.embed_tokens.weight"]}
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        state[dst + "self_attention.linear_qkv.layer_norm_weight"] = w[src + "input_layernorm.weight"]
        state[dst + "mlp.linear_fc1.layer_norm_weight"] = w[src + "post_attention_layernorm.weight"]
        for suffix in ("weight", "bias") if attn_bias else ("weight",):
            q, k, v = (w[f"{src}self_attn.{n}_proj.{suffix}"] for n in "qkv")
            state[f"{dst}self_attention.linear_qkv.{suffix}"] = _join_qkv(cfg, q, k, v)
            state[f"{dst}self_attention.linear_proj.{suffix}"] = w[f"{src}self_attn.o_proj.{suffix}"]
            gate, up = w[f"{src}mlp.gate_proj.{suffix}"], w[f"{src}mlp.up_proj.{suffix}"]
            state[f"{dst}mlp.linear_fc1.{suffix}"] = torch.cat([gate, up], 0)
            state[f"{dst}mlp.linear_fc2.{suffix}"] = w[f"{src}mlp.down_proj.{suffix}"]
    state["decoder.final_layernorm.weight"] = w["model.norm.weight"]
    if cfg.untie_embeddings_and_output_weights:
        state["output_layer.weight"] = w["lm_head.weight"]
    return FullModel(cfg, c["vocab_size"], state, source)


def _join_qkv(cfg: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q, k, v rows (head order) -> our per-query-group rows: each group's query heads, its key, its value."""
    groups, d = cfg.num_query_groups, cfg.kv_channels
    rest = q.shape[1:]
    parts = [q.reshape(groups, -1, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)]
    return torch.cat(parts, 1).reshape(-1, *rest)


def _from_gpt2(c: dict[str, Any], w: _Weights, source: str, log) -> FullModel:
    act = c.get("activation_function", "gelu_new")
    if act in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        log(f"> note: GPT-2's {act} (tanh approximation of GELU) runs as exact GELU here; logits differ slightly")
    elif act != "gelu":
        raise ConvertError(f"another architecture: GPT-2 with activation_function {act}")
    if c.get("scale_attn_by_inverse_layer_idx") or not c.get("scale_attn_weights", True):
        raise ConvertError("another architecture: GPT-2 with non-standard attention scaling")
    h, n_pos = c["n_embd"], c.get("n_positions", 1024)
    cfg = model_config(
        num_layers=c["n_layer"], hidden_size=h, ffn_hidden_size=c.get("n_inner") or 4 * h,
        num_attention_heads=c["n_head"], seq_length=n_pos, max_position_embeddings=n_pos,
        position_embedding_type="learned_absolute", normalization="LayerNorm",
        norm_epsilon=c.get("layer_norm_epsilon", 1e-5), hidden_dropout=c.get("resid_pdrop", 0.1),
        attention_dropout=c.get("attn_pdrop", 0.1),
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", True),
    )  # fmt: skip
    prefix = "transformer." if "transformer.wte.weight" in w else ""
    state = {
        "embedding.word_embeddings.weight": w[prefix + "wte.weight"],
        "embedding.position_embeddings.weight": w[prefix + "wpe.weight"],
    }
    for i in range(cfg.num_layers):
        src, dst = f"{prefix}h.{i}.", f"decoder.layers.{i}."
        for ours, theirs in (("self_attention.linear_qkv", "ln_1"), ("mlp.linear_fc1", "ln_2")):
            state[f"{dst}{ours}.layer_norm_weight"] = w[f"{src}{theirs}.weight"]
            state[f"{dst}{ours}.layer_norm_bias"] = w[f"{src}{theirs}.bias"]
        qkv, qkv_bias = w[src + "attn.c_attn.weight"].t(), w[src + "attn.c_attn.bias"]
        state[dst + "self_attention.linear_qkv.weight"] = _join_qkv(cfg, *qkv.chunk(3, 0))
        state[dst + "self_attention.linear_qkv.bias"] = _join_qkv(cfg, *qkv_bias.chunk(3, 0))
        for ours, theirs in (
            ("self_attention.linear_proj", "attn.c_proj"),
            ("mlp.linear_fc1", "mlp.c_fc"),
            ("mlp.linear_fc2", "mlp.c_proj"),
        ):
            state[f"{dst}{ours}.weight"] = w[f"{src}{theirs}.weight"].t().contiguous()
            state[f"{dst}{ours}.bias"] = w[f"{src}{theirs}.bias"]
    state["decoder.final_layernorm.weight"] = w[prefix + "ln_f.weight"]
    state["decoder.final_layernorm.bias"] = w[prefix + "ln_f.bias"]
    if cfg.untie_embeddings_and_output_weights:
        state["output_layer.weight"] = w["lm_head.weight"]
    return FullModel(cfg, c["vocab_size"], state, source)


def read_hf(folder: str | Path, true_vocab_size: int | None = None, log=print) -> FullModel:
    """A Hugging Face Llama or GPT-2 folder as a FullModel."""
    folder = Path(folder)
    if not (folder / "config.json").exists():
        raise ConvertError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        c = read_json(folder / "config.json")
    except ValueError as exc:
        raise ConvertError(f"{folder / 'config.json'} is not JSON ({first_line(exc)}): restore the file") from None
    if not isinstance(c, dict):
        raise ConvertError(f"{folder / 'config.json'} is not a JSON object: restore the file")
    architectures = c.get("architectures") or [""]
    if not (isinstance(architectures, list) and isinstance(architectures[0], str)):
        raise ConvertError(f"{folder / 'config.json'}: its architectures are not a list of names: restore the file")
    arch, kind = architectures[0], c.get("model_type")
    source = f"Hugging Face {arch or kind} {folder}"
    if kind == "llama" and arch in ("", "LlamaForCausalLM"):
        full = _from_llama(c, _Weights(folder), source)
    elif kind == "gpt2" and arch in ("", "GPT2LMHeadModel"):
        full = _from_gpt2(c, _Weights(folder), source, log)
    else:
        raise ConvertError(
            f"another architecture: {folder} holds {arch or kind}; this tool converts LlamaForCausalLM and"
            " GPT2LMHeadModel"
        )
    if true_vocab_size is not None and true_vocab_size != full.vocab_size:
        raise ConvertError(
            f"vocabulary mismatch: --true-vocab-size {true_vocab_size} but {folder} has vocab_size {full.vocab_size}"
        )
    if (folder / "tokenizer.json").exists():
        full.data = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(folder.absolute())}
    check_complete(full)
    return full
