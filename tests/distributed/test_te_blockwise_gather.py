"""TE's blockwise FP8 all-gather (megatron/parallel/fsdp/te_blockwise_gather.py) through PyTorch's FSDP2 on two gloo
processes: weights sharded by `fully_shard` (shards padded to equal rows, 128-row blocks straddling the two shards),
their grids of block scales agreed by `Fp8GatherScales` (one all-reduce), gathered by `unshard()`. The bytes FSDP hands
to the post-all-gather hook, cut to the weight, and the padded grid it is given are quantize(whole weight) in 128x128
blocks, on the first gather and, after the shards change, on a later one (FSDP's `out=` path). TE does not import on a
CPU machine: the TE tensor is replaced by the bytes themselves here; tests/gpu/test_te_fsdp_blockwise.py builds it."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import megatron.parallel.fsdp.te_blockwise_gather as te_blockwise_gather
from megatron.fp8.formats import E4M3
from megatron.fp8.quantize import BLOCK_128x128, quantize
from megatron.parallel.fsdp.fp8_gather_scales import Fp8GatherScales
from megatron.parallel.fsdp.te_blockwise_gather import TeBlockShardWeight, block_grid, te_scale_shape, wrap_te_weight
from tests.dist_utils import run_distributed
from tests.unit.test_te_blockwise_gather import Recipe, _weight

# 301 rows: shards of 151 rows, the second padded by one; 128-row blocks straddle the shards in all three
SHAPES = [(301, 200), (320, 130), (32, 48)]


def _body(rank, world_size):
    built = []  # what the post-all-gather hook would build the TE tensor from: (bytes, padded scale_inv)

    def bytes_and_grid(data, scale_inv, dtype, power_of_two):
        built.append((data, scale_inv, power_of_two))
        return data

    te_blockwise_gather._blockwise_tensor = bytes_and_grid
    for power_of_two in (True, False):
        holder = nn.Module()
        weights = [_weight(*shape, seed=sum(shape)) for shape in SHAPES]
        for i, weight in enumerate(weights):
            param = wrap_te_weight(weight.clone(), Recipe(power_2_scale=power_of_two)).requires_grad_(False)
            holder.register_parameter(f"w{i}", param)
        fully_shard(holder, mesh=init_device_mesh("cpu", (world_size,)))
        shards = list(holder.parameters())
        assert all(type(p.to_local()) is TeBlockShardWeight for p in shards)
        scales = Fp8GatherScales(shards, None)
        for step in range(2):
            scales.agree()
            built.clear()
            holder.unshard()
            assert len(built) == (len(SHAPES) if step == 0 else 0)  # later gathers refill the first gather's tensor
            for i, weight in enumerate(weights):
                want, _ = quantize(weight, BLOCK_128x128, E4M3, power_of_two=power_of_two)
                assert torch.equal(getattr(holder, f"w{i}"), want.data.view(torch.uint8)), (power_of_two, step, i)
                scale_inv = shards[i].to_local()._scale.padded_scale_inv
                assert step or built[i][1] is scale_inv and built[i][2] == power_of_two
                assert scale_inv.shape == te_scale_shape(SHAPES[i])
                assert torch.equal(scale_inv[:, : block_grid(SHAPES[i])[1]], want.scale_inv), (power_of_two, step, i)
            holder.reshard()
            # an optimizer step: every weight scaled by 3 (new block scales), rows of one block by 1000 more
            for param, weight in zip(shards, weights):
                weight.mul_(3)
                weight[:7].mul_(1000)
                first = rank * -(-weight.shape[0] // world_size)
                local = param.to_local()._tensor
                local.copy_(weight[first : first + local.shape[0]])
            scales.stale = True
    dist.barrier()


def test_te_blockwise_all_gather_through_fsdp2_is_the_cast_of_the_whole_weight():
    run_distributed(_body, world_size=2)
