"""The fused Smooth-SwiGLU kernels (megatron/model/swiglu_kernel.py) against the composed path they replace: TE's
SwiGLU in bf16, times s, TE's delayed-scaling cast; backward, TE's dSwiGLU of g * s writing FP8 with its transpose.
Forward and backward, FP8 and bf16 outputs, the per-channel and the quantizer's amaxes (NaN kept), shapes that do
not fill a tile, and the TE MLP taking the kernels under delayed scaling only.

On a CUDA GPU with Transformer Engine: `python3 -m pytest -q tests/gpu/test_swiglu_kernel.py`.
"""

from __future__ import annotations

import pytest
import torch

from megatron.model import swiglu_kernel
from tests.gpu.marks import NEEDS_TE_KERNELS, TRITON_KERNEL

pytestmark = [*TRITON_KERNEL, NEEDS_TE_KERNELS]

# (tokens, ffn channels): llama-1b's micro-batch, and shapes that leave partial tiles in both dimensions
SHAPES = [(8192, 8192), (1000, 200), (77, 1100)]


def quantizer(fp8: str, scale: float, columnwise: bool):
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    dtype = tex.DType.kFloat8E4M3 if fp8 == "e4m3" else tex.DType.kFloat8E5M2
    q = Float8Quantizer(torch.full((1,), scale, device="cuda"), torch.zeros(1, device="cuda"), dtype)
    q.set_usage(rowwise=True, columnwise=columnwise)
    q.internal = False
    return q


def inputs(tokens: int, ffn: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, 2 * ffn, device="cuda", generator=gen).bfloat16()
    exponents = torch.randint(-6, 7, (ffn,), device="cuda", generator=gen)
    return x, torch.exp2(exponents.float())


# name: (mantissa bits, smallest normal exponent)
FORMATS = {"e4m3": (3, -6), "e5m2": (2, -14), "bf16": (7, -126)}


def steps_apart(a: torch.Tensor, b: torch.Tensor, fmt: str) -> torch.Tensor:
    """|a - b| in units of `fmt`'s step at max(|a|, |b|) (0: equal); a and b as the format holds them (FP8 bytes
    read as their values, before the scale's inverse)."""
    mantissa, smallest = FORMATS[fmt]
    if a.dtype == torch.uint8:
        view = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
        a, b = a.view(view), b.view(view)
    a, b = a.float(), b.float()
    big = torch.maximum(a.abs(), b.abs()).clamp(min=2.0**smallest)
    return (a - b).abs() / torch.exp2(torch.floor(torch.log2(big)) - mantissa)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_fp8_is_the_composed_cast(shape):
    import transformer_engine_torch as tex

    x, s = inputs(*shape)
    h = tex.swiglu(x, None)
    amax = torch.zeros(shape[1], device="cuda")
    amax[0] = 1e9  # a running amax is raised, never lowered
    ours_q, te_q = quantizer("e4m3", 2.0, False), quantizer("e4m3", 2.0, False)
    ours = swiglu_kernel.smooth_swiglu_forward(x, s, amax, ours_q)
    reference = te_q(h * s)
    # TE's path rounds h to bf16 before the cast: one FP8 step apart where that crosses a rounding boundary
    apart = steps_apart(ours._data, reference._data, "e4m3")
    assert apart.max() <= 1 and (apart > 0).float().mean() < 0.05, (apart.max(), (apart > 0).float().mean())
    # the cast of the fp32 product itself: the same bytes but where torch's fp32 SwiGLU differs from TE's in its
    # last bit
    gate, up = x[:, : shape[1]].float(), x[:, shape[1] :].float()
    exact = quantizer("e4m3", 2.0, False)(gate * torch.sigmoid(gate) * up * s)
    assert (ours._data != exact._data).float().mean() < 1e-3
    assert torch.allclose(ours._scale_inv, reference._scale_inv)
    assert ours._transpose is None or ours._transpose_invalid
    # the channels' amaxes of h (fp32 here, bf16 there: within bf16's rounding), the quantizer's of h * s
    expected = h.float().abs().amax(0)
    assert amax[0] == 1e9
    assert torch.allclose(amax[1:], expected[1:], rtol=2**-8), (amax - expected).abs().max()
    assert torch.allclose(ours_q.amax, te_q.amax, rtol=2**-8), (ours_q.amax, te_q.amax)


@pytest.mark.parametrize("shape", SHAPES[:2], ids=str)
def test_forward_bf16_within_one_ulp(shape):
    import transformer_engine_torch as tex

    x, s = inputs(*shape, seed=1)
    ours = swiglu_kernel.smooth_swiglu_forward(x, s, None, None)
    reference = tex.swiglu(x, None) * s
    assert ours.dtype == torch.bfloat16 and ours.shape == reference.shape
    ulps = steps_apart(ours, reference, "bf16")
    assert ulps.max() <= 1 and (ulps > 0).float().mean() < 1e-2, (ulps.max(), (ulps > 0).float().mean())


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_backward_fp8_is_te_dswiglu_of_the_scaled_gradient(shape):
    import transformer_engine_torch as tex

    x, s = inputs(*shape, seed=2)
    g = (torch.randn(shape, device="cuda") * 1e-3).bfloat16()
    ours_q, te_q = quantizer("e5m2", 2.0**10, True), quantizer("e5m2", 2.0**10, True)
    ours = swiglu_kernel.smooth_swiglu_backward(g, x, s, ours_q)
    reference = tex.dswiglu((g * s).bfloat16().contiguous(), x, te_q)  # TE needs both inputs bf16
    apart = steps_apart(ours._data, reference._data, "e5m2")
    assert apart.max() <= 1 and (apart > 0).float().mean() < 5e-3, (apart.max(), (apart > 0).float().mean())
    assert torch.equal(ours._transpose, ours._data.t().contiguous())
    assert torch.allclose(ours_q.amax, te_q.amax, rtol=2**-8), (ours_q.amax, te_q.amax)


def test_backward_bf16_within_one_ulp():
    import transformer_engine_torch as tex

    x, s = inputs(1000, 200, seed=3)
    g = torch.randn(1000, 200, device="cuda").bfloat16()
    ours = swiglu_kernel.smooth_swiglu_backward(g, x, s, None)
    ulps = steps_apart(ours, tex.dswiglu((g * s).bfloat16().contiguous(), x, None), "bf16")
    assert ulps.max() <= 1 and (ulps > 0).float().mean() < 1e-2, (ulps.max(), (ulps > 0).float().mean())


@pytest.mark.parametrize("accurate", [True, False], ids=["accurate", "fast"])
def test_bf16_buffers_and_the_fast_math(accurate):
    """A model cast to bf16 holds its scales and amaxes in bf16; the fast exp and division stay within an FP8 step."""
    import transformer_engine_torch as tex

    x, s = inputs(1000, 200, seed=6)
    amax = torch.zeros(200, device="cuda", dtype=torch.bfloat16)
    ours = swiglu_kernel.smooth_swiglu_forward(x, s.bfloat16(), amax, quantizer("e4m3", 2.0, False), accurate=accurate)
    h = tex.swiglu(x, None)
    reference = quantizer("e4m3", 2.0, False)(h * s)
    apart = steps_apart(ours._data, reference._data, "e4m3")
    assert apart.max() <= 1 and (apart > 0).float().mean() < 0.05
    assert amax.dtype == torch.bfloat16 and torch.allclose(amax.float(), h.float().abs().amax(0), rtol=2**-7)


def test_nan_reaches_its_channel_amax_and_the_quantizer():
    x, s = inputs(300, 256, seed=4)
    x[17, 5] = float("nan")  # gate of channel 5
    amax, q = torch.zeros(256, device="cuda"), quantizer("e4m3", 1.0, False)
    out = swiglu_kernel.smooth_swiglu_forward(x, s, amax, q)
    assert torch.isnan(amax[5]) and torch.isfinite(amax[torch.arange(256, device="cuda") != 5]).all()
    assert torch.isnan(q.amax).all()
    assert torch.isnan(out.dequantize()[17, 5]) and torch.isfinite(out.dequantize()[:17]).all()


def test_autograd_and_cuda_graph_capture():
    x, s = inputs(512, 384, seed=5)
    x.requires_grad_(True)
    amax, out_q, grad_q = torch.zeros(384, device="cuda"), quantizer("e4m3", 1.0, False), quantizer("e5m2", 1.0, True)
    g = torch.randn(512, 384, device="cuda").bfloat16()

    def step():
        y = swiglu_kernel.smooth_swiglu(x, s, amax, True, out_q, grad_q)
        (dx,) = torch.autograd.grad(y, x, g)
        return y, dx

    # only the bytes: a kept output would keep its autograd graph, and x's AccumulateGrad node with the default
    # stream it was made on, alive into the capture
    eager_y, eager_dx = (t._data.clone() for t in step())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_y, graph_dx = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_y._data, eager_y) and torch.equal(graph_dx._data, eager_dx)


@pytest.mark.parametrize("shape", [(2048, 8192), (77, 1100)])
def test_divide_columns_is_the_exact_quotient_and_accumulates_in_fp32(shape):
    w = torch.randn(*shape, device="cuda").bfloat16()
    s = torch.exp2(torch.randint(-14, 15, (shape[1],), device="cuda").float())
    quotient = w / s.bfloat16()
    assert torch.equal(swiglu_kernel.divide_columns(w, s), quotient)
    main_grad = torch.randn(*shape, device="cuda")
    expected = main_grad + quotient.float()
    swiglu_kernel.divide_columns(w, s, out=main_grad, accumulate=True)
    assert torch.equal(main_grad, expected)
    out = torch.randn(*shape, device="cuda").bfloat16()
    before = out.clone()
    swiglu_kernel.divide_columns(w, s, out=out, skip=torch.ones(1, device="cuda"))  # TE's flag: reuse, write nothing
    assert torch.equal(out, before)
    swiglu_kernel.divide_columns(w, s, out=out, skip=torch.zeros(1, device="cuda"))
    assert torch.equal(out, quotient)


def test_te_mlp_takes_the_kernels_under_delayed_scaling_only(monkeypatch):
    from tests.gpu.test_te_model import LLAMA, batches, build

    calls = []
    fused = swiglu_kernel.smooth_swiglu
    monkeypatch.setattr(swiglu_kernel, "smooth_swiglu", lambda *a: calls.append(1) or fused(*a))
    batch = batches()[0]
    for flags, expected in (("--fp8-format hybrid --fp8-recipe delayed --bf16", 2), ("--bf16", 0)):
        calls.clear()
        model = build(LLAMA, "transformer_engine", f"{flags} --smooth-swiglu")
        model(batch["tokens"], labels=batch["labels"]).float().mean().backward()
        assert len(calls) == expected, (flags, len(calls))  # layers 2 and 3: the first stays in bf16
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
