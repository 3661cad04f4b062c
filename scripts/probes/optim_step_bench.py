"""Time the FSDP O2 optimizer step of llama3-8b at DP=2 on one GPU, piece by piece.

One rank's shards (~4.0e9 elements, each weight's half rows, as FSDP2 at DP=2 holds them: 32 layers of qkv, proj,
fc1, fc2 and two norms, untied embedding and output layer, final norm) with the step's states as
`te-delayed-fp8params-nocalib --layouts fsdp2_o2states` holds them: bf16 gradient shards, fp16 masters + int8
remainder, fp8 exp_avg, fp16 exp_avg_sq (128-element scale blocks), bf16 weight shards (the model copies the step
writes), and E4M3 gather bytes for the FP8 layers' linears (layers 2-31: the first and last stay bf16). Then, each
timed with CUDA events (ms per step, GB/s over the bytes it must move; the bound's 3011 GB/s for reference):

  * the grad norm (`_foreach_norm` of the bf16 gradients, fp32), the fused AdamW (`adam_kernel.adamw_step_`,
    stochastic rounding, as `PrecisionAwareAdamW.step` launches it, for two tile shapes; and, to tell its compute
    from its memory traffic, rounding to nearest and a skipped step), the grad zeroing
    (`_foreach_zero_`): the profile's "optimizer" row;
  * the FP8 shard amax before (abs().amax(): an |x| temporary) and after (`GatherScale.local_amax`: one read), and
    the cast into the gather bytes (`GatherScale.fill`);
  * FSDP2's all-gather copy-in of one layer unit (its `_foreach_copy_`, a multi_tensor_apply kernel the profile puts
    in "optimizer"), before (every input viewed as uint8: the unit mixes E4M3 bytes and bf16 norms) and after
    (`fsdp_params.gather_view`: the bytes as bf16), scaled to a step's gathers (4 micro-batches, each unit gathered
    for its forward and its backward but the last's).

    python scripts/probes/optim_step_bench.py            # ~45 GiB of GPU memory, under a minute on an H100
"""

from __future__ import annotations

import argparse

import torch

from megatron.optim import adam_kernel
from megatron.optim.states import ScaledState
from megatron.parallel.fsdp.fp8_gather import GatherScale, gather_view
from megatron.perf.probes import _time_ms

HIDDEN, FFN, KV, VOCAB, LAYERS, DP, MICRO = 4096, 14336, 1024, 128256, 32, 2, 4
BOUND_GBPS = 3011.0


def shard_shapes() -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, shard shape, FP8-gathered) of one rank's shards, in the model's order."""
    half = lambda rows: -(-rows // DP)  # noqa: E731  (FSDP's ceil(rows / ranks) rows)
    shapes = [("embedding", (half(VOCAB), HIDDEN), False)]
    for layer in range(LAYERS):
        fp8 = 0 < layer < LAYERS - 1
        shapes += [
            (f"{layer}.qkv", (half(HIDDEN + 2 * KV), HIDDEN), fp8),
            (f"{layer}.proj", (half(HIDDEN), HIDDEN), fp8),
            (f"{layer}.fc1", (half(2 * FFN), HIDDEN), fp8),
            (f"{layer}.fc2", (half(HIDDEN), FFN), fp8),
            (f"{layer}.norm1", (half(HIDDEN),), False),
            (f"{layer}.norm2", (half(HIDDEN),), False),
        ]
    return shapes + [("final_norm", (half(HIDDEN),), False), ("output", (half(VOCAB), HIDDEN), False)]


def timed(fn, iters: int) -> float:
    """ms per call over `iters` calls after one warm-up call (the bound's probes' timer)."""
    return _time_ms(fn, warmup=1, iters=iters)


def report(name: str, ms: float, nbytes: float) -> None:
    print(f"  {name:<62} {ms:8.2f} ms  {nbytes / 1e9:6.1f} GB  {nbytes / ms / 1e6:6.0f} GB/s", flush=True)


def build(device: torch.device) -> dict:
    """The states, one tensor at a time (no fp32 copy of the whole shard at once)."""
    gen = torch.Generator(device).manual_seed(0)
    out = {k: [] for k in ("grads", "masters", "m", "v", "weights", "decays", "fp8")}
    for _, shape, fp8 in shard_shapes():
        value = torch.randn(shape, device=device, generator=gen).mul_(0.02)
        grad = torch.randn(shape, device=device, generator=gen).mul_(1e-3)
        out["grads"].append(grad.bfloat16())
        out["masters"].append(ScaledState(value.view(-1), "fp16", remainder=True))
        out["m"].append(ScaledState(grad.view(-1), "fp8"))
        out["v"].append(ScaledState(grad.view(-1).square_(), "fp16"))
        out["weights"].append(value.bfloat16())
        out["decays"].append(0.1 if len(shape) == 2 else 0.0)
        if fp8:
            out["fp8"].append(len(out["weights"]) - 1)
        del value, grad
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    if not adam_kernel.available():
        raise SystemExit("needs a CUDA GPU and Triton")
    device = torch.device("cuda")
    s = build(device)
    grads, masters, ms, vs, weights = s["grads"], s["masters"], s["m"], s["v"], s["weights"]
    numel = sum(g.numel() for g in grads)
    print(f"{torch.cuda.get_device_name()}: {numel / 1e9:.3f}e9 shard elements in {len(grads)} tensors; ", end="")
    print(f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated", flush=True)

    print("the step (profile row 'optimizer'):")
    norm_ms = timed(lambda: torch._foreach_norm(grads, 2, dtype=torch.float32), args.iters)
    report("grad norm: _foreach_norm(bf16 grads, fp32)", norm_ms, 2 * numel)
    step = torch.ones((), dtype=torch.float64, device=device)
    scale, found_inf = torch.ones((), device=device), torch.zeros((), device=device)
    hyper = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, step=step, grad_scale=scale, found_inf=found_inf, seed=0)
    moved = sum(g.nbytes + 2 * (p.nbytes + m.nbytes + v.nbytes) + w.nbytes
                for g, p, m, v, w in zip(grads, masters, ms, vs, weights))  # fmt: skip
    default = adam_kernel._TILE, adam_kernel._NUM_WARPS
    adam = {}
    try:
        for tile, warps in (default, (2048, 8)):
            adam_kernel._TILE, adam_kernel._NUM_WARPS = tile, warps
            run = lambda: adam_kernel.adamw_step_(masters, grads, ms, vs, s["decays"], **hyper, model_copies=weights)  # noqa: E731
            adam[(tile, warps)] = timed(run, args.iters)
            suffix = " (the default)" if (tile, warps) == default else ""
            report(f"_adamw_kernel, tile {tile}, {warps} warps{suffix}", adam[(tile, warps)], moved)
    finally:
        adam_kernel._TILE, adam_kernel._NUM_WARPS = default
    # Diagnostics of where the kernel's time goes (not the run's step): without Philox (moments rounded to nearest),
    # and a skipped step (found_inf: the masters decoded into the weights only, 5 of the 18 B/element moved)
    nearest = dict(hyper, seed=None)
    run = lambda: adam_kernel.adamw_step_(masters, grads, ms, vs, s["decays"], **nearest, model_copies=weights)  # noqa: E731
    report("  diagnostic: _adamw_kernel rounding to nearest (no Philox)", timed(run, args.iters), moved)
    found_inf.fill_(1.0)
    run = lambda: adam_kernel.adamw_step_(masters, grads, ms, vs, s["decays"], **hyper, model_copies=weights)  # noqa: E731
    copy_bytes = sum(p.nbytes + w.nbytes for p, w in zip(masters, weights))
    report("  diagnostic: _adamw_kernel, a skipped step (decode + copy)", timed(run, args.iters), copy_bytes)
    found_inf.zero_()
    zero_ms = timed(lambda: torch._foreach_zero_(grads), args.iters)
    report("grad zero: _foreach_zero_(bf16 grads)", zero_ms, 2 * numel)
    total = norm_ms + adam[default] + zero_ms
    report("the step: norm + AdamW + zero", total, 4 * numel + moved)

    print("FP8 gather bytes, once per step (before the first forward):")
    fp8 = [weights[i] for i in s["fp8"]]
    fp8_numel = sum(w.numel() for w in fp8)
    before = timed(lambda: [w.abs().amax().float() for w in fp8], args.iters)
    report("shard amax before: abs().amax() (|x| temporary)", before, 6 * fp8_numel)
    scales = [GatherScale(device, None) for _ in fp8]
    after = timed(lambda: [sc.local_amax(w, 0) for sc, w in zip(scales, fp8)], args.iters)
    report("shard amax after: GatherScale.local_amax (one read)", after, 2 * fp8_numel)
    for sc, w in zip(scales, fp8):
        sc.set(w.abs().amax().float())
    cast = timed(lambda: [sc.fill(w, 0, w.shape[0]) for sc, w in zip(scales, fp8)], args.iters)
    report("cast into the gather bytes: GatherScale.fill", cast, 3 * fp8_numel)

    print("FSDP2 all-gather copy-in (_foreach_copy_), one FP8 layer unit, and per step:")
    unit = [sc.data for sc in scales[:4]] + [weights[s["fp8"][0] + k] for k in (4, 5)]  # 4 linears, 2 norms
    gathers = MICRO * (2 * LAYERS - 1)
    for label, inputs in (
        ("before: all as uint8", [t.view(torch.uint8).view(-1) for t in unit]),  # FSDP2 copies flat views
        ("after: E4M3 bytes as bf16 (gather_view)", [gather_view(t, torch.bfloat16).view(-1) for t in unit]),
    ):
        sizes = [t.numel() for t in inputs]
        output = torch.empty(sum(sizes) * DP, dtype=inputs[0].dtype, device=device)
        dsts = output.narrow(0, 0, sum(sizes)).split(sizes)
        unit_ms = timed(lambda inputs=inputs, dsts=dsts: torch._foreach_copy_(list(dsts), inputs), args.iters)
        nbytes = 2 * sum(t.nbytes for t in inputs)
        report(f"{label}, one unit", unit_ms, nbytes)
        report(f"{label}, x{gathers} gathers per step", unit_ms * gathers, nbytes * gathers)
        del output, dsts


if __name__ == "__main__":
    main()
