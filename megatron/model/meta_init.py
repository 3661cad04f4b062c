"""--init-model-with-meta-device: build the model without storage, shard it (FSDP), then give each rank's shards the
values an ordinary build gives, one part at a time, so that no rank ever holds the whole model.

An ordinary build draws one base seed from the global RNG and initializes every part from its own seed (the embedding,
each layer, the output layer: megatron/model/gpt.py), so a part's values do not depend on which other parts are built.
A *twin* of one part is therefore the model built for a stage holding that part alone, from the same global RNG state:
its values are the part's values in the whole model. Each twin is built where an ordinary build puts it (the CPU;
Transformer Engine's layers on the GPU, initialized by TE as in an ordinary build), cast as the ordinary build casts
(the training dtype; fp32 FSDP shards keep those values in fp32), copied into this rank's shards and dropped.

The flat-bucket engine (--use-megatron-fsdp's optim_grads, megatron/parallel/fsdp/flat_shards.py) keeps every weight
whole, so there `materialize` gives the whole model its storage on the device and its values the same way, before the
FP8 state and the buckets see it: the host never holds more than one part, as FSDP's ranks never hold more than their
shards and one part.

Transformer Engine's modules are built with device="meta" inside the meta-device context (te_layers.py), which makes
TE defer its own initialization. The FP8 state is real from the start: the local engine's amax state and the FP8
all-gather scales are made on the run's device (training/build.py, parallel/fsdp/fsdp2.py); TE makes its own at the
first forward, on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megatron.parallel.fsdp.fp8_gather_scales import shards_written
from megatron.parallel.fsdp.fsdp2 import flat_offset, local_shard, to_empty_keeping_attributes

from .gpt import Stage


def _parts(stage: Stage) -> list[tuple[Stage, dict[int, int]]]:
    """One stage per part of `stage` (its embedding, each layer, its final norm and output layer), with the map from
    the twin's layer index to the model's."""
    parts = []
    if stage.pre_process:
        parts.append((Stage(layer_numbers=(), pre_process=True, post_process=False), {}))
    for index, number in enumerate(stage.layer_numbers):
        parts.append((Stage(layer_numbers=(number,), pre_process=False, post_process=False), {0: index}))
    if stage.post_process:
        parts.append((Stage(layer_numbers=(), pre_process=False, post_process=True), {}))
    return parts


def _model_name(name: str, layers: dict[int, int]) -> str:
    if name.startswith("decoder.layers."):
        index, rest = name[len("decoder.layers.") :].split(".", 1)
        return f"decoder.layers.{layers[int(index)]}.{rest}"
    return name


class DeferredInit:
    """The model built on the meta device (`model`), and the callable that fills it once sharded and moved to its
    device (`largest_part`: the most parameter elements one twin held)."""

    def __init__(self, build: Callable[..., nn.Module], stage: Stage, dtype: torch.dtype):
        """`build(stage=...)`: the model's constructor with every other argument bound."""
        self._build, self._stage, self._dtype = build, stage, dtype
        self._rng = torch.get_rng_state()
        with torch.device("meta"):
            self.model = build(stage=stage)
        self._rng_after = torch.get_rng_state()
        self.largest_part = 0

    def materialize(self, device: torch.device) -> nn.Module:
        """The model unsharded on `device` in the training dtype (an ordinary build's `model.to(device, dtype)`),
        given its values part by part."""
        to_empty_keeping_attributes(self.model.to(dtype=self._dtype), device)
        self(self.model)
        return self.model

    @torch.no_grad()
    def __call__(self, model: nn.Module) -> None:
        params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
        for stage, layers in _parts(self._stage):
            torch.set_rng_state(self._rng)
            twin = self._build(stage=stage).to(dtype=self._dtype)
            self.largest_part = max(self.largest_part, sum(p.numel() for p in twin.parameters()))
            for name, value in twin.named_parameters():
                target = params.get(_model_name(name, layers))
                if target is None:  # the tied embedding's copy in the output part: the embedding part's
                    continue
                local = local_shard(target).view(-1)
                start = flat_offset(target)
                local.copy_(value.reshape(-1)[start : start + local.numel()])
            for name, value in twin.named_buffers():
                if (target := buffers.get(_model_name(name, layers))) is not None:
                    target.copy_(value)
        shards_written(model)  # FP8 all-gathers: scales agreed, shards cast from these values (fp8_gather_scales.py)
        torch.set_rng_state(self._rng_after)
