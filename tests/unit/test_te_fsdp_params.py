"""The shard side of TE's FP8 all-gather under FSDP (megatron/parallel/fsdp/te_fp8_gather.py), which needs no GPU:
FSDP2's ops on a shard keep the TE wrapper and the per-weight state it shares (scale, transpose buffer), the optimizer's
arithmetic gives plain tensors, and the cast before the gather is the local layers' (E4M3 bytes at the agreed
scale, padded to FSDP's rows). The gathered side (a TE Float8Tensor) runs in tests/gpu/test_te_fsdp.py."""

import torch

from megatron.parallel.fsdp.fp8_gather import Fp8ShardWeight, gathered_bytes
from megatron.parallel.fsdp.te_fp8_gather import TeFp8ShardWeight, wrap_te_fp8_weight


class _Mesh:
    def size(self) -> int:
        return 2


class _Policy:
    param_dtype = torch.bfloat16


def test_fsdp_ops_keep_the_wrapper_and_its_state():
    param = wrap_te_fp8_weight(torch.randn(3, 8))
    shard = param.data
    assert isinstance(shard, TeFp8ShardWeight)
    for piece in (shard.view(-1), shard.narrow(0, 0, 2), shard.detach(), torch.chunk(shard, 2)[0]):
        assert type(piece) is TeFp8ShardWeight
        assert piece._scale is shard._scale and piece._gather is shard._gather
    assert type(shard * 2) is torch.Tensor  # arithmetic: plain
    local = Fp8ShardWeight(torch.randn(2, 2), shard._scale)
    assert type(local.view(-1)) is Fp8ShardWeight  # the local layers' wrapper stays its own class


def test_cast_before_the_gather_is_padded_e4m3_at_the_agreed_scale():
    weight = torch.randn(3, 8)
    shard = wrap_te_fp8_weight(weight).data
    amax = weight.abs().amax()
    shard._scale.set(amax)  # what Fp8GatherScales.agree does with the max over the ranks
    (sent,), (scale_inv, orig_size) = shard.fsdp_pre_all_gather(_Mesh(), torch.Size([5, 8]), (8, 1), None, _Policy())
    # 5 rows over 2 ranks: FSDP2 wants a padded shard's input in the shard's shape, so bytes on every rank
    assert sent.dtype == torch.uint8
    data = gathered_bytes(sent)
    assert data.dtype == torch.uint8 and data.shape == (3, 8) and orig_size == (5, 8)  # ceil(5 / 2) rows
    expect = (weight * (448.0 / amax)).to(torch.float8_e4m3fn)
    assert torch.equal(data, expect.view(torch.uint8))
    assert torch.allclose(scale_inv, amax / 448.0)


def test_gathered_scales_come_from_tensors_that_outlive_the_gather():
    # FSDP2 runs fsdp_pre_all_gather on its copy-in stream: metadata made there and freed after the compute stream's
    # copy was queued could be reused by the next unit's gather first (another layer's scale)
    shard = wrap_te_fp8_weight(torch.randn(4, 8)).data
    shard._scale.set(torch.tensor(2.0))
    first = shard.fsdp_pre_all_gather(_Mesh(), torch.Size([8, 8]), (8, 1), None, None)[1]
    again = shard.fsdp_pre_all_gather(_Mesh(), torch.Size([8, 8]), (8, 1), None, None)[1]
    assert first[0] is again[0] is shard._scale.scale_inv
    local = Fp8ShardWeight(torch.randn(4, 8), shard._scale)
    scale_inv, amax = local.fsdp_pre_all_gather(_Mesh(), torch.Size([8, 8]), (8, 1), None, None)[1]
    assert scale_inv is shard._scale.scale_inv and amax is shard._scale.amax


def test_a_weight_moved_to_bf16_gathers_its_shard_in_the_gather_dtype():
    """--fp8-auto-bf16 under FSDP (parallel/fsdp/fsdp2.py, `Fp8GatherDtypes`, sets `high_precision`): the shard's rows
    in bf16, padded to FSDP's rows, and no metadata; the gathered weight is the plain tensor (FSDP views its rows), and
    nothing to rebuild at later gathers. The FP8 bytes of the step, no longer gathered, are not kept."""
    weight = torch.randn(2, 8)
    shard = wrap_te_fp8_weight(weight).data
    shard._scale.high_precision = True
    (data,), metadata = shard.fsdp_pre_all_gather(_Mesh(), torch.Size([5, 8]), (8, 1), None, _Policy())
    assert metadata is None and data.dtype == torch.bfloat16 and data.shape == (3, 8)
    assert torch.equal(data[:2], weight.to(torch.bfloat16)) and not data[2].any()
    gathered = torch.cat([data, data])
    weight_out, inner = shard.fsdp_post_all_gather((gathered,), None, torch.bfloat16)
    assert type(weight_out) is torch.Tensor and weight_out is gathered and inner == (gathered,)
    assert shard.fsdp_post_all_gather((gathered,), None, torch.bfloat16, out=weight_out) is None
    assert shard._scale.data is None


def test_te_linears_gather_fp8_while_their_layer_is_in_the_autocasts_fp8_layers():
    """`Fp8GatherDtypes`' rule in production: a TE layer's linears follow the live `fp8_layers` the FP8 guard edits;
    any other linear (the local layers', which compute a moved layer on dequantized FP8 weights) keeps FP8."""
    from types import SimpleNamespace

    from megatron.parallel.fsdp.fsdp2 import te_gathers_fp8

    class Layer(torch.nn.Module):
        def __init__(self, number, fp8):
            super().__init__()
            self.layer_number, self.fp8, self.linear = number, fp8, torch.nn.Linear(2, 2)

        def te_modules(self):
            return [self.linear]

    autocast = SimpleNamespace(fp8_layers={1, 2})
    model = torch.nn.ModuleList([Layer(1, autocast), Layer(2, autocast), torch.nn.Linear(2, 2)])
    gathers_fp8 = te_gathers_fp8(model)
    assert [gathers_fp8(m) for m in (model[0].linear, model[1].linear, model[2])] == [True, True, True]
    autocast.fp8_layers.discard(2)  # TETaps.move_to_bf16
    assert [gathers_fp8(m) for m in (model[0].linear, model[1].linear, model[2])] == [True, False, True]
    autocast.fp8_layers.add(2)
    assert gathers_fp8(model[1].linear)


def test_the_bytes_go_as_the_gather_dtype_where_the_columns_divide():
    """`gather_view`: E4M3 bytes travel as the unit's gather dtype (one dtype per unit: FSDP2's copy-in then moves
    2 or 4 bytes per element, not 1), as bytes where the columns do not divide; the output views back to them."""
    from megatron.parallel.fsdp.fp8_gather import gather_view

    data = torch.arange(24, dtype=torch.uint8).view(3, 8)
    for dtype, shape in ((torch.bfloat16, (3, 4)), (torch.float32, (3, 2)), (torch.uint8, (3, 8))):
        sent = gather_view(data, dtype)
        assert sent.dtype == dtype and sent.shape == shape and torch.equal(gathered_bytes(sent), data)
    odd = torch.arange(9, dtype=torch.uint8).view(3, 3)
    assert gather_view(odd, torch.bfloat16) is odd
    weight = torch.randn(6, 8)  # rows the ranks divide: sent as the unit's gather dtype, the policy's
    shard = wrap_te_fp8_weight(weight).data
    shard._scale.set(weight.abs().amax())
    (sent,), _ = shard.fsdp_pre_all_gather(_Mesh(), torch.Size([12, 8]), (8, 1), None, _Policy())
    assert sent.dtype == torch.bfloat16 and sent.shape == (6, 4)
    expect = (weight * (448.0 / weight.abs().amax())).to(torch.float8_e4m3fn)
    assert torch.equal(gathered_bytes(sent), expect.view(torch.uint8))
