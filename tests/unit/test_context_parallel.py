"""Context parallelism's chunk geometry and masked attention, checked in one process: every cp rank's queries
against the keys all ranks hold (concatenated here as the all-gather would) give the whole-sequence attention's rows
at that rank's positions (the multi-rank runs are tests/distributed/test_context_parallel.py)."""

import pytest
import torch

from megatron.config import ConfigError, parse_args
from megatron.model.attention import explicit_attention
from megatron.parallel.context_parallel import (
    ContextParallel,
    causal_mask,
    chunk_indices,
    gathered_positions,
    local_positions,
    split_batch,
)

BASE = "--mock-data --vocab-size 128 --num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16"


def _ranks(cp: int) -> list[ContextParallel]:
    return [ContextParallel(size=cp, rank=r, comm_types=("p2p",)) for r in range(cp)]


def test_chunks_are_load_balanced_and_cover_the_sequence():
    assert [chunk_indices(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert local_positions(8, _ranks(2)[1]).tolist() == [2, 3, 4, 5]
    assert local_positions(8, _ranks(2)[0]).tolist() == [0, 1, 6, 7]
    for cp in (1, 2, 4):
        positions = torch.cat([local_positions(16, r) for r in _ranks(cp)])
        assert sorted(positions.tolist()) == list(range(16))
        assert torch.equal(gathered_positions(16, _ranks(cp)[0]), positions)
        # causal work per rank: the number of (query, key) pairs it computes is the same on every rank
        work = {int(causal_mask(16, r).sum()) for r in _ranks(cp)}
        assert len(work) == 1


def test_split_batch_takes_each_ranks_chunks_of_every_tensor():
    b, s = 2, 8
    tokens = torch.arange(b * s).view(b, s)
    batch = {
        "tokens": tokens,
        "labels": tokens + 100,
        "loss_mask": torch.ones(b, s),
        "position_ids": torch.arange(s).expand(b, s),
        "attention_mask": torch.ones(s, s, dtype=torch.bool).tril().expand(b, 1, s, s),
    }
    rank1 = split_batch(batch, _ranks(2)[1])
    assert rank1["tokens"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert rank1["labels"].tolist() == [[102, 103, 104, 105], [110, 111, 112, 113]]
    assert rank1["position_ids"][0].tolist() == [2, 3, 4, 5]
    assert rank1["attention_mask"].shape == (b, 1, 4, s)  # this rank's query rows, every key
    assert torch.equal(rank1["attention_mask"][0, 0, 0], torch.arange(s) <= 2)
    assert split_batch(batch, ContextParallel()) is batch


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("with_mask", [False, True])
def test_queries_against_gathered_keys_give_the_whole_sequence_attention(cp, with_mask):
    torch.manual_seed(0)
    b, heads, groups, s, hn = 2, 4, 2, 16, 8
    q, k, v = torch.randn(b, heads, s, hn), torch.randn(b, groups, s, hn), torch.randn(b, groups, s, hn)
    mask = None
    if with_mask:  # documents of lengths 5 and 11 (--reset-attention-mask): causal within each
        doc = (torch.arange(s) >= 5).long()
        mask = (torch.ones(s, s, dtype=torch.bool).tril() & (doc[:, None] == doc[None, :])).expand(b, 1, s, s)
    whole = explicit_attention(q, k, v, mask)
    ranks = _ranks(cp)
    keys_order = gathered_positions(s, ranks[0])
    k_all, v_all = k[:, :, keys_order], v[:, :, keys_order]  # what the all-gather hands every rank
    for rank in ranks:
        rows = local_positions(s, rank)
        if mask is None:
            rank_mask = causal_mask(s, rank)[None, None]
        else:
            rank_mask = mask[:, :, rows].index_select(-1, keys_order)
        out = explicit_attention(q[:, :, rows], k_all, v_all, rank_mask)
        torch.testing.assert_close(out, whole[:, :, rows], rtol=1e-5, atol=1e-6)


def test_local_engine_accepts_every_comm_type_and_te_checks_its_own():
    for comm in ("p2p", "all_gather", "a2a"):
        parse_args(f"{BASE} --context-parallel-size 2 --cp-comm-type {comm}".split(), world_size=2)
    te = "--transformer-impl transformer_engine --context-parallel-size 2"
    with pytest.raises(ConfigError, match="needs --bf16 or --fp16"):
        parse_args(f"{BASE} {te}".split(), world_size=2, device_type="cuda")
    with pytest.raises(ConfigError, match="per tensor-parallel rank must be divisible"):
        gqa = "--group-query-attention --num-query-groups 1"
        parse_args(f"{BASE} {te} --bf16 --cp-comm-type a2a {gqa}".split(), world_size=2, device_type="cuda")
    with pytest.raises(ConfigError, match="Transformer Engine's context-parallel attention is causal only"):
        parse_args(f"{BASE} {te} --bf16 --reset-attention-mask".split(), world_size=2, device_type="cuda")
    parse_args(f"{BASE} --context-parallel-size 2 --reset-attention-mask".split(), world_size=2)  # local: any mask
