"""The start-of-run memory estimate: bytes per parameter by category, against numbers worked out by hand.

The model shape is the same throughout (but for the Llama-shaped tests at the end): 2 layers, hidden 128, sequence
64, micro-batch 2, vocabulary 128, so one micro-batch's activations in bf16 are 2 layers x (10 + 24) x 64 x 2 x 128
= 1,114,112 bytes, the final norm's and output layer's inputs 4 x 64 x 2 x 128 = 65,536, and the fp32 logits and
their gradient, 8 x 64 x 2 x 128 = 131,072 bytes: 1,310,720 in all (fp32 activations: twice the first two parts).
The output layer's backward adds its weight gradient (128 x 128 x 2 bytes) and its input gradient (64 x 2 x 128 x
2): 65,536 bytes of buffers in bf16, twice that in fp32.
"""

import pytest
import torch

from megatron.config import Config, parse_args
from megatron.parallel import ParallelDims
from megatron.training.memory import (
    estimate_bytes,
    headroom_line,
    headroom_note,
    in_flight_layers,
    memory_estimate_lines,
    output_wgrad_in_buffer,
)
from tests.assets.scripts import load_script

SHAPE = "--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2"
VOCAB = 128
N = 1_000_000  # parameters on this rank
SBH = 64 * 2 * 128
BF16_ACTIVATIONS = (2 * 34 + 4) * SBH + 8 * 64 * 2 * VOCAB
FP32_ACTIVATIONS = 2 * (2 * 34 + 4) * SBH + 8 * 64 * 2 * VOCAB
BF16_BUFFERS = 2 * VOCAB * 128 + 2 * SBH


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
        "weight_casts": 0,
        "activations": BF16_ACTIVATIONS,
        "buffers": BF16_BUFFERS,
        "step": 0,
        "freed_shards": 0,
        "calibration": 0,  # no FP8 delayed scaling: no calibration pass
        "in_flight": 1.0,
        "static": 18 * N,
        "total": 18 * N + BF16_ACTIVATIONS + BF16_BUFFERS,
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
    assert est["static"] == 12 * N and est["total"] == 12 * N + BF16_ACTIVATIONS + BF16_BUFFERS
    assert memory_estimate_lines(cfg, est, N, torch.bfloat16) == [
        "memory estimate per GPU: weights 1.9 MiB (2 B/param, bf16), grads 3.8 MiB (4 B/param),"
        " fp32 main params 1.9 MiB (2 B/param over 2 data-parallel ranks),"
        " Adam states 3.8 MiB (4 B/param over 2 data-parallel ranks),"
        " activations ~1.2 MiB per micro-batch, backward buffers ~0.1 MiB (the output layer's gradients)"
        " (total ~12.8 MiB; 12 B/param before activations)"
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
    assert est["activations"] == FP32_ACTIVATIONS and est["buffers"] == 2 * BF16_BUFFERS
    assert est["total"] == 16 * N + FP32_ACTIVATIONS + 2 * BF16_BUFFERS
    (line,) = memory_estimate_lines(cfg, est, N, torch.float32)
    assert "weights 3.8 MiB (4 B/param, fp32)" in line
    assert "no fp32 main params (the fp32 weights are the master copy)" in line
    assert "16 B/param before activations" in line


def test_pipeline_stages_count_their_layers_as_often_as_their_schedule_holds_them():
    """One layer's activations (34 x 64 x 2 x 128 bytes) per stage of 4 layers over 2 ranks (2 each), 4
    micro-batches. 1F1B: rank 0 runs 1 warm-up forward, so 2 micro-batches are in flight (4 layers' worth), rank 1
    one (2). Interleaved (2 chunks of 1 layer): rank 0 runs (2 - 1) x 2 + (2 - 1) x 2 = 4 warm-up forwards, then
    holds a 5th before its first backward: 5 layers' worth, Megatron-LM's pp x (1 + (pp - 1) / (pp x vpp)) = 2.5
    stages; rank 1 runs 2 warm-up forwards: 3. Only the last stage computes the loss: its logits, the final norm's
    and output layer's inputs, and the output layer's gradients."""
    layer, loss = 34 * SBH, 4 * SBH + 8 * 64 * 2 * VOCAB
    four = "--bf16 --num-layers 4 --global-batch-size 8 --pipeline-model-parallel-size 2"
    for flags, held in (("", (4, 2)), ("--num-layers-per-virtual-pipeline-stage 1", (5, 3))):
        cfg = parse(f"{four} {flags}", world_size=2)
        for rank, layers in enumerate(held):
            assert in_flight_layers(cfg, rank) == layers
            est = estimate_bytes(cfg, N, VOCAB, torch.bfloat16, pp_rank=rank)
            assert est["activations"] == layers * layer + (loss if rank == 1 else 0)
            assert est["buffers"] == (BF16_BUFFERS if rank == 1 else 0) and est["in_flight"] == layers / 2
    (line,) = memory_estimate_lines(cfg, estimate_bytes(cfg, N, VOCAB, torch.bfloat16), N, torch.bfloat16)
    assert "activations ~" in line and "(2.5 micro-batches in flight on this pipeline stage)" in line, line
    # a single micro-batch per step: nothing runs ahead
    assert in_flight_layers(parse("--bf16 --num-layers 4 --pipeline-model-parallel-size 2", world_size=2), 0) == 2
    # full recomputation keeps each in-flight layer's input (2 of 34) and recomputes one layer at a time
    full = parse(
        f"{four} --recompute-granularity full --recompute-method uniform --recompute-num-layers 1", world_size=2
    )
    assert estimate_bytes(full, N, VOCAB, torch.bfloat16)["activations"] == (4 * 2 + 34) * SBH


def test_block_recomputation_adds_no_group_once_later_layers_are_freed():
    """--recompute-method block: the first N layers keep their inputs (2 each), the rest everything (34 each). When
    the backward reaches a recomputed layer it has freed the kept layers after it, which hold more than the one
    layer recomputed: nothing is added. Under uniform nothing is freed first: one group (here 2 layers) is added."""
    flags = "--bf16 --num-layers 4 --recompute-granularity full --recompute-method"
    est = estimate_bytes(parse(f"{flags} block --recompute-num-layers 3"), N, VOCAB, torch.bfloat16)
    assert est["activations"] == (3 * 2 + 34) * SBH + 4 * SBH + 8 * 64 * 2 * VOCAB
    est = estimate_bytes(parse(f"{flags} uniform --recompute-num-layers 2"), N, VOCAB, torch.bfloat16)
    assert est["activations"] == (4 * 2 + 2 * 34) * SBH + 4 * SBH + 8 * 64 * 2 * VOCAB


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


LOSS_SIDE = 4 * SBH + 8 * 64 * 2 * VOCAB + BF16_BUFFERS  # freed before FSDP's reduce-scatter staging is allocated


def test_fsdp_over_two_data_parallel_ranks():
    """FSDP at DP=2: fp32 weight and gradient shards (2 + 2 bytes per parameter), Adam's 8 halved, no main copy. At
    the start of the backward FSDP holds the output unit (the 128 x 128 vocabulary matrix) and the last layer
    ((N - 128 x 128) / 2 parameters) gathered in bf16; once the logits are freed, a layer unit's bf16 gradient (2 B)
    beside the previous unit's fp32 reduce-scatter input and output (4 + 4/2 B) exceeds what was freed by the rest.
    optim_grads keeps the whole model gathered instead of two units. No step transient with fp32 gradients."""
    layer, vocab = (N - VOCAB * 128) / 2, VOCAB * 128
    est = estimate_bytes(parse("--bf16 --use-megatron-fsdp", world_size=2), N, VOCAB, torch.bfloat16)
    assert (est["weights"], est["grads"], est["main_params"], est["adam"], est["step"]) == (2 * N, 2 * N, 0, 4 * N, 0)
    staging = layer * (2 + 4 + 2) - LOSS_SIDE
    assert est["buffers"] == BF16_BUFFERS + 2 * (vocab + layer) + staging
    assert est["total"] == 8 * N + BF16_ACTIVATIONS + est["buffers"]
    flags = "--bf16 --use-torch-fsdp2 --data-parallel-sharding-strategy optim_grads"
    assert estimate_bytes(parse(flags, world_size=2), N, VOCAB, torch.bfloat16)["buffers"] == (
        BF16_BUFFERS + 2 * N + staging
    )
    # --torch-fsdp2-no-reshard-after-forward: every unit gathered at the end of the forward, the rest unchanged
    flags = "--bf16 --use-torch-fsdp2 --torch-fsdp2-no-reshard-after-forward"
    kept = estimate_bytes(parse(flags, world_size=2), N, VOCAB, torch.bfloat16)
    assert kept["buffers"] == BF16_BUFFERS + 2 * N + staging
    assert {k: v for k, v in kept.items() if k not in ("buffers", "total", "calibration")} == {
        k: v for k, v in est.items() if k not in ("buffers", "total", "calibration")
    }
    assert kept["total"] == est["total"] + 2 * N - 2 * (vocab + layer)
    # bf16 gradient shards: 1 B/param, reduce-scattered in bf16 (2 + 2 + 2/2 B of staging); torch's AdamW steps on
    # fp32 copies of them (4 B per parameter of the shard), less than the activations here
    flags = "--bf16 --use-megatron-fsdp --megatron-fsdp-main-grads-dtype bf16"
    bf16 = estimate_bytes(parse(flags, world_size=2), N, VOCAB, torch.bfloat16)
    assert (bf16["grads"], bf16["step"]) == (N, 2 * N)
    assert bf16["buffers"] == BF16_BUFFERS + 2 * (vocab + layer) + layer * (2 + 2 + 1) - LOSS_SIDE
    line = memory_estimate_lines(parse("--bf16 --use-megatron-fsdp", world_size=2), est, N, torch.bfloat16)[0]
    assert "weights 1.9 MiB (2 B/param, fp32 shards over 2 data-parallel ranks)" in line, line
    assert "no fp32 main params" in line and "(gathered units, gradients in flight)" in line, line


def test_fsdp_with_precision_aware_states():
    """FSDP at DP=2 with O2's precision-aware states: bf16 weight shards (1 B/param), fp32 gradient shards (2), the
    optimizer's fp16 main weights with their remainder and block scales (3.03 / 2) and FP8 / fp16 moments
    (1.03 / 2 + 2.03 / 2); the gathered units as without them."""
    layer, vocab = (N - VOCAB * 128) / 2, VOCAB * 128
    states = "--use-precision-aware-optimizer --main-params-dtype fp16 --exp-avg-dtype fp8 --exp-avg-sq-dtype fp16"
    cfg = parse(f"--bf16 --use-megatron-fsdp {states}", world_size=2)
    est = estimate_bytes(cfg, N, VOCAB, torch.bfloat16)
    assert (est["weights"], est["grads"]) == (N, 2 * N)
    assert est["buffers"] == BF16_BUFFERS + 2 * (vocab + layer) + layer * (2 + 4 + 2) - LOSS_SIDE
    assert est["main_params"] == pytest.approx((3 + 4 / 128) * N / 2)
    assert est["adam"] == pytest.approx((3 + 8 / 128) * N / 2)
    line = memory_estimate_lines(cfg, est, N, torch.bfloat16)[0]
    assert "fp16 main params" in line and "over 2 data-parallel ranks, fp8/fp16" in line, line
    # bf16 gradient shards with the precision-aware optimizer: its fused kernel reads them, no fp32 copies
    cfg = parse(f"--bf16 --use-megatron-fsdp {states} --megatron-fsdp-main-grads-dtype bf16", world_size=2)
    assert estimate_bytes(cfg, N, VOCAB, torch.bfloat16)["step"] == 0


def test_fsdp_with_tensor_and_context_parallelism():
    """TP=2 x FSDP=2: N is this rank's tensor-parallel piece, sharded over the two data-parallel ranks (fp32 weights
    and gradients 2 + 2 bytes per parameter, Adam's 8 halved), and the rank's vocabulary matrix is half of it
    (128 x 128 / 2), so a layer is (N - 64 x 128) / 2; the logits are half too. Under CP=2 x DP=2 FSDP shards over
    all four data x context parallel ranks, and a rank holds half the sequence's activations."""
    layer, vocab = (N - VOCAB * 128 / 2) / 2, VOCAB * 128 / 2
    cfg = parse("--bf16 --use-megatron-fsdp --tensor-model-parallel-size 2 --sequence-parallel", world_size=4)
    est = estimate_bytes(cfg, N, VOCAB, torch.bfloat16)
    assert (est["weights"], est["grads"], est["main_params"], est["adam"]) == (2 * N, 2 * N, 0, 4 * N)
    # sequence parallel: every activation term halved, the output layer's input gathered (2 of the 4)
    loss_side = (1 + 2) * SBH + 4 * 64 * 2 * VOCAB + 2 * vocab + 2 * SBH
    assert est["activations"] == 2 * 17 * SBH + (1 + 2) * SBH + 4 * 64 * 2 * VOCAB
    assert est["buffers"] == 2 * vocab + 2 * SBH + 2 * (vocab + layer) + layer * (2 + 4 + 2) - loss_side
    layer, vocab = (N - VOCAB * 128) / 2, VOCAB * 128
    est = estimate_bytes(
        parse("--bf16 --use-megatron-fsdp --context-parallel-size 2", world_size=4), N, VOCAB, torch.bfloat16
    )
    assert (est["weights"], est["grads"], est["main_params"], est["adam"]) == (N, N, 0, 2 * N)
    out = 2 * vocab + SBH  # the output layer's weight gradient (whole) and input gradient (half the sequence)
    loss_side = (4 * SBH + 8 * 64 * 2 * VOCAB) / 2 + out
    assert est["buffers"] == out + 2 * (vocab + layer) + layer * (2 + 4 + 4 / 4) - loss_side


# llama-1b as scripts/benchmark.py runs it (16 layers, h 2048, ffn 8192, GQA 32/8, sequence 4096, micro-batch 2,
# vocabulary 32000 untied, no dropout), on two data-parallel ranks
LLAMA = (
    "--mock-data --tokenizer-type NullTokenizer --position-embedding-type rope --normalization RMSNorm --swiglu"
    " --disable-bias-linear --untie-embeddings-and-output-weights --group-query-attention --hidden-dropout 0"
    " --attention-dropout 0 --bf16 --fp8-format hybrid --fp8-recipe delayed --num-attention-heads 32"
    " --num-query-groups 8 --transformer-impl local"
)
LLAMA_1B = (
    f"{LLAMA} --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --seq-length 4096"
    " --max-position-embeddings 4096 --micro-batch-size 2 --global-batch-size 16 --vocab-size 31999"
)
LLAMA3_8B = (
    f"{LLAMA} --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --seq-length 8192"
    " --max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 8 --vocab-size 128255"
)
L1B_V, L1B_H, L1B_SBH = 32000, 2048, 4096 * 2 * 2048
L1B_LAYER = 2048 * (2048 + 2 * 512) + 2048 * 2048 + 2048 * 2 * 8192 + 8192 * 2048 + 2 * 2048  # linears, 2 norms
L1B_N = 2 * L1B_V * L1B_H + 16 * L1B_LAYER + L1B_H  # embedding, output layer, layers, final norm
L1B_UNIT = (L1B_N - 2 * L1B_V * L1B_H) / 16  # a layer as the estimate takes it: the final norm spread over them


def llama(flags: str, impl: str = "transformer_engine", model: str = LLAMA_1B) -> Config:
    """The configuration pretrain_gpt.py builds for llama-1b (TE's layers need a GPU to parse: parsed local, then
    marked as TE's, which is all the estimate reads)."""
    cfg = parse_args(f"{model} {flags}".split(), world_size=2)
    cfg.model.transformer_impl = impl
    return cfg


def test_llama_1b_te_fsdp2_from_its_terms():
    """llama-1b, TE layers, FP8 delayed, optim_grads_params (the benchmark's fsdp2 layout), per GPU:

    shards: fp32 weights and gradients 2 + 2 B/param, Adam 8/2; activations per layer in bytes per s*b*h: norm
    inputs 4, q, k, v 2 x 1.5, attention output 2, fc1 output 2 x 8, then in the 15 FP8 layers (the first stays
    bf16) FP8 copies of the QKV and fc1 inputs 1 + 1, of the proj input 1 and of the fc2 input 4 (32 in all), in the
    bf16 one 2 + 2 and 8 (37); the loss: the bf16 logits (2 x s x b x V) with the final norm's and output layer's
    inputs (2 + 2); buffers: the output layer's bf16 weight and input gradients, and gathered the output unit (V x h)
    and the last layer in bf16; the reduce-scatter staging of a unit (65.5M x (2 + 4 + 2) B) is less than the logits
    and output layer's tensors it replaces. TE keeps no FP8 weight casts under optim_grads_params; no step transient."""
    cfg = llama("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --fsdp-double-buffer")
    est = estimate_bytes(cfg, L1B_N, L1B_V, torch.bfloat16)
    static = (2 + 2 + 4) * L1B_N
    activations = (15 * 32 + 37 + 4) * L1B_SBH + 2 * 4096 * 2 * L1B_V
    buffers = 2 * L1B_V * L1B_H + 2 * L1B_SBH + 2 * (L1B_V * L1B_H + L1B_UNIT)
    assert (est["static"], est["weight_casts"], est["step"]) == (static, 0, 0)
    assert est["activations"] == pytest.approx(activations) and est["buffers"] == pytest.approx(buffers)
    assert est["total"] == pytest.approx(static + activations + buffers)
    # within 1% of what two H100s measured (docs/benchmarks.md, "FSDP and ZeRO-2 at DP=2": 17.27 GiB)
    assert est["total"] / 2**30 == pytest.approx(17.27, rel=0.01)
    # optim_grads keeps the whole model gathered (19.2 GiB measured on two H200s): 2 bytes per parameter
    cfg_flags = "--use-torch-fsdp2 --data-parallel-sharding-strategy"
    cfg = llama(f"{cfg_flags} optim_grads --fsdp-double-buffer")
    whole = estimate_bytes(cfg, L1B_N, L1B_V, torch.bfloat16)
    gathered = whole["buffers"] - buffers + 2 * (L1B_V * L1B_H + L1B_UNIT)
    assert gathered == pytest.approx(2 * L1B_N)
    # ... and lets TE keep the step's FP8 weight casts, as the distributed optimizer does: 2 B per element of the 15
    # FP8 layers, in the static bytes and said on the startup line
    assert whole["weight_casts"] == 2 * 15 * L1B_UNIT and whole["static"] == static + 2 * 15 * L1B_UNIT
    (line,) = memory_estimate_lines(cfg, whole, L1B_N, torch.bfloat16)
    assert "TE's FP8 weight casts" in line and "kept for the step's micro-batches" in line
    local = estimate_bytes(
        llama(f"{cfg_flags} optim_grads --fsdp-double-buffer", "local"), L1B_N, L1B_V, torch.bfloat16
    )
    assert local["weight_casts"] == 0  # the local layers' casts are not counted (as without FSDP)


def test_llama_1b_te_distributed_optimizer_counts_the_cached_weight_casts():
    """The same model under the distributed optimizer: bf16 weights 2, fp32 gradient buffer 4, main copy and Adam
    (4 + 8) / 2; TE keeps each FP8 layer's weight cast and its transpose for the step (2 B per element of the 15
    FP8 layers); no gathered units (23.05 GiB measured)."""
    cfg = llama("--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather")
    est = estimate_bytes(cfg, L1B_N, L1B_V, torch.bfloat16)
    assert est["weight_casts"] == 2 * 15 * L1B_UNIT
    assert est["static"] == 12 * L1B_N + 2 * 15 * L1B_UNIT
    assert est["buffers"] == pytest.approx(2 * L1B_V * L1B_H + 2 * L1B_SBH)
    assert est["total"] / 2**30 == pytest.approx(23.05, rel=0.02)
    # the local layers keep 16-bit GEMM inputs and no counted casts, and the plain loss 8 bytes per logit
    local = estimate_bytes(llama("--use-distributed-optimizer", "local"), L1B_N, L1B_V, torch.bfloat16)
    assert local["weight_casts"] == 0
    assert local["activations"] == pytest.approx((15 * 37 + 37 + 4) * L1B_SBH + 8 * 4096 * 2 * L1B_V)


def test_llama_1b_te_grad_shards_hold_a_gradient_shard_and_one_bucket():
    """--use-megatron-fsdp optim_grads on the flat buckets (parallel/fsdp/flat_shards.py): the distributed optimizer's
    weights, main copy, Adam states and TE weight casts, but fp32 gradient shards (4 / 2 B/param) instead of the whole
    buffer; at the start of the backward one bucket more than the distributed optimizer holds: the untied output layer's
    weight, 65.5M fp32 elements (more than --ddp-bucket-size's 40M: a bucket of its own). bf16 shards
    (--grad-reduce-in-bf16) halve the shards; a bf16 reduce-scatter halves the bucket, and the output layer's GEMM
    writes its weight gradient there, with no copy beside it."""
    zero2 = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads --overlap-grad-reduce"
    distopt = estimate_bytes(llama("--use-distributed-optimizer --overlap-grad-reduce"), L1B_N, L1B_V, torch.bfloat16)
    est = estimate_bytes(llama(zero2), L1B_N, L1B_V, torch.bfloat16)
    assert est["grads"] == 2 * L1B_N and distopt["grads"] == 4 * L1B_N
    assert est["static"] == distopt["static"] - 2 * L1B_N
    assert est["buffers"] - distopt["buffers"] == 4 * L1B_V * L1B_H
    assert est["total"] == pytest.approx(distopt["total"] - 2 * L1B_N + 4 * L1B_V * L1B_H)
    bf16 = estimate_bytes(llama(f"{zero2} --grad-reduce-in-bf16"), L1B_N, L1B_V, torch.bfloat16)
    # a bf16 bucket holds the output layer's weight gradient as its GEMM writes it: no separate copy beside it
    # (model/output_layer.OutputLinear), so the bucket takes the place of the distributed optimizer's copy
    assert bf16["grads"] == L1B_N and bf16["buffers"] == distopt["buffers"]
    assert bf16["step"] == 4 * L1B_N / 2  # torch's AdamW upcasts the bf16 shards
    comm = estimate_bytes(llama(f"{zero2} --megatron-fsdp-grad-comm-dtype bf16"), L1B_N, L1B_V, torch.bfloat16)
    assert comm["grads"] == 2 * L1B_N and comm["buffers"] == distopt["buffers"]
    plain = llama(f"{zero2} --megatron-fsdp-grad-comm-dtype bf16 --no-gradient-accumulation-fusion")
    assert estimate_bytes(plain, L1B_N, L1B_V, torch.bfloat16)["buffers"] - distopt["buffers"] == 2 * L1B_V * L1B_H
    small = estimate_bytes(llama(f"{zero2} --ddp-bucket-size 100000000"), L1B_N, L1B_V, torch.bfloat16)
    assert small["buffers"] - distopt["buffers"] == 4 * 100_000_000
    (line,) = memory_estimate_lines(llama(zero2), est, L1B_N, torch.bfloat16)
    assert "(2 B/param shards over 2 data-parallel ranks)" in line and "a gradient bucket" in line, line


@pytest.mark.parametrize(
    "impl,fp8_bytes,recipe",
    [
        ("transformer_engine", 2, ""),
        ("local", 1, ""),
        ("transformer_engine", 1, "blockwise"),
        ("local", 2, "rowwise"),
        ("local", 2, "mxfp8"),
    ],
)
def test_fsdp_fp8_param_gather(impl, fp8_bytes, recipe):
    """--fp8-param-gather under FSDP: the shards stay fp32 (bf16 with the precision-aware optimizer) and the FP8
    layers' linears are gathered as E4M3, 1 byte per element; TE's layers also get a 1-byte transpose of each with
    the gathered unit (2 bytes, as bf16; TE's own cast of a bf16 weight is not held at the peak either), but not
    blockwise, where TE makes a linear's transposed copy in its backward and drops it after the dgrad. The last
    layer is an FP8 one, the output unit stays bf16; under optim_grads the 15 FP8 layers of 16 count so. Each rank
    also keeps its shards of the 15 FP8 layers cast to E4M3 from one step's cast to the next: 1 byte per element,
    halved. The local layers' rowwise and mxfp8 keep both casts (parallel/fsdp/fp8_gather_axes.py): 2 bytes, in the
    shards' casts and in a unit kept gathered."""
    fsdp = "--use-torch-fsdp2 --fsdp-double-buffer --fp8-param-gather --data-parallel-sharding-strategy"
    casts = 2 if recipe in ("rowwise", "mxfp8") else 1
    if recipe:
        fsdp = f"--fp8-recipe {recipe} --fp8-format e4m3 {fsdp}"
    est = estimate_bytes(llama(f"{fsdp} optim_grads_params", impl), L1B_N, L1B_V, torch.bfloat16)
    bf16 = estimate_bytes(
        llama(fsdp.replace(" --fp8-param-gather", "") + " optim_grads_params", impl), L1B_N, L1B_V, torch.bfloat16
    )
    assert bf16["static"] == 8 * L1B_N
    assert est["weights"] - bf16["weights"] == est["static"] - bf16["static"] == casts * 15 * L1B_UNIT / 2
    assert est["buffers"] - bf16["buffers"] == (fp8_bytes - 2) * L1B_UNIT
    whole = estimate_bytes(llama(f"{fsdp} optim_grads", impl), L1B_N, L1B_V, torch.bfloat16)
    no_units = est["buffers"] - 2 * (L1B_V * L1B_H) - fp8_bytes * L1B_UNIT
    assert whole["buffers"] - no_units == 2 * (L1B_N - 15 * L1B_UNIT) + fp8_bytes * 15 * L1B_UNIT
    (line,) = memory_estimate_lines(llama(f"{fsdp} optim_grads", impl), whole, L1B_N, torch.bfloat16)
    weights = "(2.41 B/param, fp32 shards and the FP8 layers' E4M3 casts over 2 data-parallel ranks, gathered in FP8)"
    assert casts == 2 or weights in line, line


@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
def test_fsdp_fp8_param_gather_frees_the_bf16_shards_until_the_step(impl):
    """--fp8-param-gather with the precision-aware optimizer under FSDP: the 15 FP8 layers' bf16 shards (2 bytes per
    element, halved) are freed from the forward's cast to the optimizer step (parallel/fsdp/fp8_gather_scales.py):
    out of the weights held before the activations, into the step, where they come back. Not with fp32 shards (the main
    weights), nor when the FP8 monitor watches steps (a watched step keeps them)."""
    o2 = "--use-precision-aware-optimizer --main-params-dtype fp16 --exp-avg-dtype fp8 --exp-avg-sq-dtype fp16"
    fsdp = f"--use-megatron-fsdp --fsdp-double-buffer --fp8-param-gather {o2}"
    est = estimate_bytes(llama(fsdp, impl), L1B_N, L1B_V, torch.bfloat16)
    kept = estimate_bytes(llama(f"{fsdp} --fp8-stats-interval 10", impl), L1B_N, L1B_V, torch.bfloat16)
    freed = 2 * 15 * L1B_UNIT / 2
    assert (kept["freed_shards"], kept["step"]) == (0, 0)
    assert est["freed_shards"] == est["step"] == pytest.approx(freed)
    assert kept["weights"] - est["weights"] == kept["static"] - est["static"] == pytest.approx(freed)
    assert kept["total"] - est["total"] == pytest.approx(freed)  # the step is not the peak
    (line,) = memory_estimate_lines(llama(fsdp, impl), est, L1B_N, torch.bfloat16)
    assert "bf16 shards except the FP8 layers', freed until the optimizer step," in line, line
    assert f"optimizer step +{freed / 2**20:.1f} MiB (the FP8 layers' bf16 shards back)" in line, line
    fp32 = estimate_bytes(llama(fsdp.replace(o2, ""), impl), L1B_N, L1B_V, torch.bfloat16)
    assert (fp32["freed_shards"], fp32["step"]) == (0, 0)


def test_llama3_8b_bf16_gradient_shards_peak_in_the_optimizer_step():
    """Llama-3-8B (sequence 8192, micro-batch 1, vocabulary 128256), TE layers, every layer recomputed, FSDP with
    bf16 gradient shards (the benchmark's fsdp2_bf16grads): fp32 weight shards 2, bf16 gradient shards 1, Adam 4
    B/param. torch's AdamW then steps on fp32 copies of the bf16 gradient shards, 4 B per parameter over the two
    ranks, all at once: more than the recomputed activations and the logits, so the step is the peak (69.55 GiB
    measured on two H100s, docs/benchmarks.md; the activations are freed by then)."""
    v, h = 128256, 4096
    layer = h * (h + 2 * 1024) + h * h + h * 2 * 14336 + 14336 * h + 2 * h
    n = 2 * v * h + 32 * layer + h
    recompute = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
    cfg = llama(f"{recompute} --use-megatron-fsdp --megatron-fsdp-main-grads-dtype bf16", model=LLAMA3_8B)
    assert (cfg.model.hidden_size, cfg.model.seq_length, cfg.model.num_layers) == (h, 8192, 32)
    est = estimate_bytes(cfg, n, v, torch.bfloat16)
    assert est["static"] == (2 + 1 + 4) * n and est["step"] == 2 * n
    assert est["step"] > est["activations"] + est["buffers"]
    assert est["total"] == 9 * n
    assert est["total"] / 2**30 == pytest.approx(69.55, rel=0.05)
    (line,) = memory_estimate_lines(cfg, est, n, torch.bfloat16)
    assert "optimizer step +14.96 GiB (the peak) (fp32 copies of the bf16 gradients)" in line, line


def test_memory_estimate_script_builds_the_benchmark_rows():
    """scripts/memory_estimate.py parses a benchmark row as pretrain_gpt.py would and counts its parameters from the
    shapes: llama-1b te-delayed fsdp2 is the configuration and parameter count above; under a pipeline the busiest
    rank's estimate (the first: it holds pp micro-batches in flight)."""
    script = load_script("memory_estimate")  # with scripts/ on sys.path, as `python scripts/...` runs it
    cfg, est, (line,) = script.estimate("llama-1b", "te-delayed", "fsdp2")
    expected = llama("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --fsdp-double-buffer")
    assert est == estimate_bytes(expected, L1B_N, L1B_V, torch.bfloat16)
    assert cfg.model.transformer_impl == "transformer_engine" and "(total ~17.24 GiB;" in line, line
    _, est, _ = script.estimate("llama-1b", "te-delayed", "pp2")
    per_stage = 8 * L1B_LAYER + L1B_V * L1B_H  # the embedding and 8 layers
    first = estimate_bytes(llama("--pipeline-model-parallel-size 2"), round(per_stage), L1B_V, torch.bfloat16)
    assert est["total"] == first["total"]


def test_calibration_pass_recomputes_every_layer_and_fits_under_the_step():
    """Delayed scaling's calibration pass (a fresh FP8 delayed run) holds one micro-batch with every layer recomputed
    in high precision: each layer's input (2 bytes per s*b*h) and one layer's 16-bit activations (34), the loss's
    tensors and the same buffers as the step; no pass without delayed scaling or with --no-fp8-calibration. On the
    8B row that ran out of memory in the pass (llama3-8b te-delayed-fp8params fsdp2_o2states, two H100s) it comes
    far under the step's activations, so the total stays the step's (68.74 GiB)."""
    delayed = "--bf16 --fp8-format hybrid --fp8-recipe delayed"
    est = estimate_bytes(parse(delayed), N, VOCAB, torch.bfloat16)
    loss = 4 * SBH + 8 * 64 * 2 * VOCAB  # the final norm's and output layer's inputs, fp32 logits and gradient
    assert est["calibration"] == (2 * 2 + 34) * SBH + loss + BF16_BUFFERS
    assert est["calibration"] < est["activations"] + est["buffers"]
    for off in ("--bf16", f"{delayed} --no-fp8-calibration", "--bf16 --fp8-format hybrid --fp8-recipe tensorwise"):
        assert estimate_bytes(parse(off), N, VOCAB, torch.bfloat16)["calibration"] == 0, off
    script = load_script("memory_estimate")  # with scripts/ on sys.path, as `python scripts/...` runs it
    _, est, (line,) = script.estimate("llama3-8b", "te-delayed-fp8params", "fsdp2_o2states")
    sbh = 8192 * 4096
    assert est["calibration"] - est["buffers"] < est["activations"] / 4 and est["calibration"] > 32 * 2 * sbh
    assert est["total"] == est["static"] + est["activations"] + est["buffers"]
    assert est["total"] / 2**30 == pytest.approx(68.74, abs=0.01)
    assert "calibration pass ~7.57 GiB (high precision, every layer recomputed) (total ~68.74 GiB;" in line, line


def test_fp8_attention_keeps_fp8_copies_of_q_k_v_and_its_output():
    """--fp8-dot-product-attention in TE's FP8 layers: cuDNN keeps q, k, v and the attention output in FP8 for the
    backward, a byte each instead of two; the bf16 first layer and the local layers keep bf16 (the 8B under FSDP
    on two H100s peaked 2.42 GiB lower with it: 66.48 against 68.90 GiB, what this takes off)."""
    from megatron.training.activation_memory import layer_activation_bytes

    fsdp = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --fp8-format hybrid"
    cfg = llama(f"{fsdp} --fp8-recipe delayed", model=LLAMA3_8B)
    bf16, bf16_layer = layer_activation_bytes(cfg, True), layer_activation_bytes(cfg, False)
    cfg.precision.fp8_dot_product_attention = True
    fp8 = layer_activation_bytes(cfg, True)
    query, key_value = 1.0, 0.25  # 32 heads and 8 groups of 128 over h 4096
    assert fp8["q, k, v"] == bf16["q, k, v"] / 2 == query + 2 * key_value
    assert fp8["attention output"] == bf16["attention output"] / 2 == query
    assert layer_activation_bytes(cfg, False) == bf16_layer  # the bf16 first layer: unchanged
    saved = sum(bf16.values()) - sum(fp8.values())
    assert 31 * saved * 8192 * 4096 / 2**30 == pytest.approx(68.90 - 66.48, rel=0.01)  # 31 FP8 layers


@pytest.mark.parametrize(
    "flags,dtype,fused",
    [
        ("--untie-embeddings-and-output-weights", torch.float32, True),  # fp32 weights, fp32 buffer: addmm_ in place
        ("--untie-embeddings-and-output-weights --bf16", torch.bfloat16, False),  # fp32 buffer: through a bf16 copy
        ("--untie-embeddings-and-output-weights --bf16 --grad-reduce-in-bf16", torch.bfloat16, True),
        ("--bf16 --grad-reduce-in-bf16", torch.bfloat16, False),  # tied: the embedding's gradient, summed by autograd
        ("--untie-embeddings-and-output-weights --no-gradient-accumulation-fusion", torch.float32, False),
        ("--untie-embeddings-and-output-weights --bf16 --grad-reduce-in-bf16 --use-torch-fsdp2", torch.bfloat16, False),
    ],
)
def test_the_output_layer_gradient_counts_only_where_it_is_not_written_into_its_buffer(flags, dtype, fused):
    cfg = parse(f"{flags} --use-distributed-optimizer" if "fsdp" not in flags else flags, world_size=2)
    assert output_wgrad_in_buffer(cfg, dtype) is fused
    if "fsdp" not in flags:
        est = estimate_bytes(cfg, N, VOCAB, dtype)
        assert est["buffers"] == (0 if fused else VOCAB * 128 * dtype.itemsize) + SBH * dtype.itemsize


def test_a_gpu_left_too_little_beyond_the_estimate_gets_a_note():
    assert headroom_note(73.2, 79.18) is None  # trained: 73.7 GiB peak on an 80 GB H100
    note = headroom_note(74.8, 79.18)  # made no step in two minutes
    assert note is not None and "4.4 GiB of this GPU's 79.2 GiB" in note and "--recompute-num-layers" in note
    # printed by the first rank of each pipeline stage, naming the stage where there are several
    assert headroom_line(ParallelDims(world_size=2, rank=0, tp=1, pp=1, dp=2), 74.8, 79.18) == f"> {note}"
    assert headroom_line(ParallelDims(world_size=2, rank=1, tp=1, pp=1, dp=2, dp_rank=1), 74.8, 79.18) is None
    last = ParallelDims(world_size=4, rank=2, tp=2, pp=2, dp=1, pp_rank=1)
    assert headroom_line(last, 74.8, 79.18) == f"> pipeline stage 1: {note}"
    assert headroom_line(last, 70.0, 79.18) is None
