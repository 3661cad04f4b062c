"""The bytes that memory-bound kernels and un-overlapped collectives must move per iteration (notation: work.py).

The bound assumes each operation below is one pass over its tensors, reading each input once and writing each
output once, in the dtype its consumer needs; a cast to FP8 is fused into the memory-bound kernel that produces
the tensor (the norms, SwiGLU, the residual-gradient adds: w bytes per element, see work.py), but a tensor written
by a GEMM or attention kernel (bf16 out of cuBLAS / cuDNN) needs a separate cast pass. Per layer and micro-batch:

    norm (x2), forward          read 2E, write w*E               (RMSNorm / LayerNorm, FP8 out in FP8 layers)
    norm (x2), backward         read 2E (input) + 2E (grad), write 2E
    residual add (x2), fwd      read 4E, write 2E
    residual grad add (x2), bwd read 4E, write 2E; in FP8 layers also the FP8 copies of the sum that the fc2 / proj
                                backward GEMMs read: 2E (3E with --no-fp8-wgrad), counted as cast/transpose
    RoPE, fwd and bwd           read 2(Q+2K), write 2(Q+2K)      (the fused kernel on the packed QKV output: q and
                                k rotated, v copied out, as the attention takes three contiguous tensors; backward
                                their gradients into the packed one; the cos/sin table, s*d, is not counted)
    SwiGLU fwd                  read 4F, write w*F               (GELU / squared ReLU: read 2F, write w*F)
    SwiGLU bwd                  read 4F (fc1 output) + 2F (grad), write 4F  (GELU: read 2F + 2F, write 2F)
    attention-output cast       read 2Q, write w*Q               (FP8 layers: linear_proj's input, from cuDNN)

Per micro-batch, outside the layers (T*h elements; the output layer and loss over V/t columns):

    embedding fwd               read 2Th (rows), write 2Th
    embedding bwd               read 2Th, read + write 8Th (scatter-add into the fp32 gradient rows; under FSDP
                                into the unsharded gradient in the training dtype, 4Th: 6Th in all)
    final norm                  fwd read 2E, write 2E; bwd read 4E, write 2E
    loss (fused cross entropy)  fwd read 2TV/t; bwd read 2TV/t (logits), write 2TV/t (their gradient)

Per iteration (P = parameters on this rank, P8 = the FP8 layers' linear weights, D = data-parallel size, sharding
the optimizer with --use-distributed-optimizer):

    optimizer (fused Adam)      (2*mp + 2*m1 + 2*m2 + 2*g) * S + M * S/P + g * P, S = P/D with the distributed
                                optimizer, else P: read and write the main parameters (mp bytes each) and both
                                moments (m1, m2), read the gradient twice (g: its norm, then the step), write the
                                model's weights (M = 2P bytes, P8 fewer with --fp8-param-gather), zero the whole
                                gradient buffer (g*P)
    FP8 weight casts            4*P8 (read bf16, write FP8 and its transpose); 2*P8 with --fp8-param-gather
                                (the optimizer writes FP8, the transpose is read 1, write 1)

Under FSDP2 (--data-parallel-sharding-strategy optim_grads / optim_grads_params) fsdp.py's terms replace the
optimizer, the FP8 weight casts and the data-parallel communication here. --use-megatron-fsdp's optim_grads
(megatron/parallel/fsdp/flat_shards.py, gradient shards of gs bytes per element, buckets of gc: the reduce-scatter's
dtype) keeps the distributed optimizer's terms except the gradients': the step reads the shards only, zeroing
nothing, (2mp+2m1+2m2+2gs)S + M*S/P; a step's first micro-batch copies this rank's shard of each reduce-scatter
into the shards, (gc+gs)S, and every later one adds it, (gc+2gs)S (its fresh buckets are not zeroed: the wgrad
GEMMs write them, other gradients are copied in).

Not counted (a lower bound): the wgrad GEMMs' fp32 accumulation into `main_grad` (in the GEMM epilogue, hidden
behind its math at k = T), amax reductions, norm and bias weight gradients, dropout (benchmarks run without it),
the CUDA graphs' input copies, and host time.

Communication that cannot overlap, per iteration:
    tensor parallel, per layer and micro-batch, without --tp-comm-overlap: with --sequence-parallel 2 all-gathers
    (norm outputs; gradients backward; FP8 bytes in FP8 layers) and 2 reduce-scatters (bf16) each way (the
    re-gather of the inputs for the weight gradients overlaps the data-gradient GEMMs); without it, 2 all-reduces
    (bf16) each way; embedding and output layer: 1 more each way. With --tp-comm-overlap: none.
    data parallel: the gradient reduction (all-reduce; reduce-scatter with --use-distributed-optimizer) of 4 bytes
    per parameter (2 with bf16 gradients, 1 with --fp8-grad-reduce): all of it, or with --overlap-grad-reduce only
    the last bucket (--ddp-bucket-size elements, reduced after the backward ends); the distributed optimizer's
    all-gather of the updated weights (2 bytes, FP8 weights 1): all, or one bucket with --overlap-param-gather.
    parallel/fsdp/flat_shards.py reduce-scatters every micro-batch's buckets during its backward (gc bytes per element,
    1 with
    --fp8-grad-reduce), those of the micro-batches before the last overlapping the next forward: the last bucket of
    the last micro-batch is left, whatever --overlap-grad-reduce says.
"""

from __future__ import annotations

from megatron.config import Config

from .fsdp import fsdp_communication, fsdp_memory
from .work import DTYPE_BYTES, CommWork, MemoryWork, param_count, recomputed_layers


def _sizes(cfg: Config, vocab: int) -> dict[str, int]:
    m, t = cfg.model, cfg.parallel.tensor_model_parallel_size
    tokens = cfg.training.micro_batch_size * m.seq_length
    return {
        "T": tokens,
        "E": tokens * m.hidden_size // (t if cfg.parallel.sequence_parallel else 1),
        "Q": tokens * m.num_attention_heads * m.kv_channels // t,
        "K": tokens * m.num_query_groups * m.kv_channels // t,
        "F": tokens * m.ffn_hidden_size // t,
        "Th": tokens * m.hidden_size,
        "TV": tokens * vocab // t,
    }


def fp8_operand_bytes(cfg: Config, fp8: bool) -> int:
    """w: bytes written per element of a GEMM operand: FP8 row-wise + transposed, or bf16."""
    if not fp8:
        return 2
    return 2 if cfg.precision.fp8_wgrad else 3


def layer_traffic(cfg: Config, vocab: int, fp8: bool) -> list[tuple[str, str, float, str]]:
    """(category, name, bytes, formula) of one layer's memory-bound passes for one micro-batch, forward and
    backward (the formulas in the module docstring)."""
    z = _sizes(cfg, vocab)
    E, Q, K, F = z["E"], z["Q"], z["K"], z["F"]
    w = fp8_operand_bytes(cfg, fp8)
    swiglu = cfg.model.swiglu
    rope = cfg.model.position_embedding_type == "rope"  # learned positions are added in the embedding instead
    act_fwd = (4 * F + w * F) if swiglu else (2 * F + w * F)
    act_bwd = (4 * F + 2 * F + 4 * F) if swiglu else (2 * F + 2 * F + 2 * F)
    items = [
        ("norm", "norm fwd (x2)", 2 * (2 * E + w * E), "2 x (2E + wE)"),
        ("norm", "norm bwd (x2)", 2 * 6 * E, "2 x 6E"),
        ("elementwise", "residual add fwd (x2)", 2 * 6 * E, "2 x 6E"),
        ("elementwise", "residual grad add bwd (x2)", 2 * 6 * E, "2 x 6E"),
        *([("rope", "RoPE fwd+bwd", 2 * 4 * (Q + 2 * K), "2 x 4(Q+2K)")] if rope else []),
        ("activation", "SwiGLU fwd" if swiglu else "activation fwd", act_fwd, "4F + wF" if swiglu else "2F + wF"),
        ("activation", "SwiGLU bwd" if swiglu else "activation bwd", act_bwd, "10F" if swiglu else "6F"),
    ]
    if fp8:
        items += [
            ("cast/transpose", "attention output -> FP8", 2 * Q + w * Q, "2Q + wQ"),
            ("cast/transpose", "FP8 copies of residual grads (x2)", 2 * w * E, "2 x wE"),
        ]
    return items


def layer_forward_traffic(cfg: Config, vocab: int, fp8: bool, what: set[str]) -> list[tuple[str, str, float, str]]:
    """The forward passes that recomputation repeats: a whole layer's (`layer`), the MLP's (its norm and
    activation), the norms' (`layernorm`); core attention has no memory-bound pass here."""
    z = _sizes(cfg, vocab)
    E, Q, K, F = z["E"], z["Q"], z["K"], z["F"]
    w = fp8_operand_bytes(cfg, fp8)
    act = (4 * F + w * F) if cfg.model.swiglu else (2 * F + w * F)
    act_formula = "4F + wF" if cfg.model.swiglu else "2F + wF"
    rope = cfg.model.position_embedding_type == "rope"
    items = []
    if "layer" in what:
        items += [
            ("norm", "norm fwd (x2)", 2 * (2 * E + w * E), "2 x (2E + wE)"),
            ("elementwise", "residual add fwd (x2)", 2 * 6 * E, "2 x 6E"),
            *([("rope", "RoPE fwd", 4 * (Q + 2 * K), "4(Q+2K)")] if rope else []),
            ("activation", "activation fwd", act, act_formula),
        ]
        if fp8:
            items.append(("cast/transpose", "attention output -> FP8", 2 * Q + w * Q, "2Q + wQ"))
        return items
    if "mlp" in what:
        items += [
            ("norm", "norm fwd (MLP)", 2 * E + w * E, "2E + wE"),
            ("activation", "activation fwd", act, act_formula),
        ]
    elif "layernorm" in what:
        items.append(("norm", "norm fwd (x2)", 2 * (2 * E + w * E), "2 x (2E + wE)"))
    return items


def memory_traffic(cfg: Config, vocab: int) -> list[MemoryWork]:
    """Every memory-bound pass of one iteration on this rank, merged by (category, name)."""
    m, prec, opt = cfg.model, cfg.precision, cfg.optimizer
    micro, layers = cfg.num_micro_batches, m.num_layers
    fp8_numbers = set(prec.fp8_layer_numbers(layers))
    z = _sizes(cfg, vocab)
    E, Th, TV = z["E"], z["Th"], z["TV"]
    merged: dict[tuple[str, str, float, str], int] = {}

    def add(items: list[tuple[str, str, float, str]], count: int, suffix: str = "") -> None:
        for category, name, nbytes, formula in items if count else []:
            key = (category, name + suffix, nbytes, formula)
            merged[key] = merged.get(key, 0) + count

    def layer_suffix(fp8: bool) -> str:  # FP8 and bf16 layers move different bytes where FP8 is on
        return (" [FP8 layers]" if fp8 else " [bf16 layers]") if prec.fp8 else ""

    n_fp8 = len(fp8_numbers)
    add(layer_traffic(cfg, vocab, True), n_fp8 * micro, layer_suffix(True))
    add(layer_traffic(cfg, vocab, False), (layers - n_fp8) * micro, layer_suffix(False))
    n, what = recomputed_layers(cfg)
    for number in range(1, n + 1):
        fp8 = number in fp8_numbers
        add(layer_forward_traffic(cfg, vocab, fp8, what), micro, " (recomputed)" + layer_suffix(fp8))
    add(
        [
            ("elementwise", "embedding fwd", 4 * Th, "4Th"),
            ("elementwise", "embedding bwd", *((6 * Th, "6Th") if cfg.sharding.fsdp2 else (10 * Th, "10Th"))),
            ("norm", "final norm fwd+bwd", 10 * E, "10E"),
            ("loss", "cross entropy fwd+bwd", 6 * TV, "6TV/t"),
        ],
        micro,
    )
    if cfg.sharding.fsdp2:  # its own optimizer, weight casts, gathers and reduce-scatters (fsdp.py)
        for category, name, nbytes, formula, count in fsdp_memory(cfg, vocab):
            add([(category, name, nbytes, formula)], count)
        return [MemoryWork(c, name, nbytes, count, formula) for (c, name, nbytes, formula), count in merged.items()]
    params, fp8_weights = param_count(cfg, vocab)
    dp = cfg.data_parallel_size
    shard = params / dp if opt.use_distributed_optimizer else params
    precision_aware = opt.use_precision_aware_optimizer
    mp = DTYPE_BYTES[opt.main_params_dtype] if precision_aware else 4
    m1 = DTYPE_BYTES[opt.exp_avg_dtype] if precision_aware else 4
    m2 = DTYPE_BYTES[opt.exp_avg_sq_dtype] if precision_aware else 4
    g = grad_bytes(cfg)
    model_bytes = 2 * params - (fp8_weights if prec.fp8_param_gather else 0)  # per parameter: bf16, FP8 weights 1
    # S = the optimizer's shard of the P parameters, M = the model's weight bytes (2P, less P8 with FP8 weights)
    if cfg.sharding.flat_shards:  # the step reads the gradient shards; the first micro-batch overwrites them
        gc = 2 if cfg.sharding.grad_comm_bf16 else 4
        step = (2 * mp + 2 * m1 + 2 * m2 + 2 * g) * shard + model_bytes * shard / params
        add([("optimizer", "Adam step + grad norm", step, "(2mp+2m1+2m2+2gs)S + M*S/P")], 1)
        add([("elementwise", "gradient shard copy", (gc + g) * shard, "(gc+gs)S")], 1)
        if micro > 1:
            add([("elementwise", "gradient shard add", (gc + 2 * g) * shard, "(gc+2gs)S")], micro - 1)
    else:
        step = (2 * mp + 2 * m1 + 2 * m2 + 2 * g) * shard + model_bytes * shard / params + g * params
        add([("optimizer", "Adam step + grad zero + grad norm", step, "(2mp+2m1+2m2+2g)S + M*S/P + gP")], 1)
    if fp8_weights:
        cast = 2 * fp8_weights if prec.fp8_param_gather else 4 * fp8_weights
        add([("cast/transpose", "FP8 weight casts", cast, "2 P8" if prec.fp8_param_gather else "4 P8")], 1)
    return [MemoryWork(c, name, nbytes, count, formula) for (c, name, nbytes, formula), count in merged.items()]


def grad_bytes(cfg: Config) -> int:
    """Bytes per element of the gradient buffers (`main_grad`; parallel/fsdp/flat_shards.py's gradient shards)."""
    opt, par = cfg.optimizer, cfg.parallel
    if cfg.sharding.flat_shards:
        return 2 if cfg.sharding.main_grads_bf16 else 4
    bf16 = par.grad_reduce_in_bf16 or (opt.use_precision_aware_optimizer and opt.main_grads_dtype == "bf16")
    return 2 if bf16 else 4


def communication(cfg: Config, vocab: int) -> list[CommWork]:
    """The collectives nothing overlaps (module docstring)."""
    par, opt, m = cfg.parallel, cfg.optimizer, cfg.model
    t, dp, micro = par.tensor_model_parallel_size, cfg.data_parallel_size, cfg.num_micro_batches
    z = _sizes(cfg, vocab)
    out: list[CommWork] = []
    if t > 1 and not par.tp_comm_overlap:
        full = 2 * z["Th"]  # one [T, h] bf16 tensor, whole
        n_fp8 = len(cfg.precision.fp8_layer_numbers(m.num_layers))
        if par.sequence_parallel:
            for fp8, layers in ((True, n_fp8), (False, m.num_layers - n_fp8)):
                if layers:
                    gather = full // 2 if fp8 else full
                    name = f"TP all-gather (norm outputs / grads, {'FP8' if fp8 else 'bf16'} layers)"
                    out.append(CommWork(name, "all_gather", gather, t, 4 * layers))
            out.append(
                CommWork("TP reduce-scatter (proj, fc2 / qkv, fc1 dgrad)", "reduce_scatter", full, t, 4 * m.num_layers)
            )
            # embedding output (reduce-scatter) and output-layer input (all-gather), and their gradients
            out.append(CommWork("TP all-gather (output layer)", "all_gather", full, t, 2))
            out.append(CommWork("TP reduce-scatter (embedding)", "reduce_scatter", full, t, 2))
            out = [CommWork(c.name, c.op, c.nbytes, c.ranks, c.count * micro) for c in out]
        else:
            out.append(CommWork("TP all-reduce", "all_reduce", full, t, (4 * m.num_layers + 2) * micro))
    if dp > 1 and cfg.sharding.fsdp2:
        out += fsdp_communication(cfg, vocab)
    elif dp > 1:
        params, fp8_weights = param_count(cfg, vocab)
        comm = (2 if cfg.sharding.grad_comm_bf16 else 4) if cfg.sharding.flat_shards else grad_bytes(cfg)
        per_elem = 1 if par.fp8_grad_reduce else comm
        overlapped = par.overlap_grad_reduce or cfg.sharding.flat_shards
        reduced = min(par.ddp_bucket_size, params) if overlapped else params
        op = "reduce_scatter" if opt.use_distributed_optimizer else "all_reduce"
        out.append(CommWork("DP gradient reduction", op, reduced * per_elem, dp, 1))
        if opt.use_distributed_optimizer:
            weight_bytes = 2 * params - (fp8_weights if cfg.precision.fp8_param_gather else 0)
            gathered = min(par.ddp_bucket_size, params) if par.overlap_param_gather else params
            out.append(CommWork("DP parameter all-gather", "all_gather", gathered * weight_bytes // params, dp, 1))
    return out
