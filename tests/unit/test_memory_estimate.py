"""The start-of-run memory estimate: bytes per parameter by category, against numbers worked out by hand.

The model shape is the same throughout: 2 layers, hidden 128, sequence 64, micro-batch 2, vocabulary 128, so one
micro-batch's activations in bf16 are 2 layers x (10 + 24) x 64 x 2 x 128 = 1,114,112 bytes plus the fp32 logits
and their gradient, 8 x 64 x 2 x 128 = 131,072 bytes: 1,245,184 in all (fp32 activations: twice the first part).
"""

import pytest
import torch

from megatron.config import Config, parse_args
from megatron.training.memory import estimate_bytes, in_flight_layers, memory_estimate_lines

SHAPE = "--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2"
VOCAB = 128
N = 1_000_000  # parameters on this rank
BF16_ACTIVATIONS = 2 * 34 * 64 * 2 * 128 + 8 * 64 * 2 * VOCAB
FP32_ACTIVATIONS = 2 * 2 * 34 * 64 * 2 * 128 + 8 * 64 * 2 * VOCAB


def parse(extra: str = "", **kwargs) -> Config:
    return parse_args(f"--mock-data --vocab-size {VOCAB} {SHAPE} {extra}".split(), **kwargs)


def test_bf16_plain():
    """2 (bf16 weights) + 4 (fp32 grads) + 4 (fp32 main copy) + 8 (Adam) = 18 bytes per parameter."""
    est = estimate_bytes(parse("--bf16"), N, VOCAB, torch.bfloat16)
    assert est == {
        "weights": 2 * N,
        "grads": 4 * N,
        "main_params": 4 * N,
        "adam": 8 * N,
        "activations": BF16_ACTIVATIONS,
        "in_flight": 1.0,
        "static": 18 * N,
        "total": 18 * N + BF16_ACTIVATIONS,
    }
    (line,) = memory_estimate_lines(parse("--bf16"), est, N, torch.bfloat16)
    assert "weights 1.9 MiB (2 B/param, bf16)" in line
    assert "fp32 main params 3.8 MiB (4 B/param)," in line
    assert "Adam states 7.6 MiB (8 B/param)," in line
    assert "18 B/param before activations" in line


def test_bf16_distributed_optimizer_over_two_data_parallel_ranks():
    """Main copy and Adam states are sharded: 2 + 4 + 4/2 + 8/2 = 12 bytes per parameter; the grads stay whole."""
    cfg = parse("--bf16 --use-distributed-optimizer", world_size=2)
    est = estimate_bytes(cfg, N, VOCAB, torch.bfloat16)
    assert (est["weights"], est["grads"], est["main_params"], est["adam"]) == (2 * N, 4 * N, 2 * N, 4 * N)
    assert est["static"] == 12 * N and est["total"] == 12 * N + BF16_ACTIVATIONS
    assert memory_estimate_lines(cfg, est, N, torch.bfloat16) == [
        "memory estimate per GPU: weights 1.9 MiB (2 B/param, bf16), grads 3.8 MiB (4 B/param),"
        " fp32 main params 1.9 MiB (2 B/param over 2 data-parallel ranks),"
        " Adam states 3.8 MiB (4 B/param over 2 data-parallel ranks),"
        " activations ~1.2 MiB per micro-batch (total ~12.6 MiB; 12 B/param before activations)"
    ]
    # Two ranks without the distributed optimizer: each keeps everything.
    assert estimate_bytes(parse("--bf16", world_size=2), N, VOCAB, torch.bfloat16)["static"] == 18 * N


def test_fp8_params_take_one_byte_each():
    """800M of 1B parameters in FP8, the rest bf16: weights 0.8 + 2 x 0.2 = 1.2 bytes per parameter; grads, main
    copy and Adam states as in bf16: 1.2 + 4 + 4 + 8 = 17.2."""
    cfg = parse("--bf16 --fp8-format hybrid --fp8-recipe tensorwise --fp8-param-gather")
    n, fp8 = 1_000_000_000, 800_000_000
    est = estimate_bytes(cfg, n, VOCAB, torch.bfloat16, fp8_params=fp8)
    assert est["weights"] == 1_200_000_000
    assert (est["grads"], est["main_params"], est["adam"]) == (4 * n, 4 * n, 8 * n)
    assert est["static"] == pytest.approx(17.2 * n)
    (line,) = memory_estimate_lines(cfg, est, n, torch.bfloat16, fp8_params=fp8)
    assert line.startswith("memory estimate per GPU: weights 1.12 GiB (1.2 B/param: 800M FP8 + 200M bf16),")
    assert "fp32 main params 3.73 GiB (4 B/param)," in line
    assert "(total ~16.02 GiB; 17.2 B/param before activations)" in line


def test_fp32_on_cpu_has_no_main_copy():
    """fp32 weights are their own master copy: 4 + 4 + 8 = 16 bytes per parameter; activations in fp32 take twice
    the bytes (the logits are fp32 either way)."""
    cfg = parse()
    est = estimate_bytes(cfg, N, VOCAB, torch.float32)
    assert (est["weights"], est["grads"], est["main_params"], est["adam"]) == (4 * N, 4 * N, 0, 8 * N)
    assert est["activations"] == FP32_ACTIVATIONS and est["total"] == 16 * N + FP32_ACTIVATIONS
    (line,) = memory_estimate_lines(cfg, est, N, torch.float32)
    assert "weights 3.8 MiB (4 B/param, fp32)" in line
    assert "no fp32 main params (the fp32 weights are the master copy)" in line
    assert "16 B/param before activations" in line


def test_pipeline_stages_count_their_layers_as_often_as_their_schedule_holds_them():
    """One layer's activations (34 x 64 x 2 x 128 bytes) per stage of 4 layers over 2 ranks (2 each), 4
    micro-batches. 1F1B: rank 0 runs 1 warm-up forward, so 2 micro-batches are in flight (4 layers' worth), rank 1
    one (2). Interleaved (2 chunks of 1 layer): rank 0 runs (2 - 1) x 2 + (2 - 1) x 2 = 4 warm-up forwards, then
    holds a 5th before its first backward: 5 layers' worth, Megatron-LM's pp x (1 + (pp - 1) / (pp x vpp)) = 2.5
    stages; rank 1 runs 2 warm-up forwards: 3."""
    layer, logits = 34 * 64 * 2 * 128, 8 * 64 * 2 * VOCAB
    four = "--bf16 --num-layers 4 --global-batch-size 8 --pipeline-model-parallel-size 2"
    for flags, held in (("", (4, 2)), ("--num-layers-per-virtual-pipeline-stage 1", (5, 3))):
        cfg = parse(f"{four} {flags}", world_size=2)
        for rank, layers in enumerate(held):
            assert in_flight_layers(cfg, rank) == layers
            est = estimate_bytes(cfg, N, VOCAB, torch.bfloat16, pp_rank=rank)
            assert est["activations"] == layers * layer + logits and est["in_flight"] == layers / 2
    (line,) = memory_estimate_lines(cfg, estimate_bytes(cfg, N, VOCAB, torch.bfloat16), N, torch.bfloat16)
    assert "activations ~" in line and "(2.5 micro-batches in flight on this pipeline stage)" in line, line
    # a single micro-batch per step: nothing runs ahead
    assert in_flight_layers(parse("--bf16 --num-layers 4 --pipeline-model-parallel-size 2", world_size=2), 0) == 2
    # full recomputation keeps each in-flight layer's input (2 of 34) and recomputes one layer at a time
    full = parse(
        f"{four} --recompute-granularity full --recompute-method uniform --recompute-num-layers 1", world_size=2
    )
    assert estimate_bytes(full, N, VOCAB, torch.bfloat16)["activations"] == (4 * 2 + 34) * 64 * 2 * 128 + logits


def test_more_fp8_params_than_params_is_an_error():
    with pytest.raises(ValueError, match="fp8_params"):
        estimate_bytes(parse("--bf16"), N, VOCAB, torch.bfloat16, fp8_params=N + 1)


def test_o2_states_with_fp8_weights_over_two_data_parallel_ranks():
    """--fp8-optimizer-level O2: bf16 grads 2, fp16 main params 2 + 1 (remainder) +
    4/128 (scales), fp8 first moment 1 + 4/128, fp16 second moment 2 + 4/128; main copy and moments over 2 ranks.
    With every weight FP8 (1 byte): 1 + 2 + (3.03125 + 1.03125 + 2.03125) / 2 = 6.046875 bytes per parameter."""
    cfg = parse("--bf16 --fp8-optimizer-level O2 --use-distributed-optimizer", world_size=2)
    est = estimate_bytes(cfg, N, VOCAB, torch.bfloat16, fp8_params=N)
    assert (est["weights"], est["grads"]) == (N, 2 * N)
    assert est["main_params"] == pytest.approx(3.03125 * N / 2) and est["adam"] == pytest.approx(3.0625 * N / 2)
    assert est["static"] == pytest.approx(6.046875 * N)
    (line,) = memory_estimate_lines(cfg, est, N, torch.bfloat16, fp8_params=N)
    assert "grads 1.9 MiB (2 B/param, bf16), fp16 main params 1.4 MiB (1.52 B/param over 2" in line, line
    assert "Adam states 1.5 MiB (1.53 B/param over 2 data-parallel ranks, fp8/fp16)" in line, line
    assert "6.05 B/param before activations" in line, line
    # O2's states with fp32 gradient buffers: 2 bytes more
    states = "--fp8-grad-reduce --use-precision-aware-optimizer --main-params-dtype fp16 --exp-avg-dtype fp8"
    o2 = estimate_bytes(
        parse(f"--bf16 {states} --exp-avg-sq-dtype fp16 --use-distributed-optimizer", world_size=2),
        N,
        VOCAB,
        torch.bfloat16,
        fp8_params=N,
    )
    assert o2["static"] == pytest.approx(8.046875 * N)


def test_fsdp_over_two_data_parallel_ranks():
    """FSDP at DP=2: fp32 weight and gradient shards (2 + 2 bytes per parameter), Adam's 8 halved, no main copy; plus
    two gathered bf16 units (a layer: (N - 128 x 128) / 2 parameters, larger than the vocabulary matrix) and one
    unit's bf16 gradient. optim_grads keeps the whole model gathered instead of two units."""
    layer = (N - VOCAB * 128) / 2
    est = estimate_bytes(parse("--bf16 --use-megatron-fsdp", world_size=2), N, VOCAB, torch.bfloat16)
    assert est["weights"] == 2 * N + 2 * 2 * layer
    assert est["grads"] == 2 * N + 2 * layer
    assert (est["main_params"], est["adam"]) == (0, 4 * N)
    flags = "--bf16 --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads"
    assert estimate_bytes(parse(flags, world_size=2), N, VOCAB, torch.bfloat16)["weights"] == 2 * N + 2 * N
    flags = "--bf16 --use-megatron-fsdp --megatron-fsdp-main-grads-dtype bf16"  # bf16 gradient shards: 1 B/param
    assert estimate_bytes(parse(flags, world_size=2), N, VOCAB, torch.bfloat16)["grads"] == N + 2 * layer
    line = memory_estimate_lines(parse("--bf16 --use-megatron-fsdp", world_size=2), est, N, torch.bfloat16)[0]
    assert "no fp32 main params" in line and "over 2 data-parallel ranks" in line, line


def test_fsdp_with_precision_aware_states():
    """FSDP at DP=2 with O2's precision-aware states: bf16 weight shards (1 B/param), fp32 gradient shards (2), the
    optimizer's fp16 main weights with their remainder and block scales (3.03 / 2) and FP8 / fp16 moments
    (1.03 / 2 + 2.03 / 2); the gathered units as without them."""
    layer = (N - VOCAB * 128) / 2
    states = "--use-precision-aware-optimizer --main-params-dtype fp16 --exp-avg-dtype fp8 --exp-avg-sq-dtype fp16"
    cfg = parse(f"--bf16 --use-megatron-fsdp {states}", world_size=2)
    est = estimate_bytes(cfg, N, VOCAB, torch.bfloat16)
    assert est["weights"] == N + 2 * 2 * layer
    assert est["grads"] == 2 * N + 2 * layer
    assert est["main_params"] == pytest.approx((3 + 4 / 128) * N / 2)
    assert est["adam"] == pytest.approx((3 + 8 / 128) * N / 2)
    line = memory_estimate_lines(cfg, est, N, torch.bfloat16)[0]
    assert "fp16 main params" in line and "over 2 data-parallel ranks, fp8/fp16" in line, line


def test_fsdp_with_tensor_and_context_parallelism():
    """TP=2 x FSDP=2: N is this rank's tensor-parallel piece, sharded over the two data-parallel ranks (fp32 weights
    and gradients 2 + 2 bytes per parameter, Adam's 8 halved), and the rank's vocabulary matrix is half of it
    (128 x 128 / 2), so a layer is (N - 64 x 128) / 2. Under CP=2 x DP=2 FSDP shards over all four data x context
    parallel ranks."""
    layer = (N - VOCAB * 128 / 2) / 2
    cfg = parse("--bf16 --use-megatron-fsdp --tensor-model-parallel-size 2 --sequence-parallel", world_size=4)
    est = estimate_bytes(cfg, N, VOCAB, torch.bfloat16)
    assert est["weights"] == 2 * N + 2 * 2 * layer
    assert est["grads"] == 2 * N + 2 * layer
    assert (est["main_params"], est["adam"]) == (0, 4 * N)
    layer = (N - VOCAB * 128) / 2
    est = estimate_bytes(
        parse("--bf16 --use-megatron-fsdp --context-parallel-size 2", world_size=4), N, VOCAB, torch.bfloat16
    )
    assert est["weights"] == N + 2 * 2 * layer
    assert est["grads"] == N + 2 * layer
    assert (est["main_params"], est["adam"]) == (0, 2 * N)
