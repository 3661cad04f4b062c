"""Where each tensor a rank holds lies in the global, layout-independent tensor (for `--ckpt-format torch_dist`).

A checkpoint entry is a global tensor under a global name; each rank contributes (and on load requests) chunks of it:
an offset and a size per dimension. The mapping from a rank's tensors to global chunks:

- Pipeline stages number their layers locally (`decoder.layers.0` is the stage's first); the global name uses the
  layer's global number (`layer_number - 1`), so any pipeline split finds its layers.
- A tensor-parallel parameter (`tensor_model_parallel`, `partition_dim`) is the rank's slice along its partition
  dimension. A parameter of `partition_parts` stacked matrices sliced separately (SwiGLU's [gate; up] fc1) is stored
  with that dimension split in two, [parts, n, ...], so each rank's slice is one rectangular chunk whatever the
  tensor-parallel size (the global tensor then has one dimension more than the parameter).
- The vocabulary dimension (word embeddings, output layer) is padded to a multiple of --make-vocab-size-divisible-by
  x tensor-parallel size: a run whose padding differs loads the rows both have; its extra padding rows keep their
  initial values (they are never a label, and their logits are pushed down by training).
- With the distributed optimizer a rank's optimizer state covers a flat range of a parameter's flattened elements:
  it is cut into the rectangular boxes that tile that range (`flat_range_boxes`).
- Under FSDP a parameter is a DTensor whose rows are sharded over the data-parallel ranks: a flat range of the
  whole tensor, saved and loaded as the distributed optimizer's pieces are, so nothing is gathered.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from megatron.parallel.fsdp.fsdp2 import flat_offset

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
VOCAB_SUFFIXES = ("word_embeddings.weight", "output_layer.weight")


def global_name(name: str, layer_numbers: list[int]) -> str:
    """A stage-local parameter or module name with its layer index replaced by the global layer index."""
    match = _LAYER.match(name)
    if match is None:
        return name
    return f"decoder.layers.{layer_numbers[int(match.group(1))] - 1}." + name[match.end() :]


@dataclass(frozen=True)
class Placement:
    """A rank's tensor as a chunk of a global tensor, in the checkpoint's form (parts split out)."""

    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    vocab: bool = False
    """Dimension 0 is the padded vocabulary."""

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(self.local_shape)


def placement(name: str, tensor: torch.Tensor, param: nn.Parameter | None, tp_size: int, tp_rank: int) -> Placement:
    """Where `tensor` (the state of parameter `param`, or a buffer when None) lies in its global tensor."""
    shape = tuple(tensor.shape)
    vocab = name.endswith(VOCAB_SUFFIXES)
    if param is None or not getattr(param, "tensor_model_parallel", False):
        return Placement(shape, shape, (0,) * len(shape), vocab)
    dim, parts = param.partition_dim, getattr(param, "partition_parts", 1)
    local = list(shape)
    offsets = [0] * len(shape)
    glob = list(shape)
    glob[dim] *= tp_size
    offsets[dim] = tp_rank * shape[dim]
    if parts > 1:  # [.., parts * n_local, ..] -> [.., parts, n_local, ..]
        local[dim : dim + 1] = [parts, shape[dim] // parts]
        glob[dim : dim + 1] = [parts, shape[dim] * tp_size // parts]
        offsets[dim : dim + 1] = [0, tp_rank * shape[dim] // parts]
    return Placement(tuple(local), tuple(glob), tuple(offsets), vocab)


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The rectangular boxes (offsets, sizes) that tile the flattened elements [start, stop) of a row-major tensor
    of `shape`, in order (so each box is a contiguous run of the flat range)."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner

    def row(r: int, a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [((r, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], a, b)]

    if first == last:
        return row(first, start - first * inner, stop - first * inner)
    boxes = []
    if start % inner:
        boxes += row(first, start % inner, inner)
        first += 1
    full_stop = stop // inner
    if full_stop > first:
        boxes.append(((first, *([0] * (len(shape) - 1))), (full_stop - first, *shape[1:])))
    if stop % inner:
        boxes += row(full_stop, 0, stop % inner)
    return boxes


@dataclass(frozen=True)
class Chunk:
    """One chunk of global tensor `fqn`: `tensor` (this rank's data, or where to load it) at `offsets`."""

    fqn: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    tensor: torch.Tensor


def piece_chunks(fqn: str, where: Placement, flat: torch.Tensor, start: int) -> list[Chunk]:
    """Chunks of the flat piece `flat` that starts at element `start` of the rank's tensor placed at `where`: views
    into `flat`, so that loading into them fills it."""
    chunks = []
    position = 0
    for offsets, sizes in flat_range_boxes(where.local_shape, start, start + flat.numel()):
        n = math.prod(sizes)
        glob = tuple(o + g for o, g in zip(offsets, where.offsets))
        chunks.append(Chunk(fqn, where.global_shape, glob, flat[position : position + n].view(sizes)))
        position += n
    return chunks


def clip_vocab(chunk: Chunk, saved_rows: int) -> Chunk | None:
    """The part of a vocabulary-sharded chunk that lies in a checkpoint of `saved_rows` padded rows (None: none)."""
    rows = min(chunk.tensor.shape[0], saved_rows - chunk.offsets[0])
    if rows <= 0:
        return None
    shape = (saved_rows, *chunk.global_shape[1:])
    return Chunk(chunk.fqn, shape, chunk.offsets, chunk.tensor[:rows])


def tensor_chunks(fqn: str, where: Placement, tensor: torch.Tensor) -> list[Chunk]:
    """`tensor` placed at `where` as chunks of global tensor `fqn`: one, or an FSDP shard's boxes (views into its
    local tensor, so that loading into them fills it)."""
    if isinstance(tensor, DTensor):
        return piece_chunks(fqn, where, tensor.to_local().view(-1), flat_offset(tensor))
    return [Chunk(fqn, where.global_shape, where.offsets, where.view(tensor))]
