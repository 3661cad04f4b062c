"""What TE's blockwise FP8 all-gather under FSDP (megatron/parallel/fsdp/te_blockwise_gather.py) computes without TE:
TE's padded layout of the grid of block scales, the shard's cast (the whole weight's 128x128 blocks, a block straddling
two shards), the bytes gathered, and the column-wise operand TE derives from them (the transpose with the transposed
grid, which for square blocks is the cast of W^T). FP8 is emulated with megatron/fp8/quantize.py; the TE tensor built
over these bytes is checked against TE's own cast on two GPUs (tests/gpu/test_te_fsdp_blockwise.py), the sharding
with FSDP2 on two gloo processes (tests/distributed/test_te_blockwise_gather.py)."""

import pickle

import pytest
import torch

from megatron.fp8.formats import E4M3
from megatron.fp8.quantize import BLOCK_128x128, quantize
from megatron.parallel.fsdp.fp8_gather import gathered_bytes, shard_rows
from megatron.parallel.fsdp.te_blockwise_gather import (
    TeBlockScale,
    TeBlockShardWeight,
    block_grid,
    gathered_rows,
    te_scale_shape,
    wrap_te_weight,
)
from megatron.parallel.fsdp.te_fp8_gather import TeFp8ShardWeight


class QParams:
    def __init__(self, power_2_scale: bool = True, amax_epsilon: float = 0.0):
        self.power_2_scale, self.amax_epsilon = power_2_scale, amax_epsilon


class Recipe:
    """A stand-in for TE's recipes (transformer_engine.common.recipe): what the wrapping reads of them."""

    def __init__(self, blockwise: bool = True, w_block_scaling_dim: int = 2, **qparams):
        self.blockwise, self.w_block_scaling_dim = blockwise, w_block_scaling_dim
        self.fp8_quant_fwd_weight = QParams(**qparams)

    def float8_block_scaling(self) -> bool:
        return self.blockwise


class Mesh:
    def __init__(self, rank: int, size: int = 2):
        self.rank, self.ranks = rank, size

    def size(self) -> int:
        return self.ranks

    def get_local_rank(self) -> int:
        return self.rank


def _weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # magnitudes spread over 2^-12..2^4 along the rows, so that neighbouring blocks get different scales
    return torch.randn(rows, cols, generator=gen) * torch.exp2(torch.linspace(-12, 4, rows))[:, None]


@pytest.mark.parametrize(
    "shape, rowwise, columnwise",
    [
        ((32, 32), (1, 4), (1, 4)),
        ((128, 512), (1, 4), (4, 4)),
        ((320, 200), (3, 4), (2, 4)),
        ((300, 640), (3, 8), (5, 4)),
        ((4096, 14336), (32, 112), (112, 32)),
        ((14336, 4096), (112, 32), (32, 112)),
        ((1024, 4224), (8, 36), (33, 8)),
    ],
)
def test_te_scale_shape_pads_the_second_dimension_of_the_grid_to_four(shape, rowwise, columnwise):
    # Float8BlockQuantizer.get_scale_shape, block_scaling_dim=2: (ceil(M/128), round4(ceil(K/128))), column-wise
    # (ceil(K/128), round4(ceil(M/128)))
    assert te_scale_shape(shape) == rowwise and te_scale_shape(shape, columnwise=True) == columnwise
    assert te_scale_shape(shape)[0] == block_grid(shape)[0] and te_scale_shape(shape, True)[0] == block_grid(shape)[1]


@pytest.mark.parametrize("power_of_two", [True, False])
def test_agreed_grid_lands_in_the_padded_scale_inv_te_reads(power_of_two):
    weight = _weight(300, 200)
    scale = TeBlockScale(torch.device("cpu"), (300, 200), power_of_two)
    padded = scale.padded_scale_inv
    assert padded.shape == (3, 4) and scale.scale.shape == scale.scale_inv.shape == (3, 2)
    assert scale.scale_inv.data_ptr() == padded.data_ptr()  # a view: the gathered tensor reads what `set` writes
    scale.set(scale.local_amax(weight, 0))  # one rank holding every row: its grid is the agreed one
    want, _ = quantize(weight, BLOCK_128x128, E4M3, power_of_two=power_of_two)
    assert torch.equal(padded[:, :2], want.scale_inv) and torch.equal(padded[:, 2:], torch.ones(3, 2))
    if power_of_two:
        assert torch.equal(torch.frexp(padded)[0], torch.full_like(padded, 0.5))
    else:
        assert not torch.equal(torch.frexp(padded[:, :2])[0], torch.full((3, 2), 0.5))


@pytest.mark.parametrize("rows, cols, ranks", [(300, 200, 2), (320, 130, 2), (32, 32, 2), (256, 128, 2), (520, 64, 4)])
@pytest.mark.parametrize("power_of_two", [True, False])
def test_gathered_bytes_and_grid_are_the_cast_of_the_whole_weight(rows, cols, ranks, power_of_two):
    """Each rank casts its rows (shards of ceil(rows / ranks) rows; a block may straddle two) with the agreed grid
    (the max of the ranks' block amaxes); the ranks' padded bytes, concatenated as FSDP gathers them and cut to the
    weight, and the padded grid are quantize(whole weight) in 128x128 blocks; the column-wise operand TE derives
    from them (data transposed, grid transposed and padded) is quantize(W^T)."""
    weight = _weight(rows, cols, seed=rows + cols)
    rows_per = shard_rows(rows, ranks)
    # every rank wraps the whole weight, then holds its rows (FSDP's narrow keeps the wrapper and its scale)
    params = [wrap_te_weight(weight.clone(), Recipe(power_2_scale=power_of_two)) for _ in range(ranks)]
    locals_ = [p.data.narrow(0, r * rows_per, min(rows_per, rows - r * rows_per)) for r, p in enumerate(params)]
    agreed = torch.stack([t._scale.local_amax(t._tensor, r * rows_per) for r, t in enumerate(locals_)]).amax(0)
    gathered = []
    for rank, local in enumerate(locals_):
        local._scale.set(agreed)  # what Fp8GatherScales.agree does with the all-reduced grid
        (sent,), (shape,) = local.fsdp_pre_all_gather(Mesh(rank, ranks), torch.Size([rows, cols]), None, None, None)
        data = gathered_bytes(sent)  # sent as the shard's dtype where its columns divide (fsdp_params.gather_view)
        assert data.dtype == torch.uint8 and data.shape == (rows_per, cols) and shape == (rows, cols)
        gathered.append(data)
    data = gathered_rows(torch.cat(gathered), (rows, cols))
    want, _ = quantize(weight, BLOCK_128x128, E4M3, power_of_two=power_of_two)
    assert torch.equal(data, want.data.view(torch.uint8))
    grid = block_grid((rows, cols))
    padded = locals_[0]._scale.padded_scale_inv
    assert padded.shape == te_scale_shape((rows, cols)) and torch.equal(padded[:, : grid[1]], want.scale_inv)
    # The column-wise operand as TE's `_create_columnwise` makes it: an FP8 transpose and the transposed grid
    columnwise = torch.ones(te_scale_shape((rows, cols), columnwise=True))
    columnwise[:, : grid[0]] = padded[:, : grid[1]].t()
    cast_t, _ = quantize(weight.t().contiguous(), BLOCK_128x128, E4M3, power_of_two=power_of_two)
    assert torch.equal(data.t().contiguous(), cast_t.data.view(torch.uint8))
    assert torch.equal(columnwise[:, : grid[0]], cast_t.scale_inv)


def test_wrapping_follows_the_recipe():
    weight = torch.randn(130, 64)
    blockwise = wrap_te_weight(weight, Recipe(power_2_scale=False)).data
    assert type(blockwise) is TeBlockShardWeight and not blockwise._scale.power_of_two
    assert blockwise._scale.block == (128, 128) and blockwise._scale.padded_scale_inv.shape == (2, 4)
    assert wrap_te_weight(weight, Recipe()).data._scale.power_of_two
    per_tensor = wrap_te_weight(weight, Recipe(blockwise=False)).data
    assert type(per_tensor) is TeFp8ShardWeight and per_tensor._scale.block is None
    for recipe, named in ((Recipe(w_block_scaling_dim=1), "w_block_scaling_dim=1"), (Recipe(amax_epsilon=1e-6), "")):
        with pytest.raises(ValueError, match=f"128x128 weight blocks and no amax floor.*{named}"):
            wrap_te_weight(weight, recipe)


def test_fsdp_ops_keep_the_wrapper_and_a_checkpoint_holds_the_plain_shard():
    shard = wrap_te_weight(torch.randn(3, 8), Recipe()).data
    for piece in (shard.view(-1), shard.narrow(0, 0, 2), shard.detach(), torch.chunk(shard, 2)[0]):
        assert type(piece) is TeBlockShardWeight and piece._scale is shard._scale
    assert type(shard * 2) is torch.Tensor  # the optimizer's arithmetic: plain
    loaded = pickle.loads(pickle.dumps(shard))
    assert type(loaded) is torch.Tensor and torch.equal(loaded, shard._tensor)
