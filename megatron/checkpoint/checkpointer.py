"""The trainer's checkpointer: saves in --ckpt-format, loads the format found on disk, and times both.

Which format a load uses (Megatron-LM's rule): with --ckpt-format torch_dist, or with --auto-detect-ckpt-format, the
format of the checkpoint on disk (the one `latest` names if it verifies, else the newest older one that does), told
apart by its files (metadata.json's "format", DCP's `.metadata`, or
`mp_rank_*` folders); with --ckpt-format torch alone a torch_dist checkpoint stops with a one-line error naming
the two ways to load it. Saves always use --ckpt-format, so a torch checkpoint resumed under the default is
continued in torch_dist.

Timing lines (rank 0), the seconds read by scripts/bench_checkpoint.py:

      successfully saved checkpoint at iteration      10 to DIR/iter_0000010 (torch_dist) in 3.21 s
      queued (--async-save) checkpoint at iteration   10 to DIR/iter_0000010 (torch_dist): training blocked 0.41 s
      successfully loaded checkpoint from DIR at iteration 10 (torch_dist) in 2.05 s

The first is Megatron-LM's line, which log parsers look for; with --async-save the write finishes later and
DistCheckpointer logs it then. A save's seconds are those training waits for (for --async-save: a previous
background write still running, said apart when there was one, then the copy to host memory); a load's run until
the state is in place on the device.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megatron.untrusted import LimitExceeded, parse_json

from .checkpointing import CheckpointError, _log, check_train_state, checkpoint_dir, select_checkpoint
from .dist import DistCheckpointer
from .torch_format import TorchCheckpointer

FORMATS = {"torch": TorchCheckpointer, "torch_dist": DistCheckpointer}


def folder_format(path: Path) -> str | None:
    """'torch_dist' or 'torch' for a checkpoint folder, from its files; None when it holds neither."""
    info = path / "metadata.json"
    if info.is_file():
        try:
            fmt = parse_json(info.read_bytes(), str(info)).get("format", "torch")
        except (ValueError, AttributeError, OSError, LimitExceeded):
            fmt = None  # damaged: the files below still tell
        if fmt in FORMATS:
            return fmt
    if (path / ".metadata").is_file():
        return "torch_dist"
    if path.is_dir() and any(p.name.startswith("mp_rank_") for p in path.iterdir()):
        return "torch"
    return None


class Checkpointer:
    """Saves and loads the training state of one rank (every rank calls every method): `TorchCheckpointer` or
    `DistCheckpointer` by format, with the format rule and the timing lines above."""

    def __init__(self, cfg: Any, dims: Any, model: nn.Module, optimizer: Any, loss_scaler: Any, fp8: Any, monitor: Any):
        self.cfg, self.dims = cfg, dims
        self.parts = model, optimizer, loss_scaler, fp8, monitor
        self.format = cfg.checkpoint.ckpt_format
        self.saver = FORMATS[self.format](cfg, dims, *self.parts)
        self.device = next(model.parameters()).device

    def save(self, root: str, iteration: int, train_state: dict[str, Any]) -> Path:
        """Write iteration `iteration` under `root` and log Megatron-LM's line with the seconds training waited."""
        start = time.perf_counter()
        path = self.saver.save(root, iteration, train_state)
        seconds = time.perf_counter() - start
        if self.cfg.checkpoint.async_save:
            waited = self.saver.waited_s  # --async-save is torch_dist's (DistCheckpointer)
            _log(
                f"  queued (--async-save) checkpoint at iteration {iteration:7d} to {path} ({self.format}): training"
                f" blocked {seconds:.2f} s"
                + (f" ({waited:.2f} s of it waiting for the previous background write)" if waited >= 0.01 else "")
            )
        else:
            where = f"{path} ({self.format})"
            _log(f"  successfully saved checkpoint at iteration {iteration:7d} to {where} in {seconds:.2f} s")
        return path

    def load(self, root: str) -> dict[str, Any] | None:
        """Load the newest checkpoint under `root` (see `DistCheckpointer.load`, `TorchCheckpointer.load`); returns
        its train state, or None when there is none."""
        start = time.perf_counter()
        iteration = select_checkpoint(
            root, strict=self.cfg.checkpoint.verify_integrity
        )  # verified, else the newest older one that verifies (logged)
        if iteration is None:
            return None
        fmt = folder_format(checkpoint_dir(root, iteration)) or self.format
        if fmt != self.format:
            ckpt = self.cfg.checkpoint
            if not (self.format == "torch_dist" or ckpt.auto_detect_ckpt_format):
                raise CheckpointError(
                    f"{root} holds a {fmt} checkpoint and --ckpt-format is {self.format}: add"
                    f" --auto-detect-ckpt-format (saves stay {self.format}) or use --ckpt-format {fmt}"
                )
            _log(f"> {root} holds a {fmt} checkpoint: loading it as such (saves use --ckpt-format {self.format})")
        loader = self.saver if fmt == self.format else FORMATS[fmt](self.cfg, self.dims, *self.parts)
        state = check_train_state(loader.load(root, iteration), f"checkpoint {root} (iteration {iteration})")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the copies to the device are part of loading
        seconds = time.perf_counter() - start
        done = f"at iteration {state['iteration']} ({fmt}) in {seconds:.2f} s"
        _log(f"  successfully loaded checkpoint from {root} {done}")
        return state

    def poll(self) -> None:
        """Make a finished --async-save write visible."""
        self.saver.poll()

    def finalize(self) -> None:
        """Wait for a background write and make it visible (at the next save and at the end of training)."""
        self.saver.finalize()
