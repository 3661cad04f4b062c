"""FSDP's FP8 all-gathers switched to the training dtype and back between steps (parallel/fsdp/fsdp2.py,
`Fp8GatherDtypes`: what --fp8-auto-bf16 does to a Transformer Engine layer it moves to bf16;
tests/gpu/test_te_fsdp_guard.py runs it with TE), here on the local layers' FP8-gathered weights on 2 gloo ranks, the
switch following each linear's `enabled` (the guard's move, then a move back). Layer 2 moved after step 2 and back after
step 3: its linears read Fp8GatheredWeights holding the cast of each rank's shard in steps 1, 2 and 4 and a plain bf16
weight (each rank's rows: its shard in bf16) in step 3; the all-gathers of step 3 move more bytes (bf16) and those of
step 4 as many as step 2's; the losses within 1e-3 of FSDP's bf16 gathers with the same moves, the first two steps
bitwise those of the run that keeps FP8 gathers."""

import torch
import torch.distributed as dist

from megatron.fp8.formats import E4M3
from megatron.fp8.quantize import TENSOR, scaled_cast
from megatron.parallel.fsdp.fp8_gather import Fp8GatheredWeight
from megatron.parallel.fsdp.fsdp2 import fp8_gather_pieces
from megatron.training import Trainer
from tests.dist_utils import run_distributed
from tests.distributed.test_fsdp import PARAMS, _close
from tests.distributed.test_parallel_layouts import BASE, TENSORWISE, _parse

STEPS = 4
FLAGS = f"{BASE} --bf16 {TENSORWISE} --train-iters {STEPS} --eval-iters 0 {PARAMS} --fp8-stats-interval 1"
MOVES = {2: False, 3: True}  # after step n: layer 2 enabled (in FP8) or not


def _run(flags: str, world_size: int, switch: bool) -> tuple[list[float], dict, list[int]]:
    """Losses, {step: [(type of the weight, whether its rows are this rank's shard as gathered)]} of layer 2's
    linears at each step's first forward, and the bytes this rank sent into the all-gathers of each step."""
    t = Trainer(_parse(flags, world_size))
    if switch:  # the local linears gather FP8 as the guard left them (production: TE's layers only)
        t.grad_buffers.fp8_dtypes.gathers_fp8 = lambda linear: linear.fp8.enabled
    step, seen, sent = [1], {}, [0] * STEPS
    pieces = {id(w): piece for w, piece in fp8_gather_pieces(t.model)}
    moved = [(m, pieces.get(id(m.weight))) for m in t.model.modules() if getattr(m, "fp8", None) is not None]
    moved = [(m, piece) for m, piece in moved if m.fp8.layer_number == 2]

    def look(module, args, piece):
        if not module.training or len(seen.setdefault(step[0], [])) >= len(moved):
            return
        weight = module.weight
        if piece is None:  # bf16 gathers throughout
            seen[step[0]].append((type(weight), True))
            return
        shard, row = piece()
        if type(weight) is Fp8GatheredWeight:  # this rank's rows: the cast of its shard with the agreed scale
            scale = weight.scale_inv.reciprocal().reshape(1, 1)
            cast, _ = scaled_cast(shard.reshape(1, -1), scale, TENSOR, E4M3)
            mine = weight._data[row : row + shard.shape[0]].view(torch.uint8)
            same = torch.equal(mine, cast.view(torch.uint8).reshape(shard.shape))
        else:
            mine = weight[row : row + shard.shape[0]]
            same = mine.dtype == torch.bfloat16 and torch.equal(mine, shard.to(torch.bfloat16))
        seen[step[0]].append((type(weight), same))

    for module, piece in moved:
        module.register_forward_pre_hook(lambda m, a, piece=piece: look(m, a, piece))

    def after(collector, iteration, log, scalars, report=t.fp8_monitor.report):
        rows = report(collector, iteration, log, scalars)
        for module, _ in moved:
            module.fp8.enabled = MOVES.get(iteration, module.fp8.enabled)
        step[0] = iteration + 1
        return rows

    t.fp8_monitor.report = after
    gather = dist.all_gather_single if hasattr(dist, "all_gather_single") else dist.all_gather_into_tensor
    name = gather.__name__

    def counting(output, input, *args, **kwargs):
        sent[step[0] - 1] += input.numel() * input.element_size()
        return gather(output, input, *args, **kwargs)

    setattr(dist, name, counting)
    try:
        losses = list(t.train().losses.values())
    finally:
        setattr(dist, name, gather)
    return losses, seen, sent


def _body(rank, world_size):
    kept, kept_seen, kept_sent = _run(f"{FLAGS} --fp8-param-gather", world_size, switch=False)
    got, seen, sent = _run(f"{FLAGS} --fp8-param-gather", world_size, switch=True)
    want, _, _ = _run(FLAGS, world_size, switch=False)
    assert got[:2] == kept[:2], (got, kept)  # nothing switched before step 3
    for step in (1, 2, 4):
        assert seen[step] and all(kind is Fp8GatheredWeight and same for kind, same in seen[step]), (step, seen)
    assert seen[3] and all(kind is torch.nn.Parameter and same for kind, same in seen[3]), seen
    assert all(kind is Fp8GatheredWeight for kind, _ in kept_seen[3]), kept_seen  # the local layers' default
    assert sent[0] == sent[1] == sent[3] == kept_sent[2] < sent[2], (sent, kept_sent)
    _close(got, want, 1e-3, "FP8 gathers switched to bf16 and back against bf16 gathers", steps=STEPS)


def test_fp8_gathers_switch_to_the_training_dtype_and_back():
    run_distributed(_body, world_size=2)
