"""Model architecture: the flags that decide the shape of the GPT."""

from __future__ import annotations

from dataclasses import dataclass

from .base import option, require

RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm")
"""What --recompute-modules can name here (the dense-GPT subset of Megatron-LM's choices)."""


@dataclass
class ModelConfig:
    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 128
    """Width of the residual stream (h)."""
    ffn_hidden_size: int | None = None
    """Width of the MLP's hidden layer; defaults to 4*h, or to Llama's 2/3 of that (rounded up to a multiple of 64)
    with --swiglu."""
    num_attention_heads: int = 4
    """Number of query heads."""
    group_query_attention: bool = False
    """Use grouped-query attention: --num-query-groups key/value heads shared by the query heads."""
    num_query_groups: int | None = None
    """Number of key/value heads with --group-query-attention; unset there means 1 (multi-query attention), as in
    Megatron-LM. Without --group-query-attention every query head has its own (this value must then be unset or
    equal --num-attention-heads)."""
    kv_channels: int | None = None
    """Width of one attention head; defaults to hidden_size / num_attention_heads."""
    seq_length: int = 128
    """Tokens per training sample."""
    max_position_embeddings: int | None = None
    """Size of the learned position table (defaults to --seq-length); must be at least --seq-length."""
    position_embedding_type: str = option("learned_absolute", choices=["learned_absolute", "rope"])
    """How positions enter the model: a learned absolute table (GPT-2) or rotary embeddings (Llama)."""
    rotary_base: int = 10000
    """Base of the rotary embedding frequencies."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels that are rotated."""
    use_rotary_position_embeddings: bool = False
    """Deprecated spelling of --position-embedding-type rope (Megatron-LM's legacy flag); sets it."""
    apply_rope_fusion: bool = option(True, flag="--no-rope-fusion", action="store_false")
    """`--no-rope-fusion`: apply RoPE with separate PyTorch ops instead of the fused kernel on the packed QKV output
    (megatron/model/rope_kernel.py, Triton; TE's fused QKV kernel where Triton is missing), which both engines use
    on CUDA with positions shared by the batch (not with --qk-layernorm: the norms come before RoPE)."""
    normalization: str = option("LayerNorm", choices=["LayerNorm", "RMSNorm"])
    """Normalization layer: LayerNorm (GPT-2) or RMSNorm (Llama)."""
    norm_epsilon: float = 1e-5
    """Epsilon of the normalization layers."""
    apply_layernorm_1p: bool = False
    """Zero-centred norm weights (Megatron-Core's `layernorm_zero_centered_gamma`, TE's `zero_centered_gamma`):
    every LayerNorm / RMSNorm (q/k norms included) stores w, initialized to 0, and scales by 1 + w. Checkpoints hold
    w, as Megatron-LM's do, so they load into a model with the same setting."""
    no_persist_layer_norm: bool = False
    """Accepted and ignored: it turns off Apex's persistent LayerNorm kernel, which this project never uses (norms
    run in PyTorch or inside Transformer Engine's fused norm+GEMM)."""
    qk_layernorm: bool = False
    """Normalize each query and key head (over its kv-channels, with --normalization) before RoPE and attention:
    parameters self_attention.q_layernorm / k_layernorm, as in Megatron-Core."""
    swiglu: bool = False
    """Use a SwiGLU MLP (gate and up projections fused in linear_fc1) instead of GELU."""
    smooth_swiglu: bool = False
    """Smooth-SwiGLU (Fishman et al. 2024, docs/fp8.md): scale each channel of the SwiGLU output by a power of two
    s (from the channel's amax over the previous optimizer step) before linear_fc2 quantizes it, and fold 1/s into
    linear_fc2's weight columns, so that outlier channels do not set the FP8 scale of that input. The same function
    (bit for bit in full precision); the scales are kept in checkpoints as linear_fc2.smooth_scale. Needs --swiglu;
    both engines (not with --fp8-param-gather)."""
    smooth_swiglu_migration: float = 1.0
    """With --smooth-swiglu, the share a in [0, 1] of a channel's range its scale moves into linear_fc2's weight:
    s_i = 2^-ceil(a log2 amax_i - (1 - a) log2 wmax_i), wmax_i the weight column's max |W|. 1: Fishman et al.'s
    scale, every channel of the input within (-1, 1]; 0.5: SmoothQuant's, the range shared between the input and
    the weight (megatron/model/smooth_swiglu.py). Not with FSDP at a < 1 (its weights are sharded)."""
    squared_relu: bool = False
    """Use the squared ReLU activation, relu(x)^2, in the MLP instead of GELU (not with --swiglu)."""
    disable_bias_linear: bool = False
    """Drop the biases of every linear layer (Llama style)."""
    untie_embeddings_and_output_weights: bool = False
    """Give the output layer its own weights instead of sharing the word embeddings."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight initialization; output projections are scaled by 1/sqrt(2*layers)."""
    hidden_dropout: float = 0.1
    """Dropout on the residual branches and the embeddings."""
    attention_dropout: float = 0.1
    """Dropout on the attention probabilities."""
    attention_backend: str = option("auto", choices=["auto", "flash", "fused", "unfused", "local"])
    """Attention kernel. Transformer Engine: `auto` lets TE choose, `flash` / `fused` (cuDNN) / `unfused` allow only
    that TE backend (set through NVTE_FLASH_ATTN / NVTE_FUSED_ATTN / NVTE_UNFUSED_ATTN, as Megatron-LM does; a
    contradicting value already in the environment is an error), `local` runs this project's PyTorch attention
    inside the TE layer. Local engine: `auto` is PyTorch's scaled_dot_product_attention choosing its kernel,
    `flash` its flash kernel (CUDA, or PyTorch's CPU flash kernel), `fused` its cuDNN / memory-efficient kernels
    (on a CPU its fused CPU kernel), `unfused` and `local` the explicit softmax(QK^T/sqrt(d))V that honours
    --attention-softmax-in-fp32 and --apply-query-key-layer-scaling. A kernel that cannot run these inputs fails
    with a one-line error; there is no silent fallback."""
    masked_softmax_fusion: bool = option(True, flag="--no-masked-softmax-fusion", action="store_false")
    """Accepted; `--no-masked-softmax-fusion` changes nothing here: it turns off Megatron-LM's fused scale-mask-softmax
    CUDA kernel, which this project does not have (the explicit attention always uses PyTorch's softmax; SDPA's and
    TE's kernels fuse the softmax into attention, which Megatron-LM's flag does not reach either)."""
    attention_softmax_in_fp32: bool = False
    """Run attention's masking and softmax in fp32 when the activations are bf16/fp16. Acts where softmax is computed
    explicitly (--attention-backend unfused|local on the local engine); SDPA's kernels and TE's attention always
    compute the softmax in fp32 internally, so there the flag changes nothing."""
    apply_query_key_layer_scaling: bool = False
    """Scale QK^T by 1/layer-number in the attention GEMM and multiply it back in fp32 before the softmax, to keep
    fp16 scores in range; implies --attention-softmax-in-fp32. Local engine: applied by the explicit attention
    (--attention-backend unfused|local); the fused kernels keep their scores in fp32 and need no such trick. TE:
    passed as NVTE_APPLY_QK_LAYER_SCALING=1, which TE's unfused backend applies to fp16 inputs only."""
    gradient_accumulation_fusion: bool = option(True, flag="--no-gradient-accumulation-fusion", action="store_false")
    """Accumulate each linear's weight gradient straight into its fp32 gradient buffer (`main_grad`) in the wgrad
    GEMM: Transformer Engine's fused wgrad accumulation, and on the local path one GEMM accumulating into the buffer
    (into fp32 directly when the weights are fp32; bf16/fp16 weights' product is added to it). With
    `--no-gradient-accumulation-fusion` each weight gradient is formed in `.grad`, in the weight's dtype, and then
    added into the buffer. FP8 weights (--fp8-param-gather) always accumulate into the buffer."""
    cross_entropy_loss_fusion: bool = False
    """Compute the output layer's cross-entropy with a fused implementation (--cross-entropy-fusion-impl): `native`
    keeps only the logits and one fp32 value per token for backward and recomputes the softmax there, instead of
    holding fp32 log-probabilities of the whole vocabulary. With --transformer-impl transformer_engine the loss
    always uses Transformer Engine's fused kernel unless `native` is chosen here (or --fp16, whose logits that
    kernel does not take)."""
    cross_entropy_fusion_impl: str = option("native", choices=["native", "te", "chunked"])
    """With --cross-entropy-loss-fusion: `native` (PyTorch, any device), `te` (Transformer Engine's
    parallel_cross_entropy; needs a CUDA GPU with Transformer Engine) or `chunked` (this project's: the output
    layer's GEMM and the loss together, a slice of the vocabulary at a time, the logits recomputed in the backward:
    no tensor of the whole logits is ever kept; megatron/model/output_layer.py). It trades time for memory: on
    Llama-3-8B, ~42 ms per micro-batch on an H100, more than recomputing two layers saves (docs/te.md). Without
    --cross-entropy-loss-fusion, `chunked` is an error; the other two are accepted and ignored, as Megatron-LM does."""
    transformer_impl: str | None = option(None, choices=["local", "transformer_engine"])
    """Layer implementation: `transformer_engine` (NVIDIA Transformer Engine modules: fused attention, native FP8
    recipes; CUDA only) or `local` (pure PyTorch: runs anywhere, emulates FP8 recipes the GPU lacks). Default:
    transformer_engine on a CUDA machine where Transformer Engine imports, else local (the log says which and why)."""
    recompute_activations: bool = False
    """Recompute activations in the backward pass instead of keeping them: Megatron-LM's shorthand for
    --recompute-granularity selective (with --recompute-modules, default core_attn)."""
    recompute_granularity: str | None = option(None, choices=["full", "selective"])
    """Activation recomputation (docs/recompute.md). `full`: keep only the input of each recomputed transformer
    layer (which layers: --recompute-method and --recompute-num-layers) and run the layer's forward again in the
    backward pass. `selective`: keep everything but the outputs of --recompute-modules, recomputed in backward.
    Unset: no recomputation. The recomputed forward draws the same dropout masks and uses the same FP8 scales as
    the first; TFLOP/s keep counting model FLOPs (the recomputation is not counted)."""
    recompute_method: str | None = option(None, choices=["uniform", "block"])
    """Which layers --recompute-granularity full recomputes (required there). `uniform`: every layer of the pipeline
    stage (model chunk), in groups of --recompute-num-layers consecutive layers whose inputs only are kept. `block`:
    only the first --recompute-num-layers layers of each pipeline stage (model chunk), one at a time; the rest keep
    their activations."""
    recompute_num_layers: int | None = None
    """With --recompute-granularity full (required there): layers per recomputed group (uniform) or layers
    recomputed per pipeline stage (block). Must be unset with selective."""
    recompute_modules: list[str] | None = option(None, nargs="+")
    """The parts of each transformer layer --recompute-granularity selective recomputes (Megatron-LM's names;
    default core_attn): `core_attn` (the attention between linear_qkv and linear_proj: softmax(QK^T)V with its
    dropout), `mlp` (the whole MLP, its fused pre-MLP norm included), `layernorm` (the outputs of the two norms fused
    into linear_qkv and linear_fc1, on the local engine; with --transformer-impl transformer_engine those norms run
    inside te.LayerNormLinear, which Megatron-LM does not recompute either, so there it recomputes nothing). The
    MoE, MLA and hyper-connection modules of Megatron-LM do not exist in this model (an error)."""
    no_persist_layer_norm: bool = False
    """Accepted and ignored: in Megatron-LM it turns off apex's persistent layer-norm kernel; no layer norm here
    uses that kernel (they are PyTorch's or Transformer Engine's), which is what the flag asks for."""

    def finalize(self) -> None:
        """Fill in the defaults that depend on other fields, then check the values."""
        require(self.num_layers >= 1, f"--num-layers must be >= 1, got {self.num_layers}")
        require(self.hidden_size >= 1, f"--hidden-size must be >= 1, got {self.hidden_size}")
        require(self.num_attention_heads >= 1, f"--num-attention-heads must be >= 1, got {self.num_attention_heads}")
        if self.kv_channels is None:
            require(
                self.hidden_size % self.num_attention_heads == 0,
                f"--num-attention-heads ({self.num_attention_heads}) must divide --hidden-size ({self.hidden_size}),"
                " or set --kv-channels",
            )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        require(self.kv_channels >= 1, f"--kv-channels must be >= 1, got {self.kv_channels}")
        if self.num_query_groups is not None and not self.group_query_attention:
            require(
                self.num_query_groups == self.num_attention_heads,
                "--num-query-groups needs --group-query-attention",
            )
        if not self.group_query_attention:
            self.num_query_groups = self.num_attention_heads
        elif self.num_query_groups is None:  # Megatron-LM's default: --group-query-attention alone is MQA
            self.num_query_groups = 1
        require(self.num_query_groups >= 1, f"--num-query-groups must be >= 1, got {self.num_query_groups}")
        require(
            self.num_attention_heads % self.num_query_groups == 0,
            f"--num-query-groups ({self.num_query_groups}) must divide --num-attention-heads"
            f" ({self.num_attention_heads})",
        )
        if self.ffn_hidden_size is None:
            if self.swiglu:
                self.ffn_hidden_size = -(-int(8 * self.hidden_size / 3) // 64) * 64
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        require(not (self.swiglu and self.squared_relu), "--squared-relu and --swiglu are exclusive: drop one")
        require(self.swiglu or not self.smooth_swiglu, "--smooth-swiglu scales the SwiGLU output: add --swiglu")
        a = self.smooth_swiglu_migration
        require(0 <= a <= 1, f"--smooth-swiglu-migration must be in [0, 1], got {a}")
        require(
            self.smooth_swiglu or a == ModelConfig.smooth_swiglu_migration,
            "--smooth-swiglu-migration sets --smooth-swiglu's scales: add --smooth-swiglu",
        )
        if self.use_rotary_position_embeddings:
            self.position_embedding_type = "rope"
        if self.apply_query_key_layer_scaling:
            self.attention_softmax_in_fp32 = True  # Megatron-LM's rule: the rescaled scores must be fp32
        require(self.ffn_hidden_size >= 1, f"--ffn-hidden-size must be >= 1, got {self.ffn_hidden_size}")
        require(self.seq_length >= 1, f"--seq-length must be >= 1, got {self.seq_length}")
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.position_embedding_type == "learned_absolute":
            require(
                self.max_position_embeddings >= self.seq_length,
                f"--max-position-embeddings ({self.max_position_embeddings}) must be >= --seq-length"
                f" ({self.seq_length})",
            )
        else:
            require(self.kv_channels % 2 == 0, "--position-embedding-type rope needs an even --kv-channels")
            require(0.0 < self.rotary_percent <= 1.0, "--rotary-percent must be in (0, 1]")
            require(self.rotary_base > 0, "--rotary-base must be > 0")
        require(self.norm_epsilon > 0, f"--norm-epsilon must be > 0, got {self.norm_epsilon}")
        require(self.init_method_std > 0, f"--init-method-std must be > 0, got {self.init_method_std}")
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            require(0.0 <= value < 1.0, f"--{name.replace('_', '-')} must be in [0, 1), got {value}")
        # Megatron-LM ignores the choice without the fusion; `chunked` is this project's, so no script of theirs
        # passes it alone, and ignoring it would silently keep the whole logits it exists to avoid
        require(
            self.cross_entropy_loss_fusion or self.cross_entropy_fusion_impl != "chunked",
            "--cross-entropy-fusion-impl chunked takes effect only with --cross-entropy-loss-fusion: add it",
        )
        self._check_recompute()

    def _check_recompute(self) -> None:
        """Megatron-LM's rules for the recomputation flags (its TransformerConfig and argument checks)."""
        if self.recompute_activations:
            require(
                self.recompute_granularity != "full",
                "--recompute-activations means --recompute-granularity selective; drop one of the two",
            )
            self.recompute_granularity = "selective"
        granularity = self.recompute_granularity
        if granularity is None:
            for name in ("recompute_method", "recompute_num_layers", "recompute_modules"):
                require(
                    getattr(self, name) is None,
                    f"--{name.replace('_', '-')} needs --recompute-granularity"
                    f" {'selective' if name == 'recompute_modules' else 'full'}; add it or drop the flag",
                )
            return
        if granularity == "full":
            require(
                self.recompute_method is not None,
                "--recompute-granularity full needs --recompute-method uniform or block",
            )
            require(
                self.recompute_num_layers is not None and 1 <= self.recompute_num_layers <= self.num_layers,
                f"--recompute-granularity full needs --recompute-num-layers between 1 and --num-layers"
                f" ({self.num_layers}), got {self.recompute_num_layers}",
            )
            require(
                self.recompute_modules is None,
                "--recompute-modules applies to --recompute-granularity selective; full recomputes whole layers",
            )
            return
        require(
            self.recompute_method is None,
            "--recompute-method applies to --recompute-granularity full; selective recomputes in every layer",
        )
        require(
            self.recompute_num_layers is None,
            "--recompute-num-layers applies to --recompute-granularity full; selective recomputes in every layer",
        )
        if self.recompute_modules is None:
            self.recompute_modules = ["core_attn"]  # Megatron-LM's default
        unknown = [m for m in self.recompute_modules if m not in RECOMPUTE_MODULES]
        require(
            not unknown,
            f"--recompute-modules {' '.join(unknown)}: this model has no such module to recompute; choose among"
            f" {', '.join(RECOMPUTE_MODULES)}",
        )
        require(bool(self.recompute_modules), "--recompute-modules needs at least one of core_attn, mlp, layernorm")

    @property
    def add_bias(self) -> bool:
        return not self.disable_bias_linear

    def cross_entropy_impl(self, fp16_logits: bool) -> str:
        """The output layer's loss: `te` (Transformer Engine's fused cross-entropy: asked for, or by default with TE's
        layers, whose kernel refuses fp16 logits), `native` (this project's fused one), `chunked` (fused with the
        output layer's GEMM) or `vocab_parallel`. The model
        computes with it and the memory estimate counts its bytes."""
        fused = self.cross_entropy_fusion_impl if self.cross_entropy_loss_fusion else None
        if fused == "chunked":
            return "chunked"
        if fused == "te" or (fused is None and self.transformer_impl == "transformer_engine" and not fp16_logits):
            return "te"
        return "native" if fused == "native" else "vocab_parallel"
