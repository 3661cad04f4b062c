"""The initial weights' random draws, each part's in its own thread.

Every part of the model (the embedding, each transformer layer, the output layer) draws its weights from its own seed
(`seeded`), so that they do not depend on which other parts a rank builds: every layout starts from the same model. A
part draws its matrices one after another in fp32 on the CPU from one generator, and a draw is sequential work (about
4 ns an element on one core, 30 s for an 8B model, on every rank that builds it whole). The parts are independent, so
`parallel_draws` defers the draws of the parts built inside it to its end and makes each part's there, in the part's
order, from a generator seeded as `seeded` seeds the global one: the same numbers, bit for bit (the generator's
stream does not depend on which object holds it; tests/unit/test_init_draws.py). The parts run in a pool of threads
(torch releases the GIL in its kernels), each thread drawing into one buffer that it reuses: fresh memory costs its
page faults, on some machines as much again as the draw.

A part whose values are read while it is built (Transformer Engine's FP8 weights, quantized as they are initialized)
draws at once from the global generator instead (`seeded(..., defer=False)`), as every part does outside the block.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass

import torch


@dataclass
class _Draw:
    shape: tuple[int, ...]
    std: float
    fill: Callable[[torch.Tensor], None]


@dataclass
class _Part:
    seed: int
    draws: list[_Draw]


_deferred: ContextVar[list[_Part] | None] = ContextVar("deferred_parts", default=None)
"""Inside `parallel_draws`: the parts whose draws wait for its end."""
_part: ContextVar[_Part | None] = ContextVar("deferred_part", default=None)
"""Inside a deferred part's `seeded` block: that part."""


@contextlib.contextmanager
def seeded(seed: int, defer: bool = True) -> Iterator[None]:
    """Build a part whose initial weights come from its own seed (the CPU generator). Inside `parallel_draws` (and
    with `defer`) its `init_normal` draws are made at the block's end; otherwise at once, from the global generator
    seeded with `seed` (its state is restored after the block, so the part's draws do not move it)."""
    pending = _deferred.get()
    # only where the default device is the CPU: the pool's threads draw on the CPU, not on a `torch.device(...)` default
    defer = defer and pending is not None and torch.get_default_device().type == "cpu"
    part = _Part(seed, []) if defer else None
    if part is not None:
        pending.append(part)
    token = _part.set(part)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield
    finally:
        _part.reset(token)


def init_normal(
    weight: torch.Tensor,
    shape: tuple[int, ...] | torch.Size,
    std: float,
    shard: Callable[[torch.Tensor], torch.Tensor] = lambda full: full,
) -> None:
    """Set `weight` to `shard(full)`, `full` being N(0, std) of `shape` drawn in fp32 on the CPU (the whole matrix:
    `shard` picks this rank's tensor-parallel slice): now from the global generator, or inside a deferred part at the
    end of `parallel_draws`, from the part's generator. A weight on the meta device has no values to set."""
    if weight.is_meta:
        return

    def fill(full: torch.Tensor) -> None:
        with torch.no_grad():
            weight.copy_(shard(full))

    part = _part.get()
    if part is None:
        fill(torch.empty(shape, dtype=torch.float32).normal_(0.0, std))
    else:
        part.draws.append(_Draw(tuple(shape), std, fill))


@contextlib.contextmanager
def parallel_draws(threads: int) -> Iterator[None]:
    """Defer the draws of the parts built inside the block (`seeded`) to its end, and make them there, `threads`
    parts at a time (the largest first). Nested blocks draw at the outermost one's end."""
    if _deferred.get() is not None:
        yield
        return
    parts: list[_Part] = []
    token = _deferred.set(parts)
    try:
        yield
    finally:
        _deferred.reset(token)
    parts = sorted((p for p in parts if p.draws), key=lambda p: -sum(math.prod(d.shape) for d in p.draws))
    local = threading.local()  # each thread's draw buffer

    def draw(part: _Part) -> None:
        generator = torch.Generator().manual_seed(part.seed)
        need = max(math.prod(d.shape) for d in part.draws)
        if getattr(local, "buffer", None) is None or local.buffer.numel() < need:
            local.buffer = None  # the old one freed before the new one is allocated
            local.buffer = torch.empty(need, dtype=torch.float32)
        for d in part.draws:
            d.fill(local.buffer[: math.prod(d.shape)].view(d.shape).normal_(0.0, d.std, generator=generator))

    if threads <= 1 or len(parts) <= 1:
        for part in parts:
            draw(part)
        return
    # Transformer Engine's weights are on the GPU: the pool's threads copy into them on this rank's device, not on
    # GPU 0 (a new thread's current device, where a guard's restore would make this process a context)
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    start = (lambda: torch.cuda.set_device(device)) if device is not None else None
    with ThreadPoolExecutor(min(threads, len(parts)), "init-draws", initializer=start) as pool:
        list(pool.map(draw, parts))  # a draw's exception raises here
