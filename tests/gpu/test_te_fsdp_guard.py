"""Transformer Engine's FP8 all-gathers under FSDP (--fp8-param-gather, optim_grads_params) with the FP8 guard and
monitor on 2 GPUs (NCCL), against the distributed optimizer.

* --fp8-auto-bf16: a layer the guard moves to bf16 (here through its API, `Fp8Guard.move`, the call its trigger makes)
  gathers bf16 from the next step on, and TE's linears read plain bf16 weights (parallel/fsdp/fsdp2.py,
  `Fp8GatherDtypes`). Moved before the first step (delayed scaling), the run matches the distributed optimizer's TE FP8
  weights with that layer built in bf16 (--fp8-first-layer-bf16) over 10 steps within 2e-3 (tests/gpu/test_te_fsdp.py's
  bound for the FP8 gathers); the moved layer's all-gather outputs are bf16 (2 bytes per element), the others' E4M3
  bytes (1). Moved after step 3 (tensorwise) and back after step 6 (the guard never moves a layer back: the test puts it
  back in the autocast's `fp8_layers`), the run matches the distributed optimizer without FP8 weights making the same
  moves within 1e-2 (test_te_fsdp.py's FP8 bound), its linears reading Float8Tensors before, plain bf16 weights between
  and Float8Tensors again after.
* --fp8-stats-interval: the monitor counts each FP8-gathered weight from the cast of each rank's shard, summed over
  the data-parallel ranks: its weight rows equal the distributed optimizer's (which count the cast of each rank's
  main piece) at step 1 within float rounding, and every weight is counted once (the elements counted are the
  weight's, not two ranks' read-back copies).

The CPU side: tests/distributed/test_fsdp_fp8_gather_dtypes.py (the switch, on the local layers),
tests/unit/test_fp8_monitor.py (TE's taps counting pieces)."""

import math

import torch

from megatron.parallel.fsdp import fsdp2_internals as internals
from megatron.training import Trainer
from tests.dist_utils import run_distributed
from tests.distributed.test_fsdp import DISTOPT, PARAMS, _close
from tests.distributed.test_parallel_layouts import BASE, FP8, TENSORWISE, _parse
from tests.gpu.marks import TE_ON_TWO_GPUS

TE = "--transformer-impl transformer_engine --bf16 --eval-iters 0"
NEVER = "--fp8-stats-interval 1 --fp8-guard-saturation 1 --fp8-guard-underflow 1"  # the guard acts on our moves only
GUARD = f"{NEVER} --fp8-auto-bf16"
FP8_MAX = 448.0  # E4M3: the hybrid format's forward weights

pytestmark = TE_ON_TWO_GPUS


def _train(flags: str, world_size: int, moves: dict[int, tuple[str, int]] | None = None, before: int | None = None):
    """(losses, {step: [(layer number, type of weight, dtype)] at the first forward}, {(step, linear, tensor):
    (amax, scale, saturated, underflow, elements counted)}, trainer). `before`: the layer moved to bf16 before the
    first step; `moves`: {step: ("bf16" | "fp8", layer)} after that step's report."""
    t = Trainer(_parse(flags, world_size))
    if before is not None:
        t.fp8_monitor.guard.move(before)
    step, seen, rows = [1], {}, {}
    linears = [(layer.layer_number, m) for layer in t.model.decoder.layers for m in layer.te_modules()]

    def look(module, args, number):
        if module.training and len(seen.setdefault(step[0], [])) < len(linears):
            seen[step[0]].append((number, type(module.weight).__name__, module.weight.dtype))

    for number, module in linears:
        module.register_forward_pre_hook(lambda m, a, number=number: look(m, a, number))

    def after(collector, iteration, log, scalars, report=t.fp8_monitor.report):
        stage = report(collector, iteration, log, scalars)
        names = collector.names
        for r in stage:
            elements = float(collector.counts[names.index(r.linear), r.role.value, 2])
            rows[(iteration, r.linear, r.tensor)] = (r.amax, r.scale, r.saturated, r.underflow, elements)
        kind, layer = (moves or {}).get(iteration, (None, None))
        if kind == "bf16":
            t.fp8_monitor.guard.move(layer)
        elif kind == "fp8":
            t.fp8_monitor.taps.fp8_layers.add(layer)
        step[0] = iteration + 1
        return stage

    t.fp8_monitor.report = after
    return list(t.train().losses.values()), seen, rows, t


def _gather_dtypes(t: Trainer) -> dict[int, set[int]]:
    """The bytes per weight element of FSDP's all-gather outputs of each layer's FP8-gathered weights (kept, freed,
    between steps): 1 for E4M3 bytes (sent as bf16 pairs where the rows divide: fsdp_params.gather_view), 2 bf16."""
    layer_of = {id(m): layer.layer_number for layer in t.model.decoder.layers for m in layer.te_modules()}
    widths: dict[int, set[int]] = {}
    for _, param in t.grad_buffers.fp8_dtypes.params:
        number = layer_of[id(internals.module_of(param))]
        gathered = param.padded_sharded_param_size.numel() * param.mesh_info.shard_mesh_size
        widths.setdefault(number, set()).update(
            o.numel() * o.element_size() // gathered for o in internals.gathered_outputs(param)
        )
    return widths


def _body(rank, world_size):
    flags = f"{BASE} {TE} --train-iters 10"
    # moved before the first step, against the layer built in bf16 under the distributed optimizer
    want, _, _, _ = _train(
        f"{flags} {FP8.replace(' --no-fp8-first-layer-bf16', '')} {GUARD} --fp8-param-gather {DISTOPT}",
        world_size,
    )
    got, seen, _, t = _train(f"{flags} {FP8} {GUARD} --fp8-param-gather {PARAMS}", world_size, before=1)
    _close(got, want, 2e-3, "TE FSDP, layer 1 moved to bf16 before step 1", steps=10)
    for step, weights in seen.items():
        assert all(
            (number == 1) == (kind == "Parameter" and dtype == torch.bfloat16) for number, kind, dtype in weights
        ), (step, weights)
        assert all(kind == "Float8Tensor" for number, kind, _ in weights if number != 1), (step, weights)
    dtypes = _gather_dtypes(t)
    assert dtypes[1] == {2} and all(d == {1} for n, d in dtypes.items() if n != 1), dtypes

    # moved after step 3 and back after step 6, against bf16 weights making the same moves
    moves = {3: ("bf16", 2), 6: ("fp8", 2)}
    want, _, _, _ = _train(f"{flags} {TENSORWISE} {GUARD} {DISTOPT}", world_size, moves)
    got, seen, _, t = _train(f"{flags} {TENSORWISE} {GUARD} --fp8-param-gather {PARAMS}", world_size, moves)
    _close(got, want, 1e-2, "TE FSDP, layer 2 moved to bf16 after step 3 and back after step 6", steps=10)
    for step, weights in seen.items():
        moved = 4 <= step <= 6
        layer2 = {(kind, dtype) for number, kind, dtype in weights if number == 2}
        assert layer2 == ({("Parameter", torch.bfloat16)} if moved else {("Float8Tensor", torch.bfloat16)}), (
            step,
            layer2,
        )
    assert all(d == {1} for d in _gather_dtypes(t).values())  # all FP8 again

    # the monitor's weight statistics: FSDP's shards' casts against the distributed optimizer's main pieces' casts
    flags = f"{BASE} {TE} --train-iters 3 {TENSORWISE} {NEVER} --fp8-param-gather"
    _, _, want, t_want = _train(f"{flags} {DISTOPT}", world_size)
    _, _, got, t = _train(f"{flags} {PARAMS}", world_size)
    assert got.keys() == want.keys() and t.fp8_monitor.taps.weight_pieces
    # No step skipped: the first gathers' TE copies once marked the transpose buffer valid before anything wrote
    # it, and the last layer's first dgrad (that unit stays gathered into its backward) skipped FSDP's step 1
    assert t.state.skipped_iters == t_want.state.skipped_iters == 0, (t.state.skipped_iters, t_want.state.skipped_iters)
    numel = {name: m.weight.numel() for name, m in zip(t.fp8_monitor.taps.names, t.fp8_monitor.taps.modules)}
    for key, (amax, scale, saturated, underflow, elements) in got.items():
        iteration, linear, tensor = key
        if tensor != "weight":
            continue
        w_amax, w_scale, w_saturated, w_underflow, w_elements = want[key]
        assert elements == w_elements == numel[linear], (key, elements, w_elements)  # once, not once per rank
        if iteration == 1:  # the same initial weights: the same statistics up to float rounding
            close = math.isclose(amax, w_amax, rel_tol=1e-6) and math.isclose(scale, w_scale, rel_tol=1e-6)
        else:
            # The runs' weights have parted by then: Adam's first steps move each element by about lr * sign(g), and
            # a gradient sign that the runs' different FP8 roundings flip parts an element by up to 2 lr per step
            # (measured: 3.4e-4 at step 3, lr 1e-3). Each scale is fp8_max over the amax of the weight it casts:
            # FSDP's fp32 shards, the distributed optimizer's bf16 model weight (its amax rounded, 2^-8 relative)
            close = abs(amax - w_amax) <= 2 * 1e-3 * (iteration - 1)
            close &= math.isclose(scale, FP8_MAX / amax, rel_tol=1e-6)
            close &= math.isclose(w_scale, FP8_MAX / w_amax, rel_tol=2**-8)
        if linear.endswith("layers.0.self_attention.linear_qkv") and torch.distributed.get_rank() == 0:
            print(f"monitor {key}: FSDP {got[key]}, distributed optimizer {want[key]}", flush=True)  # pytest -s
        assert close, (key, got[key], want[key])
        assert abs(saturated - w_saturated) <= 1e-3 and abs(underflow - w_underflow) <= 1e-3, (key, got[key], want[key])


def test_te_fsdp_fp8_gathers_compose_with_the_fp8_guard_and_monitor():
    run_distributed(_body, world_size=2, backend="nccl")
