"""Model architecture: the flags that decide the shape of the GPT."""

from __future__ import annotations

from dataclasses import dataclass

from .base import option, require


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
    """Number of key/value heads with --group-query-attention (defaults to --num-attention-heads)."""
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
    normalization: str = option("LayerNorm", choices=["LayerNorm", "RMSNorm"])
    """Normalization layer: LayerNorm (GPT-2) or RMSNorm (Llama)."""
    norm_epsilon: float = 1e-5
    """Epsilon of the normalization layers."""
    swiglu: bool = False
    """Use a SwiGLU MLP (gate and up projections fused in linear_fc1) instead of GELU."""
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
    always uses Transformer Engine's fused kernel unless `native` is chosen here."""
    cross_entropy_fusion_impl: str = option("native", choices=["native", "te"])
    """With --cross-entropy-loss-fusion: `native` (PyTorch, any device) or `te` (Transformer Engine's
    parallel_cross_entropy; needs a CUDA GPU with Transformer Engine)."""
    transformer_impl: str | None = option(None, choices=["local", "transformer_engine"])
    """Layer implementation: `transformer_engine` (NVIDIA Transformer Engine modules: fused attention, native FP8
    recipes; CUDA only) or `local` (pure PyTorch: runs anywhere, emulates FP8 recipes the GPU lacks). Default:
    transformer_engine on a CUDA machine where Transformer Engine imports, else local (the log says which and why)."""

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
        if not self.group_query_attention or self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
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

    @property
    def add_bias(self) -> bool:
        return not self.disable_bias_linear
