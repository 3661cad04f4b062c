"""Sharded data parallelism (--use-megatron-fsdp / --use-torch-fsdp2) on PyTorch's FSDP2 (`fully_shard`, DTensor).

`build_fsdp2` applies FSDP2 to a built GPT model in torchtitan's form and returns its gradient engine, `Fsdp2Grads`
(megatron/parallel/engines.py):

  * units: each transformer layer (or, with --suggested-communication-unit-size, a run of consecutive layers) is
    one FSDP unit; an untied embedding is a unit of its own; the final norm and an untied output layer form the last
    unit, not resharded after the forward (its backward comes at once), nor is the last layer unit (its backward
    comes next); the root unit holds the rest (the tied word
    embeddings, which the output layer reads at the end of the forward, and the final norm with them);
  * every parameter becomes a DTensor sharded on dim 0 over the data-parallel group: its local shard is the fp32 main
    weight the optimizer steps on (in place), and FSDP2 all-gathers each unit in the training dtype (bf16 under --bf16)
    before it runs. With --use-precision-aware-optimizer the shard holds the training dtype itself (gathered without a
    cast) and the optimizer keeps the shard's main weights (fp16 + remainder or fp32) and moments, writing the shard
    from them after each step (megatron/optim/optimizer.py). Under tensor parallelism the parameter is this rank's
    tensor-parallel piece (the model's own TP layers split the weights), sharded over the data (x context) parallel
    ranks holding the same piece: the DTensor's global shape is the piece's, and the TP collectives run inside the units
    as without FSDP;
  * every parameter keeps a persistent fp32 (or bf16) gradient shard (`param.grad`, a DTensor; `param.main_grad`
    its local tensor): FSDP2 reduce-scatters each micro-batch's gradients and adds them into it, so no rank ever
    holds a whole-model gradient buffer, and the shard's address never changes (the optimizer lists it once).
    FSDP2 hands a gradient over in its shard's dtype: fp32 gradient shards of bf16 weight shards receive each
    micro-batch's reduce-scattered sum rounded to bf16 (reduced in fp32 or bf16 as the flags say; with
    --fp8-grad-reduce sent as FP8 bytes and summed in fp32, megatron/parallel/fsdp/fp8_reduce_scatter.py);
  * the strategy decides when gathered weights are freed: optim_grads_params after each unit's forward and
    backward; optim_grads keeps them from the first forward to the last micro-batch's backward (one all-gather per
    step, as the distributed optimizer's), and so lets the FP8 linears (local and TE's) keep the step's first weight
    casts for its later micro-batches, as the distributed optimizer's do (`Sharding.keeps_weight_casts`);
    optim_grads_params with --torch-fsdp2-no-reshard-after-forward keeps each unit from its forward to its backward
    (one all-gather per unit and micro-batch; every unit gathered at the end of the forward) and frees it after the
    backward; a forward without a backward (evaluation) frees them all at its end (`_reshard_after_no_grad_forward`);
  * with --fp8-param-gather, the FP8 linears' weights are all-gathered as E4M3 bytes with one scale per tensor
    (delayed, tensorwise) or per 128x128 block (blockwise) agreed by the ranks once per step
    (megatron/parallel/fsdp/fp8_gather.py; rowwise and mxfp8, cast along both axes, gather the row cast for the forward
    and the column cast for the backward: fp8_gather_axes.py), and the linears read them as their FP8 operands: the
    local linears as their own FP8 weights, Transformer Engine's as TE Float8Tensors
    (megatron/parallel/fsdp/te_fp8_gather.py) or, blockwise, Float8BlockwiseQTensors
    (megatron/parallel/fsdp/te_blockwise_gather.py), which TE casts no more. With
    --use-precision-aware-optimizer those weights' bf16 shards are freed once cast, from the training forward to the
    optimizer step (`reclaim_shards`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from megatron.config import Config
from megatron.fp8.linear import Fp8LinearState
from megatron.parallel.fsdp.fp8_gather import Fp8ShardWeight, shard_data, wrap_fp8_weight
from megatron.parallel.fsdp.fp8_gather_axes import bind_gather_phases, gathers_axes, rerun_in_backward
from megatron.parallel.fsdp.fp8_gather_scales import Fp8GatherScales
from megatron.parallel.fsdp.te_blockwise_gather import wrap_te_weight

from ..fp8_reduce import Fp8ReduceStats
from . import fsdp2_internals as internals
from .fp8_reduce_scatter import use_fp8_reduce_scatter


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of `param`: a DTensor's local shard (a view of its storage), else `param`,
    detached either way: writing into it updates the parameter."""
    with torch.no_grad():
        return (param.to_local() if isinstance(param, DTensor) else param).detach()


def flat_offset(param: torch.Tensor) -> int:
    """Where this rank's shard starts among the whole tensor's flattened elements (FSDP shards rows, so a shard is
    a flat range); 0 for a plain tensor."""
    if not isinstance(param, DTensor):
        return 0
    if any(not (p.is_shard() and p.dim == 0) for p in param.placements):
        raise ValueError(f"expected a DTensor sharded on dim 0, got {param.placements}")
    _, offsets = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return offsets[0] * math.prod(param.shape[1:]) if param.dim() else 0


def fsdp_units(layers: list[nn.Module], unit_size: int | None) -> list[list[nn.Module]]:
    """Consecutive layers grouped into units of at least `unit_size` parameter elements (None: one per layer)."""
    units: list[list[nn.Module]] = []
    current: list[nn.Module] = []
    for layer in layers:
        current.append(layer)
        if unit_size is None or sum(p.numel() for m in current for p in m.parameters()) >= unit_size:
            units.append(current)
            current = []
    if current:
        units.append(current)
    return units


def fp8_gather_pieces(model: nn.Module) -> list[tuple[torch.Tensor, Callable[[], tuple[torch.Tensor, int]]]]:
    """--fp8-param-gather: each FP8-gathered weight (its sharded parameter: a local FP8 linear's or a Transformer
    Engine linear's) with (a getter of) the shard [rows, in] this rank casts to E4M3 for the all-gather and its first
    row in the weight, whose cast the FP8 monitor counts (the linear reads the gathered bytes). Called between steps,
    when a module's weight is its sharded parameter."""
    pieces = []
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, DTensor) and isinstance(weight.to_local(), Fp8ShardWeight):
            first_row = flat_offset(weight) // max(1, math.prod(weight.shape[1:]))
            pieces.append((weight, lambda weight=weight, row=first_row: (shard_data(local_shard(weight)), row)))
    return pieces


class Fp8GatherDtypes:
    """Which FP8-gathered weights (`Fp8ShardWeight`s) gather E4M3 bytes and which the training dtype, as
    `gathers_fp8(linear)` says now: a Transformer Engine layer the FP8 guard moved to bf16 (--fp8-auto-bf16) gathers
    bf16, its shard cast to the gather dtype, and TE's linear reads a plain bf16 weight; moved back, FP8 again.

    FSDP2 builds a gathered weight with `fsdp_post_all_gather` at a parameter's first all-gather and, at later ones,
    refills it through `out=` (into all-gather outputs it allocated once, in the first gather's dtypes): a weight that
    changes between an FP8 tensor and a plain one must be built afresh. `update` (between steps, before the scales'
    agreement) reshards the weight's unit and forgets both, so the next all-gather allocates and builds anew."""

    def __init__(self, model: nn.Module, gathers_fp8: Callable[[nn.Module], bool]):
        self.gathers_fp8 = gathers_fp8
        self.params = list(_fp8_fsdp_params(model))

    def update(self) -> list[nn.Module]:
        """Switch the weights whose gather dtype changed; returns their linears."""
        switched = []
        for unit, param in self.params:
            linear, scale = internals.module_of(param), internals.sharded_local_tensor(param)._scale
            if scale.high_precision != self.gathers_fp8(linear):
                continue
            unit.reshard()  # (between steps every unit is resharded already: a no-op)
            scale.high_precision, scale.data, scale.fresh = not scale.high_precision, None, False
            internals.forget_gathered(param)
            switched.append(linear)
        return switched


def _fp8_fsdp_params(model: nn.Module) -> Iterator[tuple[nn.Module, Any]]:
    """(the FSDP unit, FSDP2's record of the parameter: its `FSDPParam`) of each FP8-gathered weight of `model`."""
    for unit in internals.units(model):
        for param in internals.unit_params(unit):
            if isinstance(internals.sharded_local_tensor(param), Fp8ShardWeight):
                yield unit, param


def share_padded_storage(model: nn.Module) -> None:
    """Let FSDP2 see that each FP8-gathered shard lives in the padded storage it made for it. FSDP2 keeps every
    shard padded to ceil(rows / ranks) rows (`internals.padded_shard`) and, at its lazy initialization (the first
    forward) and after a load, re-pads a local shard shorter than that into new storage unless that storage is
    the shard's, which it checks for a plain tensor only (`FSDPParam.reset_sharded_param`, torch 2.11 to 2.13:
    "TODO: need to support tensor subclass"). An `Fp8ShardWeight` on a rank with pad rows (the ranks do not divide
    the rows) would be copied, and the optimizer, built before, would step the old storage: that rank's weights
    would never change. Recorded as the plain padded tensor it holds (the same storage, which the wrapper reports
    as its own), the check passes. Called after sharding and `to_empty` (which re-pads into new storage); then runs
    the root's lazy initialization at once: at the first forward it would come after `Fp8GatherScales.agree` (the
    hook before the root's) may have freed the shards, whose empty storage fails the check."""
    params = [param for _, param in _fp8_fsdp_params(model)]
    for param in params:
        internals.set_padded_shard(param, shard_data(internals.padded_shard(param)))
    if params:
        internals.lazy_init(model)  # idempotent: the first forward's is then a no-op


def te_gathers_fp8(model: nn.Module) -> Callable[[nn.Module], bool]:
    """Whether a linear's weight gathers FP8 now: not a Transformer Engine linear of a layer out of its autocast's
    live `fp8_layers` (the FP8 guard removes the layers it moves to bf16). The local linears keep their FP8 gathers
    and compute a moved layer on the dequantized weights, as the distributed optimizer's FP8 weights are."""
    te_layers = [layer for layer in model.modules() if hasattr(layer, "te_modules")]
    layers = {id(linear): layer for layer in te_layers for linear in layer.te_modules()}

    def gathers_fp8(linear: nn.Module) -> bool:
        layer = layers.get(id(linear))
        return layer is None or layer.fp8 is None or layer.layer_number in layer.fp8.fp8_layers

    return gathers_fp8


def _wrap_fp8_weights(modules: list[nn.Module], device: torch.device, ranks: int) -> None:
    """--fp8-param-gather: the FP8 linears' (fp32) weights become shards whose all-gather moves E4M3 bytes: the local
    linears (their `fp8` state) and the Transformer Engine linears of the layers in FP8 (`te_modules()` of a layer
    whose autocast has it among its FP8 layers; layers kept in bf16 gather bf16). Their scales are made on `device`
    (the weights may still be on the meta device). mxfp8 weights whose rows the `ranks` do not divide stay plain
    (megatron/parallel/fsdp/fp8_gather_axes.py, `gathers_axes`)."""
    for module in modules:
        for sub in module.modules():
            if hasattr(sub, "te_modules"):
                autocast = sub.fp8
                if autocast is not None and sub.layer_number in autocast.fp8_layers:
                    for linear in sub.te_modules():
                        if not isinstance(linear.weight, DTensor):
                            linear.weight = wrap_te_weight(linear.weight, autocast.recipe, device)
            elif isinstance(getattr(sub, "fp8", None), Fp8LinearState) and not isinstance(sub.weight, DTensor):
                if gathers_axes(sub.fp8.recipe.name, sub.weight.shape[0], ranks):
                    sub.weight = wrap_fp8_weight(sub.weight, sub.fp8, device)


def _cast_unsharded(modules: list[nn.Module], dtype: torch.dtype) -> None:
    """Cast the parameters about to be sharded to the shards' dtype (one unit at a time, so the whole model never
    exists in fp32 at once): fp32 main weights from the training dtype's values, as the distributed optimizer's main
    copies; or the training dtype (a model built on the meta device is fp32 until here)."""
    for module in modules:
        for param in module.parameters():
            if not isinstance(param, DTensor) and param.dtype != dtype:
                param.data = param.data.to(dtype)


def parallel_attributes(model: nn.Module) -> dict[str, dict[str, object]]:
    """The attributes the parallel code reads on each parameter (megatron/parallel/grads.py; the tensor-parallel
    layout the checkpoints place it by), by name: FSDP2's sharding and `to_empty` make new Parameter objects, and
    `set_parallel_attributes` puts them back."""
    return {name: {k: v for k, v in vars(p).items() if not k.startswith("_")} for name, p in model.named_parameters()}


def set_parallel_attributes(model: nn.Module, attributes: dict[str, dict[str, object]]) -> None:
    for name, param in model.named_parameters():
        for key, value in attributes[name].items():
            setattr(param, key, value)


def to_empty_keeping_attributes(model: nn.Module, device: torch.device) -> None:
    """`model.to_empty(device=device)` (storage for a model built on the meta device, its shards only once sharded),
    with each parameter's parallel attributes put back on the new Parameter objects `to_empty` may make."""
    attributes = parallel_attributes(model)
    model.to_empty(device=device)
    set_parallel_attributes(model, attributes)


def apply_fsdp(
    model: nn.Module,
    group: dist.ProcessGroup,
    device: torch.device,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype,
    shard_params: bool,
    prefetch: bool,
    unit_size: int | None = None,
    fp8_gather: bool = False,
    shard_dtype: torch.dtype = torch.float32,
) -> list[nn.Module]:
    """Shard `model` (a GPT model: embedding, decoder.layers, decoder.final_layernorm, output_layer) over `group`
    (on `device`; the model may still be on the meta device);
    returns its units (their first modules) in forward order. `param_dtype`: the dtype units are gathered in (None:
    the fp32 of the shards); `reduce_dtype`: the gradient reduce-scatter's; `shard_params`: reshard each unit after
    its forward (optim_grads_params without --torch-fsdp2-no-reshard-after-forward); `prefetch`: gather the next
    unit while the current one computes; `fp8_gather`: all-gather the FP8 linears' weights as FP8 (the caller agrees
    their scales: `Fp8GatherScales`); `shard_dtype`: of the weight shards (fp32: the main weights; else the training
    dtype)."""
    mesh = DeviceMesh.from_group(group, device.type)
    # Inputs keep their dtypes, as in a model cast to the training dtype (rotary tables stay fp32)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    attributes = parallel_attributes(model)

    def shard(modules: list[nn.Module], reshard: bool) -> nn.Module:
        _cast_unsharded(modules, shard_dtype)
        if fp8_gather:
            _wrap_fp8_weights(modules, device, mesh.size())
        fully_shard(
            modules if len(modules) > 1 else modules[0], mesh=mesh, mp_policy=policy, reshard_after_forward=reshard
        )
        return modules[0]

    units = []
    untied = model.output_layer is not None
    if model.embedding is not None and untied:
        units.append(shard([model.embedding], shard_params))
    layer_units = fsdp_units(list(model.decoder.layers), unit_size)
    # The last layer unit stays gathered from its forward to its backward, which comes next (after the output
    # layer's): resharding it would only gather it again at once (torchtitan does the same); the memory peak, the
    # start of the backward, holds it either way
    units += [shard(unit, shard_params and i < len(layer_units) - 1) for i, unit in enumerate(layer_units)]
    model.layer_units = tuple(len(unit) for unit in layer_units)
    if untied:
        units.append(shard([model.decoder.final_layernorm, model.output_layer], False))
    root = shard([model], False)
    if prefetch:
        for before, after in zip(units, units[1:]):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])
    set_parallel_attributes(model, attributes)
    return [root, *units]


def _add_into_main_grad(param: nn.Parameter) -> None:
    param.main_grad.add_(param.grad.to_local())
    param.grad = None


class Fsdp2Grads:
    """The gradient engine of FSDP2 (megatron/parallel/engines.py's `GradientEngine`): each parameter's `main_grad` is
    its persistent gradient shard; `owned_range` is the whole local shard."""

    sharded_state = True
    overlap_param_gather = False
    fp8_stats: Fp8ReduceStats | None = None  # --fp8-grad-reduce: what the FP8 reduce-scatters lost (the log's)
    fp8_scales: Fp8GatherScales | None = None
    fp8_dtypes: Fp8GatherDtypes | None = None
    cast_keepers: tuple[nn.Module, ...] = ()  # TE layers keeping each step's FP8 weight casts (optim_grads)

    def __init__(self, model: nn.Module, keep_gathered_until_last_backward: bool, dtype: torch.dtype = torch.float32):
        """`dtype`: of the gradient shards (fp32, or bf16: FSDP2 adds its fp32 reduce-scatter output into them)."""
        self.model = model
        self._keep = keep_gathered_until_last_backward
        # The units whose resharding after the backward optim_grads switches (FSDP2's default: reshard), listed once:
        # `set_reshard_after_backward` on the root walks every module of the model at each call
        self._units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self._reshard_after_backward = True
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._hooks = []
        with torch.no_grad():
            for param in self.params:
                if dtype == param.dtype:  # FSDP2 adds every reduce-scatter into the existing grad, in place
                    param.grad = torch.zeros_like(param)
                    param.main_grad = param.grad.to_local()
                else:  # a grad of another dtype than its parameter's: added here from FSDP2's (one unit's shard)
                    param.main_grad = torch.zeros_like(local_shard(param), dtype=dtype)
                    self._hooks.append(param.register_post_accumulate_grad_hook(_add_into_main_grad))
        self._last = True

    @property
    def is_last_micro_batch(self) -> bool:
        return self._last

    @is_last_micro_batch.setter
    def is_last_micro_batch(self, last: bool) -> None:
        """optim_grads: the gathered weights stay until the last micro-batch's backward has used them. Set for every
        micro-batch; FSDP2 is told only when the value changes (twice per step with several micro-batches)."""
        self._last = last
        if self._keep and last != self._reshard_after_backward:
            for unit in self._units:
                unit.set_reshard_after_backward(last, recurse=False)
            self._reshard_after_backward = last

    def owned_range(self, param: nn.Parameter) -> tuple[int, int] | None:
        numel = param.main_grad.numel()
        return (0, numel) if numel else None

    def grad_piece(self, param: nn.Parameter, start: int, stop: int) -> torch.Tensor:
        return param.main_grad.view(-1)[start:stop]

    def reduced_grad(self, param: nn.Parameter) -> torch.Tensor:
        return param.main_grad

    def finish(self) -> None:
        """Nothing left to wait for: FSDP2's root waits for the last reduce-scatter at the end of the backward."""

    def gather_params(self) -> None:
        """Nothing to gather: each unit gathers its weights before its next forward."""

    def wait_for_params(self) -> None:
        """No all-gather runs between steps."""

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Gradients computed inside are thrown away (zeroed on exit). No optimizer step follows: FP8 all-gather
        shards a training forward freed inside are written back first (`MixedPrecisionAdamW.restore_freed_shards`)."""
        try:
            yield
        except BaseException:
            self.reclaim_shards()  # the pass failed mid-way: its freed shards must not turn the reset into a new error
            raise
        finally:
            self.zero()

    def reclaim_shards(self) -> None:
        """Before the optimizer writes the weight shards: storage back for those a training forward freed once cast
        for its FP8 all-gathers (with --use-precision-aware-optimizer: `Fp8GatherScales.release`)."""
        if self.fp8_scales is not None:
            self.fp8_scales.reclaim()

    def shards_released(self) -> bool:
        """Whether a training forward freed FP8 all-gather shards that only the optimizer step writes again."""
        return self.fp8_scales is not None and self.fp8_scales.released

    def zero(self) -> None:
        """After each optimizer step: the gradients start again, and the FP8 all-gather scales and the TE layers'
        kept FP8 weight casts are out of date (the casts are also forgotten before each gather, which follows a step
        as its units were resharded after the last backward; this covers a unit that stayed gathered)."""
        torch._foreach_zero_([p.main_grad for p in self.params])
        if self.fp8_scales is not None:
            self.fp8_scales.stale = True
        for layer in self.cast_keepers:
            layer.forget_weight_casts()

    def remove_hooks(self) -> None:
        """Take the gradient hooks off the model at the end of a run (as `GradientBuffers.remove_hooks`)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


def _forget_casts_before_gathers(layers: list[nn.Module]) -> Callable[[nn.Module, object], None]:
    """A forward pre-hook for the root, ahead of FSDP2's own (which starts the gathers): the TE layers whose weights
    are sharded now (a DTensor in place of the gathered weight) are about to be gathered anew, after an optimizer
    step, a checkpoint load or anything else that wrote their shards, so their kept FP8 casts are stale. FSDP2 keeps
    the gathered weights' version counters through its all-gathers: the layers cannot tell by themselves."""

    def forget(module: nn.Module, args: object) -> None:
        for layer in layers:
            if any(isinstance(linear.weight, DTensor) for linear in layer.te_modules()):
                layer.forget_weight_casts()

    return forget


def _reshard_after_no_grad_forward(units: list[nn.Module]) -> Callable[[nn.Module, object, object], None]:
    """A forward hook for the root, after FSDP2's own (--torch-fsdp2-no-reshard-after-forward): a forward without
    gradients (evaluation) has no backward to free the units it kept gathered, so they are freed here, and between
    steps every rank holds its shards only, as without the flag."""

    def reshard(module: nn.Module, args: object, output: object) -> None:
        if not torch.is_grad_enabled():
            for unit in units:
                unit.reshard()

    return reshard


def build_fsdp2(
    model: nn.Module,
    cfg: Config,
    group: dist.ProcessGroup,
    device: torch.device,
    initialize: Callable[[nn.Module], None] | None = None,
    scale_group: dist.ProcessGroup | None = None,
) -> Fsdp2Grads:
    """Shard `model` over the data-parallel `group` as the flags say (the one place that maps the strategy and
    options to FSDP2's). A model built on the meta device (--init-model-with-meta-device) is then allocated on
    `device`, its shards only, and given its values by `initialize(model)`. `scale_group`: with --fp8-param-gather,
    the ranks that agree each FP8 weight's scale, all that hold a piece of it (data x tensor parallel; default
    `group`), so that each piece is cast with the whole tensor's scale, as one process casts it."""
    par, sharding = cfg.parallel, cfg.sharding
    params_dtype = cfg.precision.params_dtype
    fp8_gather = cfg.precision.fp8_param_gather
    shard_params = par.data_parallel_sharding_strategy == "optim_grads_params"
    units = apply_fsdp(
        model,
        group,
        device,
        param_dtype=None if params_dtype == torch.float32 else params_dtype,
        reduce_dtype=torch.bfloat16 if sharding.grad_comm_bf16 else torch.float32,
        shard_params=shard_params and par.torch_fsdp2_reshard_after_forward,
        prefetch=par.fsdp_double_buffer,
        unit_size=par.suggested_communication_unit_size,
        fp8_gather=fp8_gather,
        shard_dtype=torch.float32 if sharding.shards_hold_main_weights else params_dtype,
    )
    assert isinstance(model, FSDPModule)
    # FP8 casts of a freed weight (optim_grads_params) are not kept for the next micro-batch: not by a local FP8
    # linear, nor by TE's layers (TE 2.16 and later keep none under FSDP2 unless told: docs/fsdp.md). Under
    # optim_grads the step's first casts serve all its micro-batches, as under the distributed optimizer.
    keep_casts = sharding.keeps_weight_casts
    cast_keepers = []
    for module in model.modules():
        if getattr(module, "fp8", None) is not None and hasattr(module.fp8, "cache_weight"):
            # a local FP8 linear: its cache keys on the step (the FP8 manager drops it after each step and load)
            module.fp8.cache_weight = keep_casts
        if hasattr(module, "cache_weight_casts"):  # a Transformer Engine layer
            if keep_casts:
                module.keep_weight_casts_under_fsdp2()
                cast_keepers.append(module)
            else:
                module.cache_weight_casts = False
    keep = par.data_parallel_sharding_strategy == "optim_grads"
    if initialize is not None:
        to_empty_keeping_attributes(model, device)
        initialize(model)
    share_padded_storage(model)
    if shard_params and not par.torch_fsdp2_reshard_after_forward:
        model.register_forward_hook(_reshard_after_no_grad_forward(units))
    grads = Fsdp2Grads(model, keep, torch.bfloat16 if sharding.main_grads_bf16 else torch.float32)
    if cast_keepers:
        grads.cast_keepers = tuple(cast_keepers)
        model.register_forward_pre_hook(_forget_casts_before_gathers(cast_keepers), prepend=True)
    if par.fp8_grad_reduce:
        grads.fp8_stats = use_fp8_reduce_scatter(model)
    if fp8_gather:
        bind_gather_phases(_fp8_fsdp_params(model), rerun_in_backward(model))
        shards = [p for p in model.parameters() if isinstance(local_shard(p), Fp8ShardWeight)]
        # Shards that are not the main weights only feed the step's cast: freed from it to the optimizer step
        release = not sharding.shards_hold_main_weights
        grads.fp8_scales = scales = Fp8GatherScales(shards, group if scale_group is None else scale_group, release)
        grads.fp8_dtypes = dtypes = Fp8GatherDtypes(model, te_gathers_fp8(model))

        def before_gathers(module: nn.Module, args: object) -> None:
            if scales.stale:  # a new step (the FP8 guard moves layers between steps): gather dtypes, then scales
                dtypes.update()
            scales.agree()

        # before the root's own pre-forward hook, which starts the first all-gather
        model.register_forward_pre_hook(before_gathers, prepend=True)
    return grads
