"""Kernel microbenchmark behind `_SwiGLU` (megatron/model/te_mlp.py): SwiGLU forward and backward at llama-1b's
shapes (8192 tokens, ffn 8192), writing FP8 (delayed scaling) from the activation kernel against TE's activation in
bf16 followed by a separate cast. Prints ms per call and how the two FP8 results compare. Then --smooth-swiglu's
forms of it: the composed path (TE's SwiGLU in bf16, the channels' amax, times s, TE's cast; backward g * s, then
TE's dSwiGLU writing FP8) against the fused kernels of megatron/model/swiglu_kernel.py.

    python scripts/probes/microbench_swiglu_fp8.py        (a GPU with Transformer Engine)
"""

import torch

TOKENS, FFN = 8192, 8192
SWEEP = [
    {},
    {"accurate": False},
    *({"BT": bt, "BF": bf, "accurate": False} for bt, bf in ((16, 128), (32, 64), (64, 64), (32, 256), (64, 128))),
    *({"num_warps": w, "accurate": False} for w in (2, 8)),
    *({"per_sm": p, "accurate": False} for p in (2, 8, 16)),
]


def quantizer(dtype, columnwise: bool = True):
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    q = Float8Quantizer(scale=torch.full((1,), 8.0, device="cuda"), amax=torch.zeros(1, device="cuda"), fp8_dtype=dtype)
    q.set_usage(rowwise=True, columnwise=columnwise)
    return q


def ms_per_call(fn, n: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def main() -> None:
    import transformer_engine.pytorch  # noqa: F401  (loads the extension)
    import transformer_engine_torch as tex

    torch.manual_seed(0)
    x = torch.randn(TOKENS, 2 * FFN, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(TOKENS, FFN, device="cuda", dtype=torch.bfloat16) * 1e-3
    e5m2, e4m3 = tex.DType.kFloat8E5M2, tex.DType.kFloat8E4M3
    separate_q, fused_q = quantizer(e5m2), quantizer(e5m2)

    separate, fused = separate_q(tex.dswiglu(g, x, None)), tex.dswiglu(g, x, fused_q)
    reference = tex.dswiglu(g, x, None).float()

    def err(t):
        return float((t.dequantize().float() - reference).norm() / reference.norm())

    print(f"backward, rel. error against fp32: separate {err(separate):.4f}, fused {err(fused):.4f}")
    print(f"backward, elements that differ: {float((fused._data != separate._data).float().mean()):.4f}")
    print(f"backward, fused transpose consistent: {torch.equal(fused._transpose, fused._data.t().contiguous())}")
    print(
        f"backward ms: separate {ms_per_call(lambda: separate_q(tex.dswiglu(g, x, None))):.3f},"
        f" fused {ms_per_call(lambda: tex.dswiglu(g, x, fused_q)):.3f}"
    )
    separate_q, rowwise_q = quantizer(e4m3), quantizer(e4m3, columnwise=False)
    print(
        f"forward ms: separate {ms_per_call(lambda: separate_q(tex.swiglu(x, None))):.3f},"
        f" fused (row-wise, as linear_fc2 keeps it) {ms_per_call(lambda: tex.swiglu(x, rowwise_q)):.3f}"
    )
    smoothed(tex, x, g)


def smoothed(tex, x: torch.Tensor, g: torch.Tensor) -> None:
    from megatron.model import swiglu_kernel
    from megatron.model.smooth_swiglu import smooth_input

    s = torch.exp2(torch.randint(-6, 7, (FFN,), device="cuda").float())
    amax = torch.zeros(FFN, device="cuda")
    e5m2, e4m3 = tex.DType.kFloat8E5M2, tex.DType.kFloat8E4M3
    out_q, grad_q = quantizer(e4m3, columnwise=False), quantizer(e5m2)

    def composed_forward():
        return out_q(smooth_input(tex.swiglu(x, None), s, amax, True))

    def composed_backward():
        return tex.dswiglu((g * s.to(g.dtype)).contiguous(), x, grad_q)

    print(
        f"smoothed forward ms: composed {ms_per_call(composed_forward):.3f},"
        f" fused {ms_per_call(lambda: swiglu_kernel.smooth_swiglu_forward(x, s, amax, out_q)):.3f}"
        f" (plain fused SwiGLU {ms_per_call(lambda: tex.swiglu(x, out_q)):.3f})"
    )
    print(
        f"smoothed backward ms: composed {ms_per_call(composed_backward):.3f},"
        f" fused {ms_per_call(lambda: swiglu_kernel.smooth_swiglu_backward(g, x, s, grad_q)):.3f}"
        f" (plain fused dSwiGLU {ms_per_call(lambda: tex.dswiglu(g, x, grad_q)):.3f})"
    )
    # the fused kernels' launch shapes (swiglu_kernel.FORWARD / BACKWARD), one change at a time from the defaults
    for name, run, defaults in (
        ("forward", lambda **t: swiglu_kernel.smooth_swiglu_forward(x, s, amax, out_q, **t), swiglu_kernel.FORWARD),
        ("backward", lambda **t: swiglu_kernel.smooth_swiglu_backward(g, x, s, grad_q, **t), swiglu_kernel.BACKWARD),
    ):
        for change in SWEEP:
            tune = {**defaults, **change}
            print(f"smoothed {name} {tune}: {ms_per_call(lambda run=run, tune=tune: run(**tune)):.3f} ms")


if __name__ == "__main__":
    main()
