"""Model and attention flags from Megatron-LM: --apply-layernorm-1p, --attention-softmax-in-fp32,
--apply-query-key-layer-scaling, --attention-backend, --qk-layernorm, --squared-relu and the accepted legacy ones."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from megatron.config import ConfigError, parse_args
from megatron.errors import UserError
from megatron.model import GPTModel, attention
from megatron.model.attention import (
    SDPA_BACKENDS,
    CoreAttention,
    explicit_attention,
    set_te_attention_env,
    te_attention_env,
)
from megatron.model.layers import LayerNormLinear, Norm, normalize
from megatron.training import Trainer

VOCAB = 64
SMALL = (
    "--mock-data --vocab-size 64 --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16"
    " --hidden-dropout 0 --attention-dropout 0 --transformer-impl local"
)
LLAMA = " --group-query-attention --num-query-groups 2 --position-embedding-type rope --normalization RMSNorm"


def cfg_of(flags: str = ""):
    return parse_args(f"{SMALL} {flags}".split())


def logits(flags: str, tokens: torch.Tensor, state: dict | None = None) -> torch.Tensor:
    torch.manual_seed(0)
    model = GPTModel(cfg_of(flags).model, VOCAB).eval()
    if state is not None:
        model.load_state_dict(state)
    with torch.no_grad():
        return model(tokens)


TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------- --apply-layernorm-1p


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_zero_centered_norm_is_the_plain_norm_with_weight_one_plus_w(kind):
    x, w, b = torch.randn(3, 5, 16), torch.randn(16) * 0.1, torch.randn(16)
    bias = b if kind == "LayerNorm" else None
    expected = normalize(x, 1 + w, bias, kind, 1e-5)
    torch.testing.assert_close(normalize(x, w, bias, kind, 1e-5, zero_centered=True), expected)
    norm = Norm(16, kind, 1e-5, zero_centered=True)
    assert torch.equal(norm.weight, torch.zeros(16))  # stored w starts at 0, i.e. gamma = 1
    torch.testing.assert_close(norm(x), normalize(x, torch.ones(16), norm.bias, kind, 1e-5))
    fused = LayerNormLinear(16, 8, True, 0.02, kind, 1e-5, zero_centered=True)
    with torch.no_grad():
        fused.layer_norm_weight.copy_(w)
    torch.testing.assert_close(
        fused(x), F.linear(normalize(x, 1 + w, fused.layer_norm_bias, kind, 1e-5), fused.weight, fused.bias)
    )


@pytest.mark.parametrize("arch", ["", LLAMA + " --qk-layernorm"])
def test_layernorm_1p_checkpoint_holds_w_and_matches_plain_model_with_one_plus_w(arch):
    torch.manual_seed(0)
    model = GPTModel(cfg_of(arch + " --apply-layernorm-1p").model, VOCAB)
    norm_keys = [k for k in model.state_dict() if k.endswith(("layer_norm_weight", "layernorm.weight"))]
    assert len(norm_keys) == 2 * 2 + 1 + (4 if "qk" in arch else 0)
    state = model.state_dict()
    for k in norm_keys:
        assert torch.equal(state[k], torch.zeros_like(state[k])), k  # Megatron's convention: w, not 1 + w
        state[k] = torch.randn_like(state[k]) * 0.1
    plain = {k: v + 1 if k in norm_keys else v for k, v in state.items()}
    torch.testing.assert_close(logits(arch + " --apply-layernorm-1p", TOKENS, state), logits(arch, TOKENS, plain))


def test_tiny_run_trains_with_layernorm_1p_qk_layernorm_and_squared_relu():
    flags = (
        f"{SMALL}{LLAMA} --apply-layernorm-1p --qk-layernorm --squared-relu --attention-backend unfused"
        " --micro-batch-size 4 --global-batch-size 4 --lr 1e-2 --train-iters 12 --eval-iters 0 --log-interval 100"
    )
    state = Trainer(parse_args(flags.split())).train()
    assert state.losses[12] < state.losses[1] - 0.3, state.losses


# ---------------------------------------------------------------- --qk-layernorm, --squared-relu


def test_qk_layernorm_normalizes_each_query_and_key_head():
    torch.manual_seed(0)
    model = GPTModel(cfg_of(LLAMA + " --qk-layernorm").model, VOCAB)
    attn = model.decoder.layers[0].self_attention
    seen, raw = {}, {}
    attn.q_layernorm.register_forward_pre_hook(lambda m, args: raw.update(q=args[0]))
    attn.core_attention.register_forward_pre_hook(lambda m, args: seen.update(q=args[0], k=args[1]))
    model(TOKENS)
    assert float(raw["q"].detach().pow(2).mean()) < 0.1  # what the norm gets: projections of std ~0.02 weights
    for name, heads in (("q", 4), ("k", 2)):
        t = seen[name]  # [b, heads, s, hn], after RoPE, which keeps each head's norm
        assert t.shape[1] == heads
        torch.testing.assert_close(t.pow(2).mean(-1), torch.ones(t.shape[:-1]), rtol=0, atol=1e-2)  # eps 1e-5
    assert {"q_layernorm.weight", "k_layernorm.weight"} <= {n for n, _ in attn.named_parameters()}


def test_squared_relu_mlp():
    cfg = cfg_of("--squared-relu").model
    torch.manual_seed(0)
    mlp = GPTModel(cfg, VOCAB).decoder.layers[0].mlp
    x = torch.randn(4, 2, 32)
    h = mlp.linear_fc1(x)
    torch.testing.assert_close(mlp(x), mlp.linear_fc2(torch.relu(h) ** 2))
    with pytest.raises(ConfigError, match="--squared-relu and --swiglu"):
        cfg_of("--squared-relu --swiglu")


def test_legacy_and_accepted_flags():
    cfg = cfg_of("--use-rotary-position-embeddings --no-rope-fusion --no-masked-softmax-fusion --no-persist-layer-norm")
    assert cfg.model.position_embedding_type == "rope" and not cfg.model.apply_rope_fusion
    assert not cfg.model.masked_softmax_fusion and cfg.model.no_persist_layer_norm
    defaults = cfg_of().model
    assert defaults.apply_rope_fusion and defaults.masked_softmax_fusion and defaults.attention_backend == "auto"
    assert not defaults.attention_softmax_in_fp32 and not defaults.apply_query_key_layer_scaling


# ---------------------------------------------------------------- softmax in fp32, query-key layer scaling


def qkv(dtype=torch.float32, scale=1.0, heads=4, groups=2, s=16, hn=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, s, hn, generator=g) * scale
    k, v = (torch.randn(2, groups, s, hn, generator=g) * scale for _ in "kv")
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("layer_scale", [None, 3])
def test_explicit_attention_equals_sdpa(masked, layer_scale):
    q, k, v = qkv()
    mask = None
    if masked:  # two documents in one sample, as --reset-attention-mask builds it
        mask = torch.ones(16, 16, dtype=torch.bool).tril()
        mask[8:, :8] = False
        mask = mask.expand(2, 1, 16, 16)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    got = explicit_attention(q, k, v, mask, softmax_in_fp32=True, layer_scale=layer_scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_softmax_runs_in_fp32_only_when_asked(monkeypatch):
    dtypes = []
    softmax = torch.softmax
    monkeypatch.setattr(torch, "softmax", lambda x, dim: dtypes.append(x.dtype) or softmax(x, dim))
    q, k, v = qkv(torch.bfloat16)
    for fp32 in (False, True):
        out = explicit_attention(q, k, v, None, softmax_in_fp32=fp32)
        assert out.dtype == torch.bfloat16
    assert dtypes == [torch.bfloat16, torch.float32]


def test_query_key_layer_scaling_keeps_fp16_scores_in_range():
    # Scores around 1e5 overflow fp16 (max 65504) unless the GEMM produces them divided by the layer number.
    q, k, v = qkv(scale=150.0, hn=64)  # scores q.k/8 with a standard deviation of about 22500
    reference = explicit_attention(q.double(), k.double(), v.double(), None)
    half = [t.half() for t in (q, k, v)]
    overflowed = explicit_attention(*half, None, softmax_in_fp32=True)
    assert not torch.isfinite(overflowed).all()
    scaled = explicit_attention(*half, None, softmax_in_fp32=True, layer_scale=8)
    assert torch.isfinite(scaled).all()
    assert float((scaled.double() - reference).abs().mean()) < 0.01 * float(v.abs().max())


def test_query_key_layer_scaling_implies_softmax_in_fp32_and_uses_the_layer_number():
    cfg = cfg_of("--apply-query-key-layer-scaling")
    assert cfg.model.attention_softmax_in_fp32
    assert CoreAttention(cfg.model, layer_number=3).layer_scale == 3
    assert CoreAttention(cfg_of().model, layer_number=3).layer_scale is None


# ---------------------------------------------------------------- --attention-backend


@pytest.mark.parametrize("backend", ["flash", "fused", "unfused", "local"])
def test_attention_backends_match_auto_on_cpu(backend):
    flags = LLAMA + " --apply-query-key-layer-scaling"
    torch.testing.assert_close(
        logits(f"{flags} --attention-backend {backend}", TOKENS), logits(flags, TOKENS), rtol=1e-4, atol=1e-4
    )


def test_backend_that_cannot_run_fails_in_one_line(monkeypatch):
    # CUDA's memory-efficient kernel is not built for CPUs: a backend allowing only it has no kernel here
    monkeypatch.setitem(SDPA_BACKENDS, "flash", [SDPBackend.EFFICIENT_ATTENTION])
    module = CoreAttention(cfg_of().model, 1, backend="flash")
    with pytest.raises(UserError, match="--attention-backend flash: PyTorch has no flash attention kernel") as err:
        module(*qkv(), None)
    assert "\n" not in str(err.value)


def test_te_backend_environment_follows_megatron(monkeypatch):
    assert te_attention_env("auto") == {"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "1"}
    assert te_attention_env("fused") == {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "0"}
    assert te_attention_env("flash") == {"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"}
    assert te_attention_env("unfused") == {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "1"}
    assert set(te_attention_env("local").values()) == {"0"}
    monkeypatch.setattr(attention, "_SET_BY_US", {})
    env = {}
    set_te_attention_env("fused", env)
    assert env == te_attention_env("fused")
    set_te_attention_env("unfused", env)  # values this process set may change with the next model
    assert env == te_attention_env("unfused")
    monkeypatch.setattr(attention, "_SET_BY_US", {})  # from here on, values the user set
    user = {"NVTE_FLASH_ATTN": "0"}
    set_te_attention_env("fused", user)  # agrees with the user's setting
    with pytest.raises(UserError, match="--attention-backend flash needs NVTE_FLASH_ATTN=1 .* has NVTE_FLASH_ATTN=0"):
        set_te_attention_env("flash", {"NVTE_FLASH_ATTN": "0"})


def test_attention_scale_is_one_over_sqrt_head_dim():
    q, k, v = qkv(s=2, hn=16)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) / math.sqrt(16)
    probs = torch.softmax(scores.masked_fill(~torch.ones(2, 2, dtype=torch.bool).tril(), float("-inf")), -1)
    torch.testing.assert_close(explicit_attention(q, k, v, None), probs @ v.repeat_interleave(2, 1))
