"""The fused RoPE kernel on the packed QKV output (megatron/model/rope_kernel.py) against Transformer Engine's fused QKV
kernel, the unfused `apply_rotary` and an fp64 rotation, forward and backward, for llama-1b's and Llama-3-8B's
shapes, --rotary-percent < 1 and per-rank head counts of tensor parallelism; CUDA-graph capture; and the layers of
both engines taking it when they should.

On a CUDA GPU: `python3 -m pytest -q -x tests/gpu/test_rope_kernel.py`. The fp32 tests also run on the CPU under
Triton's interpreter, on short sequences: `TRITON_INTERPRET=1 pytest --noconftest tests/gpu/test_rope_kernel.py`
(tests/conftest.py skips tests/gpu on machines without CUDA; the interpreter's bf16 casts round wrongly, so the bf16
tests need the GPU).
"""

from __future__ import annotations

import re

import pytest
import torch

from megatron.model import rope_kernel
from megatron.model.layers import RotaryEmbedding, apply_rotary
from megatron.model.te_attention import te_qkv_rope
from tests.gpu.marks import INTERPRET, NEEDS_TE_KERNELS, TRITON_KERNEL

DEVICE = torch.device("cpu" if INTERPRET else "cuda")

pytestmark = TRITON_KERNEL
on_gpu = pytest.mark.skipif(INTERPRET, reason="bf16 and TE need the GPU (the interpreter's bf16 casts round wrongly)")


# name: (s, b, query heads, groups, head size, rotary percent) on one rank
SHAPES = {
    "llama-1b": (4096, 2, 32, 8, 64, 1.0),
    "llama3-8b": (8192, 1, 32, 8, 128, 1.0),
    "8b-tp2": (8192, 1, 16, 4, 128, 1.0),
    "8b-tp8": (8192, 1, 4, 1, 128, 1.0),
    "1b-rotary-half": (4096, 2, 32, 8, 64, 0.5),
    "8b-rotary-half": (2048, 2, 32, 8, 128, 0.5),
    "mha-hn80": (1024, 3, 12, 12, 80, 1.0),  # one query head per group, head size not a power of two
    "3-per-group-hn96": (512, 2, 12, 4, 96, 0.25),
    "128-heads": (256, 2, 128, 8, 128, 1.0),  # more query heads than one tile holds: blocks of heads
}


def shape_of(name: str) -> tuple[int, int, int, int, int, float]:
    s, b, heads, groups, hn, percent = SHAPES[name]
    return (min(s, 5) if INTERPRET else s), b, heads, groups, hn, percent


def make(
    name: str, dtype: torch.dtype, seed: int = 0, any_angles: bool = False
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(packed QKV output, the model's angles, heads per group) for a shape; the angles cover the whole sequence
    (positions up to 8191: the sines of thousands of radians must be right). any_angles: random angles in
    [0, s) for every channel instead, the two halves different (TE's kernel takes such angles; the model's repeat
    the first half)."""
    s, b, heads, groups, hn, percent = shape_of(name)
    g = torch.Generator().manual_seed(seed)
    packed = torch.randn(s, b, groups, (heads // groups + 2) * hn, generator=g).to(DEVICE, dtype)
    angles = RotaryEmbedding(int(hn * percent), 10000).to(DEVICE)(s)
    if any_angles:
        angles = (torch.rand(angles.shape, generator=g) * s).to(DEVICE)
    return packed, angles, heads // groups


def split(packed: torch.Tensor, per_group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [s, b, np, hn] (a copy), k and v (views) of the packed QKV output, as the layers split it."""
    s, b, groups, width = packed.shape
    hn = width // (per_group + 2)
    q, k, v = packed.split([per_group * hn, hn, hn], dim=-1)
    return q.reshape(s, b, groups * per_group, hn), k, v


def split_unfused(packed: torch.Tensor, angles: torch.Tensor, per_group: int):
    """The unfused path of the layers: `apply_rotary` on q and k."""
    q, k, v = split(packed, per_group)
    return apply_rotary(q, angles), apply_rotary(k, angles), v


def exact(packed: torch.Tensor, angles: torch.Tensor, per_group: int):
    """The rotation in fp64 of the fp32 angles, and per element of q and k the magnitude |x_i| + |x_pair(i)| it mixes
    (pass-through channels: |x_i|), for error bounds."""
    d = angles.shape[-1]

    def magnitude(a: torch.Tensor) -> torch.Tensor:
        rot = a[..., :d]
        return torch.cat([rot + torch.cat([rot[..., d // 2 :], rot[..., : d // 2]], -1), a[..., d:]], -1)

    xq, xk, _ = split(packed.double().abs(), per_group)
    return split_unfused(packed.double(), angles.double(), per_group), (magnitude(xq), magnitude(xk))


def grads_of(fn, packed: torch.Tensor, angles: torch.Tensor, per_group: int, seed: int = 1):
    """(q, k, v), random gradients for them and the packed gradient they give."""
    packed = packed.detach().requires_grad_()
    out = fn(packed, angles, per_group)
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(t.shape, generator=g).to(DEVICE, t.dtype) for t in out]
    (grad,) = torch.autograd.grad(out, packed, grads)
    return [t.detach() for t in out], grads, grad


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at |x| (8 significant bits), as fp64."""
    _, exponent = torch.frexp(x.double().abs())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), exponent - 8)


def assert_within_ulps(
    got: torch.Tensor,
    want: torch.Tensor,
    what: str,
    ulps: float = 1,
    fraction: float = 1e-3,
    magnitude: torch.Tensor | None = None,
):
    """Every element within `ulps` bf16 ulps and at most `fraction` of them different at all. `magnitude`: of the
    terms each element sums (|x_i cos| + |x_pair sin| <= |x_i| + |x_pair|), whose ulp bounds the difference instead
    where the sum cancels: two roundings of the same fp32 math (fma contracted or not) differ by fp32 ulps of the
    terms, which are many bf16 ulps of a result near zero (on the H100, 46 at 1e-5 of llama-1b's q elements)."""
    diff = (got.double() - want.double()).abs()
    scale = torch.maximum(got.double().abs(), want.double().abs())
    if magnitude is not None:
        scale = torch.maximum(scale, magnitude.double())
    limit = ulps * bf16_ulp(scale)
    worst = float((diff / limit).max())
    differ = float((diff > 0).double().mean())
    assert worst <= 1 and differ <= fraction, f"{what}: worst {worst * ulps:.2f} ulp, {differ:.2e} of elements differ"


# --------------------------------------------------------------------------------------------------------------------
# fp32: against the unfused rotation and fp64 (also under the interpreter)
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SHAPES)
def test_fp32_forward_matches_the_unfused_rotation_and_fp64(name):
    packed, angles, per_group = make(name, torch.float32)
    q, k, v = rope_kernel.fused_qkv_rope(packed, angles, per_group)
    assert all(t.is_contiguous() for t in (q, k, v))
    uq, uk, uv = split_unfused(packed, angles, per_group)
    assert torch.equal(v, uv)  # a copy
    (eq, ek, _), (mq, mk) = exact(packed, angles, per_group)
    rot = angles.shape[-1]
    for got, unfused, want, mag, what in ((q, uq, eq, mq, "q"), (k, uk, ek, mk, "k")):
        assert got.shape == unfused.shape
        # fp32 math: cos / sin within an ulp, a product, an fma (or an add): a few fp32 ulps of the magnitudes
        err = (got.double() - want).abs()
        assert float((err - 2**-21 * mag).max()) <= 0, f"{what}: {float((err / mag).max()):.3g} relative error"
        torch.testing.assert_close(got, unfused, rtol=2e-6, atol=2e-6 * float(mag.max()), msg=what)
        assert torch.equal(got[..., rot:], unfused[..., rot:]), f"{what}: pass-through channels changed"


@pytest.mark.parametrize("name", SHAPES)
def test_fp32_backward_is_the_unfused_gradient(name):
    packed, angles, per_group = make(name, torch.float32)
    out, grads, grad = grads_of(rope_kernel.fused_qkv_rope, packed, angles, per_group)
    _, _, unfused = grads_of(split_unfused, packed, angles, per_group)
    assert grad.shape == packed.shape and grad.is_contiguous()
    torch.testing.assert_close(grad, unfused, rtol=2e-6, atol=1e-5)
    # the transpose: <R x, g> = <x, R^T g>
    lhs = sum(float((o.double() * gr.double()).sum()) for o, gr in zip(out, grads))
    rhs = float((packed.double() * grad.double()).sum())
    assert abs(lhs - rhs) <= 1e-5 * sum(float(gr.double().abs().sum()) for gr in grads)


@pytest.mark.parametrize("name", ["llama-1b", "3-per-group-hn96"])
def test_fp32_angles_that_differ_between_the_halves(name):
    """Each channel its own angle, as TE's kernel and `apply_rotary` take them: the backward pairs channel i with
    the sine of channel i + d/2's angle (and i + d/2 with -sin of i's)."""
    packed, angles, per_group = make(name, torch.float32, any_angles=True)
    out, _, grad = grads_of(rope_kernel.fused_qkv_rope, packed, angles, per_group)
    want, _, want_grad = grads_of(split_unfused, packed, angles, per_group)
    for got, w in zip(out, want):
        torch.testing.assert_close(got, w, rtol=2e-6, atol=2e-5)
    torch.testing.assert_close(grad, want_grad, rtol=2e-6, atol=2e-5)


def test_non_contiguous_output_gradients():
    """The local attention's gradients reach RoPE through permutes: strided, read as they are."""
    packed, angles, per_group = make("3-per-group-hn96", torch.float32)
    q, k, v = rope_kernel.qkv_rope_forward(packed, angles, per_group)
    dq, dk, dv = (torch.randn(t.shape[1], t.shape[2], t.shape[0], t.shape[3]).to(DEVICE) for t in (q, k, v))
    strided = [t.permute(2, 0, 1, 3) for t in (dq, dk, dv)]
    assert not strided[0].is_contiguous()
    got = rope_kernel.qkv_rope_backward(*strided, angles)
    want = rope_kernel.qkv_rope_backward(*(t.contiguous() for t in strided), angles)
    assert torch.equal(got, want)


def test_angles_longer_than_the_sequence_and_empty_inputs():
    packed, angles, per_group = make("mha-hn80", torch.float32)
    longer = RotaryEmbedding(angles.shape[-1], 10000).to(DEVICE)(packed.shape[0] + 7)
    for got, want in zip(
        rope_kernel.fused_qkv_rope(packed, longer, per_group), split_unfused(packed, angles, per_group)
    ):
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-5)
    empty = packed[:0]
    assert [t.shape[0] for t in rope_kernel.qkv_rope_forward(empty, angles, per_group)] == [0, 0, 0]
    with pytest.raises(ValueError, match=r"the kernel takes \[s2 >= "):
        rope_kernel.fused_qkv_rope(packed, angles[:2], per_group)


# --------------------------------------------------------------------------------------------------------------------
# bf16 on the GPU: against TE's fused kernel and fp64
# --------------------------------------------------------------------------------------------------------------------


@on_gpu
@NEEDS_TE_KERNELS
@pytest.mark.parametrize("name, any_angles", [(name, False) for name in SHAPES] + [("8b-rotary-half", True)])
def test_bf16_forward_and_backward_match_te(name, any_angles):
    packed, angles, per_group = make(name, torch.bfloat16, any_angles=any_angles)
    (q, k, v), _, grad = grads_of(rope_kernel.fused_qkv_rope, packed, angles, per_group)
    (tq, tk, tv), grads, te_grad = grads_of(te_qkv_rope, packed, angles, per_group)
    assert torch.equal(v, tv)
    # the same fp32 math rounded once; only the compilers' fma contraction may differ
    _, (mq, mk) = exact(packed, angles, per_group)
    assert_within_ulps(q, tq, "q", magnitude=mq)
    assert_within_ulps(k, tk, "k", magnitude=mk)
    assert_within_ulps(grad, te_grad, "packed gradient", magnitude=gradient_magnitude(grads, angles, per_group))


def gradient_magnitude(grads: list[torch.Tensor], angles: torch.Tensor, per_group: int) -> torch.Tensor:
    """Per element of the packed gradient, the magnitude of the terms its transposed rotation sums: |g_i| +
    |g_pair(i)| of q's and k's output gradients (pass-through channels and v: |g_i|), in the packed layout."""
    d = angles.shape[-1]

    def magnitude(a: torch.Tensor) -> torch.Tensor:
        a = a.double().abs()
        rot = a[..., :d]
        return torch.cat([rot + torch.cat([rot[..., d // 2 :], rot[..., : d // 2]], -1), a[..., d:]], -1)

    gq, gk, gv = grads
    s, b, groups = gk.shape[:3]
    q = magnitude(gq).reshape(s, b, groups, -1)
    return torch.cat([q, magnitude(gk), gv.double().abs()], dim=-1)


@on_gpu
@pytest.mark.parametrize("name", ["llama-1b", "llama3-8b"])
@pytest.mark.parametrize("backward", [False, True])
def test_data_moves_in_16_byte_vectors(name, backward):
    """What makes the kernel memory-bound: every bf16 element is read and written as part of a 16-byte vector (TE's
    kernel moves them one by one), so the PTX stores only st.global.v4 and loads no 2-byte scalars."""
    packed, angles, per_group = make(name, torch.bfloat16)
    q, k, v = rope_kernel.qkv_rope_forward(packed, angles, per_group)
    compiled = rope_kernel.launch(packed, q, k, v, angles, backward, {})
    ptx = compiled.asm["ptx"]
    stores = set(re.findall(r"st\.global[.\w]*", ptx))
    loads = set(re.findall(r"ld\.global[.\w]*", ptx))
    assert stores == {"st.global.v4.b32"}, stores
    assert "ld.global.v4.b32" in loads and not {op for op in loads if op.endswith("b16")}, loads


@on_gpu
@pytest.mark.parametrize("name", SHAPES)
def test_bf16_is_the_fp32_rotation_rounded_once(name):
    packed, angles, per_group = make(name, torch.bfloat16)
    q, k, v = rope_kernel.fused_qkv_rope(packed, angles, per_group)
    (eq, ek, ev), (mq, mk) = exact(packed, angles, per_group)
    assert torch.equal(v.double(), ev)
    for got, want, mag, what in ((q, eq, mq, "q"), (k, ek, mk, "k")):
        err = (got.double() - want).abs()
        # half an ulp of the rounding, plus the fp32 error before it
        assert float((err - 0.5 * bf16_ulp(want) - 2**-21 * mag).max()) <= 0, what


@on_gpu
def test_cuda_graph_capture_and_replay():
    """The TE layers run under CUDA graphs: forward and backward (the cos/sin table included) captured once, then
    replayed on new data, give what eager calls give."""
    packed, angles, per_group = make("llama-1b", torch.bfloat16)
    static = packed.clone().requires_grad_()
    grads = [torch.randn_like(t) for t in rope_kernel.qkv_rope_forward(packed, angles, per_group)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles) outside the capture
        torch.autograd.grad(rope_kernel.fused_qkv_rope(static, angles, per_group), static, grads)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rope_kernel.fused_qkv_rope(static, angles, per_group)
        (grad,) = torch.autograd.grad(out, static, grads)
    fresh = make("llama-1b", torch.bfloat16, seed=5)[0].requires_grad_()
    with torch.no_grad():
        static.copy_(fresh)
    graph.replay()
    want = rope_kernel.fused_qkv_rope(fresh, angles, per_group)
    (want_grad,) = torch.autograd.grad(want, fresh, grads)
    assert all(torch.equal(got, w) for got, w in zip(out, want)) and torch.equal(grad, want_grad)


# --------------------------------------------------------------------------------------------------------------------
# The layers: which path they take, and the model's output with it
# --------------------------------------------------------------------------------------------------------------------

VOCAB = 256
FLAGS = (
    "--mock-data --vocab-size 256 --num-layers 2 --hidden-size 256 --num-attention-heads 8 --group-query-attention"
    " --num-query-groups 2 --seq-length 64 --position-embedding-type rope --normalization RMSNorm --swiglu"
    " --hidden-dropout 0 --attention-dropout 0 --micro-batch-size 2 --rotary-percent 0.5"
)


def model_output(impl: str, extra: str, monkeypatch, position_ids: bool = False) -> tuple[torch.Tensor, int]:
    """Logits of a small model and how many times the layers called the kernel."""
    from megatron.config import parse_args
    from megatron.model import GPTModel, te_attention, transformer

    calls = []

    def counted(*args):
        calls.append(1)
        return rope_kernel.fused_qkv_rope(*args)

    monkeypatch.setattr(transformer, "fused_qkv_rope", counted)
    monkeypatch.setattr(te_attention, "fused_qkv_rope", counted)
    cfg = parse_args(f"{FLAGS} --transformer-impl {impl} {extra}".split(), device_type="cuda")
    torch.manual_seed(0)
    model = GPTModel(cfg.model, VOCAB, precision=cfg.precision).to("cuda", torch.bfloat16)
    tokens = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1)).cuda()
    ids = torch.stack([torch.arange(64), torch.arange(64).flip(0)]).cuda() if position_ids else None
    logits = model(tokens, position_ids=ids).float()
    logits.sum().backward()
    return logits.detach(), len(calls)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@on_gpu
@pytest.mark.parametrize(
    "impl",
    ["local", pytest.param("transformer_engine", marks=NEEDS_TE_KERNELS)],
)
def test_layers_take_the_kernel_unless_told_or_per_sample(impl, monkeypatch):
    fused, calls = model_output(impl, "", monkeypatch)
    assert calls == 2  # one per layer
    unfused, calls = model_output(impl, "--no-rope-fusion", monkeypatch)
    assert calls == 0 and rel_err(fused, unfused) < 2e-2  # the same rotation, rounded once instead of per op
    _, calls = model_output(impl, "", monkeypatch, position_ids=True)
    assert calls == 0  # per-sample positions: [s, b, 1, d] angles, unfused
    _, calls = model_output(impl, "--qk-layernorm", monkeypatch)
    assert calls == 0  # the norms see q and k before RoPE


@on_gpu
@NEEDS_TE_KERNELS
def test_te_layer_falls_back_to_tes_kernel_without_triton(monkeypatch):
    """Where Triton is missing the TE layer keeps TE's fused kernel (and the local layer the unfused ops): the
    same logits as with this kernel up to bf16 rounding."""
    with_kernel, _ = model_output("transformer_engine", "", monkeypatch)
    monkeypatch.setattr(rope_kernel, "available", lambda: False)
    with_te, calls = model_output("transformer_engine", "", monkeypatch)
    assert calls == 0 and rel_err(with_kernel, with_te) < 2e-3
