"""Microbenchmarks of this device, run once per shape and cached in a JSON file keyed by device name and shape.

`Probes` answers the bound's questions (a GEMM's TFLOP/s, a fused attention's time, HBM and bus bandwidth) from its
cache, or measures with `measure(kind, shape)` and stores the answer; a second run on the same device costs
nothing. `cuda_measure` is the GPU implementation (torch and, lazily, Transformer Engine); tests pass a fake.
A failed probe raises `ProbeError`, and the caller decides how to fall back (the bound says so in one line).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

Measure = Callable[[str, dict[str, Any]], float]


class ProbeError(RuntimeError):
    """A microbenchmark could not run on this device (one line: which and why)."""


def one_line(error: BaseException) -> str:
    """`Type: first line of the message`, for the one-line reports of failed probes and rows."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


class Probes:
    """Cached microbenchmark results for one device. `cache`: a JSON file {device: {key: value}}, read at start and
    rewritten after each new measurement (None: memory only)."""

    def __init__(self, device: str, measure: Measure | None, cache: Path | None = None):
        self.device, self.measure, self.cache = device, measure, cache
        self.table: dict[str, dict[str, float]] = {}
        if cache is not None and cache.exists():
            self.table = json.loads(cache.read_text())
        self.measured: list[str] = []  # keys measured by this object (not read from the cache)

    @staticmethod
    def key(kind: str, shape: dict[str, Any]) -> str:
        return kind + "|" + ",".join(f"{name}={shape[name]}" for name in sorted(shape))

    def value(self, kind: str, **shape: Any) -> float:
        key = self.key(kind, shape)
        known = self.table.setdefault(self.device, {})
        if key in known:
            return known[key]
        if self.measure is None:
            raise ProbeError(f"{key}: not in the probe cache and no device to measure it on (probes need a GPU)")
        try:
            result = float(self.measure(kind, shape))
        except ProbeError:
            raise
        except Exception as error:  # any failure of the kernel under test: the caller falls back and says so
            raise ProbeError(f"{key}: {one_line(error)}") from error
        known[key] = result
        self.measured.append(key)
        if self.cache is not None:
            self.cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.cache.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.table, indent=1, sort_keys=True) + "\n")
            tmp.replace(self.cache)
        return result

    def gemm_tflops(self, m: int, n: int, k: int, fp8: bool, fast_accum: bool = False) -> float:
        """(m x k) @ (k x n): torch.matmul in bf16, or torch._scaled_mm with e4m3 operands and per-tensor scales;
        `fast_accum`: FP8 with Hopper's fast accumulation, which Transformer Engine uses for the forward GEMMs only
        (the gradient GEMMs accumulate in higher precision)."""
        if fp8:
            return self.value("gemm", m=m, n=n, k=k, dtype="fp8", fast_accum=int(fast_accum))
        return self.value("gemm", m=m, n=n, k=k, dtype="bf16")

    def attention_ms(
        self, batch: int, seq: int, heads: int, groups: int, head_dim: int, fp8: bool, backward: bool, backend: str
    ) -> float:
        """One causal attention call (forward, or forward + backward) in ms; backend `te` or `sdpa`."""
        shape = dict(b=batch, s=seq, heads=heads, groups=groups, d=head_dim, fp8=int(fp8), bwd=int(backward))
        return self.value(f"attention_{backend}", **shape)

    def hbm_gbps(self) -> float:
        """Device-memory bandwidth of a 1 GiB copy (read + write), GB/s."""
        return self.value("hbm_copy", nbytes=1 << 30)

    def bus_gbps(self, op: str, nbytes: int, ranks: int) -> float:
        """NCCL bus bandwidth (nccl-tests' definition) of `op` on `nbytes` over `ranks` GPUs of this host, GB/s."""
        return self.value(f"nccl_{op}", nbytes=nbytes, ranks=ranks)


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def cuda_measure(kind: str, shape: dict[str, Any]) -> float:
    """Run one microbenchmark on the current CUDA device."""
    import torch

    if not torch.cuda.is_available():
        raise ProbeError("no CUDA device")
    try:
        if kind == "gemm":
            return _gemm_tflops(**shape)
        if kind.startswith("attention_"):
            return _attention_ms(kind.removeprefix("attention_"), **shape)
        if kind == "hbm_copy":
            return _copy_gbps(shape["nbytes"])
        if kind.startswith("nccl_"):
            return _bus_gbps(kind.removeprefix("nccl_"), shape["nbytes"], shape["ranks"])
        raise ProbeError(f"unknown probe {kind}")
    finally:
        torch.cuda.empty_cache()  # the training runs that follow get the memory back


def _time_ms(fn: Callable[[], Any], warmup: int = 5, iters: int = 20) -> float:
    """Mean time of `fn` in ms over `iters` back-to-back calls (CUDA events), after `warmup` calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _gemm_tflops(m: int, n: int, k: int, dtype: str, fast_accum: int = 0) -> float:
    import torch

    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if dtype == "bf16":
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        ms = _time_ms(lambda: torch.matmul(a, b))
    else:  # cuBLAS FP8 takes the second operand column-major: the transpose of a row-major (n x k)
        a8 = a.to(torch.float8_e4m3fn)
        b8 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda", dtype=torch.float32)
        fast = bool(fast_accum)
        ms = _time_ms(
            lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast)
        )
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12


def _attention_ms(backend: str, b: int, s: int, heads: int, groups: int, d: int, fp8: int, bwd: int) -> float:
    """Causal attention, bf16 inputs; `te`: Transformer Engine's DotProductAttention (cuDNN / flash, as training
    picks it; FP8 through a delayed-scaling recipe with fp8_dpa), `sdpa`: torch's scaled_dot_product_attention."""
    import torch

    bf16 = torch.bfloat16
    if backend == "te":
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe

        attn = te.DotProductAttention(
            heads, d, num_gqa_groups=groups, attention_dropout=0.0, qkv_format="sbhd", attn_mask_type="causal"
        )
        q = torch.randn(s, b, heads, d, device="cuda", dtype=bf16, requires_grad=True)
        k, v = (torch.randn(s, b, groups, d, device="cuda", dtype=bf16, requires_grad=True) for _ in range(2))
        fp8_recipe = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, fp8_dpa=True) if fp8 else None

        def forward() -> torch.Tensor:
            with te.autocast(enabled=bool(fp8), recipe=fp8_recipe):
                return attn(q, k, v)
    elif fp8:
        raise ProbeError("FP8 attention needs Transformer Engine")
    else:
        q = torch.randn(b, heads, s, d, device="cuda", dtype=bf16, requires_grad=True)
        k, v = (torch.randn(b, groups, s, d, device="cuda", dtype=bf16, requires_grad=True) for _ in range(2))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def forward() -> torch.Tensor:
            return sdpa(q, k, v, is_causal=True, enable_gqa=groups != heads)

    grad = torch.randn_like(forward())
    if not bwd:
        return _time_ms(forward)
    return _time_ms(lambda: forward().backward(grad))


def _copy_gbps(nbytes: int) -> float:
    import torch

    src = torch.empty(nbytes // 4, device="cuda", dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _bus_gbps(op: str, nbytes: int, ranks: int) -> float:
    """Spawn `ranks` processes on this host's GPUs and time one NCCL collective there; rank 0 writes the result."""
    import torch
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < ranks:
        raise ProbeError(f"nccl_{op} over {ranks} ranks needs {ranks} GPUs, this host has {torch.cuda.device_count()}")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # as benchmark.py runs its layouts
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "busbw"
        mp.spawn(_collective_worker, args=(ranks, port, op, nbytes, str(out)), nprocs=ranks, join=True)
        return float(out.read_text())


def _collective_worker(rank: int, ranks: int, port: int, op: str, nbytes: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    try:
        n = max(nbytes // 2 // ranks, 1) * ranks  # bf16 elements, a multiple of the ranks
        full = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        part = torch.empty(n // ranks, device="cuda", dtype=torch.bfloat16)
        run = {
            "all_reduce": lambda: dist.all_reduce(full),
            "all_gather": lambda: dist.all_gather_into_tensor(full, part),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full),
        }[op]
        ms = _time_ms(run)
        factor = 2 * (ranks - 1) / ranks if op == "all_reduce" else (ranks - 1) / ranks
        if rank == 0:
            Path(out).write_text(str(2 * n * factor / (ms * 1e-3) / 1e9))
    finally:
        dist.destroy_process_group()
