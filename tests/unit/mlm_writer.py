"""Synthetic Megatron-LM checkpoints for the resume tests, written from a run of this project's (one process), laid out
as Megatron-LM lays them out (megatron/core/dist_checkpointing, megatron/core/optimizer/distrib_optimizer.py of
2026, TE layer spec names, which are this project's) at tensor-parallel size `tp`:

    dist_fully   torch_dist, common state in the DCP (`common_state`), optimizer `optimizer.state.<state>.<key>`
                 (--dist-ckpt-optim-fully-reshardable)
    dist_dp      torch_dist, common state in the DCP, the distributed optimizer's default `dp_reshardable` buckets
    dist_old     torch_dist of older Megatron-Core: common.pt, model-space optimizer state
    torch        --ckpt-format torch: mp_rank_TT/model_optim_rng.pt and distrib_optim.pt

The bucket layout is written with megatron/convert/mlm_optim.py's own `bucket_layout` (whose agreement with
Megatron-Core's is checked on the checkpoints Megatron-LM wrote, tests/assets/mlm_checkpoint and
/work/wt/mlm_fixtures); these fixtures test everything around it."""

from __future__ import annotations

import argparse
import io
import json
import math
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from megatron.convert.mlm_optim import bucket_layout, param_order
from megatron.convert.state import pad_vocab, split_tp

MLM_STATE = {"main": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def mlm_args(cfg, tp: int, vocab: int, iteration: int, consumed: int, **extra) -> argparse.Namespace:
    padded = -(-vocab // (128 * tp)) * 128 * tp
    args = argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, group_query_attention=True,
        num_query_groups=cfg.num_query_groups, kv_channels=cfg.kv_channels, seq_length=cfg.seq_length,
        max_position_embeddings=cfg.max_position_embeddings, position_embedding_type="rope",
        rotary_base=cfg.rotary_base, rotary_percent=1.0, normalization="RMSNorm", norm_epsilon=cfg.norm_epsilon,
        swiglu=True, add_bias_linear=False, untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        context_parallel_size=1, data_parallel_size=1, world_size=tp, padded_vocab_size=padded,
        tokenizer_type="NullTokenizer", vocab_size=vocab - 1, consumed_train_samples=consumed, train_iters=6,
        lr=1e-2, min_lr=0.0, lr_decay_style="linear", lr_warmup_iters=0, lr_decay_iters=None,
        lr_decay_samples=None, use_distributed_optimizer=True, overlap_grad_reduce=False, bf16=False, fp8=None,
    )  # fmt: skip
    vars(args).update(extra)
    return args


def _rng() -> dict:
    return {
        "random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": None, "rng_tracker_states": {},
    }  # fmt: skip


def _stack(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, layers = {}, {}
    for name, tensor in state.items():
        if name.startswith("decoder.layers."):
            layers.setdefault(name.split(".", 3)[3], []).append(tensor)
        else:
            out[name] = tensor
    out.update({f"decoder.layers.{rest}": torch.stack(t) for rest, t in layers.items()})
    return out


def _padded(state: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    return {k: pad_vocab(v, rows) if k.endswith("word_embeddings.weight") else v for k, v in state.items()}


def _flat(args, cfg, tp: int, t: int, states: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Rank t's flat distributed-optimizer buffer (one bucket): {param, exp_avg, exp_avg_sq}."""
    layout = bucket_layout(param_order(args, cfg, tp, 0, cfg.num_layers, False), 1, None, False)
    out = {}
    for kind, name in MLM_STATE.items():
        flat = torch.zeros(layout.unpadded[0])
        for param, _, start in layout.places:
            shard = split_tp(param.name, states[kind][param.name], cfg, tp)[t]
            flat[start : start + shard.numel()] = shard.reshape(-1)
        out[name] = flat
    return out


def write_mlm(root: Path, fmt: str, cfg, weights, states, step: int, args) -> None:
    """`weights`, `states` ({main, exp_avg, exp_avg_sq}: {name: tensor}): whole tensors by name (vocabulary not
    padded)."""
    tp, iteration, rows = args.tensor_model_parallel_size, 3, args.padded_vocab_size
    weights = _padded(weights, rows)
    states = {k: _padded(v, rows) for k, v in states.items()}
    scheduler = {"max_lr": args.lr, "min_lr": 0.0, "num_steps": args.consumed_train_samples, "lr_decay_style": "linear"}
    optimizer = {"optimizer": {"param_groups": [{"step": step, "lr": 0.01}, {"step": step, "lr": 0.01}]}}
    common = {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "opt_param_scheduler": scheduler}
    folder = root / f"iter_{iteration:07d}"
    folder.mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    if fmt == "torch":
        for t in range(tp):
            shard = folder / f"mp_rank_{t:02d}"
            shard.mkdir()
            model = {k: split_tp(k, v, cfg, tp)[t].clone() for k, v in weights.items()}
            torch.save(dict(common, model=model, optimizer=optimizer, rng_state=[_rng()]), shard / "model_optim_rng.pt")
            flat = _flat(args, cfg, tp, t, states)
            buffer = dict(flat, numel_unpadded=flat["param"].numel())
            torch.save(
                {"buckets_coalesced": True, 0: {(torch.float32, torch.float32): buffer}}, shard / "distrib_optim.pt"
            )
        return
    entries = dict(_stack(weights))
    entries["decoder.layers.self_attention.linear_qkv._extra_state/shard_0_4"] = io.BytesIO(b"te")
    for t in range(tp):
        entries[f"rng_state/shard_0.{t}_1.{tp}"] = [[_rng()]]
    if fmt == "dist_dp":
        for t in range(tp):
            prefix = f"optimizer.distributed.dp_group_idx_{t}"
            bucket = f"{prefix}.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0"
            entries.update({f"{bucket}.{k}": v for k, v in _flat(args, cfg, tp, t, states).items()})
            entries[f"{prefix}.optimizer/shard_0_1"] = [optimizer["optimizer"]]
    else:
        for kind, name in MLM_STATE.items():
            entries.update({f"optimizer.state.{name}.{k}": v for k, v in _stack(states[kind]).items()})
        common["optimizer"] = dict(optimizer, param_state_sharding_type="fully_reshardable")
    if fmt == "dist_old":
        torch.save(common, folder / "common.pt")
    else:
        entries["common_state/shard_0_1"] = [common]
    planner = dcp.DefaultSavePlanner(flatten_state_dict=False)
    dcp.save(entries, checkpoint_id=str(folder), planner=planner, no_dist=True)
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))


def by_name(model, optimizer) -> tuple[dict, dict, int]:
    """A one-process run's weights and optimizer states ({main, exp_avg, exp_avg_sq}) by parameter name, its step."""
    names = {id(p): n for n, p in model.named_parameters()}
    fp32 = optimizer.fp32_state()
    states = {kind: {} for kind in MLM_STATE}
    for i, (param, start, stop) in enumerate(optimizer.owned()):
        assert (start, stop) == (0, math.prod(param.shape))
        for kind in MLM_STATE:
            tensor = fp32["masters" if kind == "main" else kind][i]
            states[kind][names[id(param)]] = (param.detach() if tensor is None else tensor).float().reshape(param.shape)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    return weights, states, fp32["step"]
