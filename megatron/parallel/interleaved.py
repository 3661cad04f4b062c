"""The interleaved 1F1B schedule (Megatron-LM's virtual pipeline): each pipeline rank holds `vpp` model chunks, and
chunk c of rank r is virtual stage c * pp + r, so a micro-batch passes every rank vpp times. Each rank's work is
split into vpp times more, vpp times smaller pieces, which shrinks the pipeline bubble by vpp (at vpp times the
point-to-point traffic).

Compute order (what each rank runs, in Megatron-LM's order): the micro-batches go in groups of g (default pp,
--microbatch-group-size-per-virtual-pipeline-stage); within a group, chunk 0 runs forward for each of the group's
micro-batches, then chunk 1, ...; backward passes visit the chunks in reverse. Rank r first runs
(pp - r - 1) * 2 + (vpp - 1) * g forward passes (warm-up), then alternates one forward and one backward, then drains
the remaining backward passes. As in Megatron-LM, pp <= g <= m, and the last group is whole or at least pp long
(the config checks it for every step's batch size).

Communication: every rank knows every rank's compute order, so the whole schedule is laid out on a common clock
(`tick_plan`): at each tick a rank runs its next pass if its input was produced at an earlier tick, then exchanges,
in one batch of point-to-point operations, exactly the tensors that it and its two neighbours produced at that
tick. Both ends of each transfer post it in the batch of the same tick, and a rank sends at most one tensor per
tick, so transfers never pair up wrongly (also with pp = 2, where both neighbours are the same rank) and no
arrangement of sends and receives can deadlock. The clock is only an order: ranks with nothing to exchange do not
wait for each other.

`stage_forward(batch, input_tensor, chunk)` runs one chunk: chunk 0 of the first rank embeds the batch's tokens, the
last chunk of the last rank returns the micro-batch's scalar loss, every other chunk its output activations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .dims import ParallelDims
from .pipeline import _p2p


@dataclass(frozen=True)
class Pass:
    forward: bool
    micro: int
    chunk: int


def compute_order(
    pp: int, rank: int, vpp: int, num_micro: int, forward_only: bool = False, group: int | None = None
) -> list[Pass]:
    """Rank `rank`'s forward and backward passes in Megatron-LM's interleaved order, micro-batches in groups of
    `group` (default `pp`)."""
    group = group or pp
    table = []  # (micro-batch, chunk) of each forward pass
    for start in range(0, num_micro, group):
        stop = num_micro if start + group >= num_micro else start + group  # the last group takes the rest
        table += [(micro, chunk) for chunk in range(vpp) for micro in range(start, stop)]
    forwards = [Pass(True, micro, chunk) for micro, chunk in table]
    if forward_only:
        return forwards
    backwards = [Pass(False, micro, vpp - 1 - chunk) for micro, chunk in table]
    warmup = min((pp - rank - 1) * 2 + (vpp - 1) * group, len(table))
    order = forwards[:warmup]
    for i in range(len(table) - warmup):
        order += [forwards[warmup + i], backwards[i]]
    return order + backwards[len(table) - warmup :]


def _producer(pp: int, vpp: int, rank: int, p: Pass) -> tuple[int, Pass] | None:
    """The (rank, pass) whose output `p` consumes: the previous virtual stage's forward, or the next one's
    backward; None for the first virtual stage's forward and the last one's backward."""
    stage = p.chunk * pp + rank + (-1 if p.forward else 1)
    if not 0 <= stage < pp * vpp:
        return None
    return stage % pp, Pass(p.forward, p.micro, stage // pp)


def tick_plan(
    pp: int, vpp: int, num_micro: int, forward_only: bool = False, group: int | None = None
) -> list[list[Pass | None]]:
    """For every rank, the pass it runs at each tick (None: idle): as early as its order and its input allow."""
    orders = [compute_order(pp, r, vpp, num_micro, forward_only, group) for r in range(pp)]
    done: dict[tuple[int, Pass], int] = {}
    plan: list[list[Pass | None]] = [[] for _ in range(pp)]
    position = [0] * pp
    tick = 0
    while any(position[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            p = orders[r][position[r]] if position[r] < len(orders[r]) else None
            source = None if p is None else _producer(pp, vpp, r, p)
            if p is not None and (source is None or done.get(source, tick) < tick):
                done[(r, p)] = tick
                position[r] += 1
                progressed = True
            else:
                p = None
            plan[r].append(p)
        if not progressed:  # cannot happen for Megatron's order; guards against a broken edit of it
            raise RuntimeError(f"interleaved schedule stalls at tick {tick} (pp {pp}, vpp {vpp}, m {num_micro})")
        tick += 1
    return plan


def run_interleaved(
    stage_forward: Callable[[Any, torch.Tensor | None, int], torch.Tensor],
    batches: Iterator[Any],
    num_micro_batches: int,
    vpp: int,
    dims: ParallelDims,
    activation_shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    forward_only: bool = False,
    group: int | None = None,
) -> list[torch.Tensor]:
    """Run the interleaved schedule over `num_micro_batches` (forward and backward, or forward only), micro-batches
    in groups of `group` (default pp); returns the detached losses (last rank only). Every rank draws each
    micro-batch from `batches` once, in order."""
    pp, rank = dims.pp, dims.pp_rank
    last_stage = pp * vpp - 1
    plan = tick_plan(pp, vpp, num_micro_batches, forward_only, group)
    prev, nxt = (rank - 1) % pp, (rank + 1) % pp
    inputs: dict[tuple[int, int], torch.Tensor | None] = {}  # (micro, chunk) -> received activations
    output_grads: dict[tuple[int, int], torch.Tensor] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    micro_batches: dict[int, Any] = {}
    losses: list[torch.Tensor] = []

    def run(p: Pass) -> torch.Tensor | None:
        """Run pass `p`; returns the tensor it sends on, if any."""
        key, stage = (p.micro, p.chunk), p.chunk * pp + rank
        if p.forward:
            if p.micro not in micro_batches:
                micro_batches[p.micro] = next(batches)
            batch = micro_batches[p.micro] if p.chunk < vpp - 1 else micro_batches.pop(p.micro)
            output = stage_forward(batch, inputs.get(key), p.chunk)
            if stage == last_stage:
                losses.append(output.detach())
            if not forward_only:
                outputs[key] = output
            else:
                inputs.pop(key, None)
            return output.detach() if stage < last_stage else None
        output, input_tensor = outputs.pop(key), inputs.pop(key, None)
        torch.autograd.backward(output, grad_tensors=output_grads.pop(key, None))
        return input_tensor.grad if stage > 0 else None

    for tick in range(len(plan[0])):
        mine = plan[rank][tick]
        sent = run(mine) if mine is not None else None
        send, recv, received = [], [], []
        if sent is not None:
            send.append((sent, nxt if mine.forward else prev))
        before, after = plan[prev][tick], plan[nxt][tick]
        if before is not None and before.forward and before.chunk * pp + prev < last_stage:
            chunk = before.chunk + (1 if rank == 0 else 0)  # from the last rank: the next chunk's input
            buffer = torch.empty(activation_shape, dtype=dtype, device=device, requires_grad=not forward_only)
            recv.append((buffer, prev))
            received.append((inputs, (before.micro, chunk), buffer))
        if after is not None and not after.forward and after.chunk * pp + nxt > 0:
            chunk = after.chunk - (1 if rank == pp - 1 else 0)  # from the first rank: the previous chunk's grad
            buffer = torch.empty(activation_shape, dtype=dtype, device=device)
            recv.append((buffer, nxt))
            received.append((output_grads, (after.micro, chunk), buffer))
        if send or recv:
            with torch.no_grad():
                _p2p(dims, send, recv)
        for store, key, buffer in received:
            store[key] = buffer
    return losses
