"""The 1F1B pipeline schedule (PipeDream-Flush, as in Megatron-LM) over point-to-point sends.

With P stages and M micro-batches, stage r first runs min(P - r - 1, M) forward passes (warm-up), then alternates
one forward and one backward (steady state), then drains the remaining backward passes (cool-down). At most
P - r micro-batches' activations are alive on stage r, instead of M with all-forward-then-all-backward.

`stage_forward(batch, input_tensor)` runs this stage's layers: the first stage ignores `input_tensor` and embeds the
batch's tokens; the last stage returns the micro-batch's scalar loss (already divided by M), other stages return
their output activations [s, b, h].
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from .dims import ParallelDims


def _p2p(dims: ParallelDims, send: list[tuple[torch.Tensor, int]], recv: list[tuple[torch.Tensor, int]]) -> None:
    """Post all sends and receives (peer given as a stage index) together, then wait: no ordering deadlocks."""
    ops = [dist.P2POp(dist.isend, t, dims.pp_ranks[peer]) for t, peer in send]
    ops += [dist.P2POp(dist.irecv, t, dims.pp_ranks[peer]) for t, peer in recv]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


class _Channel:
    """Sends/receives activations and their gradients to the neighbouring stages."""

    def __init__(self, dims: ParallelDims, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.dims, self.shape, self.dtype, self.device = dims, shape, dtype, device

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device, requires_grad=True)

    def recv_forward(self) -> torch.Tensor | None:
        if self.dims.is_first_stage:
            return None
        tensor = self._buffer()
        with torch.no_grad():
            _p2p(self.dims, [], [(tensor, self.dims.pp_rank - 1)])
        return tensor

    def send_forward(self, output: torch.Tensor) -> None:
        if not self.dims.is_last_stage:
            _p2p(self.dims, [(output.detach(), self.dims.pp_rank + 1)], [])

    def recv_backward(self) -> torch.Tensor | None:
        if self.dims.is_last_stage:
            return None
        grad = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        _p2p(self.dims, [], [(grad, self.dims.pp_rank + 1)])
        return grad

    def send_backward(self, input_grad: torch.Tensor | None) -> None:
        if not self.dims.is_first_stage:
            _p2p(self.dims, [(input_grad, self.dims.pp_rank - 1)], [])

    def send_forward_recv_backward(self, output: torch.Tensor) -> torch.Tensor | None:
        if self.dims.is_last_stage:
            return None
        grad = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        _p2p(self.dims, [(output.detach(), self.dims.pp_rank + 1)], [(grad, self.dims.pp_rank + 1)])
        return grad

    def send_backward_recv_forward(self, input_grad: torch.Tensor | None) -> torch.Tensor | None:
        if self.dims.is_first_stage:
            return None
        tensor = self._buffer()
        with torch.no_grad():
            _p2p(self.dims, [(input_grad, self.dims.pp_rank - 1)], [(tensor, self.dims.pp_rank - 1)])
        return tensor


def _backward(input_tensor: torch.Tensor | None, output: torch.Tensor, output_grad: torch.Tensor | None):
    torch.autograd.backward(output, grad_tensors=output_grad)
    return None if input_tensor is None else input_tensor.grad


def forward_backward_1f1b(
    stage_forward: Callable[[Any, torch.Tensor | None], torch.Tensor],
    batches: Iterator[Any],
    num_micro_batches: int,
    dims: ParallelDims,
    activation_shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """Run forward and backward over `num_micro_batches`; returns the detached losses (last stage only)."""
    channel = _Channel(dims, activation_shape, dtype, device)
    warmup = min(dims.pp - dims.pp_rank - 1, num_micro_batches)
    steady = num_micro_batches - warmup
    inputs: list[torch.Tensor | None] = []
    outputs: list[torch.Tensor] = []
    losses: list[torch.Tensor] = []

    def forward(input_tensor):
        output = stage_forward(next(batches), input_tensor)
        if dims.is_last_stage:
            losses.append(output.detach())
        inputs.append(input_tensor)
        outputs.append(output)
        return output

    for _ in range(warmup):
        channel.send_forward(forward(channel.recv_forward()))
    input_tensor = channel.recv_forward() if steady > 0 else None
    for i in range(steady):
        output_grad = channel.send_forward_recv_backward(forward(input_tensor))
        input_grad = _backward(inputs.pop(0), outputs.pop(0), output_grad)
        if i == steady - 1:
            channel.send_backward(input_grad)
        else:
            input_tensor = channel.send_backward_recv_forward(input_grad)
    for _ in range(warmup):
        output_grad = channel.recv_backward()
        channel.send_backward(_backward(inputs.pop(0), outputs.pop(0), output_grad))
    return losses


def bubble_fraction(pp: int, vpp: int, num_micro_batches: int) -> float:
    """The idle share of an ideal pipeline step relative to its compute (Megatron-LM's (p - 1) / (v * m): 1F1B
    idles p - 1 micro-batch times per stage, and interleaving divides each stage's micro-batch time by v)."""
    return (pp - 1) / (vpp * num_micro_batches)


def schedule_line(pp: int, vpp: int, num_micro_batches: int) -> str:
    """The startup line naming the pipeline schedule and its bubble fraction."""
    bubble = bubble_fraction(pp, vpp, num_micro_batches)
    if vpp > 1:
        name, formula = (
            f"interleaved 1F1B, {vpp} virtual stages per rank",
            f"(p - 1) / (v * m) = {pp - 1} / {vpp * num_micro_batches}",
        )
    else:
        name, formula = "1F1B", f"(p - 1) / m = {pp - 1} / {num_micro_batches}"
    return (
        f"pipeline schedule: {name} over {pp} stages, {num_micro_batches} micro-batches;"
        f" bubble fraction {formula} = {bubble:.3f}"
    )


def forward_only(
    stage_forward: Callable[[Any, torch.Tensor | None], torch.Tensor],
    batches: Iterator[Any],
    num_micro_batches: int,
    dims: ParallelDims,
    activation_shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """Forward passes only (evaluation): each stage receives, computes and sends on; losses on the last stage."""
    channel = _Channel(dims, activation_shape, dtype, device)
    losses = []
    for _ in range(num_micro_batches):
        output = stage_forward(next(batches), channel.recv_forward())
        if dims.is_last_stage:
            losses.append(output.detach())
        else:
            channel.send_forward(output)
    return losses
