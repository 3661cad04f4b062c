"""Model shapes, parameter names (Transformer Engine's), and parameter counts against closed forms."""

import pytest
import torch

from megatron.config import parse_args
from megatron.model import GPTModel, count_parameters

GPT2 = "--num-layers 3 --hidden-size 64 --num-attention-heads 4 --seq-length 32"
LLAMA = (
    "--num-layers 3 --hidden-size 64 --num-attention-heads 8 --group-query-attention --num-query-groups 2"
    " --ffn-hidden-size 160 --seq-length 32 --position-embedding-type rope --normalization RMSNorm --swiglu"
    " --disable-bias-linear --untie-embeddings-and-output-weights"
)


def build(flags: str, vocab: int = 128) -> GPTModel:
    cfg = parse_args(f"--mock-data --vocab-size {vocab} {flags}".split())
    torch.manual_seed(0)
    return GPTModel(cfg.model, vocab)


def test_gpt2_parameter_count_closed_form():
    model = build(GPT2)
    v, h, layers, s, f = 128, 64, 3, 32, 256
    norm = 2 * h  # LayerNorm weight and bias, fused into linear_qkv / linear_fc1
    qkv = h * 3 * h + 3 * h
    proj = h * h + h
    mlp = (h * f + f) + (f * h + h)
    per_layer = norm + qkv + proj + norm + mlp
    expected = v * h + s * h + layers * per_layer + 2 * h  # tied output layer adds nothing
    assert count_parameters(model) == expected


def test_llama_parameter_count_closed_form():
    model = build(LLAMA)
    v, h, layers, f, hn, heads, groups = 128, 64, 3, 160, 8, 8, 2
    per_layer = h + h * (heads + 2 * groups) * hn + heads * hn * h + h + h * 2 * f + f * h
    expected = v * h + layers * per_layer + h + v * h  # untied output layer
    assert count_parameters(model) == expected


def test_state_dict_uses_transformer_engine_names():
    keys = set(build(GPT2).state_dict())
    for name in (
        "embedding.word_embeddings.weight",
        "embedding.position_embeddings.weight",
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_bias",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.self_attention.linear_proj.bias",
        "decoder.layers.2.mlp.linear_fc1.layer_norm_weight",
        "decoder.layers.2.mlp.linear_fc2.weight",
        "decoder.final_layernorm.bias",
    ):
        assert name in keys, name
    assert "output_layer.weight" not in keys
    llama = set(build(LLAMA).state_dict())
    assert "output_layer.weight" in llama and "decoder.final_layernorm.bias" not in llama
    assert not any(k.endswith(".bias") or k.endswith("layer_norm_bias") for k in llama)


@pytest.mark.parametrize("flags", [GPT2, LLAMA])
def test_forward_shapes_and_initial_loss(flags):
    model = build(flags)
    tokens = torch.randint(0, 128, (2, 32))
    assert model(tokens).shape == (2, 32, 128)
    loss = model(tokens, labels=torch.randint(0, 128, (2, 32)))
    assert loss.shape == (2, 32)
    assert abs(loss.mean().item() - torch.log(torch.tensor(128.0)).item()) < 0.5  # near-uniform at init


def test_untied_output_layer_runs_as_a_module():
    """FSDP shards the final norm and the output layer as one unit and runs its forward and pre-backward logic only
    for modules whose forward ran (torch 2.11 warns at every step otherwise): the logits come from its forward."""
    model = build(LLAMA)
    calls = []
    model.output_layer.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    model(torch.randint(0, 128, (2, 32)), labels=torch.randint(0, 128, (2, 32)))
    assert calls == [(32, 2, 128)]


def test_attention_is_causal():
    model = build(LLAMA).eval()
    tokens = torch.randint(0, 128, (1, 32))
    changed = tokens.clone()
    changed[0, 20:] = (changed[0, 20:] + 1) % 128
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_gqa_matches_explicit_head_repetition():
    """Grouped-query attention equals multi-head attention with each K/V head repeated over its query heads."""
    model = build(LLAMA).eval()
    attn = model.decoder.layers[0].self_attention
    x = torch.randn(16, 2, 64)
    with torch.no_grad():
        out = attn(x, None, None)
        s, b = 16, 2
        mixed = attn.linear_qkv(x).view(s, b, 2, (4 + 2) * 8)
        q, k, v = mixed.split([32, 8, 8], dim=-1)
        q = q.reshape(s, b, 8, 8).permute(1, 2, 0, 3)
        k = k.repeat_interleave(4, dim=2).permute(1, 2, 0, 3)
        v = v.repeat_interleave(4, dim=2).permute(1, 2, 0, 3)
        scores = (q @ k.transpose(-1, -2)) / 8**0.5
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        ref = (scores.softmax(-1) @ v).permute(2, 0, 1, 3).reshape(s, b, 64)
        ref = attn.linear_proj(ref)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_rope_is_relative():
    """Rotary embeddings make q.k depend only on the distance between positions."""
    from megatron.model.layers import RotaryEmbedding, apply_rotary

    rope = RotaryEmbedding(8, 10000)
    angles = rope(16)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    rotated_q = apply_rotary(q.expand(16, 1, 1, 8), angles)
    rotated_k = apply_rotary(k.expand(16, 1, 1, 8), angles)
    dot = lambda i, j: (rotated_q[i] * rotated_k[j]).sum()
    torch.testing.assert_close(dot(5, 2), dot(12, 9))
    torch.testing.assert_close(dot(3, 3), (q * k).sum())


def test_given_position_ids_are_used_when_the_batch_shares_them():
    """--reset-position-ids: a micro-batch whose samples share their ids (micro-batch size 1, say) rotates by those
    ids, as the same sample does beside another with other ids (the per-sample angles)."""
    model = build(LLAMA).eval()
    tokens = torch.randint(0, 128, (2, 32))
    reset = torch.cat([torch.arange(12), torch.arange(20)])  # a document boundary at 12
    ids = torch.stack([reset, torch.arange(32)])
    with torch.no_grad():
        both = model(tokens, position_ids=ids)  # per-sample angles
        alone = model(tokens[:1], position_ids=ids[:1])  # the batch shares its ids
        default = model(tokens[:1])
    torch.testing.assert_close(alone, both[:1])
    assert not torch.allclose(alone, default)  # the ids were not ignored
