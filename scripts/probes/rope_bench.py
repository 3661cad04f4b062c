"""Microbenchmark of RoPE on the packed QKV output: Transformer Engine's fused QKV kernel
(`apply_fused_qkv_rotary_pos_emb`, which the TE layer ran before) against this project's Triton kernel
(megatron/model/rope_kernel.py), forward and backward, at the presets' shapes per rank.

Prints ms per call, GB/s on the bytes the bound counts (4(Q + 2K) each way: q, k and v read and written once,
megatron/perf/traffic.py) and, as the ceiling, a device-to-device copy of as many bytes; then how far the kernel's
results are from TE's. Each time is one CUDA graph of 24 calls (no launch or autograd overhead, as in training with
CUDA graphs), its inputs cycling over 3 sets so that the 50 MB L2 cache does not hold them; the best of 5 replays.
The kernel's forward includes its cos/sin table (two small torch kernels); backward is autograd's, for both.

    python3 scripts/probes/rope_bench.py            (a GPU with Triton; TE's columns need Transformer Engine)
    python3 scripts/probes/rope_bench.py --sweep    also every rows-per-program x warps choice of the kernel
"""

from __future__ import annotations

import argparse

import torch

from megatron.model import rope_kernel
from megatron.model.layers import RotaryEmbedding
from megatron.model.te_attention import te_qkv_rope

# name: (s, b, query heads, groups, head size, rotary percent) per rank
SHAPES = {
    "llama-1b": (4096, 2, 32, 8, 64, 1.0),
    "llama-1b rotary 0.5": (4096, 2, 32, 8, 64, 0.5),
    "llama3-8b": (8192, 1, 32, 8, 128, 1.0),
    "llama3-8b tp2": (8192, 1, 16, 4, 128, 1.0),
    "llama3-8b tp8": (8192, 1, 4, 1, 128, 1.0),
}
CALLS, SETS, REPLAYS = 24, 3, 5


_STREAM: list[torch.cuda.Stream] = []  # the side stream every capture runs on (made once CUDA is up)


def stream() -> torch.cuda.Stream:
    """One side stream for warm-ups, captures and the forwards whose backward a graph captures: autograd runs a
    backward node on its forward's stream, which must be the capturing one."""
    if not _STREAM:
        _STREAM.append(torch.cuda.Stream())
    return _STREAM[0]


def graph_ms(calls: list) -> float:
    """ms per call of `calls` (closures) captured in one CUDA graph, best of REPLAYS replays."""
    torch.cuda.synchronize()
    with torch.cuda.stream(stream()):
        for fn in calls[:SETS]:  # compile and warm up outside the capture
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream()):
        for fn in calls:
            fn()
    graph.replay()
    best = float("inf")
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / len(calls))
    return best


def inputs(shape: tuple, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    s, b, heads, groups, hn, percent = shape
    torch.manual_seed(seed)
    packed = torch.randn(s, b, groups, (heads // groups + 2) * hn, device="cuda", dtype=torch.bfloat16)
    return packed, RotaryEmbedding(int(hn * percent), 10000).cuda()(s), heads // groups


def forward_calls(fn, sets: list) -> list:
    return [lambda p=p, a=a, g=g: fn(p, a, g) for p, a, g in (sets[i % SETS] for i in range(CALLS))]


def backward_calls(fn, sets: list) -> list:
    """Autograd's backward of `fn` for each input set (graphs of one forward each, kept for the replays)."""
    prepared = []
    torch.cuda.synchronize()
    with torch.cuda.stream(stream()):
        for packed, angles, per_group in sets:
            leaf = packed.clone().requires_grad_()
            out = fn(leaf, angles, per_group)
            prepared.append((leaf, out, [torch.randn_like(t) for t in out]))
    return [
        lambda leaf=leaf, out=out, grads=grads: torch.autograd.grad(out, leaf, grads, retain_graph=True)
        for leaf, out, grads in (prepared[i % SETS] for i in range(CALLS))
    ]


def ulps(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(largest difference in bf16 ulps, fraction of elements that differ)."""
    _, exponent = torch.frexp(torch.maximum(got.float().abs(), want.float().abs()))
    ulp = torch.ldexp(torch.ones_like(got, dtype=torch.float32), exponent - 8)
    diff = (got.float() - want.float()).abs()
    return float((diff / ulp).max()), float((diff > 0).float().mean())


def row(name: str, shape: tuple, te: bool) -> tuple[str, tuple | None, list]:
    """One shape: its table row, how the kernel's results compare with TE's, the input sets."""
    sets = [inputs(shape, seed) for seed in range(SETS)]
    s, b, heads, groups, hn, _ = shape
    nbytes = 2 * 2 * s * b * (heads + 2 * groups) * hn  # read and write, bf16
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = graph_ms([lambda: dst.copy_(src)] * CALLS)
    fwd, bwd = (
        graph_ms(forward_calls(rope_kernel.qkv_rope_forward, sets)),
        graph_ms(backward_calls(rope_kernel.fused_qkv_rope, sets)),
    )

    def rate(ms: float) -> str:
        return f"{nbytes / ms / 1e6:.0f}"

    cols = [name, "-", "-", f"{fwd:.4f}", f"{bwd:.4f}", "-", f"{rate(fwd)} / {rate(bwd)}"]
    check = None
    if te:
        fwd, bwd = graph_ms(forward_calls(te_qkv_rope, sets)), graph_ms(backward_calls(te_qkv_rope, sets))
        cols[1:3], cols[5] = [f"{fwd:.4f}", f"{bwd:.4f}"], f"{rate(fwd)} / {rate(bwd)}"
        packed, angles, per_group = sets[0]
        mine, theirs = rope_kernel.fused_qkv_rope(packed, angles, per_group), te_qkv_rope(packed, angles, per_group)
        grads = [torch.randn_like(t) for t in mine]
        leaf = packed.clone().requires_grad_()
        (g_mine,) = torch.autograd.grad(rope_kernel.fused_qkv_rope(leaf, angles, per_group), leaf, grads)
        (g_te,) = torch.autograd.grad(te_qkv_rope(leaf, angles, per_group), leaf, grads)
        check = (
            ulps(mine[0], theirs[0]),
            ulps(mine[1], theirs[1]),
            ulps(g_mine, g_te),
            torch.equal(mine[2], theirs[2]),
        )
    cols.append(rate(copy))
    return "| " + " | ".join(cols) + " |", check, sets


def sweep(sets: list, shape: tuple) -> list:
    """(rows per program, warps) -> (fwd, bwd) ms of direct calls, the default choice first."""
    s, b, heads, groups, hn, percent = shape
    default = rope_kernel.config(heads, groups, hn, int(hn * percent), s * b)
    choices = [(default["ROWS"], default["num_warps"])]
    choices += [(r, w) for r in (1, 2, 4, 8) for w in (1, 2, 4, 8) if (r, w) != choices[0] and (s * b) % r == 0]
    grads = [[torch.randn_like(t) for t in rope_kernel.qkv_rope_forward(*x)] for x in sets]
    out = []
    for rows_per_program, warps in choices:
        tune = dict(rows_per_program=rows_per_program, num_warps=warps)
        forward = [lambda x=sets[i % SETS], tune=tune: rope_kernel.qkv_rope_forward(*x, **tune) for i in range(CALLS)]
        backward = [
            lambda g=grads[i % SETS], a=sets[i % SETS][1], tune=tune: rope_kernel.qkv_rope_backward(*g, a, **tune)
            for i in range(CALLS)
        ]
        out.append(((rows_per_program, warps), (graph_ms(forward), graph_ms(backward))))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="time every rows-per-program x warps choice too")
    args = parser.parse_args()
    try:
        import transformer_engine.pytorch  # noqa: F401

        te = True
    except Exception as exc:  # TE's columns are left empty without it
        print(f"(no Transformer Engine: {type(exc).__name__}: {exc})")
        te = False
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16; ms per call, GB/s of 4(Q+2K) bytes\n")
    print("| shape | TE fwd | TE bwd | ours fwd | ours bwd | TE GB/s fwd / bwd | ours GB/s fwd / bwd | copy GB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    checks, sweeps = [], []
    for name, shape in SHAPES.items():
        line, check, sets = row(name, shape, te)
        print(line, flush=True)
        if check is not None:
            checks.append((name, *check))
        if args.sweep:
            sweeps.append((name, sweep(sets, shape)))
    for name, q, k, grad, v in checks:
        print(
            f"{name}: against TE, q up to {q[0]:.0f} ulp ({q[1]:.1e} differ), k {k[0]:.0f} ({k[1]:.1e}),"
            f" packed gradient {grad[0]:.0f} ({grad[1]:.1e}), v equal: {v}"
        )
    for name, rows in sweeps:
        print(f"\n{name}: rows per program x warps, fwd / bwd ms (direct calls; the default first)")
        for (rows_per_program, warps), (fwd, bwd) in rows:
            print(f"  {rows_per_program} x {warps}: {fwd:.4f} / {bwd:.4f}")


if __name__ == "__main__":
    main()
