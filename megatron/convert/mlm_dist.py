"""Megatron-LM's `--ckpt-format torch_dist` checkpoints, read in one process with torch.distributed.checkpoint (DCP).

    iter_XXXXXXX/
      metadata.json      {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
      .metadata          DCP's index
      __R_N.distcp       the data
      common.pt          the state every rank holds (args, iteration, scheduler, ...): older Megatron-Core only

Two generations: older Megatron-Core writes the common state to `common.pt`; Megatron-Core of today (2026) keeps it
inside the DCP as the object `common_state` (entry `common_state/shard_0_1`, a `torch.save` of a one-item list).
Megatron-Core's ShardedObjects (`rng_state`, the distributed optimizer's per-group objects, Transformer Engine's
`_extra_state`) are entries `<key>/shard_<offsets>_<shape>`, each a `torch.save` of a list (one item per shard
the saving rank held). Every pickle is read through megatron/checkpoint/safe_load.py (data only, stand-ins for
Megatron-LM's classes); Transformer Engine's `_extra_state` entries are never read.

Megatron-Core keys each tensor by its module name with its global shape, so no layout needs joining; homogeneous
layers come stacked along a leading axis (`decoder.layers.<name>`, [num_layers, ...]), and SwiGLU's linear_fc1
whole as [gate; up] (or `<name>_w` / `<name>_v` with singleton local shards).
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import torch

from megatron.checkpoint.safe_load import SafeLoadPlanner, SafeReader, first_line, load_foreign
from megatron.errors import UserError
from megatron.untrusted import read_json

from .files import load_torch_file
from .state import ConvertError

COMMON = "common_state/shard_0_1"
_STACKED = re.compile(r"^(.*)decoder\.layers\.(?!\d)(.*)$")
_SHARD = re.compile(r"^(.*)/shard_([\d.]+)_([\d.]+)$")


def is_megatron_dist(folder: Path) -> bool:
    """Whether `folder` (an iter_XXXXXXX) is a Megatron-LM torch_dist checkpoint: its metadata.json names a
    `sharded_backend` (this project's names a `format`), or it holds an older generation's common.pt."""
    if (folder / "common.pt").is_file():
        return True
    try:
        info = read_json(folder / "metadata.json")
    except (OSError, ValueError, UserError):
        return False
    return isinstance(info, dict) and "sharded_backend" in info


class MegatronDist:
    """One Megatron-LM torch_dist checkpoint folder: its index, common state, tensors and objects."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        info_path = self.folder / "metadata.json"
        if info_path.is_file():
            try:
                info = read_json(info_path)
            except ValueError as exc:
                raise ConvertError(f"{info_path} is damaged (not JSON: {first_line(exc)})") from None
            backend = info.get("sharded_backend") if isinstance(info, dict) else None
            if backend not in (None, "torch_dist"):
                raise ConvertError(
                    f"{self.folder} is a Megatron-LM checkpoint of sharded backend {str(backend)[:40]!r}: only"
                    " torch_dist is read here (save it with --ckpt-format torch_dist or torch)"
                )
        try:
            self.index = SafeReader(str(self.folder)).read_metadata().state_dict_metadata
        except Exception as exc:
            raise ConvertError(f"cannot read {self.folder / '.metadata'} (truncated?): {first_line(exc)}") from None
        self._common: dict[str, Any] | None = None

    def tensor_keys(self) -> list[str]:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        return [k for k, v in self.index.items() if isinstance(v, TensorStorageMetadata)]

    def object_keys(self, prefix: str) -> list[str]:
        """The object entries whose ShardedObject key is `prefix` (any shard)."""
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        return [
            k
            for k, v in self.index.items()
            if isinstance(v, BytesStorageMetadata) and (_SHARD.match(k) or [None, k])[1] == prefix
        ]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.index[key].size)

    def common(self) -> dict[str, Any]:
        """The common state: common.pt (older Megatron-Core) or the `common_state` object (today's)."""
        if self._common is None:
            if (self.folder / "common.pt").exists():
                common = load_torch_file(self.folder / "common.pt", foreign=True)
            elif COMMON in self.index:
                common = self.objects([COMMON])[COMMON]
            else:
                raise ConvertError(
                    f"{self.folder} holds neither common.pt nor a common_state entry: the checkpoint is incomplete"
                    " (half-written or copied in part)"
                )
            if not isinstance(common, dict):
                raise ConvertError(f"{self.folder}: its common state is a {type(common).__name__}, not a dict")
            self._common = common
        return self._common

    def tensors(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """Whole tensors by key (CPU, their saved dtype)."""
        state = {k: torch.empty(self.index[k].size, dtype=self.index[k].properties.dtype) for k in keys}
        self._load(state, foreign=False)
        return state

    def objects(self, keys: list[str]) -> dict[str, Any]:
        """ShardedObjects by entry: each the first item of its saved list (one shard per entry)."""
        state: dict[str, Any] = {k: None for k in keys}
        self._load(state, foreign=True)
        out = {}
        for key, value in state.items():
            if isinstance(value, io.BytesIO):  # saved by DCP's default planner: the torch.save bytes wrapped again
                value = load_foreign(value, f"entry {key} of {self.folder}", ConvertError)
            if not isinstance(value, list) or not value:
                raise ConvertError(f"{self.folder}: its entry {key} is a {type(value).__name__}, not a saved object")
            out[key] = value[0]
        return out

    def _load(self, state: dict[str, Any], foreign: bool) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        if not state:
            return
        planner = SafeLoadPlanner(self.folder, foreign=foreign)
        try:
            dcp.load(state, storage_reader=SafeReader(str(self.folder)), planner=planner, no_dist=True)
        except (CheckpointException, Exception) as exc:  # DCP's failure report is a BaseException
            raise ConvertError(
                f"cannot read {self.folder} (missing or truncated *.distcp files?): {first_line(exc)}"
            ) from None
        state.update(planner.state_dict)


def unstack(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Megatron-Core's global tensors by per-layer name: stacked layers (`<prefix>decoder.layers.<name>`) split
    along their leading axis into `<prefix>decoder.layers.<i>.<name>`, `_w` / `_v` halves joined into [gate; up]."""
    state: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        match = _STACKED.match(key)
        if match:
            for i, layer in enumerate(tensor.unbind(0)):
                state[f"{match.group(1)}decoder.layers.{i}.{match.group(2)}"] = layer
        else:
            state[key] = tensor
    for key in [k for k in state if k.endswith(("linear_fc1.weight_w", "linear_fc1.bias_w"))]:
        whole = key[:-2]
        state[whole] = torch.cat([state.pop(key), state.pop(whole + "_v")], 0)
    return state
