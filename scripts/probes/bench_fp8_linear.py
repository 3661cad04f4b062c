"""Time one linear layer's forward + backward (fprop, dgrad, wgrad) on a GPU: bf16, our FP8 recipes, and TE.

    python scripts/probes/bench_fp8_linear.py                               # M = 8192 tokens, the default (K, N) set
    python scripts/probes/bench_fp8_linear.py --shapes 8192x8192 --breakdown   # where the time of tensorwise FP8 goes

TFLOP/s counts the three GEMMs: 3 * 2 * M * K * N per forward + backward. Each iteration requantizes the weight
(one micro-batch per optimizer step; Transformer Engine's default too), takes the gradients of x and W with
`torch.autograd.grad` (no accumulation into .grad), and is timed with CUDA events; the median of --iters is
reported. Transformer Engine runs `te.Linear` under `te.autocast` with the matching recipe: DelayedScaling,
Float8CurrentScaling (tensorwise), Float8BlockScaling (blockwise), MXFP8BlockScaling (which TE refuses below
compute capability 10); TE has no rowwise recipe.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatron.fp8 import RECIPES, Fp8Format, Fp8LinearState, Recipe, Role, fp8_gemm
from megatron.fp8.manager import gemm_paths
from megatron.fp8.quantize import EAGER, compiled_kernels
from megatron.fp8.scaling import AmaxState

DEFAULT_SHAPES = "2048x2048,4096x4096,8192x8192,14336x14336,4096x14336,14336x4096,2048x8192,8192x2048"


def median_ms(step: Callable[[], object], iters: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def tflops(m: int, k: int, n: int, ms: float) -> float:
    return 6 * m * k * n / ms / 1e9


def make_inputs(m: int, k: int, n: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).bfloat16().requires_grad_()
    dy = torch.randn(m, n, device="cuda", generator=gen).bfloat16()
    return x, w, dy


def ours(recipe_name: str, fmt: str, kernels) -> tuple[Fp8LinearState, AmaxState]:
    recipe = Recipe(recipe_name, Fp8Format(fmt))
    amax = AmaxState(recipe, 1, torch.device("cuda"))
    return Fp8LinearState("bench", 0, recipe, amax, kernels), amax


def ours_step(state: Fp8LinearState, x, w, dy) -> Callable[[], object]:
    def step():
        state.drop_weight_cache()
        y = state.linear(x, w, None)
        return torch.autograd.grad(y, (x, w), dy)

    return step


def te_recipe(name: str, fmt: str):
    from transformer_engine.common import recipe as te_recipes

    te_format = te_recipes.Format.HYBRID if fmt == "hybrid" else te_recipes.Format.E4M3
    return {
        "delayed": lambda: te_recipes.DelayedScaling(
            fp8_format=te_format, amax_history_len=1, amax_compute_algo="most_recent"
        ),
        "tensorwise": lambda: te_recipes.Float8CurrentScaling(fp8_format=te_format),
        "blockwise": lambda: te_recipes.Float8BlockScaling(fp8_format=te_format),
        "mxfp8": lambda: te_recipes.MXFP8BlockScaling(fp8_format=te_format),
    }.get(name, lambda: None)()


def te_step(name: str, fmt: str, x, w, dy) -> Callable[[], object]:
    import transformer_engine.pytorch as te

    layer = te.Linear(w.shape[1], w.shape[0], bias=False, params_dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        layer.weight.copy_(w)
    recipe = te_recipe(name, fmt)

    def step():
        with te.autocast(enabled=True, recipe=recipe):
            y = layer(x)
        return torch.autograd.grad(y, (x, layer.weight), dy)

    return step


def breakdown(m: int, k: int, n: int, fmt: str, iters: int) -> None:
    """Tensorwise FP8 at one shape: the three GEMMs alone, the quantization passes alone (compiled and eager)."""
    x, w, dy = make_inputs(m, k, n)
    print(f"\nbreakdown, tensorwise {fmt}, M={m} K={k} N={n} (median ms)")
    for label, kernels in (("compiled", compiled_kernels()), ("eager", EAGER)):
        state, _ = ours("tensorwise", fmt, kernels)
        xq, xt = state.quantize(x.detach(), Role.INPUT, rows=True, cols=True)
        wq, wt = state.quantize(w.detach(), Role.WEIGHT, rows=True, cols=True)
        gq, gt = state.quantize(dy, Role.GRAD, rows=True, cols=True)
        quantize_ms = median_ms(
            lambda state=state: [
                state.quantize(t, role, rows=True, cols=True)
                for t, role in ((x.detach(), Role.INPUT), (w.detach(), Role.WEIGHT), (dy, Role.GRAD))
            ],
            iters,
            3,
        )
        total = median_ms(ours_step(state, x, w, dy), iters, 3)
        print(f"  {label:8s} quantize x, W, dY (+ transposes): {quantize_ms:7.3f}   whole fwd+bwd: {total:7.3f}")
    gemm_ms = median_ms(
        lambda: (
            fp8_gemm(xq, wq, torch.bfloat16, fast_accum=True),
            fp8_gemm(gq, wt, torch.bfloat16),
            fp8_gemm(gt, xt, torch.bfloat16),
        ),
        iters,
        3,
    )
    bf16_ms = median_ms(lambda: (x @ w.t(), dy @ w, dy.t() @ x), iters, 3)
    print(f"  3 FP8 GEMMs alone: {gemm_ms:7.3f} ({tflops(m, k, n, gemm_ms):.0f} TFLOP/s)")
    print(f"  3 bf16 GEMMs alone: {bf16_ms:7.3f} ({tflops(m, k, n, bf16_ms):.0f} TFLOP/s)")


def bench_shape(m, k, n, recipes, fmt, kernels, has_te: bool, iters: int) -> dict[str, float | None]:
    """TFLOP/s of bf16, each of our recipes and each TE recipe at one shape."""
    x, w, dy = make_inputs(m, k, n)
    cells: dict[str, float | None] = {}
    cells["bf16"] = tflops(m, k, n, median_ms(lambda: torch.autograd.grad(F.linear(x, w), (x, w), dy), iters, 3))
    for name in recipes:
        state, amax = ours(name, fmt, kernels)
        step = ours_step(state, x, w, dy)
        step()
        amax.step()  # delayed: real scales from here on
        cells[f"ours {name}"] = tflops(m, k, n, median_ms(step, iters, 3))
    for name in recipes if has_te else []:
        if name == "rowwise":
            continue
        try:
            cells[f"TE {name}"] = tflops(m, k, n, median_ms(te_step(name, fmt, x, w, dy), iters, 3))
        except Exception as exc:  # TE refuses some recipes on some GPUs: say which and why
            cells[f"TE {name}"] = None
            print(f"TE {name} at {k}x{n}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="M, the rows of x")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated KxN pairs")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--format", default="hybrid", choices=["e4m3", "hybrid"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-te", action="store_true", help="skip Transformer Engine")
    parser.add_argument("--eager", action="store_true", help="eager quantization kernels instead of torch.compile")
    parser.add_argument("--breakdown", action="store_true", help="also time tensorwise's GEMMs and casts apart")
    args = parser.parse_args()
    m, recipes = args.tokens, args.recipes.split(",")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    kernels = EAGER if args.eager else compiled_kernels()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, M={m}, format {args.format}")
    for name in recipes:
        for label, path in gemm_paths(Recipe(name, Fp8Format(args.format)), torch.device("cuda"), torch.bfloat16):
            print(f"  {name:10s} {label:13s} {path}")
    has_te = not args.no_te
    if has_te:
        try:
            import transformer_engine

            print(f"transformer_engine {transformer_engine.__version__}")
        except ImportError as exc:
            print(f"Transformer Engine not importable ({exc}); TE columns skipped")
            has_te = False

    columns = ["bf16"] + [f"ours {r}" for r in recipes]
    if has_te:
        columns += [f"TE {r}" for r in recipes if r != "rowwise"]
    rows = []
    for k, n in shapes:
        cells = bench_shape(m, k, n, recipes, args.format, kernels, has_te, args.iters)
        rows.append(((k, n), cells))
        print(f"K={k} N={n}: " + ", ".join(f"{c} {v:.0f}" if v else f"{c} -" for c, v in cells.items()), flush=True)
        torch.cuda.empty_cache()

    print(f"\nTFLOP/s (fwd+bwd, M={m}, {args.format}; in brackets: x bf16)\n")
    print("| K x N | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for (k, n), cells in rows:
        base = cells["bf16"]
        text = [f"{base:.0f}"] + [
            "refused" if cells.get(c) is None else f"{cells[c]:.0f} ({cells[c] / base:.2f}x)" for c in columns[1:]
        ]
        print(f"| {k} x {n} | " + " | ".join(text) + " |")
    if args.breakdown:
        breakdown(m, 8192, 8192, args.format, args.iters)


if __name__ == "__main__":
    main()
