"""FSDP's own work per iteration (strategies optim_grads and optim_grads_params: PyTorch's FSDP2 as
megatron/parallel/fsdp/fsdp2.py applies it; docs/fsdp.md), in traffic.py's conventions: one pass per operation, each
input read once and each output written once.

Units, in forward order, as `apply_fsdp` makes them (U = a unit's parameters on this rank, its tensor-parallel
piece, whole; U8 = those of them gathered as FP8: the FP8 layers' linear weights with --fp8-param-gather):

    root                 the tied word embedding and the final norm (nothing with untied embeddings)
    embedding            untied: word (and learned position) embeddings
    layers               one transformer layer each, or consecutive layers until a unit holds
                         --suggested-communication-unit-size elements (config.sharding.fsdp_layer_units)
    output               untied: final norm + output layer

Gathers per iteration: optim_grads_params gathers the embedding and layer units before their forward and again
before their backward, 2 per micro-batch (the root, the output unit and the last layer unit stay gathered from
forward to backward: 1);
optim_grads keeps every unit from the first forward to the last micro-batch's backward: 1 per step. optim_grads_params
with --torch-fsdp2-no-reshard-after-forward keeps each unit from its forward to its backward: 1 per micro-batch.

Bytes per element: b = the training dtype's (2 under --bf16), s = a weight shard's (4: the fp32 main weights; b with
--use-precision-aware-optimizer), g = a gradient shard's (4, or 2 with bf16 gradient shards), r = the reduce-scatter's
(4, or 2 with bf16 reduce-scatters); D = the data-parallel size. Memory-bound work:

    all-gather copy-in   per gather:     read s(U-U8) + U8, write b(U-U8) + U8, over D (each rank its shard; the
                                         FP8 shard is the cached byte buffer, written once per step below)
    all-gather copy-out  per gather:     read b(U-U8) + U8, write b(U-U8) + U8 (the gathered unit into its params)
    reduce-scatter       per micro-batch: staging: read bU (the unsharded gradients), write rU (with
                                         --fp8-grad-reduce 1 byte, the FP8 cast fused in, then the dequantize-sum of
                                         the D received chunks: read U, write rU/D)
    gradient shard add   per micro-batch: read rU/D, read + write gU/D
    optimizer            per step:       (2mp + 2m1 + 2m2 + 3g)S + M_s, S = P/D: traffic.py's step on the shards
                                         (gradient read twice, then zeroed); M_s = bS where the optimizer writes
                                         training-dtype shards (--use-precision-aware-optimizer), else 0 (it steps
                                         on the fp32 shards in place)
    FP8 weights          --fp8-param-gather: per step the shards' amax and cast, (2s + 1) P8/D; per gather
                         that a backward uses (optim_grads_params: each micro-batch; optim_grads: once) the transposed
                         FP8 weight the Hopper dgrad reads, 2 P8. With bf16 gathers under optim_grads_params the FP8
                         layers cast the gathered weight every micro-batch (nothing is kept: it is freed after use):
                         Transformer Engine in the forward (read 2, write 1) and again in the backward (docs/fsdp.md),
                         6 P8 per micro-batch; the local linears once per forward, rows and transpose, 4 P8 (b = 2);
                         under optim_grads (weights gathered for the step) both cast once per step and keep the cast,
                         rows and transpose, 4 P8, as under the distributed optimizer (traffic.py)

Categories: the copy-out and the reduce-scatter staging are `fsdp` (FSDP2's split_with_sizes_copy and chunk_cat
kernels, report.py), the copy-in (a cast to the gather dtype) and the gradient add `elementwise`, the FP8 passes
`cast/transpose`, as the profile files their kernels.

Communication that cannot overlap: the all-gather of the first unit gathered in each micro-batch's forward (the root,
or the untied embedding unit: nothing runs before it; optim_grads: once per step) and the reduce-scatter of the last
unit in its backward (the same unit: nothing follows it; with --fp8-grad-reduce an all-to-all of U(1 + 1/128) bytes,
timed as a reduce-scatter of that size, which moves the same (D-1)/D of them per rank). Every other unit's gather
and reduce-scatter can run beside the next or previous unit's computation (--fsdp-double-buffer prefetches), so the
bound counts none of them; nor the FP8 scales' all-reduce (a few bytes per weight, once per step).

Not counted: the recomputed forwards' weight casts, FSDP2's padding of shards to whole rows over D, and the host
work of its per-unit hooks (GPU idle time in the profile).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config import Config
from megatron.config.sharding import fsdp_layer_units

from .work import DTYPE_BYTES, CommWork, param_parts

# (category, name, bytes per pass, formula, passes per iteration)
Item = tuple[str, str, float, str, int]


@dataclass(frozen=True)
class Unit:
    """One FSDP unit on this rank: U parameters (whole), U8 of them gathered as FP8, gathered `gathers` times per
    iteration."""

    name: str
    elements: int
    fp8_elements: int
    gathers: int


def _bytes(cfg: Config) -> dict[str, int]:
    """b, s, g, r of the module docstring."""
    b = 2 if cfg.precision.bf16 or cfg.precision.fp16 else 4
    return {
        "b": b,
        "s": 4 if cfg.sharding.shards_hold_main_weights else b,
        "g": 2 if cfg.sharding.main_grads_bf16 else 4,
        "r": 2 if cfg.sharding.grad_comm_bf16 else 4,
    }


def fsdp_units(cfg: Config, vocab: int) -> list[Unit]:
    """The units of `cfg`'s model on this rank, in forward order (module docstring)."""
    parts, m, prec = param_parts(cfg, vocab), cfg.model, cfg.precision
    micro, par = cfg.num_micro_batches, cfg.parallel
    # the root and the output unit (and every unit without resharding after the forward): once per micro-batch
    params = par.data_parallel_sharding_strategy == "optim_grads_params"
    kept = micro if params else 1
    sharded = 2 * micro if params and par.torch_fsdp2_reshard_after_forward else kept
    fp8_numbers = set(prec.fp8_layer_numbers(m.num_layers)) if prec.fp8_param_gather else set()
    units: list[Unit] = []
    if not parts["output_layer"]:
        units.append(Unit("root (embedding, final norm)", parts["embedding"] + parts["final_norm"], 0, kept))
    else:
        units.append(Unit("embedding", parts["embedding"], 0, sharded))
    first = 1
    sizes = fsdp_layer_units(m.num_layers, parts["layer"], cfg.parallel.suggested_communication_unit_size)
    for i, n in enumerate(sizes):
        numbers = range(first, first + n)
        fp8 = sum(parts["linears"] for k in numbers if k in fp8_numbers)
        name = f"layer {first}" if n == 1 else f"layers {first}-{first + n - 1}"
        units.append(Unit(name, n * parts["layer"], fp8, sharded if i < len(sizes) - 1 else kept))
        first += n
    if parts["output_layer"]:
        units.append(Unit("output (final norm, output layer)", parts["final_norm"] + parts["output_layer"], 0, kept))
    return units


def _merged(units: list[Unit]) -> list[tuple[str, Unit, int]]:
    """Units alike in (U, U8, gathers) merged, in order: (label, unit, how many)."""
    out: dict[tuple[int, int, int], list] = {}
    for u in units:
        out.setdefault((u.elements, u.fp8_elements, u.gathers), [u.name, u, 0])[2] += 1
    return [(name if n == 1 else f"{n} units like {name}", u, n) for name, u, n in out.values()]


def fsdp_memory(cfg: Config, vocab: int) -> list[Item]:
    """FSDP's memory-bound passes of one iteration (module docstring), in place of the gradient buffers' optimizer
    and FP8 weight-cast terms."""
    z, opt, prec = _bytes(cfg), cfg.optimizer, cfg.precision
    b, s, g, r = z["b"], z["s"], z["g"], z["r"]
    dp, micro = cfg.data_parallel_size, cfg.num_micro_batches
    units = fsdp_units(cfg, vocab)
    items: list[Item] = []
    for label, u, n in _merged(units):
        U, U8, tag = u.elements, u.fp8_elements, f" [{label}]"
        gathered = b * (U - U8) + U8
        items += [
            (
                "elementwise",
                "FSDP all-gather copy-in" + tag,
                n * (s * (U - U8) + U8 + gathered) / dp,
                "(s(U-U8)+U8 + b(U-U8)+U8)/D",
                u.gathers,
            ),
            ("fsdp", "FSDP all-gather copy-out" + tag, n * 2 * gathered, "2(b(U-U8)+U8)", u.gathers),
        ]
        if cfg.parallel.fp8_grad_reduce:
            items += [
                ("fsdp", "FSDP reduce-scatter staging + FP8 cast" + tag, n * (b + 1) * U, "(b+1)U", micro),
                (
                    "cast/transpose",
                    "FSDP FP8 reduce-scatter dequantize-sum" + tag,
                    n * (U + r * U / dp),
                    "U + rU/D",
                    micro,
                ),
            ]
        else:
            items.append(("fsdp", "FSDP reduce-scatter staging" + tag, n * (b + r) * U, "(b+r)U", micro))
        items.append(("elementwise", "FSDP gradient shard add" + tag, n * (r + 2 * g) * U / dp, "(r+2g)U/D", micro))
    params, p8 = sum(u.elements for u in units), sum(u.fp8_elements for u in units)
    precision_aware = opt.use_precision_aware_optimizer
    mp = DTYPE_BYTES[opt.main_params_dtype] if precision_aware else 4
    m1 = DTYPE_BYTES[opt.exp_avg_dtype] if precision_aware else 4
    m2 = DTYPE_BYTES[opt.exp_avg_sq_dtype] if precision_aware else 4
    shard = params / dp
    step = (2 * mp + 2 * m1 + 2 * m2 + 3 * g) * shard + (b * shard if not cfg.sharding.shards_hold_main_weights else 0)
    formula = "(2mp+2m1+2m2+3g)S" + (" + bS" if not cfg.sharding.shards_hold_main_weights else "")
    items.append(("optimizer", "Adam step + grad zero + grad norm (FSDP shards)", step, formula, 1))
    fp8_weights = len(prec.fp8_layer_numbers(cfg.model.num_layers)) * param_parts(cfg, vocab)["linears"]
    if prec.fp8_param_gather and p8:
        backward_gathers = micro if cfg.parallel.data_parallel_sharding_strategy == "optim_grads_params" else 1
        items += [
            ("cast/transpose", "FP8 shard amax + cast (FSDP)", (2 * s + 1) * p8 / dp, "(2s+1)P8/D", 1),
            ("cast/transpose", "FP8 weight transpose (FSDP, dgrad)", 2 * p8, "2 P8", backward_gathers),
        ]
    elif fp8_weights and cfg.sharding.keeps_weight_casts:
        formula = "(b+2) P8 (rows + transpose, kept)"
        items.append(("cast/transpose", "FP8 weight casts (FSDP, once per step)", (b + 2) * fp8_weights, formula, 1))
    elif fp8_weights:
        te = cfg.model.transformer_impl == "transformer_engine"
        per_micro = (2 * b + 2) * fp8_weights if te else (b + 2) * fp8_weights
        formula = "2(b+1) P8 (TE: fwd + bwd casts)" if te else "(b+2) P8 (rows + transpose)"
        items.append(("cast/transpose", "FP8 weight casts (FSDP, per micro-batch)", per_micro, formula, micro))
    return items


def fsdp_communication(cfg: Config, vocab: int) -> list[CommWork]:
    """The all-gather and reduce-scatter nothing overlaps under FSDP (module docstring)."""
    z, dp, micro = _bytes(cfg), cfg.data_parallel_size, cfg.num_micro_batches
    first = fsdp_units(cfg, vocab)[0]
    gathered = z["b"] * (first.elements - first.fp8_elements) + first.fp8_elements
    gathers = micro if cfg.parallel.data_parallel_sharding_strategy == "optim_grads_params" else 1
    if cfg.parallel.fp8_grad_reduce:
        reduced, what = round(first.elements * (1 + 1 / 128)), "FP8 all-to-all"
    else:
        reduced, what = first.elements * z["r"], "reduce-scatter"
    return [
        CommWork(f"FSDP all-gather of the first unit ({first.name})", "all_gather", gathered, dp, gathers),
        CommWork(f"FSDP {what} of the last unit ({first.name})", "reduce_scatter", reduced, dp, micro),
    ]
