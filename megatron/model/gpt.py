"""The GPT model: embeddings, a stack of transformer layers, a final norm and the output layer.

Read top to bottom, this is an ordinary single-device GPT; it is also the numerical oracle that the other layer
implementations and (later) parallel layouts are tested against. Parameter names follow Megatron-Core:

    embedding.word_embeddings.weight        [V, h]
    embedding.position_embeddings.weight    [max_pos, h]   (learned_absolute only)
    decoder.layers.N.…                      (see transformer.py)
    decoder.final_layernorm.weight / .bias
    output_layer.weight                     [V, h]         (only with --untie-embeddings-and-output-weights)

The transformer layers come in two implementations with the same parameter names (`--transformer-impl`): `local`
(transformer.py, pure PyTorch) and `transformer_engine` (te_layers.py, imported only on that path). A checkpoint of
one loads into the other: TE's `_extra_state` entries (its FP8 scaling state) are dropped when a local model loads
them and left empty when a TE model loads a local checkpoint.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig, PrecisionConfig

from .layers import Norm, RotaryEmbedding
from .transformer import TransformerLayer


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int, dtype: torch.dtype | None):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, cfg.hidden_size, dtype=dtype)
        nn.init.normal_(self.word_embeddings.weight, mean=0.0, std=cfg.init_method_std)
        self.position_embeddings = None
        if cfg.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size, dtype=dtype)
            nn.init.normal_(self.position_embeddings.weight, mean=0.0, std=cfg.init_method_std)
        self.dropout = cfg.hidden_dropout

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(tokens)  # [b, s, h]
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(position_ids)
        x = x.transpose(0, 1).contiguous()  # [s, b, h]
        return F.dropout(x, self.dropout, self.training)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None, te_fp8: Any = None):
        super().__init__()
        if cfg.transformer_impl == "transformer_engine":
            from .te_layers import TETransformerLayer

            layers = [TETransformerLayer(cfg, i + 1, dtype, te_fp8) for i in range(cfg.num_layers)]
        else:
            layers = [TransformerLayer(cfg, i + 1, dtype) for i in range(cfg.num_layers)]
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = Norm(cfg.hidden_size, cfg.normalization, cfg.norm_epsilon, dtype)


class GPTModel(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        vocab_size: int,
        dtype: torch.dtype | None = None,
        *,
        precision: PrecisionConfig | None = None,
        amax_group: dist.ProcessGroup | None = None,
    ):
        """`vocab_size` is the padded vocabulary (see `megatron.data.padded_vocab_size`).

        `precision` and `amax_group` matter only with --transformer-impl transformer_engine, whose FP8 autocast runs
        inside the model: precision gives the TE recipe and the layers kept out of FP8, amax_group the ranks whose
        FP8 amaxes are max-reduced together (tensor x data parallel; None in one process). The TE layers are built
        on the current CUDA device; the rest where the local model is built (the CPU, then moved). The local
        implementation gets its FP8 from `megatron.fp8.attach_fp8` after construction."""
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        self.uses_te = cfg.transformer_impl == "transformer_engine"
        self.te_fp8 = None
        if self.uses_te:
            from .te_layers import build_te_fp8

            self.te_fp8 = build_te_fp8(cfg, precision, amax_group)
        self.embedding = Embedding(cfg, vocab_size, dtype)
        self.rotary = None
        if cfg.position_embedding_type == "rope":
            self.rotary = RotaryEmbedding(int(cfg.kv_channels * cfg.rotary_percent), cfg.rotary_base)
        self.decoder = Decoder(cfg, dtype, self.te_fp8)
        self.output_layer = None
        if cfg.untie_embeddings_and_output_weights:
            self.output_layer = nn.Linear(cfg.hidden_size, vocab_size, bias=False, dtype=dtype)
            nn.init.normal_(self.output_layer.weight, mean=0.0, std=cfg.init_method_std)
        self.register_load_state_dict_pre_hook(_reconcile_extra_state)

    def output_weight(self) -> torch.Tensor:
        return self.embedding.word_embeddings.weight if self.output_layer is None else self.output_layer.weight

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens, position_ids, labels: [b, s]; attention_mask: bool [b, 1, s, s], True where a query may attend
        (None: causal). Returns logits [b, s, V], or the per-token loss [b, s] (fp32) when labels are given."""
        b, s = tokens.shape
        given = position_ids is not None
        if not given:
            position_ids = torch.arange(s, device=tokens.device).expand(b, s)
        x = self.embedding(tokens, position_ids)  # [s, b, h]
        rotary = None
        if self.rotary is not None:
            # Comparing given ids with 0..s-1 reads a device tensor on the host: a synchronization that drains the
            # GPU's queue once per micro-batch. Without position ids there is nothing to compare.
            per_sample = given and not torch.equal(position_ids, position_ids[:1].expand_as(position_ids))
            rotary = self.rotary(s, position_ids if per_sample else None)
        with self.te_fp8.stack() if self.te_fp8 is not None else contextlib.nullcontext():
            for layer in self.decoder.layers:
                x = layer(x, rotary, attention_mask)
        x = self.decoder.final_layernorm(x)
        logits = F.linear(x, self.output_weight())  # [s, b, V]
        if labels is None:
            return logits.transpose(0, 1)
        if self.uses_te:
            from .te_layers import te_cross_entropy

            return te_cross_entropy(logits, labels)
        loss = F.cross_entropy(logits.transpose(0, 1).float().reshape(b * s, -1), labels.reshape(-1), reduction="none")
        return loss.view(b, s)

    def describe(self) -> list[str]:
        """Startup log lines about the layer implementation (none for the local one)."""
        if not self.uses_te:
            return []
        from .te_layers import describe_te

        return describe_te(self)


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


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())
