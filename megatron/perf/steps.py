"""Benchmark rows' training steps built in this process (one rank each under torchrun), for the probes that time or
count what a step does (scripts/probes/) and for scripts/benchmark.py --profile."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from .rows import layout_of, train_flags


def trainer_step(argv: list[str], device_type: str = "cuda") -> tuple[object, Callable[[], object]]:
    """A Trainer for `argv` built in this process (one rank: of the process group already started, or of torchrun's
    WORLD_SIZE), and its training step as a call: the next batch of its training data at the configured learning
    rate (a step's time does not depend on the rate)."""
    import torch.distributed as dist

    from megatron.config import parse_args
    from megatron.training.trainer import Trainer

    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    trainer = Trainer(parse_args(argv, world_size=world_size, device_type=device_type))
    batches, lr = iter(trainer.loader(trainer.datasets.train, 0)), trainer.cfg.optimizer.lr
    return trainer, lambda: trainer.train_step(batches, lr)


def build_trainers(
    preset: str, config: str, layouts: list[str], extra: str, steps: int, device_type: str
) -> list[tuple[object, Callable[[], object]]]:
    """`trainer_step` per layout (train_flags' run of `steps` iterations, `extra` flags added), in this order on every
    rank (each builds its own process groups): several layouts' trainers in one process per rank."""
    return [
        trainer_step(train_flags(preset, config, steps, steps, layout, extra=extra), device_type) for layout in layouts
    ]


def one_size(parser: argparse.ArgumentParser, layouts: list[str]) -> int:
    """The GPU count of `layouts`, which must agree: else a one-line parser error (scripts that build several
    layouts' trainers in one process per rank)."""
    sizes = set()
    for name in layouts:
        try:
            sizes.add(layout_of(name)[0])
        except ValueError as error:
            parser.error(str(error))
    if len(sizes) != 1:
        parser.error(f"{' and '.join(layouts)} run on different numbers of GPUs: compare layouts of one size")
    return sizes.pop()


def meet() -> None:
    """Wait for this rank's GPU work, then for the other ranks (where a process group is started): timed windows
    start together on every rank."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
