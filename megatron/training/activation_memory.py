"""What one transformer layer keeps for its backward pass, by tensor, and what activation recomputation leaves of it:
the activation part of the start-of-run memory estimate (memory.py).

Korthikanti et al. (2022) count 34 bytes per token and hidden unit for a GPT layer in 16-bit activations (the a * s
* s attention matrix aside, which fused attention kernels do not keep): 10 unsplit (the two norm inputs 4, the QKV
and fc1 GEMM inputs 2 + 2, the two dropout masks 2) and 24 split by tensor parallelism (q, k, v 6, the attention
output 2, the fc1 output 8, the fc2 input 8). Those numbers are for multi-head attention, a 4h GeLU MLP and dropout;
`layer_activation_bytes` counts the same tensors at the model's own widths:

    q, k, v           2 x (a + 2 g) x d / h   grouped-query attention keeps g key/value heads, not a
    attention output  2 x a x d / h           (the proj GEMM's input; the attention kernel keeps it for its backward)
    fc1 output        2 x ffn (x 2 for SwiGLU: gate and up) / h
    fc2 input         2 x ffn / h
    dropout masks     2 with --hidden-dropout > 0, else none (no dropout runs, so no mask is kept)

Transformer Engine's FP8 layers keep the GEMM inputs they cast for the weight gradient, in FP8 (1 byte), not the
bf16 tensors: the norm outputs (TE's LayerNormLinear writes them in FP8 and keeps only the column-wise copy; with
sequence parallelism and a per-tensor recipe it keeps the row-wise copy too, to gather it in backward) and the fc2
input (the SwiGLU kernel writes it in FP8). The attention output is kept twice there: in bf16 by the attention kernel,
and as the proj GEMM's FP8 copy. The local layers' FP8 linears are counted in 16 bits, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron.config import Config


def layer_activation_bytes(cfg: Config, fp8_layer: bool) -> dict[str, float]:
    """Bytes per token and hidden unit (of the whole sequence; this rank's share under tensor and sequence
    parallelism) that one transformer layer keeps for its backward pass, by tensor. `fp8_layer`: the layer's linears
    run in FP8."""
    m, par, prec = cfg.model, cfg.parallel, cfg.precision
    t, sp, h = par.tensor_model_parallel_size, par.sequence_parallel, m.hidden_size
    te_fp8 = fp8_layer and m.transformer_impl == "transformer_engine"
    # the norm outputs (QKV and fc1 GEMM inputs): TE keeps FP8 copies, both layouts where SP gathers them in backward
    norm_out = (2 if sp and prec.fp8_recipe in ("delayed", "tensorwise") else 1) if te_fp8 else 2
    unsplit = 1 / t if sp else 1.0
    query = m.num_attention_heads * m.kv_channels / h
    key_value = m.num_query_groups * m.kv_channels / h
    ffn = m.ffn_hidden_size / h
    # cuDNN's FP8 attention (--fp8-dot-product-attention, TE's FP8 layers) keeps FP8 copies of q, k, v and its output
    # for the backward instead of bf16 ones (on two H100s the 8B's peak fell by 2.42 GiB, what this counts)
    attn = 1 if te_fp8 and prec.fp8_dot_product_attention else 2
    return {
        "norm inputs": 4 * unsplit,
        "qkv gemm input": norm_out * unsplit,
        "fc1 gemm input": norm_out * unsplit,
        "dropout masks": (2 if m.hidden_dropout > 0 else 0) * unsplit,
        "q, k, v": attn * (query + 2 * key_value) / t,
        "attention output": attn * query / t,
        "proj gemm input": query / t if te_fp8 else 0.0,  # TE's FP8 copy; else the attention output itself
        "fc1 output": 2 * ffn * (2 if m.swiglu else 1) / t,
        "fc2 gemm input": (1 if te_fp8 else 2) * ffn / t,
    }


def recomputed_activation_units(cfg: Config, layer_numbers: Sequence[int], held: float | None = None) -> float:
    """Activations of the transformer layers `layer_numbers` (global, 1-based: this stage's) in bytes per s*b*h,
    with the --recompute-* flags applied: one micro-batch of each, or `held` layers' worth of micro-batches in flight
    (`memory.in_flight_layers`), plus what the backward of a recomputed group adds.

    Recomputing
      full       keeps a recomputed layer's input only (2); during the backward of a recomputed group its
                 activations exist again, but by then the backward has freed every layer after the group that kept
                 its activations (none under `uniform`; under `block` the layers after the first N), so only what
                 the group's activations exceed those by counts
      mlp        drops the fc1 GEMM input, the fc1 output and the fc2 input (its input is kept: the residual stream)
      layernorm  drops the QKV and fc1 GEMM inputs (the local norms' outputs); TE's norms run inside its
                 LayerNormLinear, with no separate output to recompute: nothing
      core_attn  nothing with SDPA's kernels (which keep no s x s matrix, what it drops in Megatron-LM), except in
                 TE's FP8 layers the bf16 attention output (the proj GEMM keeps its own FP8 copy)"""
    from megatron.model.recompute import RecomputePlan  # late: the model package imports the config as well

    m, par = cfg.model, cfg.parallel
    layers = len(layer_numbers)
    held = layers if held is None else held
    if not layers:
        return 0.0
    plan = RecomputePlan.from_config(m)
    fp8 = set(cfg.precision.fp8_layer_numbers(m.num_layers))
    terms = [layer_activation_bytes(cfg, n in fp8) for n in layer_numbers]
    whole = [sum(t.values()) for t in terms]
    if plan.granularity == "full":
        recomputed = [False] * layers
        for start, end, r in plan.chunks(layers):
            recomputed[start:end] = [r] * (end - start)
        kept_input = 2 / par.tensor_model_parallel_size if par.sequence_parallel else 2.0
        kept = sum(kept_input if r else w for r, w in zip(recomputed, whole))  # of one micro-batch
        extra = max(
            (
                sum(whole[start:end]) - sum(w for w, r in zip(whole[end:], recomputed[end:]) if not r)
                for start, end, r in plan.chunks(layers)
                if r
            ),
            default=0.0,
        )
        return kept * held / layers + max(extra, 0.0)
    te = m.transformer_impl == "transformer_engine"
    kept = 0.0
    for t, w in zip(terms, whole):
        dropped = 0.0
        if plan.selective("mlp"):
            dropped += t["fc1 gemm input"] + t["fc1 output"] + t["fc2 gemm input"]
        if plan.selective("layernorm") and not te:
            dropped += t["qkv gemm input"] + (0.0 if plan.selective("mlp") else t["fc1 gemm input"])
        if plan.selective("core_attn") and t["proj gemm input"]:  # a TE FP8 layer: proj keeps its own copy
            dropped += t["attention output"]
        kept += w - dropped
    return kept * held / layers


def calibration_activation_units(cfg: Config, layer_numbers: Sequence[int], together: int = 1) -> float:
    """Delayed scaling's calibration pass (megatron/training/warmup.py) in bytes per s*b*h: one micro-batch through
    the layers `layer_numbers` in high precision, every layer recomputed on its own whatever the --recompute-*
    flags (`every_layer_recomputed`; `together` layers at a time: an FSDP unit's): each layer's input kept, and in
    the backward of a layer (unit) its 16-bit activations once more (every later layer's are freed by then). The
    FP8 monitor's taps, which record the amaxes, make temporaries in a layer's forward (TE's norm outputs again in
    fp32), while less than the layer's activations are held: they do not raise the peak."""
    if not layer_numbers:
        return 0.0
    par = cfg.parallel
    kept_input = 2 / par.tensor_model_parallel_size if par.sequence_parallel else 2.0
    held = min(together, len(layer_numbers))
    return kept_input * len(layer_numbers) + held * sum(layer_activation_bytes(cfg, False).values())
