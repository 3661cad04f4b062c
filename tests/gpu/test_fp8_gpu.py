"""The FP8 engine on a CUDA GPU: compiled quantizers equal the eager ones byte for byte, every GEMM path agrees with
the emulation, the FP8 linear is accurate in bf16, and a tiny GPT trains with every recipe."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.config import parse_args
from megatron.fp8 import E4M3, E5M2, RECIPES, Fp8Format, Fp8LinearState, Recipe, attach_fp8, fp8_gemm
from megatron.fp8.gemm import _emulated, describe_path
from megatron.fp8.quantize import (
    EAGER,
    KERNEL_NOTES,
    MX_BLOCK,
    ROW,
    TENSOR,
    BLOCK_128x128,
    TILE_1x128,
    compiled_kernels,
    quantize,
)
from megatron.fp8.scaling import AmaxState
from megatron.model import GPTModel

pytestmark = pytest.mark.gpu
SPECS = [(TENSOR, {}), (ROW, {}), (TILE_1x128, {"power_of_two": True}), (BLOCK_128x128, {}), (MX_BLOCK, {"mx": True})]


def cuda_randn(*shape, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=gen, device="cuda").to(dtype)


def test_per_tensor_quantization_runs_on_the_checked_triton_kernels():
    compiled_kernels()
    assert any("Triton amax + fused cast-transpose" in note for note in KERNEL_NOTES), KERNEL_NOTES


@pytest.mark.parametrize("spec,options", SPECS, ids=["tensor", "row", "tile", "block", "mx"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_compiled_quantizer_equals_eager_bytes(spec, options, dtype):
    x = cuda_randn(300, 520) * torch.exp2(torch.linspace(-20, 10, 300, device="cuda"))[:, None].bfloat16()
    x[7, 11] = 0
    transpose = spec in (TENSOR, BLOCK_128x128)
    eager, eager_t = quantize(x, spec, dtype, transpose=transpose, kernels=EAGER, **options)
    fused, fused_t = quantize(x, spec, dtype, transpose=transpose, kernels=compiled_kernels(), **options)
    assert torch.equal(fused.data.view(torch.uint8), eager.data.view(torch.uint8))
    assert torch.equal(fused.scale_inv.view(torch.uint8), eager.scale_inv.view(torch.uint8))
    if transpose:
        assert torch.equal(fused_t.data.view(torch.uint8), eager.data.t().contiguous().view(torch.uint8))
    cpu, _ = quantize(x.cpu(), spec, dtype, **options)  # and the GPU equals the CPU
    assert torch.equal(cpu.data.view(torch.uint8), eager.data.cpu().view(torch.uint8))


@pytest.mark.parametrize("kinds", [("tensor", "tensor"), ("row", "row"), ("tile", "block"), ("tile", "tile")])
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3)], ids=["e4m3xe4m3", "e5m2xe4m3"])
def test_gemm_paths_agree_with_the_emulation(kinds, dtypes):
    spec = {"tensor": TENSOR, "row": ROW, "tile": TILE_1x128, "block": BLOCK_128x128}
    a = quantize(cuda_randn(512, 1024, seed=1), spec[kinds[0]], dtypes[0])[0]
    b = quantize(cuda_randn(256, 1024, seed=2), spec[kinds[1]], dtypes[1])[0]
    path = describe_path(a.data.device, *kinds, *dtypes, torch.bfloat16)
    print(f"{kinds} {dtypes}: {path}")
    got = fp8_gemm(a, b, torch.bfloat16).double()
    want = a.dequantize().double() @ b.dequantize().double().t()
    assert float((got - want).norm() / want.norm()) < 2**-7  # bf16 output rounding (2^-9) and accumulation order
    if kinds[0] in ("tensor", "row"):
        assert path.startswith("torch._scaled_mm"), path  # Hopper has both


def test_emulated_mxfp8_gemm_is_exact_in_bf16():
    a = quantize(cuda_randn(256, 512, seed=3), MX_BLOCK, E4M3, mx=True)[0]
    b = quantize(cuda_randn(128, 512, seed=4), MX_BLOCK, E4M3, mx=True)[0]
    # power-of-two scales: the bf16 dequantization is exact; the GEMM accumulates in fp32 and rounds its output to
    # bf16 once (relative 2^-9), so that is the whole error
    assert torch.equal(a.dequantize(torch.bfloat16).float(), a.dequantize())
    want = a.dequantize().double() @ b.dequantize().double().t()
    got = _emulated(a, b, torch.float32, None).double()
    assert float(((got - want).abs() / want.abs().clamp_min(1e-3)).max()) <= 2.0**-8


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_linear_in_bf16_is_accurate(recipe):
    rec = Recipe(recipe, Fp8Format("hybrid"))
    amax = AmaxState(rec, 1, torch.device("cuda"))
    state = Fp8LinearState("gpu.linear", 0, rec, amax, compiled_kernels())
    x, w, dy = cuda_randn(4, 500, 1024, seed=5), cuda_randn(768, 1024, seed=6) * 0.02, cuda_randn(4, 500, 768, seed=7)
    for _ in range(2):  # the second pass uses delayed scales from the first
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = state.linear(xg, wg, None)
        y.backward(dy)
        assert amax.step()
    x64, w64, dy64 = x.double().reshape(-1, 1024), w.double(), dy.double().reshape(-1, 768)
    e4m3, e5m2 = 2.0**-4 / math.sqrt(3), 2.0**-3 / math.sqrt(3)  # RMS rounding errors (see tests/unit)
    rel = lambda got, want: float((got.double() - want).norm() / want.norm())  # noqa: E731
    assert rel(y.reshape(-1, 768), x64 @ w64.t()) < math.hypot(e4m3, e4m3)
    assert rel(xg.grad.reshape(-1, 1024), dy64 @ w64) < math.hypot(e5m2, e4m3)
    assert rel(wg.grad, dy64.t() @ x64) < math.hypot(e5m2, e4m3)
    assert y.dtype == xg.grad.dtype == wg.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("recipe", RECIPES)
def test_tiny_gpt_trains_on_gpu(recipe):
    args = (
        "--vocab-size 256 --num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 128 --mock-data"
        " --transformer-impl local --no-fp8-first-layer-bf16"  # both layers in FP8: 8 scaled linears
        f" --fp8-format hybrid --fp8-recipe {recipe}"
    )
    cfg = parse_args(args.split(), device_type="cuda")
    assert cfg.precision.bf16  # implied by FP8 on a GPU
    torch.manual_seed(0)
    model = GPTModel(cfg.model, 256, dtype=torch.bfloat16).cuda()
    manager = attach_fp8(model, cfg)
    print("\n".join(manager.describe()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.arange(8 * 129, device="cuda").remainder(256).view(8, 129)  # a learnable sequence
    losses = []
    for _ in range(30):
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).float().mean()
        loss.backward()
        assert manager.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < 0.5 * losses[0], losses
    assert len(manager.states) == 8 and all(state.kernels is not EAGER for state in manager.states.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fsdp_shard_cast_into_its_buffer_equals_the_eager_cast(dtype):
    """FSDP's FP8 all-gather casts each shard once per step into its padded buffer (`GatherScale.fill`): on CUDA the
    checked Triton kernel writing into the buffer, the eager cast's bytes (fp32 main-weight shards, bf16 ones under
    the precision-aware optimizer), the pad rows zero."""
    from megatron.fp8.quantize import per_tensor_triton
    from megatron.parallel.fsdp.fp8_gather import GatherScale

    assert per_tensor_triton() is not None, KERNEL_NOTES
    shard = cuda_randn(301, 520, dtype=torch.float32) * torch.exp2(torch.linspace(-24, 12, 520, device="cuda"))
    shard = shard.to(dtype)
    scale = GatherScale(torch.device("cuda"), None)
    scale.set(shard.abs().amax().float() / 4)  # fp8_max / (amax / 4): some elements saturate, some underflow
    data = scale.fill(shard, 0, 320)
    assert data.shape == (320, 520) and not data[301:].any()
    assert torch.equal(data[:301], scale.cast(shard, 0).view(torch.uint8))
