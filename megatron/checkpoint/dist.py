"""`--ckpt-format torch_dist`: checkpoints on torch.distributed.checkpoint (DCP) that load under any parallel layout.

    SAVE_DIR/
      latest_checkpointed_iteration.txt     the newest complete checkpoint (moved only once it is complete)
      iter_0000010/
        metadata.json                       {"format": "torch_dist", "layout": the tp/pp/dp it was saved with}
        .metadata                           DCP's index: every entry's global shape and the chunks that hold it
        __R_N.distcp                        the chunks rank R wrote

Every tensor is stored whole in global form (see `megatron.checkpoint.sharding`): each rank writes its chunks at
their global offsets, data-parallel replicas once, and on load each rank reads the chunks its own layout needs.
Entries: `model.<name>` (weights, FP8 ones dequantized; Transformer Engine's `_extra_state` as objects),
`optimizer.{main,exp_avg,exp_avg_sq}.<name>` (fp32, also for the precision-aware optimizer's encoded states, which
are decoded on save and encoded again on load), `optimizer.step`, `fp8.<linear>.{amax_history,scale}` (delayed
scaling of the local FP8 engine: per linear, the same on every rank), `fp8_guard.stage<P>`, `train_state`,
`loss_scaler`, `rng.<rank>`. The per-rank RNG streams load only under the layout that saved them; under another
they are seeded afresh (from --seed and the iteration) and the log says so.

Verification as for the `torch` format: metadata.json records the size and CRC-32 of every file (the .distcp files
and DCP's .metadata), checked at load, with a fall-back to the newest older checkpoint that verifies.

Atomicity as for the `torch` format: the checkpoint is written into `iter_XXXXXXX.tmp`, renamed when complete, and
then the `latest` pointer moves. With --async-save the write runs in a background thread after the state is copied
to host memory (training waits only for that copy); rank 0 then checksums the files, flushes them to disk, renames
the folder and moves the pointer in a thread of its own, as these read the whole checkpoint back (about 15 GB for
llama-1b) and would stall training for seconds. Whether that is done is checked after every step, before the next
save and at the end of training (`finalize`).
"""

from __future__ import annotations

import json
import random
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from megatron.model.smooth_swiglu import SCALES_KEY, STARTED_LINE, mark_tensor_parallel_scales
from megatron.untrusted import LimitExceeded, parse_json

from .checkpointing import (
    CHECKPOINT_VERSION,
    CheckpointError,
    _log,
    checkpoint_dir,
    discard,
    iteration_dir,
    load_model_state,
    publish_checkpoint,
    read_metadata,
    rng_state,
    save_failed,
    select_checkpoint,
    set_rng_state,
    start_folder,
)
from .dist_optimizer import ENCODING, OptimizerEntries
from .dist_planner import ChunkLoadPlanner, ChunkSavePlanner, split_entries
from .dist_stager import PinnedStager
from .integrity import gather_checksums, retention
from .model_shape import differing_flags, mismatch_line, vocab_rows_fit
from .safe_load import SafeReader, first_line, malformed
from .save_folder import TMP
from .sharding import Chunk, Placement, clip_vocab, global_name, placement, tensor_chunks

FORMAT = "torch_dist"


class DistCheckpointer:
    """Saves and loads the training state of one rank in the torch_dist format; every rank calls every method."""

    KIND = "torch_dist checkpoint"
    """What the load log calls the checkpoint."""

    def __init__(self, cfg: Any, dims: Any, model: nn.Module, optimizer: Any, loss_scaler: Any, fp8: Any, monitor: Any):
        self.cfg, self.dims, self.model, self.optimizer = cfg, dims, model, optimizer
        self.loss_scaler, self.fp8, self.monitor = loss_scaler, fp8, monitor
        self.layers = list(model.stage.layer_numbers)
        # DCP coordinates ranks with collectives of its own; a separate gloo group keeps them apart from training's
        # (on GPUs too: an --async-save write runs them from a background thread while training goes on).
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        # a background write: (its future, which on rank 0 completes once published; tmp folder, final folder,
        # iteration, {"queued"/"written"/"published": time})
        self.pending: tuple[Future, Path, Path, int, dict[str, float]] | None = None
        # rank 0's thread that publishes --async-save writes (started on first use)
        self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-publish")
        self.waited_s = 0.0
        """Seconds the last save waited for the previous background write (part of its blocked time)."""
        self.optimizer_entries = OptimizerEntries(optimizer, model, self.layers, dims, self.group)
        self._stager = PinnedStager()  # --async-save's copy to host memory: training blocks while it runs
        if self.group is None:  # one process: DCP warns that it assumes so, which is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)

    # ------------------------------------------------------------------ entries

    def _params(self) -> dict[str, nn.Parameter]:
        # Smooth-SwiGLU's scales are buffers split over the tensor-parallel ranks: placed as a parameter would be
        return {**dict(self.model.named_parameters()), **mark_tensor_parallel_scales(self.model)}  # type: ignore[dict-item]

    def _placement(self, name: str, tensor: torch.Tensor, param: nn.Parameter | None) -> Placement:
        return placement(name, tensor, param, self.dims.tp, self.dims.tp_rank)

    def _skip(self, param: nn.Parameter | None) -> bool:
        """The last stage's copy of tied word embeddings: the first stage's copy (equal, with its optimizer state
        sharded differently over the data-parallel ranks) is the one saved."""
        return param is not None and getattr(param, "shared_embedding", False) and not self.model.stage.pre_process

    def _model_entries(self, state: dict[str, Any], saving: bool) -> tuple[list[Chunk], dict[str, Any]]:
        params = self._params()
        chunks, objects = [], {}
        for name, value in state.items():
            fqn = "model." + global_name(name, self.layers)
            param = params.get(name)
            if saving and self._skip(param):
                continue
            if isinstance(value, torch.Tensor) and not name.endswith("_extra_state"):
                chunks += tensor_chunks(fqn, self._placement(name, value, param), value)
            else:
                objects[fqn] = value
        return chunks, objects

    def _fp8_entries(self, history: torch.Tensor, scale: torch.Tensor) -> list[Chunk]:
        chunks = []
        for name, state in self.fp8.states.items():
            fqn = f"fp8.{global_name(name, self.layers)}"
            h, s = history[:, state.index], scale[state.index]
            chunks += [Chunk(f"{fqn}.amax_history", tuple(h.shape), (0, 0), h), Chunk(f"{fqn}.scale", (3,), (0,), s)]
        return chunks

    # ------------------------------------------------------------------ save

    def save(self, root: str, iteration: int, train_state: dict[str, Any]) -> Path:
        """Write iteration `iteration`; with --async-save return once the state is in host memory."""
        start = time.perf_counter()
        self.finalize()  # a previous background write completes (and becomes visible) first
        self.waited_s = time.perf_counter() - start
        chunks, objects = self._model_entries(self.model.state_dict(), saving=True)
        optimizer_chunks, optimizer_objects = self.optimizer_entries.save()
        chunks += optimizer_chunks
        objects.update(optimizer_objects)
        if self.fp8 is not None:
            amax = self.fp8.amax
            if amax.history is not None:
                chunks += self._fp8_entries(amax.history, amax.scale)
            objects["fp8.recipe"] = self.fp8.recipe.name
        if self.monitor is not None:
            objects[f"fp8_guard.stage{self.dims.pp_rank}"] = self.monitor.state_dict()
        layout = {"tp": self.dims.tp, "pp": self.dims.pp, "dp": self.dims.dp, "cp": self.dims.cp}
        # plain state as JSON text: nothing of it needs pickling (older checkpoints hold the dicts themselves)
        train = dict(train_state, iteration=iteration, checkpoint_version=CHECKPOINT_VERSION)
        objects["train_state"], objects["layout"] = json.dumps(train), json.dumps(layout)
        objects["loss_scaler"] = self.loss_scaler.state_dict()
        objects[f"rng.{self.dims.rank}"] = rng_state()
        state, where = split_entries(chunks, objects)

        final = iteration_dir(root, iteration)
        tmp = final.with_name(final.name + TMP)
        try:
            if self._first():
                start_folder(Path(root), tmp, {"format": FORMAT, "layout": layout, "iteration": iteration})
            self._barrier()
            writer = FileSystemWriter(tmp)
            planner = ChunkSavePlanner(where, self.cfg.checkpoint.ckpt_fully_parallel_save)
            if self.cfg.checkpoint.async_save:
                times = {"queued": time.perf_counter()}
                future = dcp.async_save(
                    state,
                    storage_writer=writer,
                    planner=planner,
                    process_group=self.group,
                    no_dist=self.group is None,
                    async_stager=self._stager,
                )
                if self._first():
                    future = self._publish_when_written(future, tmp, final, iteration, times)
                self.pending = (future, tmp, final, iteration, times)
                return final
            dcp.save(
                state, storage_writer=writer, planner=planner, process_group=self.group, no_dist=self.group is None
            )
            self._barrier()
            checksums = gather_checksums(tmp, self.group)
            if self._first():
                publish_checkpoint(root, tmp, final, iteration, checksums, retention(self.cfg.checkpoint))
        except (CheckpointException, OSError) as exc:  # a full disk: the previous checkpoint stays the latest
            if self._first():
                discard(tmp)
            raise save_failed(root, iteration, _cause(exc)) from exc
        self._barrier()
        return final

    def _publish_when_written(
        self, written: Future, tmp: Path, final: Path, iteration: int, times: dict[str, float]
    ) -> Future:
        """Rank 0: once `written` completes, checksum, flush, rename and point `latest` at the checkpoint in a thread
        of its own (no collective: rank 0's write completes DCP's metadata last, after every rank's data is
        written). The returned future completes when the checkpoint is visible, or raises what failed."""

        def publish() -> None:
            written.result()  # a failed write raises here, before anything is made visible
            times["written"] = time.perf_counter()
            publish_checkpoint(str(final.parent), tmp, final, iteration, None, retention(self.cfg.checkpoint))
            times["published"] = time.perf_counter()

        return self._publisher.submit(publish)

    def poll(self) -> None:
        """Report a background write that has finished (and on rank 0 been published)."""
        if self.pending is not None and self.pending[0].done():
            self._finish_pending()

    def finalize(self) -> None:
        """Wait for a background write and make it visible; at the next save and at the end of training."""
        if self.pending is not None:
            self._finish_pending()
        if self.cfg.checkpoint.async_save:  # every rank, pending or not (rank 0 may have finished in `poll`)
            self._barrier()

    def _finish_pending(self) -> None:
        future, tmp, final, iteration, times = self.pending
        self.pending = None
        try:
            future.result()
        except (CheckpointException, OSError) as exc:
            if self._first():
                discard(tmp)
            raise save_failed(final.parent, iteration, _cause(exc)) from exc
        if self._first():
            written, published = times["written"] - times["queued"], times["published"] - times["written"]
            _log(
                f"  checkpoint at iteration {iteration:7d} written in the background to {final} in {written:.2f} s"
                f" (checksummed and published in {published:.2f} s more)"
            )

    # ------------------------------------------------------------------ load

    def load(self, root: str, iteration: int | None = None) -> dict[str, Any] | None:
        """Load the newest checkpoint under `root` (`iteration`: one already selected) into the model (and unless
        --finetune / --no-load-optim / --no-load-rng, the optimizer, FP8 state and RNG); returns its train state,
        or None when there is none."""
        if iteration is None:
            iteration = select_checkpoint(root, self.group)
        if iteration is None:
            return None
        path = checkpoint_dir(root, iteration)
        _check_format(root, path, iteration)
        try:
            metadata = SafeReader(path).read_metadata()
        except Exception as exc:  # a missing, truncated or refused .metadata
            raise CheckpointError(
                f"cannot read the torch_dist checkpoint index {path / '.metadata'}: {_first_line(exc)}"
            ) from None
        with malformed(f"torch_dist checkpoint {path}", CheckpointError):
            return self._load(root, path, iteration, metadata)

    def _load(self, root: str, path: Path, iteration: int, metadata: Any) -> dict[str, Any]:
        saved = metadata.state_dict_metadata
        ckpt = self.cfg.checkpoint
        load_optim = not (ckpt.finetune or ckpt.no_load_optim)

        # Objects first (small): the optimizer's encoding decides which tensors to read
        model_state = self.model.state_dict()
        chunks, objects = self._model_entries(model_state, saving=False)
        wanted = set(objects) | {"train_state", "layout", "loss_scaler", "optimizer.step", "fp8.recipe"}
        wanted |= {f"rng.{self.dims.rank}", ENCODING, self.optimizer_entries.rounding_key}
        wanted |= {k for k in saved if k.startswith("fp8_guard.")}
        loaded = self._read(path, [], {k: None for k in wanted if isinstance(saved.get(k), BytesStorageMetadata)})
        for key in ("train_state", "layout"):
            loaded[key] = _plain(loaded.get(key), key, path)
        train_state = loaded["train_state"]
        _log(
            f"> {self.KIND} {root} at iteration {iteration} was saved with layout {loaded['layout']}"
            f" (this run: tp {self.dims.tp}, pp {self.dims.pp}, dp {self.dims.dp}, cp {self.dims.cp})"
        )

        saved_run = train_state.get("config"), loaded["layout"].get("tp", 1)  # what decided the saved shapes
        chunks = self._fit(chunks, saved, root, "model", *saved_run)
        if load_optim:
            chunks += self._fit(self.optimizer_entries.plan(saved, loaded), saved, root, "optimizer", *saved_run)
        fp8_history = fp8_scale = None
        has_fp8 = any(k.startswith("fp8.") and k.endswith(".scale") for k in saved)
        if self.fp8 is not None and self.fp8.amax.history is not None and has_fp8 and not ckpt.finetune:
            fp8_history, fp8_scale = self.fp8.amax.history.clone(), self.fp8.amax.scale.clone()
            chunks += self._fit(self._fp8_entries(fp8_history, fp8_scale), saved, root, "fp8", *saved_run)
        self._read(path, chunks, {})

        # FP8 scales first: loading FP8 weights quantizes them with the current scales
        if fp8_history is not None:
            self.fp8.load_state_dict(
                {"linears": list(self.fp8.states), "amax_history": fp8_history, "scale": fp8_scale}
            )
        for name in model_state:
            fqn = "model." + global_name(name, self.layers)
            if name.endswith("_extra_state"):
                model_state[name] = loaded.get(fqn)
        load_model_state(self.model, model_state, root)
        if ckpt.finetune:
            return train_state
        if load_optim:
            step = loaded.get("optimizer.step", 0)
            note = self.optimizer_entries.apply(step, loaded["layout"], iteration, _log)
            if note:
                _log(f"> {note} (checkpoint {root})")
            self.loss_scaler.load_state_dict(loaded.get("loss_scaler") or {})
        else:
            self.optimizer.reload_model_params()
        if self.monitor is not None:
            stages = [v for k, v in loaded.items() if k.startswith("fp8_guard.") and v]
            ours = set(self.layers)
            layers = sorted({n for s in stages for n in s.get("bf16_layers", []) if n in ours})
            self.monitor.load_state_dict({"bf16_layers": layers})
        if not ckpt.no_load_rng:
            self._load_rng(loaded, iteration, root)
        return train_state

    def _read(self, path: Path, chunks: list[Chunk], objects: dict[str, Any]) -> dict[str, Any]:
        """Load `chunks` in place and `objects` (returned by name) from the checkpoint folder `path`."""
        state, where = split_entries(chunks, objects)
        planner = ChunkLoadPlanner(where, path)
        try:
            reader = SafeReader(path)
            dcp.load(
                state, storage_reader=reader, planner=planner, process_group=self.group, no_dist=self.group is None
            )
        except (CheckpointException, Exception) as exc:
            raise CheckpointError(f"cannot read torch_dist checkpoint {path}: {_first_line(exc)}") from exc
        return planner.state_dict

    def _fit(
        self, chunks: list[Chunk], saved: dict[str, Any], root: str, tensors: str, saved_config: Any, saved_tp: int
    ) -> list[Chunk]:
        """Check this rank's chunks against the checkpoint's entries (missing, other shapes: one line naming them
        and the flags that differ from `saved_config`, the saved run's, as --dist-ckpt-strictness says) and clip
        vocabulary chunks to the checkpoint's padding (model_shape.py: another vocabulary is refused)."""
        strictness = self.cfg.checkpoint.dist_ckpt_strictness
        fitted, missing, mismatched, padding = [], set(), set(), set()
        smoothing_started = False
        for chunk in chunks:
            entry = saved.get(chunk.fqn)
            if not isinstance(entry, TensorStorageMetadata):
                if chunk.fqn.startswith("optimizer.main."):
                    continue  # saved from fp32 parameters: rebuilt from the weights
                if chunk.fqn.endswith(SCALES_KEY):  # saved without --smooth-swiglu: the scales keep their 1
                    smoothing_started = True
                    continue
                missing.add(chunk.fqn)
                continue
            shape = tuple(entry.size)
            if shape != tuple(chunk.global_shape):
                rows = shape[0], chunk.global_shape[0]
                if (
                    chunk.fqn.endswith(VOCAB)
                    and shape[1:] == tuple(chunk.global_shape[1:])
                    and vocab_rows_fit(*rows, saved_config, saved_tp, self.cfg)
                ):
                    padding.add((chunk.global_shape[0], shape[0]))
                    chunk = clip_vocab(chunk, shape[0])
                    if chunk is None:
                        continue
                else:
                    mismatched.add(f"{chunk.fqn}: checkpoint {list(shape)} vs model {list(chunk.global_shape)}")
                    continue
            fitted.append(chunk)
        problems = []
        if missing and strictness in ("log_all", "return_all", "ignore_all"):
            if strictness != "ignore_all":
                _log(f"> checkpoint {root} lacks {len(missing)} {tensors} tensors, left as they are: {_few(missing)}")
        elif missing:
            problems.append(f"missing in checkpoint: {_few(missing)}")
        if mismatched:
            problems.append(f"{len(mismatched)} of another shape: {_few(mismatched)}")
        if problems:
            raise CheckpointError(mismatch_line(root, differing_flags(saved_config, self.cfg), problems))
        if smoothing_started:
            _log(f"> checkpoint {root} {STARTED_LINE}")
        for ours, theirs in sorted(padding):
            _log(f"> vocabulary padded to {theirs} rows in the checkpoint, {ours} here: the rows both have are loaded")
        if tensors == "model":
            self._check_unexpected(saved, {c.fqn for c in chunks}, root, strictness)
        return fitted

    def _check_unexpected(self, saved: dict[str, Any], ours: set[str], root: str, strictness: str) -> None:
        """Weights in the checkpoint that this model has no place for (another pipeline split is fine: ranks see
        only their own layers, so the check counts this stage's layer range)."""
        if strictness in ("assume_ok_unexpected", "ignore_all"):
            return
        stage = {f"decoder.layers.{n - 1}." for n in self.layers}
        extra = set()
        for fqn in saved:
            if not fqn.startswith("model.") or fqn.endswith("_extra_state") or fqn in ours:
                continue
            name = fqn[len("model.") :]
            if name.startswith("decoder.layers.") and not any(name.startswith(p) for p in stage):
                continue
            if not name.startswith("decoder.layers."):
                continue  # embeddings, final norm, output layer: held by the first or last stage only
            extra.add(fqn)
        if not extra:
            return
        if strictness.startswith("raise"):
            raise CheckpointError(f"checkpoint {root} holds weights this model has no place for: {_few(extra)}")
        _log(f"> checkpoint {root} holds weights this model has no place for, ignored: {_few(extra)}")

    def _load_rng(self, loaded: dict[str, Any], iteration: int, root: str) -> None:
        layout = loaded["layout"]
        saved = (layout["tp"], layout["pp"], layout["dp"], layout.get("cp", 1))
        same = saved == (self.dims.tp, self.dims.pp, self.dims.dp, self.dims.cp)
        state = loaded.get(f"rng.{self.dims.rank}")
        if same and state is not None:
            set_rng_state(state, f"checkpoint {root}")
            return
        seed = self.cfg.training.seed + iteration
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        _log(
            f"> random-number generators seeded afresh from --seed + iteration ({seed}): the checkpoint's per-rank"
            f" streams belong to layout {layout}, not this one"
        )

    # ------------------------------------------------------------------ helpers

    def _first(self) -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)


VOCAB = ("word_embeddings.weight", "output_layer.weight")


def _check_format(root: str, path: Path, iteration: int) -> None:
    if not path.is_dir():
        raise CheckpointError(
            f"{root}: {path.name} (named by the latest pointer, iteration {iteration}) is missing or damaged"
        )
    info = read_metadata(path)
    fmt = info.get("format", "torch") if info is not None else None
    if fmt is None and (path / ".metadata").exists():
        raise CheckpointError(
            f"{path} is a torch_dist checkpoint of another program (no metadata.json; Megatron-LM's?): convert it"
            " with tools/checkpoint/convert.py --loader mcore --saver native"
        )
    if fmt != FORMAT:
        raise CheckpointError(
            f"{path} is not a torch_dist checkpoint (format {fmt or 'unknown'}): load it with --ckpt-format"
            f" {fmt or 'torch'} or --auto-detect-ckpt-format"
        )


def _plain(value: Any, key: str, path: Path) -> dict[str, Any]:
    """The `train_state` or `layout` entry: JSON text (or, written before, the dict itself)."""
    if isinstance(value, str):
        try:
            value = parse_json(value, f"{path}: {key}")
        except (ValueError, LimitExceeded):
            value = None
    if not isinstance(value, dict):
        raise CheckpointError(f"torch_dist checkpoint {path}: its {key} entry is missing or malformed; restore it")
    return value


def _few(names: set[str], limit: int = 6) -> str:
    names_list = sorted(names)
    more = f" and {len(names_list) - limit} more" if len(names_list) > limit else ""
    return ", ".join(names_list[:limit]) + more


def _cause(exc: BaseException) -> BaseException:
    """The error inside DCP's per-rank failure report (an OSError such as ENOSPC), else `exc` itself."""
    failures = getattr(exc, "failures", None) or getattr(exc, "_failures", None)
    if failures:
        failure = next(iter(failures.values()))
        inner = getattr(failure, "exc", failure)
        if isinstance(inner, tuple):  # (exception, traceback) in some torch versions
            inner = next((x for x in inner if isinstance(x, BaseException)), None)
        if isinstance(inner, BaseException):
            return inner
    return exc


def _first_line(exc: BaseException) -> str:
    rank = next(iter(getattr(exc, "failures", None) or getattr(exc, "_failures", None) or {}), None)
    return (f"rank {rank}: " if rank is not None else "") + first_line(exc)
