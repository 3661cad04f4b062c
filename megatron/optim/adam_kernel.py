"""The precision-aware AdamW step (`states.adamw_update_`) as one fused Triton kernel per tensor, for CUDA: the
host side.

The eager step decodes master, m and v to fp32, runs torch.optim.AdamW's arithmetic and re-encodes the three, about
30 passes over the tensor and 5.5 fp32 temporaries. This kernel reads the gradient and the encoded states once and
writes the new encodings once: 14 bytes per element in O2 (bf16 grad 2, fp16 master + int8 remainder 3 + 3, fp8 m
1 + 1, fp16 v 2 + 2), 28 for fp32 states and grads, plus 4 B per 128 elements and state for the scales.

The kernel itself, its tiles and its arithmetic (bit for bit `adamw_update_`'s when rounding to nearest, checked by
tests/gpu/test_adam_kernel.py on every format) are in `adam_triton.py`. Here: which states it can step
(`available`, `supports`), the scalars it reads as torch would round them (`step_scalars`, `torch_roundings`), the
launches (`adamw_step_`, one per tensor, no host synchronisation) and the timing.

Triton is imported on first use only (`available()` is False without it). `python -m megatron.optim.adam_kernel`
times the step on a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import struct
import time
from collections.abc import Sequence

import torch

from . import adam_triton
from .states import BLOCK, ScaledState, adamw_update_

_KINDS = {"fp32": 0, "bf16": 1, "fp16": 2, "fp8": 3}
# Elements per program and warps for them: 8 elements per thread (94 registers in O2 on sm_90, no spills). A larger
# block is one row of next_pow2(block) elements with proportionally more warps.
_TILE = 1024
_NUM_WARPS = 4
#: Set by tests under TRITON_INTERPRET=1 to step CPU tensors with the interpreted kernel (`available("cpu")`); off
#: otherwise, so that CPU runs keep the eager step and its torch.Generator stream whatever the environment says.
INTERPRET_ON_CPU = False
# A block is one row of registers, 32 warps at most: larger blocks are left to the eager step.
_MAX_BLOCK = 8192

State = ScaledState | torch.Tensor


# --------------------------------------------------------------------------------------------------------------------
# Which states, and the scalars as torch rounds them
# --------------------------------------------------------------------------------------------------------------------


def interpreting() -> bool:
    """Whether Triton runs kernels with its CPU interpreter (TRITON_INTERPRET=1, read when Triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def available(device: torch.device | str | None = None) -> bool:
    """Whether `PrecisionAwareAdamW` steps tensors on `device` (default: CUDA) with the kernel: Triton importable and
    a CUDA device; the CPU only under Triton's interpreter with `INTERPRET_ON_CPU` set (tests)."""
    device = torch.device("cuda" if device is None else device)
    if device.type == "cuda":
        return torch.cuda.is_available() and adam_triton.build() is not None
    return device.type == "cpu" and INTERPRET_ON_CPU and interpreting() and adam_triton.build() is not None


_Layout = tuple[int, bool, bool, int | None]
#: What `torch_roundings` found where torch rounds like none of the kernel's variants (then within 1 ulp, not bitwise).
KERNEL_NOTES: list[str] = []


def _operands(state: State) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], _Layout]:
    """((data, scales, remainder) to pass, (kind, root, remainder, block or None when unscaled)). Absent tensors are
    passed as the data again (never read: the layout's flags say so); fp8 data as uint8, which the kernel bitcasts.
    ValueError for what the kernel cannot take: non-contiguous data, plain tensors other than fp32."""
    if isinstance(state, ScaledState):
        data, scales, remainder = state.data, state.scales, state.remainder
        if not data.is_contiguous():
            raise ValueError("a non-contiguous state")
        if state.dtype_name == "fp8":
            data = data.view(torch.uint8)
        layout = (_KINDS[state.dtype_name], state.root, remainder is not None, None if scales is None else state.block)
        return (data, data if scales is None else scales, data if remainder is None else remainder), layout
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"a plain {state.dtype} state of strides {state.stride()} (plain states: contiguous fp32)")
    return (state, state, state), (0, False, False, None)


_OUT_KINDS = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}


def _out_kind(copy: torch.Tensor | None, numel: int) -> int:
    """The kernel's OUT_KIND for a model copy; ValueError for one it cannot write."""
    if copy is None:
        return 0
    if copy.dtype not in _OUT_KINDS or not copy.is_contiguous() or copy.numel() != numel:
        raise ValueError(
            f"a model copy of {copy.dtype}, {copy.numel()} elements (contiguous fp32/bf16/fp16 of {numel})"
        )
    return _OUT_KINDS[copy.dtype]


def _block(layouts: tuple[_Layout, _Layout, _Layout]) -> int:
    """The scale block the states share (BLOCK, as a tile width, when none is scaled); ValueError if they differ."""
    blocks = {layout[3] for layout in layouts} - {None}
    if len(blocks) > 1:
        raise ValueError(f"scale blocks of different sizes {sorted(blocks)}")
    block = blocks.pop() if blocks else BLOCK
    if block > _MAX_BLOCK:
        raise ValueError(f"scale blocks of {block} elements (at most {_MAX_BLOCK})")
    return block


def unsupported(master: State, exp_avg: State, exp_avg_sq: State) -> str | None:
    """Why the kernel cannot step these states, or None: the scaled ones must share one block size (at most
    _MAX_BLOCK), the data be contiguous, plain tensors fp32."""
    try:
        _block(tuple(_operands(state)[1] for state in (master, exp_avg, exp_avg_sq)))
    except ValueError as exc:
        return str(exc)
    return None


def supports(masters: Sequence[State], exp_avgs: Sequence[State], exp_avg_sqs: Sequence[State]) -> bool:
    """Whether `unsupported` finds nothing for every tensor."""
    return all(unsupported(p, m, v) is None for p, m, v in zip(masters, exp_avgs, exp_avg_sqs))


@functools.lru_cache(maxsize=64)
def _config(
    layouts: tuple[_Layout, _Layout, _Layout], out_kind: int, flags: tuple[bool, ...], tile: int, warps: int
) -> tuple:
    """(block, rows per program, launch keywords: the constexprs, warps and no fp fusion) for these layouts and the
    model copy's kind (`_OUT_KINDS`, 0 for none)."""
    (p_kind, p_root, p_rem, _), (m_kind, m_root, _, _), (v_kind, v_root, _, _) = layouts
    block = _block(layouts)
    cols = 1 << (block - 1).bit_length()
    rows = max(1, tile // cols)
    # A block beyond the tile is one row: more warps keep it at the tile's elements per thread (no spills).
    warps = min(32, warps * max(1, cols // tile))
    has_grad_scale, has_found_inf, lerp_small, lerp_fma, addcmul, bc2_reciprocal, stochastic = flags
    keywords = dict(
        P_KIND=p_kind,
        P_ROOT=p_root,
        P_REM=p_rem,
        M_KIND=m_kind,
        M_ROOT=m_root,
        V_KIND=v_kind,
        V_ROOT=v_root,
        OUT_KIND=out_kind,
        HAS_GRAD_SCALE=has_grad_scale,
        HAS_FOUND_INF=has_found_inf,
        LERP_SMALL=lerp_small,
        LERP_FMA=lerp_fma,
        ADDCMUL=addcmul,
        BC2_RECIPROCAL=bc2_reciprocal,
        STOCHASTIC=stochastic,
        BLOCK=block,
        COLS=cols,
        ROWS=rows,
        num_warps=warps,
        enable_fp_fusion=False,
    )
    return block, rows, keywords


def fma32(x: torch.Tensor | float, y: torch.Tensor | float, z: torch.Tensor | float) -> torch.Tensor:
    """x * y + z of fp32 values rounded once to fp32, as a GPU's fma, computed on their device without one. In fp64
    the product is exact and the sum s rounds once, with an exact error e (TwoSum); s rounds to the fp32 value
    nearest x * y + z except where s is an fp32 midpoint and e is not 0, and there e's sign picks the neighbour (a
    second rounding would take the even one)."""
    x, y, z = (torch.as_tensor(a, dtype=torch.float32) for a in (x, y, z))
    p, q = x.double() * y.double(), z.double()
    s = p + q
    b = s - p
    e = (p - (s - b)) + (q - b)
    near = s.float()
    other = torch.nextafter(near, torch.where(s > near, torch.inf, -torch.inf).float())
    tie = (near.double() + other.double()) / 2 == s
    return torch.where(tie & (e != 0) & ((e > 0) == (other > near)), other, near)


@functools.cache
def _roundings(device_type: str) -> tuple[bool, int]:
    device = torch.device(device_type)
    gen = torch.Generator().manual_seed(0)
    a, b, v = (torch.randn(4096, generator=gen) for _ in range(3))
    w, alpha, beta2 = _fp32(0.1), _fp32(0.05), _fp32(0.95)
    # The candidates in fp32 on the CPU (one rounding per op, an fma by `fma32`).
    fma = fma32
    lerp = torch.lerp(a.to(device), b.to(device), w).cpu()
    lerp_fma = torch.equal(lerp, fma(torch.full_like(a, w), b - a, a))
    if not lerp_fma and not torch.equal(lerp, a + w * (b - a)):
        KERNEL_NOTES.append(f"torch.lerp on {device_type} rounds like no candidate: the kernel's m may be 1 ulp off")
    vb = v.abs() * beta2
    got = v.abs().to(device).mul(beta2).addcmul_(b.to(device), b.to(device), value=alpha).cpu()
    candidates = [fma(torch.full_like(b, alpha), b * b, vb), fma(alpha * b, b, vb), vb + alpha * (b * b)]
    candidates.append(vb + (alpha * b) * b)
    matches = [i for i, candidate in enumerate(candidates) if torch.equal(got, candidate)]
    if not matches:
        KERNEL_NOTES.append(f"addcmul on {device_type} rounds like no candidate: the kernel's v may be 1 ulp off")
    return lerp_fma, matches[0] if matches else 0


def torch_roundings(device: torch.device) -> tuple[bool, int]:
    """How torch's lerp and addcmul round on `device`, which the kernel then does too: (whether lerp fuses its
    product and sum into an fma, which association and fusion addcmul_'s v + a g g has: 0 fma(a, g g, v) (CUDA's
    `a + alpha * (b * c)`, contracted by nvcc), 1 fma(a g, g, v) (the CPU's `self + value * t1 * t2`, contracted by
    GCC), 2 and 3 those two unfused). Found once per device type by running both ops on 4096 values against
    fp32 emulations (one host sync, at the first step); a build matching none is noted in KERNEL_NOTES."""
    return _roundings(device.type)


def step_scalars(
    step: int | torch.Tensor, lr: float, beta1: float, beta2: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(fp32 [neg_step_size, bias_correction2_sqrt or its reciprocal], float64 step, whether the reciprocal) on
    `device`: `adamw_update_`'s expressions (on the device for a tensor step: no host sync), rounded to fp32 as torch
    does when they meet the fp32 moments. An int step makes them Python floats there, and CUDA's division by a
    Python scalar multiplies by its fp32 reciprocal (`div_true_kernel_cuda`; the CPU's divides): so does the kernel."""
    if isinstance(step, torch.Tensor):
        step = step.to(device=device, dtype=torch.float64)
        neg_step_size = -lr / (1 - torch.pow(beta1, step))
        bias_correction2_sqrt = (1 - torch.pow(beta2, step)).sqrt()
        return torch.stack([neg_step_size, bias_correction2_sqrt]).float(), step.reshape(()), False
    neg_step_size, bias_correction2_sqrt = -(lr / (1 - beta1**step)), math.sqrt(1 - beta2**step)
    reciprocal = device.type == "cuda"
    if reciprocal:
        bias_correction2_sqrt = 1.0 / _fp32(bias_correction2_sqrt)  # 1 / fp32 in fp64, then to fp32: exact as fp32's
    coef = torch.tensor([neg_step_size, bias_correction2_sqrt], dtype=torch.float32, device=device)
    return coef, torch.tensor(float(step), dtype=torch.float64, device=device), reciprocal


def _fp32(x: float) -> float:
    """x rounded to nearest fp32 (what torch does with a Python scalar in an fp32 op), as a Python float."""
    return struct.unpack("f", struct.pack("f", x))[0]


def adamw_step_(
    masters: Sequence[State],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[State],
    exp_avg_sqs: Sequence[State],
    weight_decays: Sequence[float],
    *,
    lr: float | Sequence[float],
    beta1: float,
    beta2: float,
    eps: float,
    step: int | torch.Tensor,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    seed: int | None = None,
    model_copies: Sequence[torch.Tensor | None] | None = None,
) -> None:
    """`adamw_update_` on every tensor i, one kernel launch each, no host synchronisation. `lr`: one for all
    tensors or one per tensor (the tensors sharing a rate are launched together).

    Same arguments as `adamw_update_` (states: ScaledStates or contiguous fp32 tensors on one device, see
    `unsupported`; grads fp32, bf16 or fp16), except `seed`: None rounds the moments to nearest (bit for bit the
    eager result), an int rounds them stochastically with Philox keyed by it and counted by (element, step, i). The
    bias corrections are computed once for all tensors: from a device step tensor without a host sync (an int step
    is copied to the device). `grad_scale`, `found_inf`: 0-dim tensors, best on the device (a CPU one is copied
    there, and a CPU grad_scale then divides where CUDA's eager step multiplies by its reciprocal: 1 ulp apart).
    `model_copies[i]`: a contiguous fp32, bf16 or fp16 tensor of master i's size (or None) that receives the new
    master as `copy_(master.decode())` would, written by the same pass (on a skipped step: the unchanged master)."""
    count = len(masters)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(weight_decays) == count):
        raise ValueError(
            f"{len(grads)} grads, {len(exp_avgs)} exp_avg, {len(exp_avg_sqs)} exp_avg_sq and {len(weight_decays)}"
            f" weight decays for {count} masters: pass one of each per tensor"
        )
    copies = [None] * count if model_copies is None else list(model_copies)
    if len(copies) != count:
        raise ValueError(f"{len(copies)} model copies for {count} masters: pass one (or None) per tensor")
    items = list(zip(range(count), masters, grads, exp_avgs, exp_avg_sqs, weight_decays, copies))
    lrs = [lr] * count if isinstance(lr, (int, float)) else list(lr)
    if len(lrs) != count:
        raise ValueError(f"{len(lrs)} learning rates for {count} masters: pass one, or one per tensor")
    for rate in dict.fromkeys(lrs):  # the bias-corrected step size is computed once per rate
        group = [item for item, r in zip(items, lrs) if r == rate]
        _launch(group, rate, beta1, beta2, eps, step, grad_scale, found_inf, seed)


def _launch(
    items: list[tuple[int, State, torch.Tensor, State, State, float, torch.Tensor | None]],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int | torch.Tensor,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    seed: int | None,
) -> None:
    if not items:
        return
    kernel = adam_triton.build()
    if kernel is None:
        raise RuntimeError("the fused AdamW step needs Triton (pip install triton); states.adamw_update_ does not")
    first = items[0][1]
    device = (first.data if isinstance(first, ScaledState) else first).device
    coef, step_tensor, bc2_reciprocal = step_scalars(step, lr, beta1, beta2, device)
    if grad_scale is not None:
        grad_scale = grad_scale.to(device).reshape(1)
    if found_inf is not None:
        found_inf = found_inf.to(device).reshape(1)
        found_inf = found_inf if found_inf.is_floating_point() else found_inf.float()
    lerp_w = _fp32(1 - beta1)
    scalars = (_fp32(beta2), _fp32(1 - beta2), _fp32(eps))
    lerp_fma, addcmul = torch_roundings(device)
    flags = (grad_scale is not None, found_inf is not None, abs(lerp_w) < 0.5, lerp_fma, addcmul, bc2_reciprocal)
    flags += (seed is not None,)
    placeholders = (coef if grad_scale is None else grad_scale, coef if found_inf is None else found_inf)
    # Philox keys are 64-bit: any int seed is folded into [0, 2^63).
    seed_key = 0 if seed is None else int(seed) % (1 << 63)
    decays: dict[float, float] = {}
    launches = []  # all checked before the first launch: a refused tensor leaves every state as it was
    for index, master, grad, m, v, wd, copy in items:
        try:
            (p_ops, p_layout), (m_ops, m_layout), (v_ops, v_layout) = (_operands(s) for s in (master, m, v))
            out_kind = _out_kind(copy, p_ops[0].numel())
            block, rows, keywords = _config((p_layout, m_layout, v_layout), out_kind, flags, _TILE, _NUM_WARPS)
        except ValueError as exc:
            raise ValueError(
                f"the fused AdamW step does not handle {exc} (tensor {index}): use adamw_update_"
            ) from None
        n = p_ops[0].numel()
        if grad.numel() != n:
            raise ValueError(f"a gradient of {grad.numel()} elements for a parameter of {n}; pass its own grad")
        if wd not in decays:
            decays[wd] = _fp32(1 - lr * wd)
        programs = (n + block * rows - 1) // (block * rows)  # whole blocks, ROWS of them per program
        out = grad if copy is None else copy  # absent: never written (OUT_KIND 0)
        operands = (grad.reshape(-1), *p_ops, m_ops[0], m_ops[1], v_ops[0], v_ops[1], coef, step_tensor, *placeholders)
        operands += (out,)
        if n:
            launches.append((programs, (*operands, n, decays[wd], lerp_w, *scalars, seed_key, index), keywords))
    # Triton launches on the current device: make it the tensors' (a rank's tensors need not be on cuda:0).
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        for programs, args, keywords in launches:
            kernel[(programs,)](*args, **keywords)


# --------------------------------------------------------------------------------------------------------------------
# Timing (python -m megatron.optim.adam_kernel, on a GPU)
# --------------------------------------------------------------------------------------------------------------------


def _llama_1b_pieces(numel: int) -> list[int]:
    """Tensor sizes like half of llama-1b's (hidden 2048, ffn 8192, 8 kv heads of 64, vocabulary 128256: the pieces
    of one rank of two with the distributed optimizer), cycled until `numel` elements in all (the last one cut)."""
    layer = [2048 * 3072 // 2, 2048 * 2048 // 2, 2048 * 16384 // 2, 8192 * 2048 // 2, 2048, 2048]
    sizes: list[int] = []
    for size in itertools.chain([128256 * 2048 // 2], itertools.cycle(layer)):
        size = min(size, numel - sum(sizes))
        if size <= 0:
            return sizes
        sizes.append(size)
    return sizes


def _time_ms(fn, steps: int) -> tuple[float, float]:
    """(device ms per call, host ms per call to enqueue it) over `steps` calls after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    host = time.perf_counter()
    for _ in range(steps):
        fn()
    host = time.perf_counter() - host
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps, 1e3 * host / steps


def _o2_states(sizes: list[int], device: torch.device) -> tuple[list, list, list, list]:
    """(bf16 grads, fp16 + remainder masters, fp8 m, fp16 v) of these sizes, random values of typical magnitudes."""
    gen = torch.Generator(device).manual_seed(0)
    grads = [torch.randn(s, device=device, generator=gen).mul_(1e-3).bfloat16() for s in sizes]
    masters = [
        ScaledState(torch.randn(s, device=device, generator=gen).mul_(0.02), "fp16", remainder=True) for s in sizes
    ]
    return (
        grads,
        masters,
        [ScaledState(g.float(), "fp8") for g in grads],
        [ScaledState(g.float() ** 2, "fp16") for g in grads],
    )


def benchmark(numel: int = 550_000_000, steps: int = 20, eager_steps: int = 3) -> dict[str, float]:
    """ms per step for `numel` elements in llama-1b-like tensors, O2 (bf16 grads, fp16 master + remainder, fp8 m,
    fp16 v): the kernel rounding stochastically and to nearest, for a few tile shapes, against `adamw_update_` (the
    eager step) and torch's fused AdamW on fp32 states. Prints a table; returns {name: ms per step}."""
    global _TILE, _NUM_WARPS
    if not available():
        raise RuntimeError("the benchmark needs a CUDA GPU and Triton")
    device = torch.device("cuda")
    sizes = _llama_1b_pieces(numel)
    grads, masters, exp_avgs, exp_avg_sqs = _o2_states(sizes, device)
    decays = [0.1 if s > 2048 else 0.0 for s in sizes]
    step = torch.ones((), dtype=torch.float64, device=device)
    found_inf, grad_scale = torch.zeros((), device=device), torch.ones((), device=device)
    hyper = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, step=step, grad_scale=grad_scale, found_inf=found_inf)
    state_bytes = sum(s.nbytes for states in (masters, exp_avgs, exp_avg_sqs) for s in states)
    moved = sum(g.numel() * g.element_size() for g in grads) + 2 * state_bytes
    total = sum(sizes)
    print(f"{total / 1e6:.1f}M elements in {len(sizes)} tensors, O2: bf16 grads, fp16 master + int8 remainder, fp8 m,")
    print(f"fp16 v: {moved / total:.2f} B/element moved; {torch.cuda.get_device_name()}")
    results: dict[str, float] = {}
    default = _TILE, _NUM_WARPS
    try:
        for seed, mode in ((0, "stochastic"), (None, "nearest")):
            for tile, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8)):
                _TILE, _NUM_WARPS = tile, warps
                ms, host = _time_ms(
                    lambda seed=seed: adamw_step_(masters, grads, exp_avgs, exp_avg_sqs, decays, **hyper, seed=seed),
                    steps,
                )
                name = f"kernel {mode}, tile {tile}, {warps} warps"
                results[name] = ms
                print(f"  {name:<42} {ms:8.2f} ms/step  {moved / ms / 1e9:5.2f} TB/s  (host: {host:.2f} ms to launch)")
    finally:
        _TILE, _NUM_WARPS = default
    eager_gen = torch.Generator(device).manual_seed(0)

    def eager() -> None:
        for p, g, m, v, wd in zip(masters, grads, exp_avgs, exp_avg_sqs, decays):
            adamw_update_(p, g, m, v, weight_decay=wd, **hyper, generator=eager_gen)

    name = "eager adamw_update_, stochastic"
    results[name], _ = _time_ms(eager, eager_steps)
    print(f"  {name:<42} {results[name]:8.2f} ms/step")
    for states in (masters, exp_avgs, exp_avg_sqs):
        states.clear()  # room for the fp32 states
    params = [torch.zeros(s, device=device, requires_grad=True) for s in sizes]
    for p, g in zip(params, grads):
        p.grad = g.float()
    name = "torch fused AdamW, fp32 states and grads"
    results[name], _ = _time_ms(torch.optim.AdamW(params, lr=1e-4, fused=True).step, steps)
    print(f"  {name:<42} {results[name]:8.2f} ms/step")
    return results


if __name__ == "__main__":
    benchmark()
