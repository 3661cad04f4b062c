"""Context parallelism: each sequence split over the ranks of the context-parallel (cp) group.

Causal attention makes late tokens expensive (they attend to everything before them), so an even split into cp
contiguous pieces would leave the last rank with most of the work. As in Megatron-LM, the sequence is cut into
2 x cp chunks and cp rank r keeps chunks r and 2cp-1-r: every rank gets one early and one late chunk, the same
amount of attention work.

What follows the chunks:
    data         `split_batch`: tokens, labels, loss mask, position ids [b, s] and the attention mask's query rows,
                 where the batch reaches the device (the data loader is unchanged)
    positions    `local_positions`: the model's default position ids (RoPE, learned position embeddings) are the
                 chunks' positions, not 0..s/cp-1
    attention    local engine: keys and values are all-gathered over the group (backward: their gradients are
                 reduce-scattered back, `gather_kv`), and each rank's queries attend to the whole sequence under
                 the causal mask of their positions (`causal_mask`); Transformer Engine: its DotProductAttention
                 exchanges keys and values itself (`attach_context_parallel` hands it the group, cp_comm_type)
    loss         megatron/training/loss.py: a micro-batch's mean is over the tokens of all cp ranks
    gradients    replicated weights' gradients are averaged over the dp x cp group (ParallelDims.dp_cp_group)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatron.parallel.tensor_parallel import gather_from_sp

from .dims import ParallelDims


@dataclass(frozen=True)
class ContextParallel:
    """What the model and the trainer need to know about context parallelism."""

    group: object | None = None
    """torch.distributed ProcessGroup of the cp ranks (None: no context parallelism)."""
    size: int = 1
    rank: int = 0
    global_ranks: tuple[int, ...] = (0,)
    comm_types: tuple[str, ...] = ("p2p",)
    """--cp-comm-type: one value for every layer, or one per layer (Transformer Engine's exchange)."""

    @classmethod
    def from_dims(cls, dims: ParallelDims, comm_types: list[str] | tuple[str, ...] = ("p2p",)) -> ContextParallel:
        return cls(dims.cp_group, dims.cp, dims.cp_rank, dims.cp_ranks, tuple(comm_types))

    def comm_type(self, layer_number: int) -> str:
        """The exchange of layer `layer_number` (1-based, global)."""
        return self.comm_types[0] if len(self.comm_types) == 1 else self.comm_types[layer_number - 1]


NO_CP = ContextParallel()


def chunk_indices(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two of the 2 x cp sequence chunks that cp rank `cp_rank` holds (load-balanced for causal attention)."""
    return cp_rank, 2 * cp - 1 - cp_rank


def local_positions(seq_len: int, cp: ContextParallel, device: torch.device | None = None) -> torch.Tensor:
    """Positions in the whole sequence of rank `cp.rank`'s seq_len / cp tokens, in its order (int64 [seq_len/cp]).
    `seq_len` is the whole sequence's length."""
    positions = torch.arange(seq_len, device=device)
    if cp.size == 1:
        return positions
    chunks = positions.chunk(2 * cp.size)
    return torch.cat([chunks[i] for i in chunk_indices(cp.size, cp.rank)])


def _take_chunks(x: torch.Tensor, dim: int, cp: ContextParallel) -> torch.Tensor:
    if x.shape[dim] % (2 * cp.size):
        raise ValueError(f"sequence length {x.shape[dim]} does not split into 2 x {cp.size} context-parallel chunks")
    chunks = x.chunk(2 * cp.size, dim=dim)
    return torch.cat([chunks[i] for i in chunk_indices(cp.size, cp.rank)], dim=dim)


def split_batch(batch: dict[str, torch.Tensor], cp: ContextParallel) -> dict[str, torch.Tensor]:
    """This cp rank's part of a micro-batch: its two chunks of every [b, s] tensor (tokens, labels, loss mask,
    position ids) and of the attention mask's query rows ([b, 1, s, s] -> [b, 1, s/cp, s]: each query still sees
    every key)."""
    if cp.size == 1:
        return batch
    return {key: _take_chunks(value, 2 if key == "attention_mask" else 1, cp) for key, value in batch.items()}


def gather_kv(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """[b, heads, s/cp, hn] -> [b, heads, s, hn]: every cp rank's keys (or values), in cp-rank order (rank r's
    chunks r and 2cp-1-r, then rank r+1's, ...). Backward: the gradients of the gathered tensor are summed over the
    ranks (every rank's queries read every key) and each rank keeps its own part (a reduce-scatter)."""
    if cp.size == 1:
        return x
    gathered = gather_from_sp(x.permute(2, 0, 1, 3), cp.group)  # the sequence first: the collectives split dim 0
    return gathered.permute(1, 2, 0, 3)


def gathered_positions(seq_len: int, cp: ContextParallel, device: torch.device | None = None) -> torch.Tensor:
    """Positions of the keys `gather_kv` returns (int64 [seq_len])."""
    ranks = [ContextParallel(size=cp.size, rank=r) for r in range(cp.size)]
    return torch.cat([local_positions(seq_len, r, device) for r in ranks])


def causal_mask(seq_len: int, cp: ContextParallel, device: torch.device | None = None) -> torch.Tensor:
    """bool [s/cp, s]: True where this rank's query (row) may attend to a gathered key (column): the key's position
    is not after the query's."""
    queries = local_positions(seq_len, cp, device)
    keys = gathered_positions(seq_len, cp, device)
    return keys[None, :] <= queries[:, None]


def attention_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None, cp: ContextParallel
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The local engine's context-parallel attention inputs: q [b, np, s/cp, hn] as it is, k and v gathered to the
    whole sequence, and the mask of this rank's queries against the gathered keys (bool [b|1, 1, s/cp, s]):
    causal by position, or the given mask ([b, 1, s/cp, s] over the keys in sequence order) with its columns put
    in the gathered order."""
    seq_len = q.shape[2] * cp.size
    k, v = gather_kv(k, cp), gather_kv(v, cp)
    if attention_mask is None:
        mask = causal_mask(seq_len, cp, q.device)[None, None]
    else:
        mask = attention_mask.index_select(-1, gathered_positions(seq_len, cp, q.device))
    return k, v, mask


def attach_context_parallel(model: nn.Module, cp: ContextParallel) -> None:
    """Give the model its context-parallel group (after construction, like the FP8 engine): the model's default
    positions and the local attention (`cp` attributes), and Transformer Engine's DotProductAttention modules
    (TE exchanges keys and values itself, by --cp-comm-type; one CUDA stream for all layers, as Megatron-LM)."""
    if cp.size == 1:
        return
    stream = None
    for module in model.modules():
        if hasattr(module, "context_parallel"):
            module.context_parallel = cp
    for layer in getattr(getattr(model, "decoder", None), "layers", []):
        for module in layer.modules():
            if hasattr(module, "set_context_parallel_group"):  # TE's DotProductAttention
                if stream is None:
                    stream = torch.cuda.Stream()
                module.set_context_parallel_group(
                    cp.group, list(cp.global_ranks), stream, cp.comm_type(layer.layer_number)
                )
