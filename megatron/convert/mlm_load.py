"""Resume a Megatron-LM run here: `pretrain_gpt.py --load MLM_DIR` (megatron/training/train_state.py routes a
Megatron-LM checkpoint here).

The checkpoint is read whole (mlm_resume.py) and handed to this project's torch_dist loader as if it were one of its
own checkpoints in memory: the same entries (`model.<name>`, `optimizer.{main,exp_avg,exp_avg_sq}.<name>`,
`optimizer.step`, `train_state`, `loss_scaler`), the same resharding to this run's tensor x pipeline x data layout,
the same vocabulary-padding rule, the same --finetune / --no-load-optim / --no-load-rng / --dist-ckpt-strictness.
Each rank reads the whole checkpoint (host memory: the model and its optimizer state once per rank).

Random-number generators: under Megatron-LM's tensor x pipeline layout each rank takes its (pipeline, tensor)
rank's Python, NumPy, torch and CUDA states (Megatron-LM restores the same on every data-parallel replica);
Megatron-Core's model-parallel CUDA RNG tracker has no counterpart here. Under another layout they are seeded
afresh from --seed + the iteration, as for this project's checkpoints.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from megatron.checkpoint import Checkpointer, DistCheckpointer
from megatron.checkpoint.checkpointing import CheckpointError, _log, check_train_state, set_rng_state
from megatron.checkpoint.safe_load import malformed
from megatron.checkpoint.sharding import Chunk

from .mlm_resume import Resume, read_resume

_FC1 = (".mlp.linear_fc1.weight", ".mlp.linear_fc1.bias")


def _ours(name: str, tensor: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """A whole tensor in this project's torch_dist form: SwiGLU's fc1 [gate; up] as [2, ffn, ...]."""
    if swiglu and name.endswith(_FC1):
        return tensor.reshape(2, tensor.shape[0] // 2, *tensor.shape[1:])
    return tensor


def _entry(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return BytesStorageMetadata()
    chunk = ChunkStorageMetadata(offsets=torch.Size([0] * value.dim()), sizes=value.shape)
    return TensorStorageMetadata(TensorProperties(dtype=value.dtype), value.shape, [chunk])


class MegatronLMLoader(DistCheckpointer):
    """DistCheckpointer's load, reading from a Megatron-LM checkpoint held in memory instead of DCP files."""

    KIND = "Megatron-LM checkpoint"

    def load(self, root: str, iteration: int | None = None) -> dict[str, Any] | None:
        ckpt = self.cfg.checkpoint
        with malformed(f"Megatron-LM checkpoint {root}", CheckpointError):
            res = read_resume(root, load_optim=not (ckpt.finetune or ckpt.no_load_optim))
            self.tensors, self.objects = self._entries(res)
        if res.optimizer is None and not (ckpt.finetune or ckpt.no_load_optim):
            res.notes.append(
                "the Megatron-LM checkpoint holds no optimizer state (saved with --no-save-optim): the optimizer"
                " starts afresh from its weights, as Megatron-LM's would"
            )
            self.cfg = dataclasses.replace(self.cfg, checkpoint=dataclasses.replace(ckpt, no_load_optim=True))
        for note in res.notes:
            _log(f"> {note}")
        if res.optimizer is not None:
            _log(f"> Megatron-LM optimizer state: {res.optimizer_format}, Adam step {self.objects['optimizer.step']}")
        metadata = Metadata({k: _entry(v) for k, v in {**self.tensors, **self.objects}.items()})
        with malformed(f"Megatron-LM checkpoint {root}", CheckpointError):
            return self._load(root, res.folder, res.iteration, metadata)

    def _entries(self, res: Resume) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        swiglu = res.model.swiglu
        tensors = {f"model.{k}": _ours(k, v, swiglu) for k, v in res.weights.items()}
        for kind, states in (res.optimizer or {}).items():
            tensors.update({f"optimizer.{kind}.{k}": _ours(k, v, swiglu) for k, v in states.items()})
        tp, pp = res.layout
        args = res.args
        cp = getattr(args, "context_parallel_size", 1) or 1
        dp = getattr(args, "data_parallel_size", None) or 1
        train = {"iteration": res.iteration, "consumed_samples": res.consumed_samples, "skipped_iters": 0}
        train["consumed_valid_samples"] = res.consumed_valid_samples
        config: dict[str, Any] = {"optimizer": res.schedule}
        divisible = getattr(args, "make_vocab_size_divisible_by", None)  # how far its vocabulary's padding goes
        if divisible is not None:
            config["data"] = {"make_vocab_size_divisible_by": divisible}
        train |= {"nan_iters": 0, "config": config}
        objects: dict[str, Any] = {
            "train_state": train,
            "layout": {"tp": tp, "pp": pp, "dp": dp, "cp": cp},
            "optimizer.step": res.step if res.step is not None else res.iteration,
            "loss_scaler": res.loss_scale,
        }
        same = (tp, pp) == (self.dims.tp, self.dims.pp)
        self.rng = res.rng.get((self.dims.pp_rank, self.dims.tp_rank)) if same else None
        return tensors, objects

    def _read(self, path: Any, chunks: list[Chunk], objects: dict[str, Any]) -> dict[str, Any]:
        for chunk in chunks:
            source = self.tensors[chunk.fqn]
            index = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.tensor.shape))
            chunk.tensor.copy_(source[index])
        return {k: self.objects[k] for k in objects if k in self.objects}

    def _load_rng(self, loaded: dict[str, Any], iteration: int, root: str) -> None:
        if self.rng is None:
            super()._load_rng(loaded, iteration, root)  # another layout: seeded afresh, and logged
            return
        set_rng_state(self.rng, f"Megatron-LM checkpoint {root}")


def load_megatron_lm(checkpointer: Checkpointer, root: str) -> dict[str, Any]:
    """Load the newest Megatron-LM checkpoint under `root` into the checkpointer's model and optimizer (every rank
    calls this); returns its train state."""
    start = time.perf_counter()
    loader = MegatronLMLoader(checkpointer.cfg, checkpointer.dims, *checkpointer.parts)
    state = loader.load(root)
    state = check_train_state(state, f"Megatron-LM checkpoint {root}")
    if checkpointer.device.type == "cuda":
        torch.cuda.synchronize(checkpointer.device)
    seconds = time.perf_counter() - start
    done = f"at iteration {state['iteration']} (Megatron-LM) in {seconds:.2f} s"
    _log(f"  successfully loaded checkpoint from {root} {done}")
    return state
