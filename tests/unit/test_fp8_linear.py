"""The FP8 linear: each GEMM on the right quantized operands, accuracy vs high precision, what backward keeps."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.fp8 import E4M3, E5M2, RECIPES, Fp8Format, Fp8LinearState, Recipe, Role, fp8_gemm, quantize
from megatron.fp8.gemm import _emulated
from megatron.fp8.quantize import ROW, TENSOR
from megatron.fp8.scaling import AmaxState

K, N = 64, 48
CASES = [(r, f) for r in RECIPES for f in ("e4m3", "hybrid")]


def make(recipe: str, fmt: str, **options) -> tuple[Fp8LinearState, AmaxState, Recipe]:
    rec = Recipe(recipe, Fp8Format(fmt), **options)
    amax = AmaxState(rec, 1, torch.device("cpu"))
    return Fp8LinearState("test.linear", 0, rec, amax), amax, rec


def tensors(seed: int, tokens: tuple[int, ...] = (3, 37)):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*tokens, K, generator=gen)
    w = torch.randn(N, K, generator=gen) * 0.05
    b = torch.randn(N, generator=gen)
    dy = torch.randn(*tokens, N, generator=gen) * 1e-3
    return x, w, b, dy


def run(state: Fp8LinearState, x, w, b, dy):
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    y = state.linear(x, w, b)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad


def deq(t: torch.Tensor, rec: Recipe, role: Role, scale=None) -> torch.Tensor:
    """float64 dequantization of t quantized along its last dim by the recipe (quantizers: test_fp8_quantize)."""
    options = {"power_of_two": rec.power_of_two(role), "mx": rec.mx, "scale": scale}
    return quantize(t.contiguous(), rec.block(role), rec.dtype(role), **options)[0].dequantize().double()


@pytest.mark.parametrize("recipe,fmt", CASES)
def test_each_gemm_runs_on_operands_quantized_along_its_reduction_dim(recipe, fmt):
    """y, dx, dW equal float64 GEMMs of the dequantized operands: x, W along K; dY, W^T along N; dY^T, x^T along M."""
    state, amax, rec = make(recipe, fmt)
    x, w, b, dy = tensors(0)
    run(state, x, w, b, dy)
    assert amax.step()  # delayed: the second call uses scales from the first call's amaxes
    y, dx, dw, db = run(state, x, w, b, dy)
    scale = (lambda role: amax.scale[0, role.value]) if rec.delayed else (lambda role: None)
    x2, dy2 = x.reshape(-1, K), dy.reshape(-1, N)
    y_ref = deq(x2, rec, Role.INPUT, scale(Role.INPUT)) @ deq(w, rec, Role.WEIGHT, scale(Role.WEIGHT)).t() + b
    dx_ref = deq(dy2, rec, Role.GRAD, scale(Role.GRAD)) @ deq(w.t(), rec, Role.WEIGHT, scale(Role.WEIGHT)).t()
    dw_ref = deq(dy2.t(), rec, Role.GRAD, scale(Role.GRAD)) @ deq(x2.t(), rec, Role.INPUT, scale(Role.INPUT)).t()
    # fp32 accumulation vs float64: a few ulps of the largest entry
    for got, want in ((y.reshape(-1, N), y_ref), (dx.reshape(-1, K), dx_ref), (dw, dw_ref)):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))
    torch.testing.assert_close(db, dy2.sum(0), rtol=1e-6, atol=1e-7)  # bias gradient stays high precision


def rms_rounding_error(dtype: torch.dtype) -> float:
    """RMS relative rounding error of an FP8 format with m mantissa bits: half an ulp, uniform: 2^-(m+1) / sqrt(3)."""
    mantissa_bits = 3 if dtype == E4M3 else 2
    return 2.0 ** -(mantissa_bits + 1) / math.sqrt(3.0)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.parametrize("recipe,fmt", CASES)
def test_forward_and_gradients_close_to_high_precision(recipe, fmt):
    """Each GEMM's relative error is below sqrt(eps_a^2 + eps_b^2), eps = the RMS rounding error of its operands."""
    state, amax, rec = make(recipe, fmt)
    x, w, b, dy = tensors(1)
    run(state, x, w, b, dy)
    amax.step()
    y, dx, dw, _ = run(state, x, w, b, dy)
    x64, w64, dy64 = x.reshape(-1, K).double(), w.double(), dy.reshape(-1, N).double()
    bound = {
        role_pair: math.hypot(rms_rounding_error(rec.dtype(role_pair[0])), rms_rounding_error(rec.dtype(role_pair[1])))
        for role_pair in ((Role.INPUT, Role.WEIGHT), (Role.GRAD, Role.WEIGHT), (Role.GRAD, Role.INPUT))
    }
    assert relative_error(y.reshape(-1, N) - b, x64 @ w64.t()) < bound[(Role.INPUT, Role.WEIGHT)]
    assert relative_error(dx.reshape(-1, K), dy64 @ w64) < bound[(Role.GRAD, Role.WEIGHT)]
    assert relative_error(dw, dy64.t() @ x64) < bound[(Role.GRAD, Role.INPUT)]
    assert y.dtype == dx.dtype == dw.dtype == torch.float32


def test_finer_scales_survive_rows_of_very_different_magnitude():
    """Rows spanning 2^-16..2^4: one scale per tensor flushes the small rows; per-row/block scales do not."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 128, generator=gen) * torch.exp2(torch.linspace(-16, 4, 64))[:, None]
    w = torch.randn(32, 128, generator=gen) * 0.05
    want = x.double() @ w.double().t()
    errors = {}
    for recipe in ("tensorwise", "rowwise", "blockwise", "mxfp8"):
        state, _, _ = make(recipe, "e4m3")
        y = state.linear(x, w, None)
        errors[recipe] = float(((y.double() - want).norm(dim=1) / want.norm(dim=1)).max())  # worst row
    assert errors["tensorwise"] > 0.5
    for recipe in ("rowwise", "blockwise", "mxfp8"):
        assert errors[recipe] < 0.1, errors


def test_backward_keeps_fp8_activations_not_a_high_precision_copy():
    state, _, _ = make("mxfp8", "hybrid")
    x, w, b, _ = tensors(3)
    y = state.linear(x.requires_grad_(), w.requires_grad_(), b)
    ctx = y.grad_fn.next_functions[0][0]  # the FP8 linear's node, under the reshape
    assert ctx.saved_tensors == (None,)
    assert ctx.x_t.data.dtype == E4M3 and ctx.x_t.data.shape == (K, 3 * 37)  # x^T quantized along tokens
    assert ctx.w_t.data.dtype == E4M3


def test_no_fp8_wgrad_computes_wgrad_in_high_precision():
    state, _, _ = make("tensorwise", "hybrid", fp8_wgrad=False)
    x, w, b, dy = tensors(4)
    y = state.linear(x.requires_grad_(), w.requires_grad_(), b)
    ctx = y.grad_fn.next_functions[0][0]
    assert ctx.x_t is None and ctx.saved_tensors[0].dtype == torch.float32  # the flag's cost: x itself is kept
    y.backward(dy)
    torch.testing.assert_close(w.grad, dy.reshape(-1, N).t() @ x.detach().reshape(-1, K))
    assert relative_error(x.grad.reshape(-1, K), dy.reshape(-1, N).double() @ w.detach().double()) > 1e-3  # FP8


def test_dtypes_follow_input_and_weight():
    state, _, _ = make("rowwise", "e4m3")
    x, w, b, dy = tensors(5, tokens=(20,))
    x16 = x.to(torch.bfloat16).requires_grad_()
    w32 = w.requires_grad_()
    y = state.linear(x16, w32, b)
    y.backward(dy.to(torch.bfloat16))
    assert y.dtype == x16.grad.dtype == torch.bfloat16 and w32.grad.dtype == torch.float32


def test_weight_casts_are_cached_within_a_step_and_refreshed_after():
    state, amax, _ = make("tensorwise", "e4m3")
    x, w, b, _ = tensors(6)
    w = w.clone()
    first = state.weight_operands(w)
    assert state.weight_operands(w)[0] is first[0]  # second micro-batch: same cast
    with torch.no_grad():
        w.mul_(2.0)  # an in-place update (the optimizer's) bumps the version: recast
    second = state.weight_operands(w)
    assert second[0] is not first[0] and float(second[0].amax) == 2 * float(first[0].amax)
    amax.step()  # a new step drops the cache
    assert state.weight_operands(w)[0] is not second[0]


@pytest.mark.parametrize("spec", [TENSOR, ROW])
@pytest.mark.parametrize("dtype_b", [E4M3, E5M2])
def test_cpu_scaled_mm_matches_the_emulation(spec, dtype_b):
    gen = torch.Generator().manual_seed(7)
    a = quantize(torch.randn(40, 64, generator=gen), spec, E4M3)[0]
    b = quantize(torch.randn(48, 64, generator=gen), spec, dtype_b)[0]
    torch.testing.assert_close(fp8_gemm(a, b, torch.float32), _emulated(a, b, torch.float32, None))


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_an_fp8_weight_is_its_own_operand_and_its_gradient_goes_to_main_grad(recipe):
    """--fp8-param-gather: the linear with an Fp8Parameter computes what it computes with a plain weight holding the
    same FP8 value, the weight gradient lands in main_grad (fp32) and autograd sees a zero dummy; with the layer out
    of FP8 (the guard) it is F.linear on the dequantized weight."""
    from megatron.fp8.params import Fp8Parameter

    def made() -> Fp8LinearState:
        state, amax, _ = make(recipe, "hybrid")
        if amax.scale is not None:
            amax.scale.fill_(2.0**8)  # some delayed scale other than 1
        return state

    state = made()
    x, w, b, dy = tensors(3)
    param = Fp8Parameter(w, state)
    param.main_grad = torch.zeros(N, K)
    plain = param.dequantize().clone()
    assert torch.equal(Fp8Parameter(plain, state).data.view(torch.uint8), param.data.view(torch.uint8))
    reference = made()
    if reference.amax.scale is not None:  # delayed: the plain weight cast with the FP8 weight's own scale
        reference.amax.scale[0, Role.WEIGHT.value] = param.scale_inv.reciprocal()
    y_want, dx_want, dw_want, db_want = run(reference, x, plain, b, dy)
    for enabled, want in ((True, (y_want, dx_want, dw_want, db_want)), (False, None)):
        state.enabled = enabled
        param.main_grad.zero_()
        x_in, b_in = x.clone().requires_grad_(), b.clone().requires_grad_()
        y = state.linear(x_in, param, b_in)
        y.backward(dy)
        assert param.grad is not None and not param.grad.any()  # the dummy (no gradient buffers to free it here)
        param.grad = None
        if want is None:  # high precision on the dequantized weight
            ref_x, ref_w, ref_b = (t.clone().requires_grad_() for t in (x, plain, b))
            torch.nn.functional.linear(ref_x, ref_w, ref_b).backward(dy)
            want = (None, ref_x.grad, ref_w.grad, ref_b.grad)
        torch.testing.assert_close(x_in.grad, want[1])
        torch.testing.assert_close(param.main_grad, want[2].float())
        torch.testing.assert_close(b_in.grad, want[3])
        if want[0] is not None:
            torch.testing.assert_close(y.detach(), want[0])
