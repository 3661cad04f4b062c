"""A start-of-run memory estimate, per GPU: what torch.cuda.max_memory_allocated should read at the peak.

Held for the whole run, in bytes per parameter of this rank:

* weights: 2 in bf16, 4 in fp32; 1 for each FP8 parameter (--fp8-param-gather: the transformer linears' weights,
  stored only in FP8).
* gradients: 4, the fp32 accumulation buffer (`main_grad`), whatever the weights' type; 2 in bf16
  (--grad-reduce-in-bf16, --main-grads-dtype bf16).
* main (master) parameters: 4 (fp32) when the weights are not fp32 (bf16, or any FP8 parameter: the optimizer then
  keeps a main copy of every parameter); none for fp32 weights, which are their own master copy. fp16 main
  parameters of the precision-aware optimizer: 3.03 (data, remainder and block scales; `state_bytes`).
* Adam states: two fp32 moments, 8; with the precision-aware optimizer 4, 2 or 2.03, 1.03 each (fp32, bf16 or
  fp16, fp8).
* Transformer Engine's FP8 weight casts: without FSDP, TE keeps each FP8 linear's weight cast for the step's later
  micro-batches, with its transpose on Hopper (2 bytes per element; an FP8 parameter's transpose: 1); so it does
  under FSDP's optim_grads (without --fp8-param-gather), whose gathered weights live for the whole step: 2 bytes
  per FP8 layer parameter beside them (`Sharding.keeps_weight_casts`). Under optim_grads_params TE (2.16 and later)
  keeps none: it casts the gathered weight for each GEMM and frees the cast, so none is held at the peak. The
  local layers' casts are not counted.

The distributed optimizer keeps 1/dp of the main copy and the moments (the gradient buffer stays whole: it is
reduce-scattered in place). --use-megatron-fsdp's optim_grads (megatron/parallel/fsdp/flat_shards.py) keeps what the
distributed optimizer keeps but holds 1/dp of the gradients (persistent fp32 shards, bf16 with
--megatron-fsdp-main-grads-dtype bf16 or --grad-reduce-in-bf16) and no whole gradient buffer: a bucket exists only
while its gradients are formed and reduce-scattered (in --megatron-fsdp-grad-comm-dtype), and at the peak, the start
of the backward, one is (the output layer's, or the last layers'; counted as a backward buffer).
FSDP keeps 1/dp of the weights, gradients and moments: fp32 weight shards that are the
main weights, or with --use-precision-aware-optimizer shards in the training dtype beside 1/dp of its main weights;
with --fp8-param-gather also the FP8 layers' shards cast to E4M3 for the step's all-gathers (1 byte per element /
dp, cast once per step and kept: megatron/parallel/fsdp/fp8_gather_scales.py). Those casts are all a step needs of
the FP8 layers' training-dtype shards (--use-precision-aware-optimizer): these are freed from the forward to the
optimizer step, so they count in the step (`freed_shards`), not before the activations (unless --fp8-stats-interval:
a watched step keeps them).

The peak comes at the start of the backward pass, or in the optimizer step, whichever holds more:

* activations (`activation_memory.py`): what this stage's layers keep for backward at their own widths (Korthikanti
  et al.'s 34 bytes per token and hidden unit for a GPT-3 layer), as often as the schedule holds micro-batches in
  flight (`in_flight_layers`: pp of them on the first stage under 1F1B), less what recomputation drops; on the
  stage that computes the loss, the final norm's and the output layer's inputs and the logits: Transformer Engine's
  cross-entropy keeps them in the training dtype and writes their gradient into them; the other losses 8 bytes per
  logit (fp32 logits and their gradient).
* backward buffers: the output layer's weight gradient in the training dtype (added into `main_grad` or
  reduce-scattered after the layer's backward; none where the untied layer writes it straight into a gradient
  buffer of its own dtype: `output_wgrad_in_buffer`) and its input gradient; under FSDP what is gathered (the
  output unit being computed and the last layer's unit prefetched, or the whole model under optim_grads) and the
  reduce-scatter staging where it outgrows what it replaces.
* the optimizer step: torch's AdamW upcasts bf16 gradients to fp32 copies of this rank's whole shard at once; the
  precision-aware optimizer writes FP8 weights' new main values into fp32 pieces before casting them, and under FSDP
  the FP8 layers' freed shards get their storage back.
* delayed scaling's calibration pass before the first step (a fresh run with --fp8-calibration): one micro-batch
  in high precision with every layer recomputed (`calibration_activation_units`) beside the same buffers; it
  frees FSDP's shards as a step's forward does. It can set the peak only where the step keeps little more than
  one layer's activations: a run that itself recomputes every layer one at a time (then the pass holds more by
  what one layer keeps in 16 bits beyond its FP8 copies, ~4.5 bytes per s*b*h on Llama shapes with TE), or a tiny
  model.

`estimate_bytes` gives the numbers; `memory_estimate_lines` writes them as the start-of-run log line
(`print_memory_estimate` prints it, with `headroom_note` where the GPU is tight), and `print_peak_memory` the total
again beside the measured peak at the end of the run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.config import Config
from megatron.config.sharding import fsdp_layer_units
from megatron.model.output_layer import SLICE_BYTES_PER_ELEMENT, chunk_rows
from megatron.optim.states import state_bytes
from megatron.parallel import ParallelDims
from megatron.parallel.fsdp.fp8_gather_axes import AXES_RECIPES

from .activation_memory import calibration_activation_units, recomputed_activation_units
from .logger import print_rank_0


def _size(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def _count(n: int) -> str:
    """A parameter count as in model names, to three significant digits (812M, 1.24B, 45.3K)."""
    rounded = float(f"{n:.3g}")  # first, so that 999.9M reads 1B and not 1e+03M
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if rounded >= scale:
            return f"{rounded / scale:g}{unit}"
    return f"{rounded:g}"


def _per(num_bytes: float) -> str:
    """Bytes per parameter, three significant digits at most (4, 1.19, 13.2)."""
    return f"{num_bytes:.3g}"


def _te(cfg: Config) -> bool:
    return cfg.model.transformer_impl == "transformer_engine"


def _stage_layers(cfg: Config, pp_rank: int) -> list[int]:
    """Global (1-based) numbers of pipeline rank `pp_rank`'s transformer layers."""
    return [n for chunk in cfg.stage_chunks(pp_rank) for n in chunk]


def _layer_params(cfg: Config, num_params: int, vocab: float, pp_rank: int) -> float:
    """One transformer layer's parameters on this rank: the stage's `num_params` less its vocabulary matrices
    (`vocab` elements each: the embedding on the first stage, the output layer, or tied a copy of the embedding, on
    the last), over its layers."""
    pp = cfg.parallel.pipeline_model_parallel_size
    untied = cfg.model.untie_embeddings_and_output_weights
    matrices = int(pp_rank == 0) + int(pp_rank == pp - 1 and (untied or pp > 1))
    return (num_params - matrices * vocab) / max(len(_stage_layers(cfg, pp_rank)), 1)


def _fsdp_weights_and_grads(cfg: Config, num_params: int, itemsize: int, fp8_gathered: float) -> tuple[float, float]:
    """FSDP's weight and gradient shards per rank: fp32 (bf16 gradients with --megatron-fsdp-main-grads-dtype bf16;
    the weight shards are the main weights, or hold the training dtype with --use-precision-aware-optimizer, whose
    main weights `estimate_bytes` counts as the optimizer's), and the E4M3 cast of the `fp8_gathered` parameters'
    shards that their all-gathers send (1 byte each, 2 under rowwise and mxfp8: `_fp8_gathered_casts`; kept from one
    step's cast to the next). Under tensor parallelism `num_params` is this rank's tensor-parallel piece, which FSDP
    shards over the data (x context) parallel ranks."""
    dp = cfg.sharding.optimizer_shards
    shard_bytes = 4 if cfg.sharding.shards_hold_main_weights else itemsize
    casts = fp8_gathered * _fp8_gathered_casts(cfg)
    return (num_params * shard_bytes + casts) / dp, num_params * (2 if cfg.sharding.main_grads_bf16 else 4) / dp


def _fp8_gathered_casts(cfg: Config) -> int:
    """E4M3 casts of an FP8-gathered weight FSDP keeps per step and gathers into a unit kept gathered: two (along
    both axes, 1 byte each) for the local layers' rowwise and mxfp8 (megatron/parallel/fsdp/fp8_gather_axes.py), else
    one."""
    return 2 if cfg.precision.fp8_recipe in AXES_RECIPES and not _te(cfg) else 1


def _fsdp_freed_shards(cfg: Config, fp8_gathered: float, itemsize: int) -> float:
    """Bytes of the `fp8_gathered` parameters' shards FSDP frees from the training forward's cast to the optimizer
    step (megatron/parallel/fsdp/fp8_gather_scales.py): shards in the training dtype beside the optimizer's main weights
    (--use-precision-aware-optimizer), unless the FP8 monitor watches steps (a watched step keeps them: the local
    linears count their cast from them)."""
    if cfg.sharding.shards_hold_main_weights or cfg.precision.fp8_stats_interval:
        return 0.0
    return fp8_gathered * itemsize / cfg.sharding.optimizer_shards


def _fsdp_buffers(
    cfg: Config, num_params: int, vocab: float, layer: float, itemsize: int, loss_side: float
) -> tuple[float, float]:
    """(gathered, staging): FSDP's buffers at the peak, the start of the backward pass, in bytes.

    gathered: the units FSDP holds gathered in the training dtype: under optim_grads_params the output unit (the
    final norm and untied output layer, kept from its forward to its backward; tied, the root with the embedding)
    and the last layer unit, which its backward prefetches (one or more layers: --suggested-communication-unit-size);
    under optim_grads every unit, kept for the whole step, and so under optim_grads_params with
    --torch-fsdp2-no-reshard-after-forward (each unit kept from its forward to its backward: all of them at the end of
    the forward, the activation peak). With --fp8-param-gather the FP8 layers' linears are
    gathered as E4M3, 1 byte per element; Transformer Engine's layers also get a 1-byte transpose of each, allocated
    with the gathered unit and freed with it: 2 bytes, as in bf16 (then without TE's own cast of the bf16 weight,
    which is not held at the peak either: see the module docstring). Not blockwise: TE derives that layer's
    column-wise copy in its backward, one linear at a time, and drops it after the dgrad
    (parallel/fsdp/te_blockwise_gather.py), so 1 byte (its grid of block scales, 4 bytes per 16384 elements, is not
    counted). The local layers' rowwise and mxfp8 weights in a unit kept gathered hold both casts: 2 bytes (mxfp8's
    scales not counted). Norm weights are counted as the linears.

    staging: after the output unit's backward, each unit's backward holds its unsharded gradient (training dtype)
    while the previous unit's reduce-scatter input and output (the reduce dtype: bf16 with bf16 gradient shards or
    --megatron-fsdp-grad-comm-dtype bf16, else fp32) are still in flight (FSDP2 frees them at the next unit's
    reduce-scatter). By then the logits and the output layer's tensors (`loss_side` bytes) are freed, so only what
    the staging of the largest unit exceeds them by raises the peak."""
    par, prec, m = cfg.parallel, cfg.precision, cfg.model
    fp8 = prec.fp8_layer_numbers(m.num_layers)
    if not prec.fp8_param_gather:
        fp8_bytes = itemsize
    elif _te(cfg):  # the E4M3 weight and its transpose; blockwise: the weight alone
        fp8_bytes = 1 if prec.fp8_recipe == "blockwise" else 2
    else:
        fp8_bytes = _fp8_gathered_casts(cfg)
    per_unit = _layers_per_unit(cfg, layer)
    if par.data_parallel_sharding_strategy == "optim_grads" or not par.torch_fsdp2_reshard_after_forward:
        gathered = (num_params - len(fp8) * layer) * itemsize + len(fp8) * layer * fp8_bytes
    else:
        last_fp8 = m.num_layers in fp8
        gathered = vocab * itemsize + per_unit * layer * (fp8_bytes if last_fp8 else itemsize)
    unit = max(vocab, per_unit * layer)
    rs = 2 if cfg.sharding.grad_comm_bf16 else 4
    staging = unit * (itemsize + rs + rs / cfg.sharding.optimizer_shards)
    return gathered, max(staging - loss_side, 0.0)


def _layers_per_unit(cfg: Config, layer: float) -> int:
    """Transformer layers in the largest FSDP unit (--suggested-communication-unit-size; the first unit, the others
    as large or the last smaller) for layers of `layer` parameters."""
    if layer <= 0:
        return 1
    return fsdp_layer_units(cfg.model.num_layers, layer, cfg.parallel.suggested_communication_unit_size)[0]


def _step_bytes(cfg: Config, num_params: int, fp8_params: int) -> float:
    """What the optimizer step allocates beside the states (`MixedPrecisionAdamW.step`): torch's AdamW steps fp32
    main parameters, so bf16 gradients (FSDP's bf16 gradient shards, --grad-reduce-in-bf16) are upcast to fp32
    copies of this rank's whole shard at once; the precision-aware optimizer's fused kernel reads them as they are,
    but writes the new main values of FP8 weights into fp32 tensors of this rank's pieces, all allocated before the
    step and cast into the weights after it (`_model_copies`)."""
    shards = cfg.sharding.optimizer_shards
    if cfg.optimizer.use_precision_aware_optimizer:
        return 4 * fp8_params / shards
    bf16 = cfg.sharding.main_grads_bf16
    return 4 * num_params / shards if bf16 else 0.0


def output_wgrad_in_buffer(cfg: Config, dtype: torch.dtype) -> bool:
    """Whether the untied output layer's weight gradient is written straight into its gradient buffer, with no
    separate tensor (model/output_layer.OutputLinear): gradient accumulation fusion on, a buffer (the
    distributed optimizer's, DDP's or the flat-bucket engine's; FSDP2 reduce-scatters autograd's gradient), and
    the buffer in the training dtype (an fp32 buffer for bf16 weights takes the product through a bf16 copy)."""
    m = cfg.model
    if not m.untie_embeddings_and_output_weights or not m.gradient_accumulation_fusion or cfg.sharding.fsdp2:
        return False
    return dtype == (torch.bfloat16 if cfg.sharding.grad_comm_bf16 else torch.float32)


def _first_bucket(cfg: Config, num_params: int, vocab: float) -> float:
    """Bytes of the gradient bucket parallel/fsdp/flat_shards.py holds at the start of the backward: --ddp-bucket-size
    elements (a bucket closes once it holds that many), or the output layer's weight alone where that is larger, in the
    reduce-scatter's dtype."""
    elements = min(num_params, max(cfg.parallel.ddp_bucket_size, vocab))
    return elements * (2 if cfg.sharding.grad_comm_bf16 else 4)


def in_flight_layers(cfg: Config, pp_rank: int = 0) -> int:
    """How many layers' worth of one micro-batch's activations pipeline rank `pp_rank` holds at the peak of its
    schedule: the forward passes it has run whose backward passes it has not (Megatron-LM's in-flight
    micro-batches). Without a pipeline every layer once; under 1F1B this stage's layers min(pp - rank, micro-batches)
    times (pp times on the first rank); under the interleaved schedule the chunks of its warm-up plus one (on the
    first rank about pp x (1 + (pp - 1) / (pp x vpp)) times the stage), counted from the schedule itself, so that
    uneven chunks count as they are."""
    pp = cfg.parallel.pipeline_model_parallel_size
    if pp == 1:
        return cfg.model.num_layers
    chunks = [len(chunk) for chunk in cfg.stage_chunks(pp_rank)]
    micro = cfg.num_micro_batches
    if len(chunks) == 1:
        return min(pp - pp_rank, micro) * chunks[0]
    from megatron.parallel.interleaved import compute_order  # late: the parallel package imports the config too

    group = cfg.parallel.microbatch_group_size_per_virtual_pipeline_stage or pp
    held = peak = 0
    for step in compute_order(pp, pp_rank, len(chunks), micro, group=group):
        held += chunks[step.chunk] if step.forward else -chunks[step.chunk]
        peak = max(peak, held)
    return peak


def estimate_bytes(
    cfg: Config,
    num_params: int,
    vocab_size: int,
    dtype: torch.dtype,
    *,
    pp_rank: int = 0,
    fp8_params: int = 0,
) -> dict[str, float]:
    """Bytes per GPU by category: held for the run `weights`, `grads`, `main_params`, `adam`, `weight_casts` (TE's
    FP8 weight casts), together `static`; at the start of the backward `activations` (those of the micro-batches the
    schedule holds at once, `in_flight` of them, plus the loss's) and `buffers` (see the module docstring); `step`,
    what the optimizer step adds (`freed_shards` of it: FSDP's shards freed before, not counted in `weights`);
    `calibration`, what delayed scaling's calibration pass adds (activations and buffers; 0 without the pass);
    `total`, static plus the largest of activations + buffers, step and calibration. `num_params`:
    the parameters of pipeline rank `pp_rank`, of which `fp8_params` are stored in FP8."""
    if not 0 <= fp8_params <= num_params:
        raise ValueError(f"fp8_params ({fp8_params}) must lie in [0, num_params ({num_params})]")
    itemsize = dtype.itemsize
    weights = fp8_params * 1 + (num_params - fp8_params) * itemsize
    opt, par, m = cfg.optimizer, cfg.parallel, cfg.model
    shards = cfg.sharding.optimizer_shards
    # The optimizer keeps a main copy of every parameter as soon as one of them is not fp32 (FP8 ones included).
    has_main_copy = dtype != torch.float32 or fp8_params > 0
    main_params = num_params * state_bytes(opt.main_params_dtype, master=True) / shards if has_main_copy else 0
    grads = num_params * (2 if par.grad_reduce_in_bf16 else 4)
    adam = num_params * (state_bytes(opt.exp_avg_dtype) + state_bytes(opt.exp_avg_sq_dtype)) / shards
    t = par.tensor_model_parallel_size
    vocab = vocab_size * m.hidden_size / t  # this rank's vocabulary matrix (vocabulary-parallel under TP)
    layers = _stage_layers(cfg, pp_rank)
    layer = _layer_params(cfg, num_params, vocab, pp_rank)
    fp8_layers = len(set(layers) & set(cfg.precision.fp8_layer_numbers(m.num_layers)))
    weight_casts = freed = 0.0
    keeps_casts = not cfg.sharding.fsdp2 or cfg.sharding.keeps_weight_casts
    if _te(cfg) and cfg.precision.fp8 and keeps_casts:  # kept for the step: data and transpose, 1 byte each
        weight_casts = fp8_params if fp8_params else 2.0 * fp8_layers * layer  # an FP8 parameter: its transpose
    if cfg.sharding.fsdp2:  # --fp8-param-gather: the FP8 layers' parameters (norms counted as the linears, as gathered)
        fp8_gathered = fp8_layers * layer if cfg.precision.fp8_param_gather else 0.0
        weights, grads = _fsdp_weights_and_grads(cfg, num_params, itemsize, fp8_gathered)
        main_params = 0 if cfg.sharding.shards_hold_main_weights else main_params
        freed = _fsdp_freed_shards(cfg, fp8_gathered, itemsize)  # held in the optimizer step only
        weights -= freed
    # this rank's part of the sequence under context parallelism
    s, b, h = m.seq_length // par.context_parallel_size, cfg.training.micro_batch_size, m.hidden_size
    act_scale = itemsize / 2  # the activation terms count 16-bit tensors
    held = in_flight_layers(cfg, pp_rank)
    activations = recomputed_activation_units(cfg, layers, held) * s * b * h * act_scale
    buffers = loss_side = loss_activations = 0.0
    if pp_rank == par.pipeline_model_parallel_size - 1:  # the stage that computes the loss
        loss_impl = cfg.model.cross_entropy_impl(fp16_logits=cfg.precision.fp16)
        logits = (itemsize if loss_impl == "te" else 8) * s * b * vocab_size / t
        # the final norm's input (a sequence-parallel shard) and the output layer's (gathered) input
        inputs = (2 / t if par.sequence_parallel else 2) * s * b * h * act_scale + 2 * s * b * h * act_scale
        # the output layer's backward: its weight gradient in the training dtype and its input gradient
        buffers = (0 if output_wgrad_in_buffer(cfg, dtype) else vocab * itemsize) + s * b * h * itemsize
        if loss_impl == "chunked":  # no logits kept: a slice's at a time in the backward, and the fp32 input gradient
            logits = 0.0
            buffers += SLICE_BYTES_PER_ELEMENT * s * b * min(vocab_size / t, chunk_rows(s * b)) + 4 * s * b * h
        loss_activations = logits + inputs
        activations += loss_activations
        loss_side = logits + inputs + buffers
    if cfg.sharding.fsdp2:
        gathered, staging = _fsdp_buffers(cfg, num_params, vocab, layer, itemsize, loss_side)
        buffers += gathered + staging
    if cfg.sharding.flat_shards:  # persistent gradient shards, and one bucket at the peak
        grads = num_params * (2 if cfg.sharding.main_grads_bf16 else 4) / shards
        buffers += _first_bucket(cfg, num_params, vocab)
    step = _step_bytes(cfg, num_params, fp8_params) + freed
    calibration = 0.0
    # delayed scaling's calibration pass: a fresh run assumed (a resumed one runs none), none with TE's userbuffers
    if cfg.precision.calibration_pass and not (_te(cfg) and par.tp_comm_overlap):
        # recomputed an FSDP unit at a time where units hold several layers (model/recompute.py)
        together = _layers_per_unit(cfg, layer) if cfg.sharding.fsdp2 else 1
        calibration = calibration_activation_units(cfg, layers, together) * s * b * h * act_scale
        calibration += loss_activations + buffers
    static = weights + grads + main_params + adam + weight_casts
    return {
        "weights": weights,
        "grads": grads,
        "main_params": main_params,
        "adam": adam,
        "weight_casts": weight_casts,
        "activations": activations,
        "buffers": buffers,
        "step": step,
        "freed_shards": freed,
        "calibration": calibration,
        "in_flight": held / len(layers) if layers else 0.0,
        "static": static,
        "total": static + max(activations + buffers, step, calibration),
    }


def memory_estimate_lines(
    cfg: Config, est: dict[str, float], num_params: int, dtype: torch.dtype, *, fp8_params: int = 0
) -> list[str]:
    """The start-of-run line for `est`, what `estimate_bytes` gave for these arguments: each category's size and
    bytes per parameter, then the totals."""
    n = max(num_params, 1)  # bytes per parameter of an empty stage: 0, not a ZeroDivisionError
    high = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    par, opt = cfg.parallel, cfg.optimizer
    shards = cfg.sharding.optimizer_shards
    over = f" over {shards} data-parallel ranks" if shards > 1 else ""
    if cfg.sharding.fsdp2:  # the shards; what is gathered counts as a buffer
        weights = (
            f"{_per(est['weights'] / n)} B/param, {'fp32' if cfg.sharding.shards_hold_main_weights else high} shards"
        )
        weights += " except the FP8 layers', freed until the optimizer step," if est["freed_shards"] else ""
        cast = " and the FP8 layers' E4M3 casts" if cfg.precision.fp8_param_gather else ""
        weights += f"{cast}{over}{', gathered in FP8' if cast else ''}"
    elif fp8_params:
        weights = f"{_per(est['weights'] / n)} B/param: {_count(fp8_params)} FP8 + {_count(num_params - fp8_params)}"
        weights += f" {high}"
    else:
        weights = f"{_per(est['weights'] / n)} B/param, {high}"
    bf16_grads = cfg.sharding.main_grads_bf16
    grads_dtype = (", bf16" if bf16_grads else "") + (f" shards{over}" if cfg.sharding.flat_shards else "")
    moments = (
        "" if opt.exp_avg_dtype == opt.exp_avg_sq_dtype == "fp32" else f", {opt.exp_avg_dtype}/{opt.exp_avg_sq_dtype}"
    )
    in_flight = "per micro-batch"
    if par.pipeline_model_parallel_size > 1:  # the pipeline schedule holds several
        in_flight = f"({est['in_flight']:.3g} micro-batches in flight on this pipeline stage)"
    if est["main_params"]:
        main = f"{opt.main_params_dtype} main params {_size(est['main_params'])}"
        main += f" ({_per(est['main_params'] / n)} B/param{over})"
    else:
        main = "no fp32 main params (the fp32 weights are the master copy)"
    casts = f", TE's FP8 weight casts {_size(est['weight_casts'])}" if est["weight_casts"] else ""
    if casts and cfg.sharding.fsdp2:  # optim_grads: beside the gathered weights, for the step
        casts += " (kept for the step's micro-batches with the gathered weights, 2 B per FP8 layer parameter)"
    buffers = "gathered units, gradients in flight" if cfg.sharding.fsdp2 else "the output layer's gradients"
    buffers += ", a gradient bucket" if cfg.sharding.flat_shards else ""
    step = ""
    if est["step"]:
        peak = " (the peak)" if est["step"] > est["activations"] + est["buffers"] else ""
        copies = "FP8 weights' main values" if cfg.optimizer.use_precision_aware_optimizer else "bf16 gradients"
        parts = [f"fp32 copies of the {copies}"] if est["step"] > est["freed_shards"] else []
        parts += [f"the FP8 layers' {high} shards back"] if est["freed_shards"] else []
        step = f", optimizer step +{_size(est['step'])}{peak} ({' and '.join(parts)})"
    calibration = ""
    if est["calibration"]:
        above = est["calibration"] > max(est["activations"] + est["buffers"], est["step"])
        calibration = f", calibration pass ~{_size(est['calibration'])}{' (the peak)' if above else ''}"
        calibration += " (high precision, every layer recomputed)"
    return [
        f"memory estimate per GPU: weights {_size(est['weights'])} ({weights}),"
        f" grads {_size(est['grads'])} ({_per(est['grads'] / n)} B/param{grads_dtype}),"
        f" {main}, Adam states {_size(est['adam'])} ({_per(est['adam'] / n)} B/param{over}{moments}){casts},"
        f" activations ~{_size(est['activations'])} {in_flight}, backward buffers ~{_size(est['buffers'])}"
        f" ({buffers}){step}{calibration}"
        f" (total ~{_size(est['total'])}; {_per(est['static'] / n)} B/param before activations)"
    ]


# What a GPU needs beyond the estimate: the CUDA context, NCCL's buffers and the caching allocator's fragmentation.
# On two 80 GB H100s (79.2 GiB each; docs/benchmarks.md, "Llama-3-8B") Llama-3-8B estimated at 73.2 and 73.8 GiB
# trained (peaks 73.7, 74.3); estimated at 74.8 and 75.5 it made no step in two minutes; at 76.5 it ran out of memory.
UNCOUNTED_GIB = 5.0


def headroom_note(estimate_gib: float, capacity_gib: float) -> str | None:
    """The start-of-run note where the estimate leaves a GPU of `capacity_gib` less than `UNCOUNTED_GIB` for what
    it does not count (None otherwise)."""
    left = capacity_gib - estimate_gib
    if left >= UNCOUNTED_GIB:
        return None
    return (
        f"note: the memory estimate leaves {left:.1f} GiB of this GPU's {capacity_gib:.1f} GiB for the CUDA context,"
        f" NCCL's buffers and fragmentation (about {UNCOUNTED_GIB:g} GiB): runs this close have stalled or run out of"
        " memory; recompute more layers (--recompute-num-layers) or shard more"
    )


def headroom_line(dims: ParallelDims, estimate_gib: float, capacity_gib: float) -> str | None:
    """This rank's line of `headroom_note`, if any: each pipeline stage's own estimate (the last stage, with the
    output layer, is often the tightest), printed once per stage, by its first rank."""
    if dims.dp_rank or dims.cp_rank or dims.tp_rank or not (note := headroom_note(estimate_gib, capacity_gib)):
        return None
    return f"> {note}" if dims.pp == 1 else f"> pipeline stage {dims.pp_rank}: {note}"


def print_memory_estimate(
    cfg: Config, dims: ParallelDims, num_params: int, vocab_size: int, fp8_params: int, device: torch.device
) -> float:
    """The start-of-run estimate line of this rank's `num_params` (`fp8_params` of them in FP8), and on a GPU the
    headroom note; returns the total in GiB (printed again beside the measured peak at the end)."""
    dtype = cfg.precision.params_dtype
    estimate = estimate_bytes(cfg, num_params, vocab_size, dtype, pp_rank=dims.pp_rank, fp8_params=fp8_params)
    for line in memory_estimate_lines(cfg, estimate, num_params, dtype, fp8_params=fp8_params):
        print_rank_0(f"> {line}")
    total_gib = estimate["total"] / 2**30
    if device.type == "cuda":
        capacity_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
        if line := headroom_line(dims, total_gib, capacity_gib):
            print(line, flush=True)
    return total_gib


def print_peak_memory(device: torch.device, estimate_gib: float) -> None:
    """On a GPU, the end-of-run line: the peak memory allocated and the start-of-run estimate, of the busiest rank
    (pipeline stages and vocabulary shards differ), in one reduction every rank joins."""
    if device.type != "cuda":
        return
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    both = torch.tensor([peak, estimate_gib], device=device)
    if dist.is_initialized():
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
    peak, estimate = both.tolist()
    where = "the most on any rank; " if dist.is_initialized() else ""
    print_rank_0(f"> peak memory allocated: {peak:.2f} GiB ({where}estimate at start: {estimate:.2f} GiB)")
