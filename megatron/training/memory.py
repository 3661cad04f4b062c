"""A start-of-run memory estimate, per GPU (Megatron-LM's accounting, before fragmentation and workspaces).

Weights and optimizer, in bytes per parameter of this rank:

* weights: 2 in bf16, 4 in fp32; 1 for each FP8 parameter (--fp8-param-gather: the transformer linears' weights,
  stored only in FP8). Transformer Engine on Hopper also keeps an FP8 transpose of each FP8 weight for the
  backward pass; like the weight casts TE caches for bf16 weights, that is not counted.
* gradients: 4, the fp32 accumulation buffer (`main_grad`), whatever the weights' type; 2 in bf16
  (--grad-reduce-in-bf16, --main-grads-dtype bf16).
* main (master) parameters: 4 (fp32) when the weights are not fp32 (bf16, or any FP8 parameter: the optimizer then
  keeps a main copy of every parameter); none for fp32 weights, which are their own master copy. fp16 main
  parameters of the precision-aware optimizer: 3.03 (data, remainder and block scales; `state_bytes`).
* Adam states: two fp32 moments, 8; with the precision-aware optimizer 4, 2 or 2.03, 1.03 each (fp32, bf16 or
  fp16, fp8).

The distributed optimizer keeps 1/dp of the main copy and the moments (the gradient buffer stays whole: it is
reduce-scattered in place). FSDP keeps 1/dp of the weights, gradients and moments: fp32 weight shards that are the
main weights, or with --use-precision-aware-optimizer shards in the training dtype beside 1/dp of its main weights.

Activations of one micro-batch without recomputation, Korthikanti et al. (2022), for
16-bit activations: per layer s * b * h * (34 + 5 * a * s / h) bytes; SDPA's fused kernels do not keep the
a * s * s attention matrix, so we drop that term. With tensor parallelism t that is s * b * h * (10 + 24 / t), and
34 * s * b * h / t with sequence parallelism; only this pipeline stage's layers count, as often as its schedule
holds micro-batches in flight (`in_flight_layers`: pp of them on the first stage under 1F1B). Activation recomputation
removes what it recomputes (`recomputed_activation_units`). Plus the fp32 logits and their gradient
(8 * s * b * V / t).

`estimate_bytes` gives the numbers; `memory_estimate_lines` writes them as the start-of-run log line, and
`print_peak_memory` the total again beside the measured peak at the end of the run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.config import Config
from megatron.config.sharding import main_grads_bf16, shards_hold_main_weights
from megatron.optim.states import state_bytes

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


def _optimizer_shards(cfg: Config) -> int:
    """How many ranks share the main parameters and Adam states (the distributed optimizer's data x context parallel
    size)."""
    shards = cfg.data_parallel_size * cfg.parallel.context_parallel_size
    return shards if cfg.optimizer.use_distributed_optimizer or cfg.parallel.fsdp else 1


def _fsdp_weights_and_grads(cfg: Config, num_params: int, vocab_size: int, itemsize: int) -> tuple[float, float]:
    """FSDP's weights and gradients per rank: fp32 shards of both (bf16 gradients with
    --megatron-fsdp-main-grads-dtype bf16; the weight shards are the main weights, or hold the training dtype with
    --use-precision-aware-optimizer, whose main weights `estimate_bytes` counts as the optimizer's), plus at the
    peak what is gathered in the training dtype, the whole model under optim_grads (kept through the step) or two
    units (the one computing and the one prefetched; a unit is a layer or the vocabulary matrix, whichever is
    larger), and one unit's unsharded gradient before its reduce-scatter. Under tensor parallelism `num_params` is
    this rank's tensor-parallel piece, which FSDP shards over the data (x context) parallel ranks, and a rank holds
    1/t of the vocabulary matrix (vocabulary-parallel embedding and output layer)."""
    m = cfg.model
    dp = _optimizer_shards(cfg)
    vocab = vocab_size * m.hidden_size / cfg.parallel.tensor_model_parallel_size
    layer = (num_params - vocab * (2 if m.untie_embeddings_and_output_weights else 1)) / max(m.num_layers, 1)
    unit = max(layer, vocab, cfg.parallel.suggested_communication_unit_size or 0)
    gathered = num_params if cfg.parallel.data_parallel_sharding_strategy == "optim_grads" else 2 * unit
    grad_bytes = 2 if main_grads_bf16(cfg) else 4
    shard_bytes = 4 if shards_hold_main_weights(cfg) else itemsize
    return num_params * shard_bytes / dp + gathered * itemsize, num_params * grad_bytes / dp + unit * itemsize


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
    """Bytes per GPU by category: `weights`, `grads`, `main_params`, `adam`, `activations` (those of the micro-batches
    the schedule holds at once, `in_flight` of them, plus one micro-batch's logits), `static` (all but activations)
    and `total`. `num_params`: the parameters of pipeline rank `pp_rank`, of which `fp8_params` are stored in
    FP8."""
    if not 0 <= fp8_params <= num_params:
        raise ValueError(f"fp8_params ({fp8_params}) must lie in [0, num_params ({num_params})]")
    high_precision = dtype.itemsize
    weights = fp8_params * 1 + (num_params - fp8_params) * high_precision
    opt = cfg.optimizer
    shards = _optimizer_shards(cfg)
    # The optimizer keeps a main copy of every parameter as soon as one of them is not fp32 (FP8 ones included).
    has_main_copy = dtype != torch.float32 or fp8_params > 0
    main_params = num_params * state_bytes(opt.main_params_dtype, master=True) / shards if has_main_copy else 0
    grads = num_params * (2 if cfg.parallel.grad_reduce_in_bf16 else 4)
    adam = num_params * (state_bytes(opt.exp_avg_dtype) + state_bytes(opt.exp_avg_sq_dtype)) / shards
    if cfg.parallel.fsdp:
        weights, grads = _fsdp_weights_and_grads(cfg, num_params, vocab_size, high_precision)
        main_params = 0 if shards_hold_main_weights(cfg) else main_params
    m = cfg.model
    # this rank's part of the sequence under context parallelism
    s, b, h = m.seq_length // cfg.parallel.context_parallel_size, cfg.training.micro_batch_size, m.hidden_size
    act_scale = dtype.itemsize / 2
    layers = sum(len(chunk) for chunk in cfg.stage_chunks(pp_rank))
    held = in_flight_layers(cfg, pp_rank)
    units = recomputed_activation_units(cfg, layers, held)
    activations = units * s * b * h * act_scale + 8 * s * b * vocab_size / cfg.parallel.tensor_model_parallel_size
    static = weights + grads + main_params + adam
    return {
        "weights": weights,
        "grads": grads,
        "main_params": main_params,
        "adam": adam,
        "activations": activations,
        "in_flight": held / layers if layers else 0.0,
        "static": static,
        "total": static + activations,
    }


def recomputed_activation_units(cfg: Config, layers: int, held: float | None = None) -> float:
    """Activations of `layers` transformer layers in bytes per s*b*h (16-bit activations), with the --recompute-*
    flags applied: one micro-batch of each, or `held` layers' worth of micro-batches in flight (`in_flight_layers`),
    plus, under full recomputation, the one group being recomputed.

    Korthikanti et al.'s terms per layer (t: tensor-parallel size; /t on all of them with sequence parallelism):
    10 unsplit (the two norm inputs 4, the QKV and fc1 GEMM inputs 2 + 2, the two dropout masks 2) and 24/t split
    (q, k, v 6, the proj input 2, the fc1 output and the fc2 input 8 + 8). Recomputing
      full       keeps a recomputed layer's input only (2), plus, during its backward, one recomputed group whole
      mlp        drops the fc1 GEMM input (2) and the MLP's 16/t inside (its input is kept: the residual stream)
      layernorm  drops the QKV and fc1 GEMM inputs (the norm outputs, 2 + 2)
      core_attn  nothing here: SDPA's kernels keep no s x s matrix, which is what it drops in Megatron-LM"""
    from megatron.model.recompute import RecomputePlan  # late: the model package imports the config as well

    tp = cfg.parallel.tensor_model_parallel_size
    sp = cfg.parallel.sequence_parallel
    unsplit, split = (10 / tp, 24 / tp) if sp else (10.0, 24 / tp)
    per_layer = unsplit + split
    held = layers if held is None else held
    plan = RecomputePlan.from_config(cfg.model)
    if plan.granularity == "full":
        recomputed = plan.recomputed_layers(layers)
        group = max((end - start for start, end, r in plan.chunks(layers) if r), default=0)
        kept_input = 2 / tp if sp else 2.0
        kept = (layers - recomputed) * per_layer + recomputed * kept_input  # of one micro-batch
        return (kept * held / layers if layers else 0.0) + group * per_layer  # one group recomputed at a time
    dropped = 0.0
    gemm_input = 2 / tp if sp else 2.0  # one norm output, the input of linear_qkv or linear_fc1
    if plan.selective("mlp"):
        dropped += gemm_input + 16 / tp
    if plan.selective("layernorm"):
        dropped += gemm_input * (1 if plan.selective("mlp") else 2)
    return held * (per_layer - dropped)


def memory_estimate_lines(
    cfg: Config, est: dict[str, float], num_params: int, dtype: torch.dtype, *, fp8_params: int = 0
) -> list[str]:
    """The start-of-run line for `est`, what `estimate_bytes` gave for these arguments: each category's size and
    bytes per parameter, then the totals."""
    n = max(num_params, 1)  # bytes per parameter of an empty stage: 0, not a ZeroDivisionError
    high = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    if fp8_params:
        weights = f"{_per(est['weights'] / n)} B/param: {_count(fp8_params)} FP8 + {_count(num_params - fp8_params)}"
        weights += f" {high}"
    else:
        weights = f"{_per(est['weights'] / n)} B/param, {high}"
    shards = _optimizer_shards(cfg)
    over = f" over {shards} data-parallel ranks" if shards > 1 else ""
    opt = cfg.optimizer
    grads_dtype = ", bf16" if cfg.parallel.grad_reduce_in_bf16 else ""
    moments = (
        "" if opt.exp_avg_dtype == opt.exp_avg_sq_dtype == "fp32" else f", {opt.exp_avg_dtype}/{opt.exp_avg_sq_dtype}"
    )
    in_flight = "per micro-batch"
    if cfg.parallel.pipeline_model_parallel_size > 1:  # the pipeline schedule holds several
        in_flight = f"({est['in_flight']:.3g} micro-batches in flight on this pipeline stage)"
    if est["main_params"]:
        main = f"{opt.main_params_dtype} main params {_size(est['main_params'])}"
        main += f" ({_per(est['main_params'] / n)} B/param{over})"
    else:
        main = "no fp32 main params (the fp32 weights are the master copy)"
    return [
        f"memory estimate per GPU: weights {_size(est['weights'])} ({weights}),"
        f" grads {_size(est['grads'])} ({_per(est['grads'] / n)} B/param{grads_dtype}),"
        f" {main}, Adam states {_size(est['adam'])} ({_per(est['adam'] / n)} B/param{over}{moments}),"
        f" activations ~{_size(est['activations'])} {in_flight}"
        f" (total ~{_size(est['total'])}; {_per(est['static'] / n)} B/param before activations)"
    ]


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
