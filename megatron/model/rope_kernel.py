"""RoPE on the packed QKV output as one Triton kernel each way (CUDA): q and k rotated, v copied, written out as
three contiguous tensors; the backward writes the packed gradient directly.

What it computes is Transformer Engine's `apply_fused_qkv_rotary_pos_emb(packed, angles, angles, [np/ng * hn, hn,
hn], tensor_format="sbhd")` (non-interleaved), which the attention layers used before:
    packed [s, b, ng, (np/ng + 2) * hn]: per query group its np/ng query heads, its key head, its value head;
    angles [s2 >= s, 1, 1, d] fp32 (`RotaryEmbedding`, d <= hn even; channels d..hn pass through);
    per head, in fp32 with c = cos(angle[i]), n = sin(angle[i]), h = d / 2:
        out[i] = x[i] c - x[i + h] n  (i < h),   out[i] = x[i] c + x[i - h] n  (h <= i < d),
    rounded once to the input dtype; the backward applies the transpose (sin(angle[i + h]) and -sin(angle[i - h])).
The cosines and sines are CUDA's `cosf` / `sinf` (torch's, as `apply_rotary` takes them; TE's `sincosf` is the
same correctly reduced function), computed into an fp32 [2, s, d] table (`trig_table`) once per angles tensor and
length, which every layer of a forward and their backwards share: evaluated per thread inside the kernel they cost
as much as the memory traffic (tens of instructions each, for every column each thread holds). Results equal TE's
up to how the compilers contract `a c + b n` into an fma: within one ulp of the output dtype.

Why not TE's kernel: it runs at about a third of the memory bandwidth (llama-1b 22.4 ms per step against 7.1 ms of
bytes): its threads move one 2-byte element at a time and read each element twice. Here one program takes
ROWS whole (s, b) rows: per row it reads the position's cos / sin once for all heads, and moves each kind of head
as two [heads, d/2] tiles (the halves that pair up) plus the pass-through channels: every byte read once and
written once, in 16-byte vectors, all of a row's loads issued before its first store (one memory latency a row).

Triton is imported on first use only (`build()`); `available()` is False without it. The CPU (the plain GPT, the
numerical oracle) never runs this kernel; the tests run it under Triton's interpreter on the CPU too
(tests/gpu/test_rope_kernel.py). `python3 scripts/probes/rope_bench.py` times it against TE's on a GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

# Bound by `build()`; None until then, so that importing this module never imports Triton.
tl = None
_TRITON: Any = None  # the triton module once built, False when it cannot be imported

# Tiles and warps: each thread moves 16-byte vectors (8 elements of bf16), so the warps are as many as the smallest
# tile (the key heads' halves) fills with _VECTOR elements per thread (1 to 8); the query tiles hold at most
# _PER_THREAD elements per thread (registers), more heads than that are taken in blocks. Rows shorter than
# _ROW_ELEMENTS go several to a program (tensor parallelism leaves few heads per rank).
_VECTOR = 8
_PER_THREAD = 32
_ROW_ELEMENTS = 2048


# --------------------------------------------------------------------------------------------------------------------
# Kernel (plain functions: `build()` wraps them with triton.jit and rebinds these names to the jitted versions)
# --------------------------------------------------------------------------------------------------------------------


def _offsets(FIRST: tl.constexpr, N: tl.constexpr, PER: tl.constexpr, OFFSET: tl.constexpr, SLOTS: tl.constexpr,
             HN: tl.constexpr, TO_PACKED: tl.constexpr, HEADS_B: tl.constexpr):  # fmt: skip
    """Heads FIRST.. of one kind (q, k or v) of a row: head i is slot (i // PER) * SLOTS + OFFSET + i % PER of the
    packed row and slot i of the dense one (q, k or v). Returns (source offsets, destination offsets, mask): read
    from the packed row, written to the dense one, or the other way round with TO_PACKED (backward)."""
    heads = FIRST + tl.arange(0, HEADS_B)
    packed = ((heads // PER) * SLOTS + OFFSET + heads % PER) * HN
    dense = heads * HN
    if TO_PACKED:
        return dense, packed, heads < N
    return packed, dense, heads < N


def _load(src, off, head_mask, START: tl.constexpr, WIDTH: tl.constexpr, WIDTH_B: tl.constexpr):
    """Channels START..START+WIDTH of a block of heads: a [heads, WIDTH_B] tile (masked beyond)."""
    cols = tl.arange(0, WIDTH_B)
    return tl.load(src + off[:, None] + START + cols[None, :], mask=head_mask[:, None] & (cols < WIDTH)[None, :])


def _store(dst, off, x, head_mask, START: tl.constexpr, WIDTH: tl.constexpr, WIDTH_B: tl.constexpr):
    cols = tl.arange(0, WIDTH_B)
    mask = head_mask[:, None] & (cols < WIDTH)[None, :]
    tl.store(dst + off[:, None] + START + cols[None, :], x.to(dst.dtype.element_ty), mask=mask)


def _qkv_rope_kernel(
    packed,
    q,
    k,
    v,
    trig,
    batch,
    sin_offset,
    NP: tl.constexpr,
    NG: tl.constexpr,
    PER: tl.constexpr,
    HN: tl.constexpr,
    HN_B: tl.constexpr,
    HALF: tl.constexpr,
    HALF_B: tl.constexpr,
    REST: tl.constexpr,
    REST_B: tl.constexpr,
    Q_HEADS_B: tl.constexpr,
    KV_HEADS_B: tl.constexpr,
    ROWS: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    """ROWS rows (s, b) of the packed tensor <-> q, k, v. Forward: packed -> q, k, v; BACKWARD: their gradients ->
    the packed gradient (the transposed rotation). trig: cos of the angles [s, 2 HALF], their sin at sin_offset.

    Per row, every load comes before the first store (the compiler may not move a load past a store: the pointers
    could alias), so that a row costs one memory latency: the query heads (in blocks of Q_HEADS_B when there are
    more), with the first block the key and value heads (all of them: KV_HEADS_B >= NG). Rotated halves x1, x2 of
    the first 2 HALF channels: y1 = x1 cos1 + x2 sin_a, y2 = x2 cos2 + x1 sin_b."""
    cols = tl.arange(0, HALF_B)
    col_mask = cols < HALF
    for r in tl.static_range(ROWS):
        row = tl.program_id(0).to(tl.int64) * ROWS + r
        cos_row = trig + (row // batch) * (2 * HALF)
        cos1 = tl.load(cos_row + cols, mask=col_mask, other=0.0)[None, :]
        cos2 = tl.load(cos_row + HALF + cols, mask=col_mask, other=0.0)[None, :]
        sin1 = tl.load(cos_row + sin_offset + cols, mask=col_mask, other=0.0)[None, :]
        sin2 = tl.load(cos_row + sin_offset + HALF + cols, mask=col_mask, other=0.0)[None, :]
        if BACKWARD:
            sin_a, sin_b = sin2, -sin1
        else:
            sin_a, sin_b = -sin1, sin2
        p_row = packed + row * (NG * (PER + 2) * HN)
        q_row, k_row, v_row = q + row * (NP * HN), k + row * (NG * HN), v + row * (NG * HN)
        if BACKWARD:
            q_src, k_src, v_src, q_dst, k_dst, v_dst = q_row, k_row, v_row, p_row, p_row, p_row
        else:
            q_src, k_src, v_src, q_dst, k_dst, v_dst = p_row, p_row, p_row, q_row, k_row, v_row
        for first in tl.static_range(0, NP, Q_HEADS_B):
            qs, qd, qm = _offsets(first, NP, PER, 0, PER + 2, HN, BACKWARD, Q_HEADS_B)
            q1 = _load(q_src, qs, qm, 0, HALF, HALF_B).to(tl.float32)
            q2 = _load(q_src, qs, qm, HALF, HALF, HALF_B).to(tl.float32)
            if REST > 0:
                q_rest = _load(q_src, qs, qm, 2 * HALF, REST, REST_B)
            if first == 0:
                ks, kd, km = _offsets(0, NG, 1, PER, PER + 2, HN, BACKWARD, KV_HEADS_B)
                vs, vd, vm = _offsets(0, NG, 1, PER + 1, PER + 2, HN, BACKWARD, KV_HEADS_B)
                k1 = _load(k_src, ks, km, 0, HALF, HALF_B).to(tl.float32)
                k2 = _load(k_src, ks, km, HALF, HALF, HALF_B).to(tl.float32)
                if REST > 0:
                    k_rest = _load(k_src, ks, km, 2 * HALF, REST, REST_B)
                v_all = _load(v_src, vs, vm, 0, HN, HN_B)
            _store(q_dst, qd, q1 * cos1 + q2 * sin_a, qm, 0, HALF, HALF_B)
            _store(q_dst, qd, q2 * cos2 + q1 * sin_b, qm, HALF, HALF, HALF_B)
            if REST > 0:
                _store(q_dst, qd, q_rest, qm, 2 * HALF, REST, REST_B)
            if first == 0:
                _store(k_dst, kd, k1 * cos1 + k2 * sin_a, km, 0, HALF, HALF_B)
                _store(k_dst, kd, k2 * cos2 + k1 * sin_b, km, HALF, HALF, HALF_B)
                if REST > 0:
                    _store(k_dst, kd, k_rest, km, 2 * HALF, REST, REST_B)
                _store(v_dst, vd, v_all, vm, 0, HN, HN_B)


def build() -> Any:
    """Import Triton and jit the kernel (once): the jitted `_qkv_rope_kernel`, or None without Triton."""
    global _TRITON, tl, _offsets, _load, _store, _qkv_rope_kernel
    if _TRITON is None:
        try:
            import triton
        except ImportError:
            _TRITON = False
            return None
        tl = triton.language
        # The kernel resolves its helpers through this module's globals: rebind them to their jitted versions.
        _offsets, _load, _store = triton.jit(_offsets), triton.jit(_load), triton.jit(_store)
        _qkv_rope_kernel = triton.jit(_qkv_rope_kernel)
        _TRITON = triton
    return _qkv_rope_kernel if _TRITON else None


# --------------------------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------------------------


def available() -> bool:
    """Whether the kernel can run: Triton imports (tried once, at the first call: the first CUDA forward)."""
    return build() is not None


def rope_path(fusion: bool, angles: torch.Tensor, device: torch.device, te_kernel: bool) -> str:
    """How the attention layers rotate q and k of the packed QKV output on `device` with these angles:

    "triton"  this kernel: RoPE fusion on (the default; --no-rope-fusion and --qk-layernorm turn it off), angles
              shared by the batch ([s, 1, 1, d]), CUDA, Triton importable;
    "te"      TE's fused QKV kernel (`te_kernel`: the layer is TE's) where only Triton is missing;
    "unfused" `apply_rotary` on q and k: --no-rope-fusion, per-sample positions ([s, b, 1, d] angles, which
              neither kernel takes), the CPU (the plain GPT stays the oracle, op for op).
    """
    if not fusion or angles.shape[1] != 1 or device.type != "cuda":
        return "unfused"
    if available():
        return "triton"
    return "te" if te_kernel else "unfused"


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def config(
    heads: int, groups: int, head_dim: int, rotary_dim: int, rows: int, *, rows_per_program: int | None = None,
    num_warps: int | None = None,
) -> dict[str, int]:  # fmt: skip
    """The kernel's compile-time sizes and launch shape for `rows` (s * b) rows of `heads` query heads in `groups`
    groups of `head_dim` channels, the first `rotary_dim` rotated. `rows_per_program` and `num_warps` override the
    choice (scripts/probes/rope_bench.py sweeps them)."""
    if heads % groups:
        raise ValueError(f"{heads} query heads do not split into {groups} groups")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary dimension {rotary_dim}: must be even and in 2..{head_dim} (the head size)")
    half, rest, hn_b = rotary_dim // 2, head_dim - rotary_dim, _next_pow2(head_dim)
    half_b = _next_pow2(half)
    kv_heads = _next_pow2(groups)  # all key and value heads in one tile (the kernel loads them with the first block)
    if num_warps is None:
        num_warps = min(max(kv_heads * half_b // (32 * _VECTOR), 1), 8)
    q_heads = min(_next_pow2(heads), max(1, num_warps * 32 * _PER_THREAD // half_b))
    if rows_per_program is None:
        rows_per_program = 1
        row_elements = (heads + 2 * groups) * head_dim
        while rows_per_program * 2 * row_elements <= _ROW_ELEMENTS and rows % (rows_per_program * 2) == 0:
            rows_per_program *= 2
    if rows % rows_per_program:
        raise ValueError(f"{rows_per_program} rows per program do not divide {rows} rows")
    return dict(
        NP=heads, NG=groups, PER=heads // groups, HN=head_dim, HN_B=hn_b, HALF=half, HALF_B=half_b,
        REST=rest, REST_B=_next_pow2(max(rest, 1)), Q_HEADS_B=q_heads, KV_HEADS_B=kv_heads, ROWS=rows_per_program,
        num_warps=num_warps,
    )  # fmt: skip


# `config` of a launch: the same few shapes every layer and micro-batch (the dict is shared: read only)
_launch_config = functools.lru_cache(maxsize=256)(config)


def trig_table(angles: torch.Tensor, seq: int) -> torch.Tensor:
    """cos and sin of the first `seq` positions' angles ([s2 >= seq, 1, 1, d]) as one fp32 [2, seq, d] tensor: two
    small torch kernels (CUDA's `cosf` / `sinf`, as TE's kernel and `apply_rotary` compute them), so that the main
    kernel's threads read them instead of each evaluating the same sines for every head.

    The table is kept on `angles` (an attribute: it goes with the tensor) for the next call with the same length
    and the angles unchanged since (their version): the model computes its angles once a forward and every layer,
    forward and backward, rotates by them, so the table is made once a micro-batch instead of twice a layer (2 x 16
    x 4 small kernels and their host work a step on llama-1b). Not while a CUDA graph is captured: a graph computes
    its own, into its memory pool, and the replays refresh it."""
    if angles.dim() != 4 or angles.shape[1] != 1 or angles.shape[2] != 1 or angles.shape[0] < seq:
        raise ValueError(f"angles of shape {tuple(angles.shape)}: the kernel takes [s2 >= {seq}, 1, 1, d]")
    # inference tensors (torch.inference_mode) count no versions: theirs are made each call
    keep = not angles.is_inference() and not (angles.is_cuda and torch.cuda.is_current_stream_capturing())
    key = (seq, angles._version) if keep else None
    kept = getattr(angles, "_rope_trig_table", None)
    if keep and kept is not None and kept[0] == key:
        return kept[1]
    theta = angles[:seq].reshape(seq, angles.shape[-1]).float()
    table = torch.empty((2, *theta.shape), dtype=torch.float32, device=theta.device)
    torch.cos(theta, out=table[0])
    torch.sin(theta, out=table[1])
    if keep:
        angles._rope_trig_table = (key, table)
    return table


def launch(
    packed: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, angles: torch.Tensor, backward: bool,
    tune: dict[str, int],
) -> Any:  # fmt: skip
    """One launch over all rows: packed -> q, k, v, or (backward) their gradients -> packed. Returns Triton's
    compiled kernel (tests read its PTX)."""
    kernel = build()
    if kernel is None:
        raise RuntimeError("the fused RoPE kernel needs Triton (pip install triton); --no-rope-fusion does not")
    s, b, heads, hn = q.shape
    groups = k.shape[2]
    table = trig_table(angles, s)
    sizes = _launch_config(heads, groups, hn, table.shape[2], s * b, **tune)
    grid = (s * b // sizes["ROWS"],)
    args = (packed, q, k, v, table, b, table[0].numel())
    # fma contraction on, as nvcc compiles TE's kernel (Triton's default changes after 3.9)
    flags = dict(BACKWARD=backward, enable_fp_fusion=True)
    if packed.device.type == "cuda" and packed.device.index != torch.cuda.current_device():
        with torch.cuda.device(packed.device):  # Triton launches on the current device
            return kernel[grid](*args, **sizes, **flags)
    return kernel[grid](*args, **sizes, **flags)


def qkv_rope_forward(
    packed: torch.Tensor, angles: torch.Tensor, heads_per_group: int, **tune: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [s, b, np, hn], k and v [s, b, ng, hn] (contiguous, RoPE on q and k) from the packed QKV output
    [s, b, ng, (np/ng + 2) * hn] and angles [s2, 1, 1, d]."""
    s, b, groups, width = packed.shape
    hn = width // (heads_per_group + 2)
    if hn * (heads_per_group + 2) != width:
        raise ValueError(f"a packed row of {width} channels does not hold {heads_per_group} + 2 heads per group")
    packed = packed.contiguous()
    q = packed.new_empty(s, b, groups * heads_per_group, hn)
    k, v = packed.new_empty(s, b, groups, hn), packed.new_empty(s, b, groups, hn)
    if q.numel():
        launch(packed, q, k, v, angles, False, tune)
    return q, k, v


def qkv_rope_backward(
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, angles: torch.Tensor, **tune: int
) -> torch.Tensor:
    """The gradient of the packed QKV output [s, b, ng, (np/ng + 2) * hn] from those of q, k and v."""
    s, b, heads, hn = dq.shape
    groups = dk.shape[2]
    dq, dk, dv = dq.contiguous(), dk.contiguous(), dv.contiguous()
    packed = dq.new_empty(s, b, groups, (heads // groups + 2) * hn)
    if dq.numel():
        launch(packed, dq, dk, dv, angles, True, tune)
    return packed


class _QKVRoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, packed: torch.Tensor, angles: torch.Tensor, heads_per_group: int):
        ctx.save_for_backward(angles)
        return qkv_rope_forward(packed, angles, heads_per_group)

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor):
        (angles,) = ctx.saved_tensors
        return qkv_rope_backward(dq, dk, dv, angles), None, None


def fused_qkv_rope(
    packed: torch.Tensor, angles: torch.Tensor, heads_per_group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`qkv_rope_forward` under autograd: its backward writes the packed gradient (no concatenation)."""
    return _QKVRoPE.apply(packed, angles, heads_per_group)
