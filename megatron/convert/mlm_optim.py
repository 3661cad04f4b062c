"""Megatron-LM's optimizer state (Adam: fp32 main params and both moments) as whole tensors by parameter name.

Where Megatron-LM keeps it:

    torch_dist, --dist-ckpt-optim-fully-reshardable (and any non-distributed optimizer):
        optimizer.state.{param|fp32_param, exp_avg, exp_avg_sq}.<weight key>   global form, like the weights
    torch_dist, distributed optimizer, default (`dp_reshardable`):
        optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<b>.dtype_<..>.bucket_idx_<k>.{param, exp_avg, exp_avg_sq}
            one flat tensor per gradient-buffer bucket of model-parallel rank g (tp_rank + tp * pp_rank)
    torch, distributed optimizer:
        mp_rank_TT[_PPP]/distrib_optim.pt: {<b>: {(param dtype, grad dtype): {param, exp_avg, exp_avg_sq, ...}}}
            one flat tensor per gradient buffer, its buckets one after another (bucket-end padding stripped)

The flat forms follow Megatron-Core's gradient buffer (DistributedOptimizer._compute_per_buffer_param_layout): the
rank's parameters in reverse module order, each starting at a multiple of 64 elements, buckets closed at
--ddp-bucket-size elements (only with --overlap-grad-reduce, first pipeline stage) and padded at the end to a
multiple of lcm(dp, 128) (x 2^16 with --ddp-pad-buckets-for-high-nccl-busbw). `param_order` rebuilds a rank's
module order from the model settings; the reader checks the result against the saved bucket sizes, and the caller
checks the main params against the weights, so a layout that is not Megatron-Core's stops with one line.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron.config import ModelConfig

from .state import ConvertError

STATE_KEYS = {"param": "main", "fp32_param": "main", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
"""Megatron-LM's optimizer state names -> this project's (checkpoint entries optimizer.<kind>.<name>)."""

NO_OPTIM = "add --no-load-optim (or --finetune) to start the optimizer afresh from the checkpoint's weights"


@dataclass
class Param:
    name: str
    """Megatron-Core name, layers numbered within the stage."""
    shape: tuple[int, ...]
    shared_embedding: bool = False


@dataclass
class Bucketed:
    """Where each parameter lies in a rank's gradient buffer: (name, bucket, start within the bucket)."""

    places: list[tuple[Param, int, int]] = field(default_factory=list)
    unpadded: list[int] = field(default_factory=list)
    """Each bucket's size without its end padding."""


def _arg(args: Any, name: str, default: Any = None) -> Any:
    value = getattr(args, name, default)
    return default if value is None else value


def param_order(args: Any, cfg: ModelConfig, tp: int, pp_rank: int, layers: int, local_spec: bool) -> list[Param]:
    """A Megatron-Core GPT rank's parameters in module order (`model.parameters()`), layers numbered within the
    stage: embedding, each layer (attention: linear_proj, linear_qkv, q/k norms; MLP: linear_fc1, linear_fc2; with
    the local spec the norms are modules of their own before each), final norm, output layer."""
    pp = _arg(args, "pipeline_model_parallel_size", 1)
    first, last = pp_rank == 0, pp_rank == pp - 1
    h, d, ffn = cfg.hidden_size, cfg.kv_channels, cfg.ffn_hidden_size
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups
    vocab = _arg(args, "padded_vocab_size")
    bias = ["weight", "bias"] if cfg.add_bias else ["weight"]
    norm = ["weight", "bias"] if cfg.normalization == "LayerNorm" else ["weight"]
    tied = not cfg.untie_embeddings_and_output_weights
    out: list[Param] = []
    if first:
        out.append(Param("embedding.word_embeddings.weight", (vocab // tp, h), tied and pp > 1))
        if cfg.position_embedding_type == "learned_absolute":
            out.append(Param("embedding.position_embeddings.weight", (cfg.max_position_embeddings, h)))
    for i in range(layers):
        p = f"decoder.layers.{i}."
        if local_spec:
            out += [Param(f"{p}input_layernorm.{n}", (h,)) for n in norm]
        out += [
            Param(f"{p}self_attention.linear_proj.{n}", (h, heads * d // tp) if n == "weight" else (h,)) for n in bias
        ]
        if not local_spec:
            out += [Param(f"{p}self_attention.linear_qkv.layer_norm_{n}", (h,)) for n in norm]
        rows = (heads + 2 * groups) * d // tp
        out += [Param(f"{p}self_attention.linear_qkv.{n}", (rows, h) if n == "weight" else (rows,)) for n in bias]
        if cfg.qk_layernorm:
            out += [Param(f"{p}self_attention.{q}_layernorm.{n}", (d,)) for q in "qk" for n in norm]
        if local_spec:
            out += [Param(f"{p}pre_mlp_layernorm.{n}", (h,)) for n in norm]
        else:
            out += [Param(f"{p}mlp.linear_fc1.layer_norm_{n}", (h,)) for n in norm]
        rows = ffn * (2 if cfg.swiglu else 1) // tp
        out += [Param(f"{p}mlp.linear_fc1.{n}", (rows, h) if n == "weight" else (rows,)) for n in bias]
        out += [Param(f"{p}mlp.linear_fc2.{n}", (h, ffn // tp) if n == "weight" else (h,)) for n in bias]
    if last:
        out += [Param(f"decoder.final_layernorm.{n}", (h,)) for n in norm]
        if not tied or pp > 1:  # a later stage's copy of tied embeddings is a parameter of its own
            out.append(Param("output_layer.weight", (vocab // tp, h), tied))
    return out


def bucket_layout(params: list[Param], dp: int, bucket_size: int | None, busbw_padding: bool) -> Bucketed:
    """Megatron-Core's distributed-optimizer buffer layout of `params` (module order)."""
    divisor = math.lcm(dp, 128, 2**16) if busbw_padding else math.lcm(dp, 128)
    layout = Bucketed()
    start = bucket_start = bucket = 0
    open_bucket = False
    end = 0

    def close(end: int) -> int:
        layout.unpadded.append(end - bucket_start)
        return -(-end // divisor) * divisor

    for param in params[::-1]:
        start = -(-start // 64) * 64
        if param.shared_embedding and open_bucket:
            bucket_start, bucket, open_bucket = close(start), bucket + 1, False
            start = bucket_start
        end = start + math.prod(param.shape)
        layout.places.append((param, bucket, start - bucket_start))
        open_bucket = True
        if (bucket_size is not None and end - bucket_start >= bucket_size) or param.shared_embedding:
            bucket_start, bucket, open_bucket = close(end), bucket + 1, False
            start = bucket_start
        else:
            start = end
    if open_bucket:
        close(end)
    return layout


def rank_layout(args: Any, cfg: ModelConfig, tp: int, pp_rank: int, layers: int, local_spec: bool) -> Bucketed:
    """The buffer layout of model-parallel rank (any tp rank, stage `pp_rank`) of the Megatron-LM run `args`."""
    pp, cp = _arg(args, "pipeline_model_parallel_size", 1), _arg(args, "context_parallel_size", 1)
    dp = _arg(args, "data_parallel_size", _arg(args, "world_size", 1) // (tp * pp * cp))
    bucket_size = None
    if _arg(args, "overlap_grad_reduce", False) and pp_rank == 0:
        bucket_size = _arg(args, "ddp_bucket_size", max(40000000, 1000000 * dp * cp))
    params = param_order(args, cfg, tp, pp_rank, layers, local_spec)
    return bucket_layout(params, dp * cp, bucket_size, bool(_arg(args, "ddp_pad_buckets_for_high_nccl_busbw")))


def split_buckets(
    layout: Bucketed, buckets: dict[int, dict[str, torch.Tensor]], where: str
) -> dict[str, dict[str, torch.Tensor]]:
    """{our kind: {Megatron-Core name: rank-local tensor}} from each bucket's flat states ({bucket: {state: flat}});
    one-line error when the saved sizes are not the layout's."""
    sizes = {b: {t.numel() for t in states.values()} for b, states in buckets.items()}
    want = dict(enumerate(layout.unpadded))
    got = {b: s.pop() if len(s) == 1 else s for b, s in sizes.items()}
    if got != want:
        raise ConvertError(
            f"{where}: the distributed optimizer's buckets hold {got} elements, the gradient buffer of this model"
            f" would hold {want}; its layout is not one this reader rebuilds: {NO_OPTIM}"
        )
    out: dict[str, dict[str, torch.Tensor]] = {}
    for param, bucket, start in layout.places:
        n = math.prod(param.shape)
        for key, flat in buckets[bucket].items():
            if key in STATE_KEYS:
                out.setdefault(STATE_KEYS[key], {})[param.name] = flat[start : start + n].view(param.shape)
    return out


_BUCKET = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_.*\.bucket_idx_(\d+)\.(\w+)$")


def dp_reshardable_keys(keys: list[str]) -> dict[int, dict[tuple[int, int], dict[str, str]]]:
    """The `dp_reshardable` entries by model-parallel rank: {g: {(buffer, bucket): {state: key}}}."""
    out: dict[int, dict[tuple[int, int], dict[str, str]]] = {}
    for key in keys:
        match = _BUCKET.match(key)
        if match:
            g, b, k, state = int(match[1]), int(match[2]), int(match[3]), match[4]
            out.setdefault(g, {}).setdefault((b, k), {})[state] = key
    return out


def coalesced_buckets(layout: Bucketed, flat: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """A legacy distrib_optim.pt buffer's flat states (buckets one after another, end padding stripped) cut into
    buckets."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    offset = 0
    for bucket, size in enumerate(layout.unpadded):
        out[bucket] = {k: v[offset : offset + size] for k, v in flat.items() if isinstance(v, torch.Tensor)}
        offset += size
    return out


def optimizer_step(optimizer_state: Any) -> int | None:
    """Adam's step count from Megatron-LM's (distributed) optimizer state dict (its param groups), if saved."""
    inner = optimizer_state.get("optimizer") if isinstance(optimizer_state, dict) else None
    groups = inner.get("param_groups") if isinstance(inner, dict) else None
    steps = {g.get("step") for g in groups or [] if isinstance(g, dict) and g.get("step") is not None}
    steps = {int(s.item()) if isinstance(s, torch.Tensor) else int(s) for s in steps}
    return steps.pop() if len(steps) == 1 else None
