"""Wall-clock host time of the gradient engines' own functions, per step and per call, on every rank: where the flat
buckets' host work beyond the distributed optimizer's goes, in real microseconds.

    python3 scripts/probes/engine_timers.py --preset llama-1b --config te-delayed-fp8params \
        --layouts mfsdp2_optim_grads_bf16comm dp2_distopt --steps 8

llama-1b's flat-bucket step (mfsdp2_*) on two H100s is host-bound (docs/fsdp.md): its GPU idled in gaps ~29 ms a step
longer than the distributed optimizer's, and cProfile put ~40 ms of its own time a step in the engine's per-bucket
functions, but cProfile's cost per call inflates small calls unevenly. Here each layout's trainer is built in one
process per rank (benchmark.py's flags, as scripts/probes/ab_steps.py does) and run for `--warmup` steps; then
for `--steps` steps the engines' functions (`FlatGradShards` and `GradientBuffers`: the forward hooks that register the
allocating gradient hooks, allocating a bucket, freeing it, the gradient hook, starting a bucket's reduce-scatter, the
reduce-scatter call itself, retiring it, the end of a backward, `finish`) run under perf_counter timers, nothing else.
A function's exclusive time leaves out the timed functions it calls. `--parts` times the torch calls inside them too
(registering a gradient hook, a reduce-scatter's wait, stream switches, `record_stream`, a bucket storage's resize,
adds, copies, zeroing), wherever Python calls them in the timed steps. Each rank prints its table: calls a step,
exclusive us a call, exclusive and inclusive ms a step, and the step's wall time. Under torchrun when launched
without it.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

from megatron.perf.launch import relaunch  # no torch at import
from megatron.perf.rows import PRESETS
from megatron.perf.steps import build_trainers, meet, one_size

# (module, class or None for a module function, name): what runs on the host per bucket, parameter or step
TIMED = (
    ("megatron.parallel.fsdp.flat_shards", "FlatGradShards", "_on_output"),
    ("megatron.parallel.fsdp.flat_shards", "FlatGradShards", "_allocate_all"),
    ("megatron.parallel.fsdp.flat_shards", "FlatGradShards", "_allocate"),
    ("megatron.parallel.fsdp.flat_shards", "FlatGradShards", "_free"),
    ("megatron.parallel.fsdp.flat_shards", "FlatGradShards", "_on_grad"),
    ("megatron.parallel.fsdp.flat_shards", "FlatGradShards", "_start"),
    ("megatron.parallel.fsdp.flat_shards", "FlatGradShards", "_retire"),
    ("megatron.parallel.fsdp.flat_shards", "FlatGradShards", "_end_of_backward_hook"),
    ("megatron.parallel.fsdp.flat_shards", "FlatGradShards", "_queue_end_of_backward"),
    ("megatron.parallel.fsdp.flat_shards", "FlatGradShards", "_end_of_backward"),
    ("megatron.parallel.fsdp.flat_shards", "FlatGradShards", "finish"),
    ("megatron.parallel.data_parallel", "GradientBuffers", "_on_grad"),
    ("megatron.parallel.data_parallel", "GradientBuffers", "_start"),
    ("megatron.parallel.data_parallel", "GradientBuffers", "finish"),
    ("megatron.parallel.data_parallel", None, "_reduce_scatter"),
)
# --parts: the torch calls inside them, timed wherever Python calls them during the timed steps (Transformer Engine's
# and the optimizer's `add_` and `copy_` too; its C++ calls are not seen): what a bucket's retire and allocation spend
# their time on
PARTS = (
    ("torch", "Tensor", "register_hook"),
    ("torch._C._distributed_c10d", "Work", "wait"),
    ("torch.cuda", None, "current_stream"),
    ("torch.cuda", None, "set_stream"),
    ("torch", "Tensor", "record_stream"),
    ("torch", "UntypedStorage", "resize_"),
    ("torch", "Tensor", "add_"),
    ("torch", "Tensor", "copy_"),
    ("torch", None, "_foreach_copy_"),
    ("torch", "Tensor", "zero_"),
)


class Timers:
    """Exclusive and inclusive seconds and calls per timed function, while `on`; nested timed calls are subtracted
    from their caller's exclusive time."""

    def __init__(self) -> None:
        self.on = False
        self.stack: list[float] = []  # per open timed call: the time its timed callees took
        self.calls: dict[str, int] = {}
        self.exclusive: dict[str, float] = {}
        self.inclusive: dict[str, float] = {}

    def wrap(self, label: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            self.stack.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - start
                inner = self.stack.pop()
                if self.stack:
                    self.stack[-1] += took
                self.calls[label] = self.calls.get(label, 0) + 1
                self.exclusive[label] = self.exclusive.get(label, 0.0) + took - inner
                self.inclusive[label] = self.inclusive.get(label, 0.0) + took

        return timed

    def reset(self) -> None:
        self.calls, self.exclusive, self.inclusive = {}, {}, {}


_ORIGINALS: list[tuple[object, str, Callable]] = []  # what `install` replaced, for `uninstall`


def install(timers: Timers, parts: bool = False) -> None:
    """Wrap every TIMED function in place (before any trainer is built: the gradient hooks bind `_on_grad` then),
    and with `parts` the PARTS too."""
    import importlib

    for module_name, owner, name in TIMED + (PARTS if parts else ()):
        module = importlib.import_module(module_name)
        target = getattr(module, owner) if owner else module
        label = f"{owner}.{name}" if owner else name
        _ORIGINALS.append((target, name, getattr(target, name)))
        setattr(target, name, timers.wrap(label, getattr(target, name)))


def uninstall() -> None:
    """Put back what `install` wrapped."""
    while _ORIGINALS:
        target, name, original = _ORIGINALS.pop()
        setattr(target, name, original)


def table(layout: str, timers: Timers, steps: int, step_ms: float) -> list[str]:
    lines = [
        f"{layout}: {step_ms:.1f} ms a step (wall, {steps} steps)",
        "| function | calls/step | exclusive us/call | exclusive ms/step | inclusive ms/step |",
        "|---|---:|---:|---:|---:|",
    ]
    for label in sorted(timers.calls, key=lambda k: -timers.exclusive[k]):
        calls = timers.calls[label]
        lines.append(
            f"| {label} | {calls / steps:.0f} | {1e6 * timers.exclusive[label] / calls:.1f} |"
            f" {1e3 * timers.exclusive[label] / steps:.2f} | {1e3 * timers.inclusive[label] / steps:.2f} |"
        )
    total = sum(timers.exclusive.values())
    lines.append(f"| all of them | | | {1e3 * total / steps:.2f} | |")
    return lines


def measure(
    timers: Timers, steps_of: list[Callable[[], object]], layouts: list[str], warmup: int, steps: int
) -> list[list[str]]:
    """Each layout's table: its warm-up untimed, then `steps` steps timed (layouts in turn; `timers` installed)."""
    tables = []
    for layout, step in zip(layouts, steps_of):
        for _ in range(warmup):
            step()
        meet()
        timers.reset()
        timers.on = True
        start = time.perf_counter()
        for _ in range(steps):
            step()
        meet()
        timers.on = False
        tables.append(table(layout, timers, steps, 1e3 * (time.perf_counter() - start) / steps))
    return tables


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-1b", choices=sorted(PRESETS))
    parser.add_argument("--config", default="te-delayed-fp8params")
    parser.add_argument("--layouts", nargs="+", default=["mfsdp2_optim_grads_bf16comm", "dp2_distopt"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--extra-flags", default="", help="pretrain_gpt.py flags added to every layout's run")
    parser.add_argument(
        "--parts", action="store_true", help="time the torch calls inside the engines' functions too (PARTS)"
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: gloo ranks (tests)")
    args = parser.parse_args(argv)
    world = one_size(parser, args.layouts)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1, --warmup at least 0")
    if (code := relaunch(__file__, world, args.layouts[0], argv)) is not None:
        return code
    total = args.warmup + args.steps + 1  # the schedules' length: never reached
    timers = Timers()
    install(timers, args.parts)  # before the trainers bind their gradient hooks
    runs = build_trainers(args.preset, args.config, args.layouts, args.extra_flags, total, args.device)
    tables = measure(timers, [step for _, step in runs], args.layouts, args.warmup, args.steps)
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    print("\n".join(f"[rank {rank}] {line}" for lines in tables for line in lines), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
