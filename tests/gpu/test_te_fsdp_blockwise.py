"""Transformer Engine's weights all-gathered as FP8 in 128x128 blocks under FSDP2 on 2 GPUs (NCCL): --fp8-param-gather
--fp8-recipe blockwise with --transformer-impl transformer_engine (megatron/parallel/fsdp/te_blockwise_gather.py).

(a) The gathered weight is a TE Float8BlockwiseQTensor whose bytes and scales are TE's own blockwise quantization of
    the whole fp32 weight (TE's weight quantizer of the recipe), row-wise and, once TE derives it for the dgrad,
    column-wise, bit for bit: for weights whose 128-row blocks straddle the two shards, with power-of-two scales and
    with --fp8-blockwise-fp32-scales; and for every TE FP8 linear of a model after 20 steps of training.
(b) FSDP with the FP8 all-gather trains like the distributed optimizer with TE's blockwise FP8 weights
    (--fp8-param-gather, TE's `quantize_master_weights`), both strategies, over 20 steps within 2e-3 relative. Both
    runs' FP8 weights are the same cast of the same fp32 main weights (a); what differs is the weight gradient: the
    distributed optimizer's TE GEMMs accumulate it in fp32 main_grad, FSDP's return it in bf16 to autograd and
    reduce-scatter it (rounding of 2^-9 relative per micro-batch, as in tests/gpu/test_te_fsdp.py's per-tensor
    comparison, which measured 2e-4 over 30 steps on two H200s and allows 2e-3). A block scale agreed by one shard
    only (a straddling block) moved the local layers' first loss by 2.6e-3 (docs/fsdp.md), and a layer given
    another's scales drifted 2% by step 19: both fail it. Each FP8 layer's all-gather moves at most 0.55x the bytes
    of bf16's (the grid of scales travels as metadata), and after a step no gathered byte and no column-wise copy
    is left."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from megatron.fp8.te_recipe import te_recipe
from megatron.parallel.fsdp import fsdp2_internals as internals
from megatron.parallel.fsdp.fp8_gather_scales import Fp8GatherScales
from megatron.parallel.fsdp.te_blockwise_gather import TeBlockShardWeight, block_grid, te_scale_shape, wrap_te_weight
from tests.dist_utils import run_distributed
from tests.distributed.test_fsdp import DISTOPT, GRADS, PARAMS, _close, _counted, _gather_rows, _gathered_bytes, _run
from tests.distributed.test_parallel_layouts import BASE, _parse
from tests.gpu.marks import TE_ON_TWO_GPUS
from tests.unit.test_te_blockwise_gather import _weight

STEPS = 20
BLOCKWISE = "--fp8-format e4m3 --fp8-recipe blockwise --lr 1e-3 --no-fp8-first-layer-bf16"
FLAGS = f"{BASE} --transformer-impl transformer_engine --bf16 {BLOCKWISE} --eval-iters 0"
# rows split at 160, 152 and 24 by two shards: inside a 128-row block each time; several blocks along both axes
SHAPES = [(320, 208), (304, 256), (48, 32)]

pytestmark = TE_ON_TWO_GPUS


def _same_as_tes_cast(got, weight: torch.Tensor, quantizer, label: str) -> None:
    """`got` (a gathered Float8BlockwiseQTensor) holds TE's cast of `weight` by `quantizer`: row-wise data and
    scales (the grid; TE leaves the padding of its own unset), then the column-wise pair TE derives for the dgrad."""
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockwiseQTensor

    assert type(got) is Float8BlockwiseQTensor and got.shape == weight.shape, (label, type(got))
    quantizer = quantizer.copy()
    quantizer.set_usage(rowwise=True, columnwise=True)
    want = quantizer(weight.contiguous())
    rows, cols = block_grid(tuple(weight.shape))
    assert got._rowwise_scale_inv.shape == want._rowwise_scale_inv.shape == te_scale_shape(tuple(weight.shape))
    assert torch.equal(got._rowwise_scale_inv[:, :cols], want._rowwise_scale_inv[:, :cols]), label
    assert torch.equal(got._rowwise_data, want._rowwise_data), (
        label,
        int((got._rowwise_data != want._rowwise_data).sum()),
    )
    assert got._columnwise_data is None, label  # nothing gathered or kept for it: TE derives it when asked
    got.update_usage(columnwise_usage=True)
    assert got._columnwise_scale_inv.shape == want._columnwise_scale_inv.shape, label
    assert torch.equal(got._columnwise_scale_inv[:, :rows], want._columnwise_scale_inv[:, :rows]), label
    assert torch.equal(got._columnwise_data, want._columnwise_data), label
    got.update_usage(rowwise_usage=True, columnwise_usage=False)


def _weight_quantizer(recipe):
    """TE's quantizer for weights of `recipe` (its forward recipe state's weight slot, as a TE linear makes it)."""
    from transformer_engine.pytorch.quantization import RecipeState

    return RecipeState.create(recipe, mode="forward", num_quantizers=3).make_quantizers()[1]


def _standalone(world_size: int) -> None:
    """(a) on weights of SHAPES, each wrapped, sharded by FSDP2, its grid agreed and gathered by `unshard()`."""
    for fp32_scales in ("", "--fp8-blockwise-fp32-scales"):
        recipe = te_recipe(_parse(f"{FLAGS} {fp32_scales}", world_size).precision)
        assert recipe.fp8_quant_fwd_weight.power_2_scale == (not fp32_scales)
        holder = nn.Module()
        weights = [_weight(*shape, seed=sum(shape)).cuda() for shape in SHAPES]
        for i, weight in enumerate(weights):
            holder.register_parameter(f"w{i}", wrap_te_weight(weight.clone(), recipe))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        fully_shard(holder, mesh=init_device_mesh("cuda", (world_size,)), mp_policy=mp)
        shards = list(holder.parameters())
        assert all(type(p.to_local()) is TeBlockShardWeight for p in shards)
        Fp8GatherScales(shards, None).agree()
        holder.unshard()
        for i, weight in enumerate(weights):
            got = getattr(holder, f"w{i}")
            assert got.dtype == torch.bfloat16
            _same_as_tes_cast(got, weight, _weight_quantizer(recipe), f"{SHAPES[i]} {fp32_scales}")
        holder.reshard()


def _model_weights(trainer, world_size: int) -> None:
    """(a) on every TE FP8 linear of the trained model: each layer gathered, its weights against TE's cast (by the
    linear's own weight quantizer) of the whole fp32 main weight."""
    from transformer_engine.pytorch.constants import FP8FwdTensorIdx

    scales = trainer.optimizer.buffers.fp8_scales
    scales.stale = True  # the last step wrote the shards: agree and cast as the next forward would
    scales.agree()
    checked = 0
    for layer in trainer.model.decoder.layers:
        linears = list(layer.te_modules())
        mains = [_gather_rows(lin.weight.to_local()._tensor, lin.weight.shape[0], world_size) for lin in linears]
        layer.unshard()
        for lin, main in zip(linears, mains):
            quantizer = lin.quantizers["scaling_fwd"][FP8FwdTensorIdx.GEMM1_WEIGHT]
            _same_as_tes_cast(lin.weight, main, quantizer, f"layer {layer.layer_number} {type(lin).__name__}")
            checked += 1
        layer.reshard()
    assert checked >= 4 * len(trainer.model.decoder.layers), checked


def _columnwise_left(model) -> list[str]:
    """The gathered weights FSDP2 keeps between steps that still hold a column-wise copy (none should)."""
    params = [internals.unsharded_param(p) for unit in internals.units(model) for p in internals.unit_params(unit)]
    return [repr(p.shape) for p in params if getattr(p, "_columnwise_data", None) is not None]


def _body(rank, world_size):
    _standalone(world_size)
    flags = f"{FLAGS} --train-iters {STEPS}"
    want, _ = _run(f"{flags} --fp8-param-gather {DISTOPT}", world_size)
    _, bf16_sent, _, _ = _counted(f"{flags} {PARAMS}", world_size)
    for name, layout in (("optim_grads_params", PARAMS), ("optim_grads", GRADS)):
        label = f"TE blockwise FP8 all-gather {name}"
        got, sent, _, trainer = _counted(f"{flags} --fp8-param-gather {layout}", world_size)
        _close(got, want, 2e-3, label, steps=STEPS)
        if layout == PARAMS:
            shrunk = [(a, b) for a, b in zip(sent, bf16_sent) if a != b]
            assert len(sent) == len(bf16_sent) and shrunk, label
            assert all(a <= 0.55 * b for a, b in shrunk), (label, shrunk[:4])
        shards = [m.weight.to_local() for layer in trainer.model.decoder.layers for m in layer.te_modules()]
        assert shards and all(type(t) is TeBlockShardWeight for t in shards), label
        assert _gathered_bytes(trainer.model) == 0 and not _columnwise_left(trainer.model), label
        _model_weights(trainer, world_size)
    dist.barrier()


def test_te_blockwise_fp8_all_gather_is_tes_cast_and_trains_like_the_distributed_optimizer():
    run_distributed(_body, world_size=2, backend="nccl")
