"""Process-group layout, tensor/sequence-parallel collectives, vocab-parallel cross-entropy and the 1F1B schedule,
each against the same computation in one process (gloo ranks on CPU)."""

import pytest
import torch
import torch.distributed as dist

from megatron.parallel.dims import ParallelDims
from megatron.parallel.pipeline import forward_backward_1f1b
from megatron.parallel.tensor_parallel import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_sp,
    vocab_parallel_cross_entropy,
)
from tests.dist_utils import run_distributed


def test_layout_order_single_process_math():
    # rank = pp * (dp * tp) + dp * tp + tp, checked without a process group through the formula's inverse.
    tp, dp, pp = 2, 2, 2
    seen = set()
    for rank in range(8):
        t, d, p = rank % tp, (rank // tp) % dp, rank // (tp * dp)
        assert p * dp * tp + d * tp + t == rank
        seen.add((t, d, p))
    assert seen == {(t, d, p) for t in range(tp) for d in range(dp) for p in range(pp)}


def _groups_body(rank, world):
    dims = ParallelDims.create(world, rank, tp=2, pp=2)
    assert (dims.tp_rank, dims.dp_rank, dims.pp_rank) == (rank % 2, 0, rank // 2)
    assert dist.get_process_group_ranks(dims.tp_group) == ([0, 1] if rank < 2 else [2, 3])
    assert dist.get_process_group_ranks(dims.pp_group) == ([0, 2] if rank % 2 == 0 else [1, 3])
    assert dims.dp_group is None and dims.dp == 1
    assert dist.get_process_group_ranks(dims.amax_group) == ([0, 1] if rank < 2 else [2, 3])
    assert dims.pp_ranks == ((0, 2) if rank % 2 == 0 else (1, 3))
    assert dims.is_first_stage == (rank < 2) and dims.is_last_stage == (rank >= 2)
    # --tp-only-amax-red: the amaxes are reduced over the tensor-parallel group, not over data-parallel replicas
    replicas = ParallelDims.create(world, rank, tp=2, pp=1)
    assert dist.get_process_group_ranks(replicas.amax_group) == [0, 1, 2, 3]
    tp_only = ParallelDims.create(world, rank, tp=2, pp=1, tp_only_amax=True)
    assert tp_only.amax_group is tp_only.tp_group and tp_only.dp == 2
    assert ParallelDims.create(world, rank, tp=1, pp=1, tp_only_amax=True).amax_group is None

    # Column-parallel then row-parallel linear (Megatron MLP) equals the dense product, values and gradients.
    torch.manual_seed(0)
    x = torch.randn(6, 8, requires_grad=True)
    w1, w2 = torch.randn(12, 8, requires_grad=True), torch.randn(8, 12, requires_grad=True)
    dense = (x @ w1.t()).relu() @ w2.t()
    dense.square().sum().backward()
    t = dims.tp_rank
    w1_shard = w1.detach()[t * 6 : (t + 1) * 6].clone().requires_grad_()
    w2_shard = w2.detach()[:, t * 6 : (t + 1) * 6].clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    out = reduce_from_tp((copy_to_tp(x2, dims.tp_group) @ w1_shard.t()).relu() @ w2_shard.t(), dims.tp_group)
    out.square().sum().backward()
    torch.testing.assert_close(out, dense)
    torch.testing.assert_close(x2.grad, x.grad)
    torch.testing.assert_close(w1_shard.grad, w1.grad[t * 6 : (t + 1) * 6])
    torch.testing.assert_close(w2_shard.grad, w2.grad[:, t * 6 : (t + 1) * 6])

    # Sequence parallel: scatter -> gather round trip and reduce-scatter adjointness.
    seq = torch.randn(4, 3, requires_grad=True)
    local = scatter_to_sp(seq, dims.tp_group)
    assert local.shape == (2, 3)
    torch.testing.assert_close(gather_from_sp(local, dims.tp_group), seq)
    y = torch.randn(4, 3, requires_grad=True)
    reduced = reduce_scatter_to_sp(y, dims.tp_group)
    torch.testing.assert_close(reduced, 2 * y.detach()[t * 2 : (t + 1) * 2])  # both ranks hold the same y
    reduced.sum().backward()
    torch.testing.assert_close(y.grad, torch.ones(4, 3))
    g = gather_from_tp(torch.full((2, 1), float(t)), dims.tp_group)
    torch.testing.assert_close(g, torch.tensor([[0.0, 1.0], [0.0, 1.0]]))

    # Vocab-parallel cross-entropy equals the full one, loss and logits gradient.
    logits = torch.randn(5, 10, requires_grad=True)
    labels = torch.tensor([0, 4, 5, 9, 7])
    ref = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    ref.sum().backward()
    shard = logits.detach()[:, t * 5 : (t + 1) * 5].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, labels, dims.tp_group)
    loss.sum().backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(shard.grad, logits.grad[:, t * 5 : (t + 1) * 5])


def test_groups_and_tensor_parallel_collectives():
    run_distributed(_groups_body, world_size=4)


def _pipeline_body(rank, world, num_micro):
    dims = ParallelDims.create(world, rank, tp=1, pp=world)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 4) for _ in range(world)]
    data = [(torch.randn(3, 4), torch.randn(3, 4)) for _ in range(num_micro)]
    # Reference: the whole network in this process.
    ref_losses = []
    for x, y in data:
        h = x
        for layer in layers:
            h = torch.tanh(layer(h))
        loss = (h - y).square().mean() / num_micro
        loss.backward()
        ref_losses.append(loss.detach())
    ref_grads = [p.grad.clone() for p in layers[rank].parameters()]
    for layer in layers:
        layer.zero_grad()
    mine = layers[rank]

    def stage_forward(batch, input_tensor):
        x, y = batch
        h = torch.tanh(mine(x if dims.is_first_stage else input_tensor))
        return (h - y).square().mean() / num_micro if dims.is_last_stage else h

    losses = forward_backward_1f1b(
        stage_forward, iter(data), num_micro, dims, (3, 4), torch.float32, torch.device("cpu")
    )
    for got, want in zip([p.grad for p in mine.parameters()], ref_grads):
        torch.testing.assert_close(got, want)
    if dims.is_last_stage:
        torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    else:
        assert losses == []


@pytest.mark.parametrize("world, num_micro", [(2, 4), (4, 3)])
def test_1f1b_matches_single_process(world, num_micro):
    run_distributed(_pipeline_body, world_size=world, args=(num_micro,))
