"""The optimizer's entries of a torch_dist checkpoint (the checkpoint as a whole: megatron/checkpoint/dist.py).

torch's AdamW: fp32 values per parameter, in global form like the weights (layout-independent):

    optimizer.main.<name>         fp32 main params (absent with fp32 weights, which are their own main params)
    optimizer.exp_avg.<name>      optimizer.exp_avg_sq.<name>      optimizer.step

The precision-aware optimizer (--use-precision-aware-optimizer, --fp8-optimizer-level): the states as it holds them,
so that a resume continues bit for bit, as with --ckpt-format torch (<kind>: main, exp_avg, exp_avg_sq):

    optimizer.encoded.<kind>.<name>     the data in its storage dtype (fp32, bf16, fp16, fp8), global form
    optimizer.remainder.main.<name>     the fp16 main params' int8 remainders, global form
    optimizer.scales.<kind>.<name>      fp32 block scales (fp16, fp8), 1-D: the blocks of each saved piece in turn,
                                        pieces ordered by (tensor-parallel rank, start)
    optimizer.encoding                  block size, tensor-parallel size, each kind's format, and per parameter its
                                        global shape, split dimension and saved pieces (tp rank, start, stop, block)
    optimizer.rounding.<rank>           rank <rank>'s stochastic rounding: seed and generator state

A piece is the range of a tensor-parallel shard's flattened elements that one rank's states cover (the whole shard
unless --use-distributed-optimizer cuts it); its scale blocks start at its start. Data and remainders are elementwise,
so they reshard like the weights; scales belong to the saved pieces. Pipeline stages other than the first save
their copy of tied word embeddings' states too (`tied.` before the name): its blocks differ from the first stage's.

Loading: a piece this run holds that was saved as such (same tensor-parallel size and rank, same range, same
format) takes its encodings bit for bit. Any other (another layout or state dtype, or torch's AdamW) is decoded
element by element with the scale of the saved block each element lay in, then encoded in this run's blocks, and the
log says how many pieces were. Stochastic rounding continues each rank's stream under the layout that saved it;
under another the generators are seeded afresh from the optimizer's seed + the iteration (the same on every rank,
so data-parallel replicas stay equal) and the log says so. Checkpoints of either optimizer load into the other.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron.fp8.params import is_fp8_param
from megatron.optim.states import ScaledState, decode_elements, storage_dtype

from .sharding import Chunk, Placement, global_name, piece_chunks, placement

KINDS = ("main", "exp_avg", "exp_avg_sq")
ENCODING = "optimizer.encoding"
# Elements decoded at a time when a piece is converted (bounds the index temporaries of a large embedding)
SLICE = 1 << 22


@dataclass(frozen=True)
class Slot:
    """One main index of the optimizer: the parameter, its placement and the range of it the states cover."""

    name: str
    """Global name (layer renumbered) under which its entries are saved."""
    param: nn.Parameter
    where: Placement
    start: int
    stop: int
    tied_copy: bool
    """The last pipeline stage's copy of tied word embeddings."""
    dim: int | None
    """The dimension of the global tensor (checkpoint form) that tensor parallelism splits; None: replicated."""

    @property
    def key(self) -> tuple[int, int, int]:
        """(tensor-parallel rank, start, stop): which saved piece this is (replicated parameters: rank 0)."""
        rank = 0 if self.dim is None else self.where.offsets[self.dim] // self.where.local_shape[self.dim]
        return rank, self.start, self.stop

    @property
    def whole(self) -> bool:
        return (self.start, self.stop) == (0, math.prod(self.where.local_shape))

    def chunks(self, fqn: str, tensor: torch.Tensor) -> list[Chunk]:
        """`tensor` (this slot's states: its shape, or flat) as chunks of global tensor `fqn`."""
        if self.whole:
            return [Chunk(fqn, self.where.global_shape, self.where.offsets, self.where.view(tensor))]
        return piece_chunks(fqn, self.where, tensor.view(-1), self.start)


def _format(kind: str, dtype: str) -> dict[str, Any]:
    """How PrecisionAwareAdamW holds a kind of state: fp16 main params keep a remainder, an fp8 second moment is
    stored as its square root."""
    root, remainder = kind == "exp_avg_sq" and dtype == "fp8", kind == "main" and dtype == "fp16"
    return {"dtype": dtype, "root": root, "remainder": remainder}


def _split_dim(param: nn.Parameter) -> int | None:
    if not getattr(param, "tensor_model_parallel", False):
        return None
    return param.partition_dim + (1 if getattr(param, "partition_parts", 1) > 1 else 0)


class OptimizerEntries:
    """Saves and loads one rank's optimizer state in the torch_dist format (every rank calls every method)."""

    def __init__(self, optimizer: Any, model: nn.Module, layers: list[int], dims: Any, group: Any):
        self.optimizer, self.dims, self.group = optimizer, dims, group
        names = {id(p): n for n, p in model.named_parameters()}
        last_stage = not model.stage.pre_process
        self.slots = []
        for param, start, stop in optimizer.owned():
            name = names[id(param)]
            self.slots.append(
                Slot(
                    name=global_name(name, layers),
                    param=param,
                    where=placement(name, param, param, dims.tp, dims.tp_rank),
                    start=start,
                    stop=stop,
                    tied_copy=getattr(param, "shared_embedding", False) and last_stage,
                    dim=_split_dim(param),
                )
            )
        self._encoding: dict[str, Any] | None = None

    # ------------------------------------------------------------------ save

    def save(self) -> tuple[list[Chunk], dict[str, Any]]:
        """This rank's chunks and objects."""
        states = self.optimizer.encoded_states()
        if states is not None:
            return self._save_encoded(states)
        fp32 = self.optimizer.fp32_state()
        chunks = []
        for i, slot in enumerate(self.slots):
            if slot.tied_copy:  # fp32 states: equal to the first stage's copy, which is saved
                continue
            for kind in KINDS:
                tensor = fp32["masters" if kind == "main" else kind][i]
                if kind == "main" and not self.optimizer.mixed:
                    continue  # fp32 weights are their own main params: saved as the model's
                chunks += slot.chunks(f"optimizer.{kind}.{slot.name}", tensor)
        return chunks, {"optimizer.step": fp32["step"]}

    def _entry(self, slot: Slot) -> str:
        return ("tied." if slot.tied_copy else "") + slot.name

    def _save_encoded(self, states: dict[str, list[ScaledState]]) -> tuple[list[Chunk], dict[str, Any]]:
        encoding = self._gather_encoding(states)
        chunks = []
        for i, slot in enumerate(self.slots):
            entry = self._entry(slot)
            pieces = {tuple(p[:3]): p[3] for p in encoding["params"][entry]["pieces"]}
            for kind in KINDS:
                state = states[kind][i]
                chunks += slot.chunks(f"optimizer.encoded.{kind}.{entry}", state.data)
                if state.remainder is not None:
                    chunks += slot.chunks(f"optimizer.remainder.{kind}.{entry}", state.remainder)
                if state.scales is not None:
                    blocks = encoding["params"][entry]["blocks"]
                    fqn = f"optimizer.scales.{kind}.{entry}"
                    chunks.append(Chunk(fqn, (blocks,), (pieces[slot.key],), state.scales))
        held = self.optimizer.optimizer
        objects = {
            ENCODING: encoding,
            "optimizer.step": held.step_count,
            f"optimizer.rounding.{self.dims.rank}": held.rounding_state(),
        }
        return chunks, objects

    def _gather_encoding(self, states: dict[str, list[ScaledState]]) -> dict[str, Any]:
        """Every rank's pieces (one all-gather at the first save: the layout does not change during a run)."""
        if self._encoding is not None:
            return self._encoding
        held = self.optimizer.optimizer
        mine = [(self._entry(s), list(s.where.global_shape), s.dim, s.key) for s in self.slots]
        everyone = [mine]
        if self.group is not None:
            everyone = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(everyone, mine, group=self.group)
        params: dict[str, Any] = {}
        for entry, shape, dim, key in (item for rank in everyone for item in rank):
            info = params.setdefault(entry, {"shape": shape, "dim": dim, "keys": set()})
            info["keys"].add(tuple(key))
        for info in params.values():
            first = 0
            info["pieces"] = []
            for rank, start, stop in sorted(info.pop("keys")):
                info["pieces"].append([rank, start, stop, first])
                first += -(-(stop - start) // held.block_size)
            info["blocks"] = first
        dtypes = {kind: held.dtypes["main_params" if kind == "main" else kind] for kind in KINDS}
        formats = {kind: _format(kind, dtype) for kind, dtype in dtypes.items()}
        self._encoding = {"block": held.block_size, "tp": self.dims.tp, "formats": formats, "params": params}
        return self._encoding

    # ------------------------------------------------------------------ load

    def plan(self, saved: dict[str, Any], objects: dict[str, Any]) -> list[Chunk]:
        """The chunks to load (the caller checks them against the checkpoint's entries, as the weights'). `saved`:
        the checkpoint's index; `objects`: its objects, loaded before (the encoding among them)."""
        self.saved, self.encoding = saved, objects.get(ENCODING)
        self.rounding = objects.get(self.rounding_key)
        self.fp32: dict[str, Any] | None = None
        self.convert: list[tuple[int, str, Slot, dict[str, Any]]] = []
        self.after_load: list[tuple[ScaledState, torch.Tensor]] = []
        states = self.optimizer.encoded_states()
        if self.encoding is None or states is None:
            # fp32 form on either side: load into fp32 tensors (decoded from the saved encodings where saved so)
            self.fp32 = self.optimizer.fp32_state()
            masters = self.fp32["masters"]
            if self.optimizer.precision_aware or self.optimizer.mixed:
                self.fp32["masters"] = [m.detach().clone() for m in masters]
            else:  # the weights themselves, loaded as the model's
                self.fp32["masters"] = [None] * len(masters)
            if self.encoding is None:
                return self._plan_fp32()
        chunks = []
        for i, slot in enumerate(self.slots):
            for kind in KINDS:
                if self.fp32 is not None:  # an encoded checkpoint into torch's AdamW
                    if self.fp32["masters" if kind == "main" else kind][i] is not None:
                        chunks += self._plan_convert(i, kind, slot)
                elif self._exact(kind, slot, states[kind][i]):
                    chunks += self._plan_exact(kind, slot, states[kind][i])
                else:
                    chunks += self._plan_convert(i, kind, slot)
        return chunks

    def _plan_fp32(self) -> list[Chunk]:
        chunks = []
        for i, slot in enumerate(self.slots):
            for kind in KINDS:
                tensor = self.fp32["masters" if kind == "main" else kind][i]
                if tensor is None or (kind == "main" and self._absent(f"optimizer.main.{slot.name}")):
                    continue  # saved from fp32 weights: rebuilt from the loaded weights in `apply`
                chunks += slot.chunks(f"optimizer.{kind}.{slot.name}", tensor)
        return chunks

    def _absent(self, fqn: str) -> bool:
        return not isinstance(self.saved.get(fqn), TensorStorageMetadata)

    def _saved_entry(self, slot: Slot) -> str:
        """The entry to load a slot from: the tied copy's own when saved (by a later pipeline stage)."""
        entry = self._entry(slot)
        return entry if entry in self.encoding["params"] else slot.name

    def _exact(self, kind: str, slot: Slot, state: ScaledState) -> bool:
        entry = self._saved_entry(slot)
        info = self.encoding["params"].get(entry)
        saved = self.encoding["formats"][kind]
        mine = {"dtype": state.dtype_name, "root": state.root, "remainder": state.remainder is not None}
        return (
            info is not None
            and saved == mine
            and self.encoding["block"] == state.block
            and (slot.dim is None or self.encoding["tp"] == self.dims.tp)
            and tuple(info["shape"]) == tuple(slot.where.global_shape)
            and any(tuple(p[:3]) == slot.key for p in info["pieces"])
        )

    def _plan_exact(self, kind: str, slot: Slot, state: ScaledState) -> list[Chunk]:
        entry = self._saved_entry(slot)
        info = self.encoding["params"][entry]
        data = state.data
        if kind == "main" and not self.optimizer.mixed:
            # fp32 main params are the weights themselves, which the model's entries load too: read into a copy,
            # written over the weights after them (a later stage's tied copy may differ from the saved weights)
            data = torch.empty_like(state.data)
            self.after_load.append((state, data))
        chunks = slot.chunks(f"optimizer.encoded.{kind}.{entry}", data)
        if state.remainder is not None:
            chunks += slot.chunks(f"optimizer.remainder.{kind}.{entry}", state.remainder)
        if state.scales is not None:
            first = next(p[3] for p in info["pieces"] if tuple(p[:3]) == slot.key)
            chunks.append(Chunk(f"optimizer.scales.{kind}.{entry}", (info["blocks"],), (first,), state.scales))
        return chunks

    def _plan_convert(self, index: int, kind: str, slot: Slot) -> list[Chunk]:
        """Read the saved encodings of this slot's elements (and the saved scales of the whole parameter) into
        temporaries, decoded in `apply`."""
        entry = self._saved_entry(slot)
        info = self.encoding["params"].get(entry)
        fqn = f"optimizer.encoded.{kind}.{entry}"
        fmt = self.encoding["formats"][kind]
        n = slot.stop - slot.start
        data = torch.zeros(n, dtype=storage_dtype(fmt["dtype"]), device=slot.param.device)
        chunks = slot.chunks(fqn, data)
        if info is None or self._absent(fqn):
            return chunks  # missing: the caller reports it as --dist-ckpt-strictness says; the state stays
        temps: dict[str, Any] = {"data": data, "info": info, "fmt": fmt}
        if fmt["remainder"]:
            temps["remainder"] = torch.zeros(n, dtype=torch.int8, device=data.device)
            chunks += slot.chunks(f"optimizer.remainder.{kind}.{entry}", temps["remainder"])
        if fmt["dtype"] in ("fp16", "fp8"):
            temps["scales"] = torch.zeros(info["blocks"], dtype=torch.float32, device=data.device)
            chunks.append(Chunk(f"optimizer.scales.{kind}.{entry}", (info["blocks"],), (0,), temps["scales"]))
        self.convert.append((index, kind, slot, temps))
        return chunks

    def apply(self, step: int, layout: dict[str, int], iteration: int, log: Callable[[str], None]) -> str | None:
        """After the chunks are loaded: finish the optimizer's state; returns a note naming conversions."""
        states = self.optimizer.encoded_states()
        converted = set()
        for index, kind, slot, temps in self.convert:
            decoded, valid = self._decode(slot, temps)
            if self.fp32 is not None:
                target = self.fp32["masters" if kind == "main" else kind][index].view(-1)
                target[valid] = decoded[valid]
            else:
                state = states[kind][index]
                values = state.decode().view(-1)
                values[valid] = decoded[valid]
                state.encode_(values)
            converted.add((kind, temps["fmt"]["dtype"]))
        for state, data in self.after_load:
            state.data.copy_(data)
        if self.fp32 is not None:
            self._rebuild_masters()
            self.fp32["step"] = step
            note = self.optimizer.load_fp32_state(self.fp32)
            if self.encoding is not None:
                note = note or "optimizer states converted: the precision-aware optimizer's -> fp32 (torch AdamW)"
            return note
        self.optimizer.encoded_states_loaded(step)
        self._load_rounding(layout, iteration, log)
        if not self.convert:
            return None
        mine = {kind: states[kind][0].dtype_name for kind in KINDS if states[kind]}
        changes = sorted(f"{kind} {saved} -> {mine[kind]}" for kind, saved in converted if saved != mine[kind])
        pieces = len({(i, s.key) for i, _, s, _ in self.convert})
        note = f"{pieces} of {len(self.slots)} optimizer state pieces re-encoded in this layout's blocks"
        return f"optimizer states converted: {', '.join(changes)}; {note}" if changes else note

    def _rebuild_masters(self) -> None:
        """Main params a checkpoint of fp32 weights did not save: the loaded weights are the main params."""
        for i, slot in enumerate(self.slots):
            master = self.fp32["masters"][i]
            if master is None or not (self.encoding is None and self._absent(f"optimizer.main.{slot.name}")):
                continue
            value = slot.param.dequantize() if is_fp8_param(slot.param) else slot.param.detach()
            self.fp32["masters"][i] = value.float().reshape(-1)[slot.start : slot.stop].reshape(master.shape).clone()

    def _decode(self, slot: Slot, temps: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 values of the slot's elements from the saved encodings, and which of them the checkpoint holds
        (not: vocabulary rows beyond its padding)."""
        fmt, info = temps["fmt"], temps["info"]
        data, remainder, scales = temps["data"], temps.get("remainder"), temps.get("scales")
        out = torch.empty(data.numel(), dtype=torch.float32, device=data.device)
        valid = torch.empty(data.numel(), dtype=torch.bool, device=data.device)
        for a in range(0, data.numel(), SLICE):
            b = min(a + SLICE, data.numel())
            blocks, ok = self._saved_blocks(slot, info, slot.start + a, slot.start + b)
            per_element = None if scales is None else scales[blocks.clamp(min=0)]
            rem = None if remainder is None else remainder[a:b]
            out[a:b] = decode_elements(data[a:b], per_element, rem, fmt["root"])
            valid[a:b] = ok
        return out, valid

    def _saved_blocks(self, slot: Slot, info: dict[str, Any], start: int, stop: int) -> tuple[torch.Tensor, ...]:
        """For the elements [start, stop) of this rank's shard: the index of the saved scale block each lay in, and
        whether the checkpoint holds it."""
        device = slot.param.device
        local = torch.tensor(slot.where.local_shape, device=device)
        coords = torch.arange(start, stop, device=device)[:, None] // _strides(local) % local
        coords += torch.tensor(slot.where.offsets, device=device)
        shape = torch.tensor(info["shape"], device=device)
        valid = (coords < shape).all(1)
        rank = torch.zeros(stop - start, dtype=torch.long, device=device)
        saved_local = shape.clone()
        dim, tp = info["dim"], self.encoding["tp"]
        if dim is not None:
            saved_local[dim] = shape[dim] // tp
            rank = coords[:, dim] // saved_local[dim]
            coords[:, dim] -= rank * saved_local[dim]
        flat = (coords * _strides(saved_local)).sum(1)
        pieces = torch.tensor(info["pieces"], dtype=torch.long, device=device)  # [rank, start, stop, first block]
        span = int(saved_local.prod()) + 1
        keys = pieces[:, 0] * span + pieces[:, 1]
        where = torch.searchsorted(keys, rank * span + flat, right=True).sub_(1).clamp_(min=0)
        piece = pieces[where]
        valid &= (piece[:, 0] == rank) & (piece[:, 1] <= flat) & (flat < piece[:, 2])
        blocks = piece[:, 3] + (flat - piece[:, 1]) // self.encoding["block"]
        return torch.where(valid, blocks, -1), valid

    def _load_rounding(self, layout: dict[str, int], iteration: int, log: Callable[[str], None]) -> None:
        held = self.optimizer.optimizer
        saved = (layout["tp"], layout["pp"], layout["dp"], layout.get("cp", 1))
        state = self.rounding
        if saved == (self.dims.tp, self.dims.pp, self.dims.dp, self.dims.cp) and state is not None:
            held.load_rounding_state(state)
            return
        held.reseed_rounding(held.seed + iteration)
        if held.generator is not None:
            log(
                f"> stochastic rounding of the optimizer states seeded afresh (seed {held.seed} + iteration"
                f" {iteration}): the checkpoint's per-rank streams belong to layout {layout}, not this one"
            )

    @property
    def rounding_key(self) -> str:
        return f"optimizer.rounding.{self.dims.rank}"


def _strides(shape: torch.Tensor) -> torch.Tensor:
    """Row-major strides of a shape given as a tensor."""
    ones = torch.ones(1, dtype=shape.dtype, device=shape.device)
    return torch.cat([shape.flip(0).cumprod(0).flip(0)[1:], ones])
