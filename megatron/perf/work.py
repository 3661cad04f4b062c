"""What one training iteration must do, per GPU, counted from the configuration alone (no device, no torch).

The counts are for one rank of a data x tensor parallel layout (pipeline and context parallelism are not modelled:
`NotModelled`). Notation, per micro-batch on this rank, with b = micro-batch size, s = sequence length,
T = b*s tokens, h = hidden size, d = head size, H / G = query heads / query groups, f = FFN width, V = padded
vocabulary, t = tensor-parallel size:

    E  = T*h / t with --sequence-parallel, else T*h     elements of one residual-stream tensor on this rank
    Q  = T*H*d / t, K = T*G*d / t                       query and key (or value) elements on this rank
    F  = T*f / t                                        MLP activation elements (fc1 writes 2F with SwiGLU)

A GEMM operand that an FP8 GEMM reads is written as FP8 twice (row-wise for the forward / data-gradient GEMM,
transposed for the weight-gradient GEMM): w = 1 + 1 = 2 bytes per element, 1 + 2 = 3 with --no-fp8-wgrad (the
weight gradient then reads bf16), 2 bytes (bf16) when the GEMM runs in bf16.

Everything here is pure arithmetic on `Config`, so the CPU tests check it against hand-computed values.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config import Config, ConfigError

#: Bytes per element of the optimizer's storage dtypes (FP8 states' per-block scales are under 1% and not counted).
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


class NotModelled(ConfigError):
    """The layout or feature has no lower bound here (one line, naming what is missing)."""


@dataclass(frozen=True)
class GemmWork:
    """`count` GEMMs per iteration of an (m x k) @ (k x n) product: 2*m*n*k FLOPs each."""

    name: str
    m: int
    n: int
    k: int
    fp8: bool
    count: int

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count


@dataclass(frozen=True)
class AttentionWork:
    """`count` causal fused attentions (forward, or forward and backward) of one micro-batch and layer."""

    name: str
    batch: int
    seq: int
    heads: int
    groups: int
    head_dim: int
    fp8: bool
    backward: bool
    count: int

    @property
    def forward_flops(self) -> float:
        """QK^T and PV over the causal half of the s x s scores: 2 GEMMs x 2*b*H*d*s^2/2 = 2*b*H*d*s^2 (the fused
        kernels skip the masked tiles, so the half is what they compute; flops.py's model FLOPs count the whole)."""
        return 2.0 * self.batch * self.heads * self.head_dim * self.seq**2

    @property
    def flops(self) -> float:
        """Backward = 2.5 x forward: it recomputes QK^T and runs four more GEMMs of that size (dV, dP, dQ, dK)."""
        return self.forward_flops * (3.5 if self.backward else 1.0) * self.count


@dataclass(frozen=True)
class MemoryWork:
    """`count` passes per iteration of a memory-bound kernel moving `nbytes` each (reads plus writes)."""

    category: str
    name: str
    nbytes: float
    count: int
    formula: str

    @property
    def total_bytes(self) -> float:
        return self.nbytes * self.count


@dataclass(frozen=True)
class CommWork:
    """`count` collectives per iteration that nothing overlaps. `nbytes` is the all-reduced tensor, or the whole
    (gathered) tensor of an all-gather / reduce-scatter, on `ranks` ranks."""

    name: str
    op: str  # all_reduce | all_gather | reduce_scatter
    nbytes: int
    ranks: int
    count: int


@dataclass
class Workload:
    gemms: list[GemmWork]
    attention: list[AttentionWork]
    memory: list[MemoryWork]
    comm: list[CommWork]
    params: int
    """Parameters on this rank (its tensor-parallel shard of every weight)."""


def check_modelled(cfg: Config) -> None:
    par = cfg.parallel
    if par.pipeline_model_parallel_size > 1 or par.context_parallel_size > 1:
        raise NotModelled(
            "the lower bound models data and tensor parallelism only (pipeline/context parallel layouts: no bound)"
        )
    if cfg.model.num_query_groups % par.tensor_model_parallel_size:
        raise NotModelled("the lower bound needs --num-query-groups divisible by the tensor-parallel size")


def linear_shapes(cfg: Config, vocab: int) -> dict[str, tuple[int, int]]:
    """(input, output) width of each linear on this tensor-parallel rank: column-parallel ones split the output,
    row-parallel ones the input."""
    m, t = cfg.model, cfg.parallel.tensor_model_parallel_size
    q, kv = m.num_attention_heads * m.kv_channels, m.num_query_groups * m.kv_channels
    fc1 = m.ffn_hidden_size * (2 if m.swiglu else 1)
    return {
        "linear_qkv": (m.hidden_size, (q + 2 * kv) // t),
        "linear_proj": (q // t, m.hidden_size),
        "linear_fc1": (m.hidden_size, fc1 // t),
        "linear_fc2": (m.ffn_hidden_size // t, m.hidden_size),
        "output_layer": (m.hidden_size, vocab // t),
    }


def gemms(cfg: Config, vocab: int) -> list[GemmWork]:
    """Forward (m=T, n=out, k=in), data gradient (m=T, n=in, k=out) and weight gradient (m=out, n=in, k=T) of every
    linear, per iteration. With sequence parallelism the GEMMs see the gathered T tokens. FP8 where the layer is in
    `fp8_layer_numbers` (the output layer never); the weight gradient too unless --no-fp8-wgrad."""
    prec, layers = cfg.precision, cfg.model.num_layers
    tokens = cfg.training.micro_batch_size * cfg.model.seq_length
    micro = cfg.num_micro_batches
    fp8_layers = len(prec.fp8_layer_numbers(layers))
    out: list[GemmWork] = []
    for name, (width_in, width_out) in linear_shapes(cfg, vocab).items():
        counts = [(False, 1)] if name == "output_layer" else [(True, fp8_layers), (False, layers - fp8_layers)]
        for fp8, n_layers in counts:
            if n_layers == 0:
                continue
            count = n_layers * micro
            out += [
                GemmWork(f"{name} fprop", tokens, width_out, width_in, fp8, count),
                GemmWork(f"{name} dgrad", tokens, width_in, width_out, fp8, count),
                GemmWork(f"{name} wgrad", width_out, width_in, tokens, fp8 and prec.fp8_wgrad, count),
            ]
    return out


def recomputed_layers(cfg: Config) -> tuple[int, set[str]]:
    """(layers recomputed, what of each): full granularity recomputes whole layers (uniform: all of them, block: the
    first --recompute-num-layers), selective the --recompute-modules (default core_attn); `layernorm` recomputes
    nothing on Transformer Engine (its norms are inside te.LayerNormLinear)."""
    m = cfg.model
    if m.recompute_granularity == "full":
        n = m.num_layers if m.recompute_method == "uniform" else min(m.recompute_num_layers, m.num_layers)
        return n, {"layer"}
    if m.recompute_granularity == "selective":
        modules = set(m.recompute_modules or ["core_attn"])
        if m.transformer_impl == "transformer_engine":
            modules.discard("layernorm")
        return m.num_layers, modules
    return 0, set()


def recompute_gemms(cfg: Config, vocab: int) -> list[GemmWork]:
    """The forward GEMMs that recomputation runs a second time."""
    n, what = recomputed_layers(cfg)
    names = {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"} if "layer" in what else set()
    if "mlp" in what:
        names |= {"linear_fc1", "linear_fc2"}
    if not n or not names:
        return []
    fp8_numbers = set(cfg.precision.fp8_layer_numbers(cfg.model.num_layers))
    fp8_n = len([k for k in range(1, n + 1) if k in fp8_numbers])  # recomputed layers are the first n
    tokens = cfg.training.micro_batch_size * cfg.model.seq_length
    out = []
    for name, (width_in, width_out) in linear_shapes(cfg, vocab).items():
        for fp8, layers in ((True, fp8_n), (False, n - fp8_n)):
            if name in names and layers:
                count = layers * cfg.num_micro_batches
                out.append(GemmWork(f"{name} fprop (recomputed)", tokens, width_out, width_in, fp8, count))
    return out


def attention(cfg: Config) -> list[AttentionWork]:
    """One causal attention per layer and micro-batch (FP8 in FP8 layers with --fp8-dot-product-attention), plus the
    recomputed forwards."""
    m, t, prec = cfg.model, cfg.parallel.tensor_model_parallel_size, cfg.precision
    shape = (cfg.training.micro_batch_size, m.seq_length, m.num_attention_heads // t, m.num_query_groups // t)
    fp8_numbers = set(prec.fp8_layer_numbers(m.num_layers)) if prec.fp8_dot_product_attention else set()
    n_fp8 = len(fp8_numbers)
    out = []
    for fp8, layers in ((True, n_fp8), (False, m.num_layers - n_fp8)):
        if layers:
            count = layers * cfg.num_micro_batches
            out.append(AttentionWork("attention fwd+bwd", *shape, m.kv_channels, fp8, True, count))
    n, what = recomputed_layers(cfg)
    if n and what & {"layer", "core_attn"}:
        fp8_n = len([k for k in range(1, n + 1) if k in fp8_numbers])
        for fp8, layers in ((True, fp8_n), (False, n - fp8_n)):
            if layers:
                count = layers * cfg.num_micro_batches
                out.append(AttentionWork("attention fwd (recomputed)", *shape, m.kv_channels, fp8, False, count))
    return out


def param_parts(cfg: Config, vocab: int) -> dict[str, int]:
    """Parameters on this rank by where the model holds them: `embedding` (word and learned position embeddings),
    `layer` (one transformer layer: the four linears' shards, two norm weights, and biases with LayerNorm or linear
    biases, counted whole), `linears` (of them, the four linears' weights: what an FP8 layer runs in FP8),
    `final_norm`, and `output_layer` (V/t x h; 0 when tied to the embedding)."""
    m = cfg.model
    shapes = linear_shapes(cfg, vocab)
    linears = sum(i * o for name, (i, o) in shapes.items() if name != "output_layer")
    norm = m.hidden_size * (2 if m.normalization == "LayerNorm" else 1)
    biases = 0 if m.disable_bias_linear else sum(o for name, (i, o) in shapes.items() if name != "output_layer")
    word = shapes["output_layer"][0] * shapes["output_layer"][1]
    position = m.max_position_embeddings * m.hidden_size if m.position_embedding_type == "learned_absolute" else 0
    return {
        "embedding": word + position,
        "layer": linears + 2 * norm + biases,
        "linears": linears,
        "final_norm": norm,
        "output_layer": word if m.untie_embeddings_and_output_weights else 0,
    }


def param_count(cfg: Config, vocab: int) -> tuple[int, int]:
    """(all parameters on this rank, the FP8 layers' linear weights among them): `param_parts` summed (untied
    embedding and output layer, V/t x h each)."""
    parts, layers = param_parts(cfg, vocab), cfg.model.num_layers
    total = parts["embedding"] + layers * parts["layer"] + parts["final_norm"] + parts["output_layer"]
    fp8_weights = len(cfg.precision.fp8_layer_numbers(layers)) * parts["linears"]
    return total, fp8_weights
