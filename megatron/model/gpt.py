"""The GPT model: embeddings, a stack of transformer layers, a final norm and the output layer.

Read top to bottom, this is an ordinary single-device GPT; it is also the numerical oracle that the other layer
implementations and (later) parallel layouts are tested against. Parameter names follow Megatron-Core:

    embedding.word_embeddings.weight        [V, h]
    embedding.position_embeddings.weight    [max_pos, h]   (learned_absolute only)
    decoder.layers.N.…                      (see transformer.py)
    decoder.final_layernorm.weight / .bias
    output_layer.weight                     [V, h]         (only with --untie-embeddings-and-output-weights)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig

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
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(cfg, i + 1, dtype) for i in range(cfg.num_layers))
        self.final_layernorm = Norm(cfg.hidden_size, cfg.normalization, cfg.norm_epsilon, dtype)


class GPTModel(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int, dtype: torch.dtype | None = None):
        """`vocab_size` is the padded vocabulary (see `megatron.data.padded_vocab_size`)."""
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        self.embedding = Embedding(cfg, vocab_size, dtype)
        self.rotary = None
        if cfg.position_embedding_type == "rope":
            self.rotary = RotaryEmbedding(int(cfg.kv_channels * cfg.rotary_percent), cfg.rotary_base)
        self.decoder = Decoder(cfg, dtype)
        self.output_layer = None
        if cfg.untie_embeddings_and_output_weights:
            self.output_layer = nn.Linear(cfg.hidden_size, vocab_size, bias=False, dtype=dtype)
            nn.init.normal_(self.output_layer.weight, mean=0.0, std=cfg.init_method_std)

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
        if position_ids is None:
            position_ids = torch.arange(s, device=tokens.device).expand(b, s)
        x = self.embedding(tokens, position_ids)  # [s, b, h]
        rotary = None
        if self.rotary is not None:
            per_sample = not torch.equal(position_ids, position_ids[:1].expand_as(position_ids))
            rotary = self.rotary(s, position_ids if per_sample else None)
        for layer in self.decoder.layers:
            x = layer(x, rotary, attention_mask)
        x = self.decoder.final_layernorm(x)
        logits = F.linear(x, self.output_weight()).transpose(0, 1)  # [b, s, V]
        if labels is None:
            return logits
        loss = F.cross_entropy(logits.float().reshape(b * s, -1), labels.reshape(-1), reduction="none")
        return loss.view(b, s)


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())
