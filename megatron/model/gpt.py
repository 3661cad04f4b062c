"""The GPT model: embeddings, a stack of transformer layers, a final norm and the output layer.

Read top to bottom, this is an ordinary single-device GPT; it is also the numerical oracle that the other layer
implementations and (later) parallel layouts are tested against. Parameter names follow Megatron-Core:

    embedding.word_embeddings.weight        [V, h]
    embedding.position_embeddings.weight    [max_pos, h]   (learned_absolute only)
    decoder.layers.N.…                      (see transformer.py)
    decoder.final_layernorm.weight / .bias
    output_layer.weight                     [V, h]         (only with --untie-embeddings-and-output-weights)

The transformer layers come in two implementations with the same parameter names (`--transformer-impl`): `local`
(transformer.py, pure PyTorch) and `transformer_engine` (te_layers.py and its te_*.py pieces, imported only on that
path). A checkpoint of one loads into the other: TE's `_extra_state` entries (its FP8 scaling state) are dropped
when a local model loads them and left empty when a TE model loads a local checkpoint.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig, PrecisionConfig
from megatron.fp8.params import Fp8Parameter
from megatron.parallel.context_parallel import NO_CP, ContextParallel, local_positions
from megatron.parallel.tensor_parallel import (
    NO_TP,
    TensorParallel,
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    scatter_to_sp,
    vocab_parallel_cross_entropy,
)

from .cross_entropy import fused_cross_entropy
from .init_draws import init_normal, parallel_draws, seeded
from .layers import Linear, Norm, RotaryEmbedding, is_fp8_param, mark_tensor_parallel
from .output_layer import OutputLinear, linear_cross_entropy
from .recompute import RecomputePlan, Runner, run_layers
from .transformer import TransformerLayer


@dataclass(frozen=True)
class Stage:
    """The part of the model a pipeline stage holds: global layer numbers (1-based), and whether it embeds the
    tokens (first stage) and computes the loss (last stage). One stage holds everything.

    Under the interleaved schedule a stage holds several model chunks (virtual stages), each a run of consecutive
    layers: `chunk_sizes` gives their layer counts, in `layer_numbers`' order (empty: one chunk). Chunk 0 of the
    first stage embeds, the last chunk of the last stage computes the loss. One module holds all chunks, so the
    optimizer, gradient buffers, FP8 state and checkpoints (which name layers by their global numbers) see one model
    per rank, as without interleaving."""

    layer_numbers: tuple[int, ...]
    pre_process: bool = True
    post_process: bool = True
    chunk_sizes: tuple[int, ...] = ()

    @classmethod
    def whole(cls, num_layers: int) -> Stage:
        return cls(tuple(range(1, num_layers + 1)))

    @classmethod
    def of_chunks(cls, chunks: tuple[tuple[int, ...], ...], pre_process: bool, post_process: bool) -> Stage:
        """A stage of the given chunks' layers (global numbers, as `chunk_layer_numbers` gives them)."""
        sizes = tuple(len(c) for c in chunks) if len(chunks) > 1 else ()
        return cls(tuple(n for c in chunks for n in c), pre_process, post_process, sizes)

    @property
    def num_chunks(self) -> int:
        return max(1, len(self.chunk_sizes))

    def computes_loss(self, chunk: int | None = None) -> bool:
        """Whether running `chunk` (None: the whole stage) ends in the loss."""
        return self.post_process and chunk in (None, self.num_chunks - 1)

    def chunk_slice(self, chunk: int) -> slice:
        """The stage-local indices of chunk `chunk`'s layers."""
        if not self.chunk_sizes:
            return slice(0, len(self.layer_numbers))
        start = sum(self.chunk_sizes[:chunk])
        return slice(start, start + self.chunk_sizes[chunk])


class VocabParallelEmbedding(nn.Module):
    """Word embeddings [V, h], rows split over the tensor-parallel ranks; each rank looks up the tokens in its
    range and the partial results are all-reduced (the others contribute zeros)."""

    def __init__(self, vocab_size: int, hidden_size: int, init_std: float, dtype, tp: TensorParallel):
        super().__init__()
        self.tp, self.vocab_local = tp, vocab_size // tp.size
        self.vocab_start = tp.rank * self.vocab_local
        self.weight = nn.Parameter(torch.empty(self.vocab_local, hidden_size, dtype=dtype or torch.float32))
        init_normal(self.weight, (vocab_size, hidden_size), init_std, partial(tp.shard, dim=0))
        mark_tensor_parallel(self.weight, 0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(tokens, self.weight)
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.tp.group)


class Embedding(nn.Module):
    def __init__(
        self, cfg: ModelConfig, vocab_size: int, dtype: torch.dtype | None, tp: TensorParallel, positions: bool = True
    ):
        super().__init__()
        self.tp = tp
        self.word_embeddings = VocabParallelEmbedding(vocab_size, cfg.hidden_size, cfg.init_method_std, dtype, tp)
        self.position_embeddings = None
        if positions and cfg.position_embedding_type == "learned_absolute":
            shape = (cfg.max_position_embeddings, cfg.hidden_size)
            self.position_embeddings = nn.Embedding(*shape, _weight=torch.empty(shape, dtype=dtype or torch.float32))
            init_normal(self.position_embeddings.weight, shape, cfg.init_method_std)
            self.position_embeddings.weight.grad_norm_duplicate = tp.rank > 0
        self.dropout = cfg.hidden_dropout

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(tokens)  # [b, s, h]
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(position_ids)
        x = x.transpose(0, 1).contiguous()  # [s, b, h]
        if self.tp.sequence_parallel:
            x = scatter_to_sp(x, self.tp.group)  # [s/tp, b, h]
        return F.dropout(x, self.dropout, self.training)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, te_fp8: Any, tp: TensorParallel, stage: Stage, base_seed: int):
        super().__init__()
        layers = []
        # FP8 weights are built as TE tensors whose nominal dtype must be the model's (bf16), so the trainer's later
        # .to(bf16) leaves them alone instead of dequantizing them; TE quantizes them as it initializes them, so their
        # layers draw at once, not with the other parts (init_draws.py)
        fp8_params = te_fp8 is not None and te_fp8.fp8_params
        for number in stage.layer_numbers:
            with seeded(base_seed + number, defer=not fp8_params):
                if cfg.transformer_impl == "transformer_engine":
                    from .te_layers import TETransformerLayer

                    with te_fp8.param_init(number) if fp8_params else contextlib.nullcontext():
                        layers.append(
                            TETransformerLayer(cfg, number, torch.bfloat16 if fp8_params else dtype, te_fp8, tp)
                        )
                else:
                    layers.append(TransformerLayer(cfg, number, dtype, tp))
        # Indices are stage-local (as in Megatron-Core); each layer's `layer_number` is its global number.
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = (
            Norm(cfg.hidden_size, cfg.normalization, cfg.norm_epsilon, dtype, tp, cfg.apply_layernorm_1p)
            if stage.post_process
            else None
        )


class GPTModel(nn.Module):
    context_parallel: ContextParallel = NO_CP
    """Set by megatron.parallel.context_parallel.attach_context_parallel: the inputs are this rank's sequence chunks."""

    def __init__(
        self,
        cfg: ModelConfig,
        vocab_size: int,
        dtype: torch.dtype | None = None,
        *,
        precision: PrecisionConfig | None = None,
        amax_group: dist.ProcessGroup | None = None,
        tp: TensorParallel = NO_TP,
        stage: Stage | None = None,
        init_threads: int = 1,
    ):
        """`vocab_size` is the padded vocabulary (see `megatron.data.padded_vocab_size`).

        `precision` and `amax_group` matter only with --transformer-impl transformer_engine, whose FP8 autocast runs
        inside the model: precision gives the TE recipe and the layers kept out of FP8, amax_group the ranks whose
        FP8 amaxes are max-reduced together (tensor x data parallel; None in one process). The TE layers are built
        on the current CUDA device; the rest where the local model is built (the CPU, then moved). The local
        implementation gets its FP8 from `megatron.fp8.attach_fp8` after construction.

        `tp` splits the layers over tensor-parallel ranks and `stage` picks this pipeline stage's part; the defaults
        build the whole model in one process. Initial weights depend only on the global RNG state at construction
        (one draw gives a base seed; each module then uses its own), not on the layout, nor on `init_threads`: how
        many threads draw them (megatron/model/init_draws.py)."""
        super().__init__()
        stage = stage or Stage.whole(cfg.num_layers)
        self.cfg, self.vocab_size, self.tp, self.stage = cfg, vocab_size, tp, stage
        base_seed = int(torch.randint(0, 2**31 - 1, (1,), device="cpu"))  # also when built on the meta device
        self.uses_te = cfg.transformer_impl == "transformer_engine"
        self.te_fp8 = None
        self.checkpoint_runner: Runner | None = None
        if self.uses_te:
            from .attention import set_te_attention_env
            from .te_fp8 import build_te_fp8, te_checkpoint

            set_te_attention_env(cfg.attention_backend)  # as Megatron-LM does when it builds the model
            self.te_fp8 = build_te_fp8(cfg, precision, amax_group)
            self.checkpoint_runner = te_checkpoint  # TE's checkpoint for its layers' FP8 state (see recompute.py)
        # The parts' weights are drawn at the end of this block, the parts in parallel (init_draws.py)
        with parallel_draws(init_threads):
            self._build_parts(vocab_size, dtype, base_seed)
        for module in self.modules():
            if isinstance(module, (Linear, OutputLinear)):
                module.gradient_accumulation_fusion = cfg.gradient_accumulation_fusion
        self.register_load_state_dict_pre_hook(_reconcile_extra_state)
        self.register_load_state_dict_pre_hook(_quantize_into_fp8_params)
        self._register_state_dict_hook(_dequantize_fp8_params)

    def _build_parts(self, vocab_size: int, dtype: torch.dtype | None, base_seed: int) -> None:
        """The embedding, the layers and the output layer (each from its own seed), in Megatron-Core's order."""
        cfg, tp, stage = self.cfg, self.tp, self.stage
        tied = not cfg.untie_embeddings_and_output_weights
        self.embedding = None
        if stage.pre_process or (tied and stage.post_process):
            # The last stage of a pipeline keeps its own copy of tied word embeddings for the output layer; the
            # trainer sums the two copies' gradients, so they stay equal.
            with seeded(base_seed):
                self.embedding = Embedding(cfg, vocab_size, dtype, tp, positions=stage.pre_process)
            if tied and not (stage.pre_process and stage.post_process):
                self.embedding.word_embeddings.weight.shared_embedding = True
                self.embedding.word_embeddings.weight.grad_norm_duplicate = not stage.pre_process
        self.rotary = None
        if cfg.position_embedding_type == "rope":
            self.rotary = RotaryEmbedding(int(cfg.kv_channels * cfg.rotary_percent), cfg.rotary_base)
        self.decoder = Decoder(cfg, dtype, self.te_fp8, tp, stage, base_seed)
        self.recompute = RecomputePlan.from_config(cfg)
        # Layers per FSDP unit over decoder.layers, in order, once sharded (parallel/fsdp/fsdp2.py): full recomputation
        # recomputes a unit of several layers whole (`recompute.check_units_whole`)
        self.layer_units: tuple[int, ...] = ()
        self.output_layer = None
        if not tied and stage.post_process:
            # Built on the meta device, then given storage on the default one: nn.Linear's own initialization (a
            # uniform draw of V/tp x h from the global generator, a few seconds at 8B) would be overwritten anyway
            linear = OutputLinear(cfg.hidden_size, vocab_size // tp.size, bias=False, dtype=dtype, device="meta")
            self.output_layer = linear.to_empty(device=torch.get_default_device())
            with seeded(base_seed + cfg.num_layers + 1):
                shape = (vocab_size, cfg.hidden_size)
                init_normal(self.output_layer.weight, shape, cfg.init_method_std, partial(tp.shard, dim=0))
            mark_tensor_parallel(self.output_layer.weight, 0)

    def output_weight(self) -> torch.Tensor:
        """[V/tp, h]: this rank's vocabulary rows of the output layer (the word embeddings when tied)."""
        return self.embedding.word_embeddings.weight if self.output_layer is None else self.output_layer.weight

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
        chunk: int | None = None,
    ) -> torch.Tensor:
        """tokens, position_ids, labels: [b, s]; attention_mask: bool [b, 1, s, s], True where a query may attend
        (None: causal); hidden: the previous pipeline stage's output (stages after the first); chunk: run only this
        model chunk of the stage (interleaved schedule; None: all layers).
        Returns logits [b, s, V], or the per-token loss [b, s] (fp32) when labels are given; a stage other than the
        last returns its output activations [s, b, h] ([s/tp, b, h] with sequence parallelism)."""
        b, s = tokens.shape
        cp = self.context_parallel
        given = position_ids is not None
        if not given:  # the chunks' positions in the whole sequence under context parallelism
            position_ids = local_positions(s * cp.size, cp, tokens.device).expand(b, s)
        embeds = self.stage.pre_process and chunk in (None, 0)
        x = self.embedding(tokens, position_ids) if embeds else hidden  # [s, b, h]
        rotary = None
        if self.rotary is not None:
            # Comparing given ids with 0..s-1 reads a device tensor on the host: a synchronization that drains the
            # GPU's queue once per micro-batch. Without position ids there is nothing to compare.
            # Ids the batch shares (micro-batch size 1 under --reset-position-ids, say) still rotate by themselves:
            # one row of them gives the batch-wide [s, 1, 1, d] angles the fused RoPE kernels take.
            per_sample = given and not torch.equal(position_ids, position_ids[:1].expand_as(position_ids))
            shared = position_ids[:1] if given or cp.size > 1 else None
            rotary = self.rotary(s, position_ids if per_sample else shared)
        with self.te_fp8.stack() if self.te_fp8 is not None else contextlib.nullcontext():
            layers = self.decoder.layers if chunk is None else self.decoder.layers[self.stage.chunk_slice(chunk)]
            if self.te_fp8 is not None and self.recompute.granularity is not None:
                self.te_fp8.update_backward_amaxes_at(x)
            x = run_layers(layers, x, rotary, attention_mask, self.recompute, self.checkpoint_runner)
        if not self.stage.computes_loss(chunk):
            return x
        x = self.decoder.final_layernorm(x)
        x = gather_from_sp(x, self.tp.group) if self.tp.sequence_parallel else copy_to_tp(x, self.tp.group)
        # [s, b, V/tp]. The untied output layer runs as a module: under FSDP it shares a unit with the final norm,
        # and FSDP2 runs its forward and pre-backward logic only for modules whose forward ran (and warns)
        if labels is not None and self.cfg.cross_entropy_impl(fp16_logits=False) == "chunked":
            return self._chunked_loss(x, labels)
        logits = F.linear(x, self.output_weight()) if self.output_layer is None else self.output_layer(x)
        if labels is None:
            return gather_from_tp(logits, self.tp.group).transpose(0, 1)
        impl = self.cfg.cross_entropy_impl(fp16_logits=logits.dtype == torch.float16)  # (--fp16 refused with `te`)
        if impl == "te":
            from .te_layers import te_cross_entropy

            return te_cross_entropy(logits, labels, self.tp.group)
        if impl == "native":
            return fused_cross_entropy(logits.transpose(0, 1), labels, self.tp.group)
        return vocab_parallel_cross_entropy(logits.transpose(0, 1), labels, self.tp.group)

    def _chunked_loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The per-token loss [b, s] of the output layer fused with the cross-entropy (output_layer.py), from the
        final norm's output x [s, b, h] (whole over the tensor-parallel group) and labels [b, s]."""
        s, b, h = x.shape
        flat, targets = x.reshape(s * b, h), labels.t().reshape(s * b)
        if self.output_layer is None:  # tied: the embedding gets a second gradient from its lookup, so none is fused
            loss = linear_cross_entropy(flat, self.output_weight(), targets, self.tp.group)
        else:
            loss = self.output_layer(flat, targets, self.tp.group)
        return loss.view(s, b).t()

    def describe(self) -> list[str]:
        """Startup log lines about the layer implementation (the local one has none) and the recomputation."""
        lines = self.recompute.describe(len(self.decoder.layers))
        if self.uses_te and "layernorm" in self.recompute.modules:
            lines.append(
                "--recompute-modules layernorm: the norms run inside Transformer Engine's LayerNormLinear, which has"
                " no separate norm output to recompute (as in Megatron-LM); nothing is recomputed for it"
            )
        if not self.uses_te:
            return lines
        from .te_layers import describe_te

        return describe_te(self) + lines


def extra_state_keys(model: nn.Module, prefix: str = "") -> set[str]:
    """The `_extra_state` entries `model.state_dict()` holds: one per module that overrides `get_extra_state`."""
    return {
        f"{prefix}{name}{'.' if name else ''}_extra_state"
        for name, module in model.named_modules()
        if type(module).get_extra_state is not nn.Module.get_extra_state
    }


def _reconcile_extra_state(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """Load-time hook: drop `_extra_state` entries this model has no module for (a TE checkpoint loaded into the
    local model) and give the ones it expects an empty value (a local checkpoint loaded into a TE model; TE keeps its
    fresh FP8 state when given None). The weights themselves must still match key for key."""
    ours = extra_state_keys(module, prefix)
    for key in [k for k in state_dict if k.startswith(prefix) and k.endswith("_extra_state") and k not in ours]:
        del state_dict[key]
    for key in ours - state_dict.keys():
        state_dict[key] = None


def _dequantize_fp8_params(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """State-dict hook: FP8 parameters (--fp8-param-gather) are saved as their high-precision values, so a checkpoint
    holds plain tensors that either engine (and a machine without TE) loads. Loading one quantizes again; the
    optimizer's fp32 main parameters, saved alongside, keep the full precision for resuming. Parameters themselves
    (`state_dict(keep_vars=True)`) are left as they are."""
    params = {prefix + name: p for name, p in module.named_parameters()}
    with torch.no_grad():
        for key, value in state_dict.items():
            if not isinstance(value, nn.Parameter) and is_fp8_param(params.get(key)):
                state_dict[key] = params[key].dequantize()


def _quantize_into_fp8_params(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """Load-time hook: a high-precision value for a local FP8 weight is quantized into it here (a plain copy into
    its E4M3 storage would drop the scale); the entry then holds the weight's own bytes. TE's quantized parameters
    quantize in their `copy_` themselves."""
    for name, param in module.named_parameters():
        value = state_dict.get(prefix + name)
        if isinstance(param, Fp8Parameter) and value is not None and value.shape == param.shape:
            if value.dtype != param.dtype:
                param.quantize_(value.to(param.device))
            state_dict[prefix + name] = param.data


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())
