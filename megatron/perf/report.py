"""Profile kernels grouped as the bound's categories, and the tables that put bound and measurement side by side."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .bound import CATEGORIES, Bound

COMMUNICATION = r"nccl|userbuffer|PtoP"  # NCCL kernels, TE userbuffers kernels, peer-to-peer copies
# First match wins. cuDNN attention kernels also contain "sm90" and "wgmma", so attention comes before GEMM; the
# kernels that write FP8 as a side effect (norms, SwiGLU) belong to their producer, as in the bound, so the FP8
# cast pattern comes after them. The bound's optimizer term counts the step, the gradient norm and the gradient
# buffers' zeroing, so the norm's kernels (torch._foreach_norm: LpNorm, lpnorm_cleanup) and the fills come before
# the layers' norms and the elementwise rest (the gradient buffers' zero_() writes most of a step's filled bytes).
KERNEL_CATEGORIES = [
    ("communication", COMMUNICATION),
    ("attention", r"flash|fmha|sdpa|attn|attention"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|sm90_|wgmma|cublas"),
    ("fsdp", r"chunk_cat|split_with_sizes_copy"),  # FSDP2's reduce-scatter packing and all-gather unpacking
    ("optimizer", r"adam|multi_tensor|foreach|lpnorm|FillFunctor"),
    ("norm", r"norm"),
    ("rope", r"rope|rotary"),
    ("activation", r"swiglu|silu|gelu|glu|gated_act"),
    ("loss", r"cross_entropy|softmax|nll"),
    ("cast/transpose", r"quantiz|(?<!no)cast|transpose|amax|fp8|dequant"),
    ("copy", r"memcpy|memset"),
    ("elementwise", r""),  # residual adds, embedding, gradient adds, reductions: everything else
]

IDLE = "GPU idle"  # the step's time with no kernel running (host work, launch gaps)


def kernel_category(name: str) -> str:
    return next(c for c, pattern in KERNEL_CATEGORIES if re.search(pattern, name, re.IGNORECASE))


@dataclass
class Row:
    """One benchmark row: its bound, its measured step (ms, the trainer's log), and the profile's kernel time per
    step by category with the step's idle time (None where not profiled)."""

    preset: str
    config: str
    layout: str
    bound: Bound | None = None
    measured_ms: float | None = None
    profile: dict[str, float] | None = None
    errors: list[str] = field(default_factory=list)


def excess(row: Row) -> dict[str, float]:
    """Measured minus bound per category (and the GPU's idle time, whose bound is 0), largest first."""
    if row.bound is None or row.profile is None:
        return {}
    bound = row.bound.by_category()
    names = [*CATEGORIES, *(c for c in row.profile if c not in CATEGORIES)]
    diff = {name: row.profile.get(name, 0.0) - bound.get(name, 0.0) for name in names}
    return dict(sorted(diff.items(), key=lambda kv: -kv[1]))


def bound_table(rows: list[Row], top: int = 3) -> str:
    """Markdown: bound, measured, measured / bound and the `top` categories furthest above their bound."""
    lines = [
        "| preset | config | layout | bound ms | measured ms | measured/bound | most above the bound (ms) |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        bound = f"{r.bound.total_ms:.1f}" if r.bound else "-"
        measured = f"{r.measured_ms:.1f}" if r.measured_ms is not None else "-"
        ratio = f"{r.measured_ms / r.bound.total_ms:.2f}x" if r.bound and r.measured_ms is not None else "-"
        above = ", ".join(f"{name} +{ms:.1f}" for name, ms in list(excess(r).items())[:top] if ms > 0)
        if r.errors:
            above = "; ".join(e.replace("|", "/") for e in r.errors) + (f"; {above}" if above else "")
        lines.append(f"| {r.preset} | {r.config} | {r.layout} | {bound} | {measured} | {ratio} | {above} |")
    return "\n".join(lines)


def category_table(row: Row) -> str:
    """Markdown: per category the bound, the profile's kernel time per step, and the difference."""
    assert row.bound is not None
    bound = row.bound.by_category()
    lines = [
        f"{row.preset} {row.config} {row.layout}: bound {row.bound.total_ms:.1f} ms",
        "",
        "| category | bound ms | measured ms (profile) | above bound |",
        "|---|---:|---:|---:|",
    ]
    names = [*CATEGORIES, *(c for c in (row.profile or {}) if c not in CATEGORIES)]
    for name in names:
        measured = row.profile.get(name, 0.0) if row.profile is not None else None  # no kernel: 0 ms
        if not bound.get(name) and not measured:
            continue
        shown = f"{measured:.1f}" if measured is not None else "-"
        diff = f"{measured - bound.get(name, 0.0):+.1f}" if measured is not None else "-"
        lines.append(f"| {name} | {bound.get(name, 0.0):.1f} | {shown} | {diff} |")
    return "\n".join(lines)


def terms_table(bound: Bound) -> str:
    """Markdown: every term of the bound with how it was computed."""
    lines = ["| category | term | ms | how |", "|---|---|---:|---|"]
    for t in sorted(bound.terms, key=lambda t: (CATEGORIES.index(t.category), -t.ms)):
        lines.append(f"| {t.category} | {t.name} | {t.ms:.2f} | {t.detail} |")
    return "\n".join(lines)
