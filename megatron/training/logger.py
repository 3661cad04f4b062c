"""Progress output: Megatron-LM's log line on stdout (so existing log parsers work) and TensorBoard scalars."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence

import torch.distributed as dist


def print_rank_0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def training_log_line(
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    ms_per_iter: float,
    tflops_per_gpu: float,
    tokens_per_s: float,
    mfu: float | None,
    lr: float,
    global_batch_size: int,
    loss: float,
    grad_norm: float,
    skipped: int,
    nan_iters: int,
    loss_scale: float = 1.0,
    extra_fields: Sequence[str] = (),
) -> str:
    """One progress line in Megatron-LM's format (plus tokens/s and MFU fields); `extra_fields` (num zeros,
    params norm) follow the grad norm, where Megatron-LM prints them."""
    timestamp = time.strftime("%Y-%m-%d %H:%M:%S")
    fields = [
        f" [{timestamp}] iteration {iteration:8d}/{train_iters:8d}",
        f"consumed samples: {consumed_samples:12d}",
        f"elapsed time per iteration (ms): {ms_per_iter:.1f}",
        f"throughput per GPU (TFLOP/s/GPU): {tflops_per_gpu:.2f}",
        f"tokens/s: {tokens_per_s:.0f}",
    ]
    if mfu is not None:
        fields.append(f"MFU: {100 * mfu:.1f}%")
    fields += [
        f"learning rate: {lr:.6E}",
        f"global batch size: {global_batch_size:5d}",
        f"lm loss: {loss:.6E}",
        f"loss scale: {loss_scale:.1f}",
        f"grad norm: {grad_norm:.3f}",
        *extra_fields,
        f"number of skipped iterations: {skipped:3d}",
        f"number of nan iterations: {nan_iters:3d}",
    ]
    return " | ".join(fields) + " |"


def validation_log_lines(iteration: int, loss: float, split: str = "validation", final: bool = False) -> str:
    """Megatron-LM's lines: "validation loss at iteration N | ..." in the training loop; after training "... at
    iteration N on validation set | ..." and "... on test set | ..." (the test split is evaluated then only)."""
    ppl = math.exp(min(20.0, loss))
    where = f" on {split} set" if final or split != "validation" else ""
    text = f" validation loss at iteration {iteration}{where} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
    bar = "-" * (len(text) + 1)
    return f"{bar}\n{text}\n{bar}"


class TensorBoardWriter:
    """Writes on rank 0 only; a no-op without --tensorboard-dir."""

    def __init__(self, log_dir: str | None):
        self.writer = None
        if log_dir and (not dist.is_initialized() or dist.get_rank() == 0):
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:  # pragma: no cover - tensorboard is a dependency
                print(f"error: --tensorboard-dir needs the tensorboard package ({exc})", file=sys.stderr)
                raise
            self.writer = SummaryWriter(log_dir=log_dir, max_queue=1000)

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)

    def text(self, tag: str, text: str) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
