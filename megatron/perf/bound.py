"""The lower bound of one training iteration: measured rates (probes.py) applied to the work it must do (work.py,
traffic.py).

    bound = sum over GEMMs        FLOPs / TFLOP/s measured for that (m, n, k, dtype; FP8 forward GEMMs with fast
                                  accumulation, as Transformer Engine runs them)
          + sum over attentions   time of the fused kernel measured for that shape (forward + backward)
          + sum over memory passes bytes / measured HBM copy bandwidth (FSDP's copies: category `fsdp`, fsdp.py)
          + sum over collectives  bytes x (2(n-1)/n all-reduce, (n-1)/n all-gather / reduce-scatter) / bus bandwidth

Each term assumes its kernels run alone at the speed they reach in isolation, one after the other, with no gap
between them: host time, launch gaps and kernels slower than their probe are what the measured step has above it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from megatron.config import Config

from .probes import ProbeError, Probes
from .traffic import communication, memory_traffic
from .work import attention, check_modelled, gemms, param_count, recompute_gemms

#: Categories of the bound, in print order; the profile's kernels are grouped the same way (report.py).
CATEGORIES = (
    "gemm",
    "attention",
    "norm",
    "cast/transpose",
    "rope",
    "activation",
    "elementwise",
    "loss",
    "optimizer",
    "fsdp",
    "communication",
)


@dataclass
class Term:
    category: str
    name: str
    ms: float
    detail: str


@dataclass
class Bound:
    terms: list[Term]
    notes: list[str] = field(default_factory=list)
    params: int = 0

    @property
    def total_ms(self) -> float:
        return sum(term.ms for term in self.terms)

    def by_category(self) -> dict[str, float]:
        out = dict.fromkeys(CATEGORIES, 0.0)
        for term in self.terms:
            out[term.category] += term.ms
        return out


def padded_vocab(cfg: Config) -> int:
    """The run's padded vocabulary, as the trainer computes it."""
    from megatron.data import build_tokenizer, padded_vocab_size

    vocab = build_tokenizer(cfg.data).vocab_size
    return padded_vocab_size(vocab, cfg.data.make_vocab_size_divisible_by, cfg.parallel.tensor_model_parallel_size)


def attention_backend(cfg: Config) -> str:
    """`te` where the run's attention is Transformer Engine's fused attention, else `sdpa` (the local layers)."""
    m = cfg.model
    return "te" if m.transformer_impl == "transformer_engine" and m.attention_backend != "local" else "sdpa"


def lower_bound(cfg: Config, probes: Probes, vocab: int | None = None, log: Callable[[str], None] = print) -> Bound:
    """The bound of one iteration of `cfg` on this rank. A probe that fails falls back (FP8 GEMM -> bf16 GEMM,
    FP8 attention -> bf16, TE attention -> torch SDPA) with one line to `log` and in `notes`; a failure with no
    fallback raises ProbeError."""
    check_modelled(cfg)
    vocab = padded_vocab(cfg) if vocab is None else vocab
    notes: list[str] = []
    said: set[str] = set()

    def note(kind: str, line: str) -> None:  # the first failure of each kind, in one line
        if kind not in said:
            said.add(kind)
            notes.append(line)
            log(line)

    terms: list[Term] = []
    for g in gemms(cfg, vocab) + recompute_gemms(cfg, vocab):
        fp8 = g.fp8
        try:
            tflops = probes.gemm_tflops(g.m, g.n, g.k, fp8, fast_accum="fprop" in g.name)
        except ProbeError as error:
            if not fp8:
                raise
            note("gemm", f"FP8 GEMM probe failed, bf16 rate used for the FP8 GEMMs that fail: {error}")
            fp8, tflops = False, probes.gemm_tflops(g.m, g.n, g.k, False)
        ms = g.flops / (tflops * 1e12) * 1e3
        dtype, rate = "fp8" if g.fp8 else "bf16", "fp8" if fp8 else "bf16"
        detail = f"{g.count} x ({g.m} x {g.k}) @ ({g.k} x {g.n}), {g.flops / 1e12:.2f} TFLOP at {tflops:.0f}"
        terms.append(Term("gemm", f"{g.name} {dtype}", ms, f"{detail} TFLOP/s ({rate} probe)"))
    backend = attention_backend(cfg)
    for a in attention(cfg):
        shape = (a.batch, a.seq, a.heads, a.groups, a.head_dim)
        one, fp8, used = None, a.fp8, backend
        while one is None:
            try:
                one = probes.attention_ms(*shape, fp8, a.backward, used)
            except ProbeError as error:
                if fp8:
                    note("fp8 attention", f"FP8 attention probe failed, bf16 attention used instead: {error}")
                    fp8 = False
                elif used == "te":
                    note("te attention", f"Transformer Engine attention probe failed, torch SDPA used: {error}")
                    used = "sdpa"
                else:
                    raise
        tflops = a.flops / a.count / (one * 1e-3) / 1e12
        dtype = "fp8" if fp8 else "bf16"
        detail = f"{a.count} x {one:.3f} ms ({used}, b{a.batch} s{a.seq} H{a.heads} G{a.groups} d{a.head_dim}"
        terms.append(Term("attention", f"{a.name} {dtype}", one * a.count, f"{detail}, {tflops:.0f} TFLOP/s causal)"))
    hbm = probes.hbm_gbps()
    for w in memory_traffic(cfg, vocab):
        ms = w.total_bytes / (hbm * 1e9) * 1e3
        detail = f"{w.count} x {w.nbytes / 1e6:.1f} MB ({w.formula}) at {hbm:.0f} GB/s"
        terms.append(Term(w.category, w.name, ms, detail))
    for c in communication(cfg, vocab):
        bus = probes.bus_gbps(c.op, c.nbytes, c.ranks)
        factor = 2 * (c.ranks - 1) / c.ranks if c.op == "all_reduce" else (c.ranks - 1) / c.ranks
        ms = c.count * c.nbytes * factor / (bus * 1e9) * 1e3
        detail = f"{c.count} x {c.op} of {c.nbytes / 1e6:.1f} MB over {c.ranks} at {bus:.0f} GB/s bus bandwidth"
        terms.append(Term("communication", c.name, ms, detail))
    return Bound(terms, notes, param_count(cfg, vocab)[0])
