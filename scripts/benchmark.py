"""Throughput benchmark: `pretrain_gpt.py` with mock data, for named model presets, precision configs and parallel
layouts (one GPU by default; several through torchrun on one host).

    python scripts/benchmark.py                                    # every preset x every config, one GPU
    python scripts/benchmark.py --presets llama-1b --configs te-bf16 te-delayed
    python scripts/benchmark.py --presets llama-1b --configs te-delayed --layouts 1gpu dp2 tp2 pp2
    python scripts/benchmark.py --presets llama-1b --configs te-bf16 te-delayed --cuda-graphs
    python scripts/benchmark.py --profile llama-1b te-bf16         # where the GPU time goes (torch.profiler)
    python scripts/benchmark.py --profile llama-1b te-delayed --layouts dp2   # ... on rank 0 of two GPUs
    python scripts/benchmark.py --presets llama-1b --configs te-delayed --cuda-graphs --bound   # against the bound

Every layout keeps the preset's global batch, so a layout's tokens/s per GPU against the one-GPU row is its scaling
efficiency on the same work (strong scaling; with data parallelism each rank runs fewer micro-batches per step).
`--weak-scaling` multiplies the global batch by the data-parallel size instead (each GPU runs as many micro-batches
per step as one GPU does). `--cuda-graphs` runs the Transformer Engine configs with their layers captured as CUDA
graphs (--cuda-graph-impl transformer_engine); those rows are named `<config>+graphs`.

Each (preset, config) is a separate `pretrain_gpt.py` process; the table reports the last Megatron log line's
tokens/s, TFLOP/s/GPU and MFU (an average over the final --log-interval iterations, so the first iterations' warm-up
(cuDNN plans, Triton and torch.compile kernels) is excluded) and the run's peak allocated memory. A config that fails
(no Transformer Engine, a recipe this GPU cannot run, an engine not built yet) becomes a row saying why.

`--bound` adds each row's lower bound (megatron/perf: every GEMM, attention, memory-bound pass and un-overlapped
collective at the rate measured on this GPU for its shape, cached in --probe-cache), measured / bound, and, from a
`--profile` pass of the row in its own process, the kernel time per category against the bound's
(docs/benchmarks.md, "Lower bound").
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's megatron, not an installed copy

from megatron import perf  # noqa: E402  (no torch at import)
from megatron.perf.report import COMMUNICATION  # noqa: E402

COMMON = (
    "--mock-data --tokenizer-type NullTokenizer --position-embedding-type rope --normalization RMSNorm --swiglu"
    " --disable-bias-linear --untie-embeddings-and-output-weights --group-query-attention --hidden-dropout 0"
    " --attention-dropout 0 --bf16 --lr 1e-4 --min-lr 1e-5 --eval-iters 0"
)
# --vocab-size 31999 with the NullTokenizer is a vocabulary of 32000 (31999 ids + end-of-document), not padded.
PRESETS = {
    "llama-1b": "--num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 32"
    " --num-query-groups 8 --seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 2"
    " --global-batch-size 16 --vocab-size 31999",
    "llama-8b-4l": "--num-layers 4 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32"
    " --num-query-groups 8 --seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1"
    " --global-batch-size 8 --vocab-size 31999",
}
# Not run by default: llama-1b at micro-batch 8, four times the activations per micro-batch (recomputation's case);
# the whole Llama-3-8B shape (vocabulary 128256: 128255 ids + end-of-document), two GPUs' worth, and its 32k-token
# sequence for context parallelism (issue 17).
PRESETS["llama-1b-mbs8"] = PRESETS["llama-1b"].replace("--micro-batch-size 2", "--micro-batch-size 8")
PRESETS["llama3-8b"] = (
    "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --num-query-groups 8"
    " --seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 8"
    " --vocab-size 128255"
)
PRESETS["llama3-8b-32k"] = PRESETS["llama3-8b"].replace("8192", "32768")
TE = "--transformer-impl transformer_engine"
# the 8B's FSDP rows: FP8 weights, no calibration pass, FP8 attention; the chunked loss; the first n layers recomputed
FP8ATTN = (
    f"{TE} --fp8-format hybrid --fp8-recipe delayed --fp8-param-gather --no-fp8-calibration --fp8-dot-product-attention"
)
CHUNKED_LOSS = " --cross-entropy-loss-fusion --cross-entropy-fusion-impl chunked"


def recompute_block(n: int) -> str:
    return f" --recompute-granularity full --recompute-method block --recompute-num-layers {n}"


LOCAL = "--transformer-impl local"
CONFIGS = {
    "te-bf16": TE,
    "te-delayed": f"{TE} --fp8-format hybrid --fp8-recipe delayed",
    # every transformer layer in FP8, the first included (Megatron-LM's default; ours keeps the first in bf16)
    "te-delayed-all-fp8": f"{TE} --fp8-format hybrid --fp8-recipe delayed --no-fp8-first-layer-bf16",
    "te-delayed-fp8params": f"{TE} --fp8-format hybrid --fp8-recipe delayed --fp8-param-gather",
    # MS-AMP's levels (FP8 gradient communication; O2 also low-precision optimizer states and bf16 gradients)
    "te-delayed-fp8params-o1": f"{TE} --fp8-format hybrid --fp8-recipe delayed --fp8-param-gather"
    " --fp8-optimizer-level O1",
    "te-delayed-fp8params-o2": f"{TE} --fp8-format hybrid --fp8-recipe delayed --fp8-param-gather"
    " --fp8-optimizer-level O2",
    # --profile's cost outside its window: Nsight's window over steps 3-4, the numbers average steps after it
    "te-delayed-profile-window": f"{TE} --fp8-format hybrid --fp8-recipe delayed --profile --profile-step-start 2"
    " --profile-step-end 4 --timing-log-level 0",
    # O2's states with fp32 gradient buffers (O2 before it took bf16 ones): 2 bytes per parameter more
    "te-delayed-fp8params-o2-fp32grads": f"{TE} --fp8-format hybrid --fp8-recipe delayed --fp8-param-gather"
    " --fp8-grad-reduce --use-precision-aware-optimizer --main-params-dtype fp16 --exp-avg-dtype fp8"
    " --exp-avg-sq-dtype fp16",
    # activation recomputation (docs/recompute.md): selective (core attention) and full (every layer, one at a time)
    "te-delayed-recompute-selective": f"{TE} --fp8-format hybrid --fp8-recipe delayed --recompute-activations",
    "te-delayed-recompute-full": f"{TE} --fp8-format hybrid --fp8-recipe delayed --recompute-granularity full"
    " --recompute-method uniform --recompute-num-layers 1",
    # the first N of the layers recomputed whole, the rest keeping their activations: llama3-8b under fsdp2_o2states
    # (estimated 61.4 and 58.0 GiB per GPU; 64.9 with 8, 71.9 with none: scripts/memory_estimate.py)
    "te-delayed-recompute-block4": f"{TE} --fp8-format hybrid --fp8-recipe delayed --recompute-granularity full"
    " --recompute-method block --recompute-num-layers 4",  # llama3-8b's 76.0 GiB on H200s, less 4 layers: H100s
    "te-delayed-recompute-block12": f"{TE} --fp8-format hybrid --fp8-recipe delayed --recompute-granularity full"
    " --recompute-method block --recompute-num-layers 12",
    "te-delayed-recompute-block16": f"{TE} --fp8-format hybrid --fp8-recipe delayed --recompute-granularity full"
    " --recompute-method block --recompute-num-layers 16",
    # FP8 weights (under FSDP: all-gathered as FP8) with fewer layers recomputed than O2's states alone allowed
    "te-delayed-fp8params-recompute-block4": f"{TE} --fp8-format hybrid --fp8-recipe delayed --fp8-param-gather"
    " --recompute-granularity full --recompute-method block --recompute-num-layers 4",
    "te-delayed-fp8params-recompute-block8": f"{TE} --fp8-format hybrid --fp8-recipe delayed --fp8-param-gather"
    " --recompute-granularity full --recompute-method block --recompute-num-layers 8",
    # bf16 beside them on the same layout (its activations take more bytes than FP8's)
    "te-bf16-recompute-block12": f"{TE} --recompute-granularity full --recompute-method block"
    " --recompute-num-layers 12",
    "te-bf16-recompute-block8": f"{TE} --recompute-granularity full --recompute-method block"
    " --recompute-num-layers 8",  # llama3-8b fsdp2_o2states: estimated 68.3 GiB (block12: 64.3, measured 64.0)
    # the fewest bytes a Llama-3-8B replica needs per GPU: FP8 weights, every layer recomputed (32k tokens at CP=2)
    "te-delayed-fp8params-recompute-full": f"{TE} --fp8-format hybrid --fp8-recipe delayed --fp8-param-gather"
    " --recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
    "te-delayed-fp8attn": f"{TE} --fp8-format hybrid --fp8-recipe delayed --fp8-dot-product-attention",
    # delayed scaling without its calibration pass (a bf16 forward and backward: on the 8B under FSDP it peaks above
    # the FP8 steps on an 80 GB card)
    "te-delayed-fp8params-nocalib": f"{TE} --fp8-format hybrid --fp8-recipe delayed --fp8-param-gather"
    " --no-fp8-calibration",
    # and FP8 attention: the Llama-3-8B's heads of 128 let cuDNN run it on Hopper
    "te-delayed-fp8params-nocalib-fp8attn": FP8ATTN,
    # the same with the first N layers recomputed whole: llama3-8b under mfsdp2_o2states on two H100s ran out of
    # memory with none recomputed and stalled with 1 or 2 (tenth session: estimates 76.5, 75.5, 74.8 GiB); since the
    # output layer writes its gradient into the bf16 buckets 2 trains (eleventh: 2242 ms, 74.3 GiB, estimate 73.8)
    **{f"te-delayed-fp8params-nocalib-fp8attn-recompute-block{n}": FP8ATTN + recompute_block(n) for n in (1, 2, 3, 4)},
    # and with the output layer's GEMM and the loss fused a slice of the vocabulary at a time (no logits kept)
    "te-delayed-fp8params-nocalib-fp8attn-chunkce": FP8ATTN + CHUNKED_LOSS,
    **{
        f"te-delayed-fp8params-nocalib-fp8attn-chunkce-recompute-block{n}": FP8ATTN + CHUNKED_LOSS + recompute_block(n)
        for n in (1, 2)
    },
    "te-tensorwise": f"{TE} --fp8-format hybrid --fp8-recipe tensorwise",
    "te-blockwise": f"{TE} --fp8-format e4m3 --fp8-recipe blockwise",
    # FP8 weights in 128x128 blocks (under FSDP: all-gathered as E4M3 bytes,
    # megatron/parallel/fsdp/te_blockwise_gather.py)
    "te-blockwise-fp8params": f"{TE} --fp8-format e4m3 --fp8-recipe blockwise --fp8-param-gather",
    "local-bf16": LOCAL,
    "local-delayed": f"{LOCAL} --fp8-format hybrid --fp8-recipe delayed",
    "local-delayed-fp8params": f"{LOCAL} --fp8-format hybrid --fp8-recipe delayed --fp8-param-gather",
    "local-tensorwise": f"{LOCAL} --fp8-format hybrid --fp8-recipe tensorwise",
    "local-delayed-recompute-full": f"{LOCAL} --fp8-format hybrid --fp8-recipe delayed --recompute-granularity full"
    " --recompute-method uniform --recompute-num-layers 1",
    "local-rowwise": f"{LOCAL} --fp8-format hybrid --fp8-recipe rowwise",
    "local-blockwise": f"{LOCAL} --fp8-format e4m3 --fp8-recipe blockwise",
    "local-mxfp8": f"{LOCAL} --fp8-format e4m3 --fp8-recipe mxfp8",
    # FSDP2 layouts (fsdp2*) only: the row cast gathered for the forward, the column cast for the backward
    # (megatron/parallel/fsdp/fp8_gather_axes.py); the distributed optimizer's local FP8 weights have one scale per
    # tensor
    "local-rowwise-fp8params": f"{LOCAL} --fp8-format hybrid --fp8-recipe rowwise --fp8-param-gather",
    "local-mxfp8-fp8params": f"{LOCAL} --fp8-format e4m3 --fp8-recipe mxfp8 --fp8-param-gather",
}

FSDP_ONLY_CONFIGS = ("local-rowwise-fp8params", "local-mxfp8-fp8params")  # run with --layouts fsdp2* (not by default)

GRAPHS = "+graphs"  # suffix of a config run with --cuda-graph-impl transformer_engine

LAYOUTS = {  # name: (GPUs, flags)
    "1gpu": (1, ""),
    "1gpu_distopt": (1, "--use-distributed-optimizer"),  # one GPU's optimizer memory and step time, not sharded
    "dp2": (2, "--overlap-grad-reduce"),
    "dp2_distopt": (2, "--overlap-grad-reduce --use-distributed-optimizer --overlap-param-gather"),
    "dp2_distopt_tpamax": (
        2,
        "--overlap-grad-reduce --use-distributed-optimizer --overlap-param-gather --tp-only-amax-red",
    ),
    # FSDP (PyTorch's FSDP2; weights gathered in bf16, the FP8 layers' as FP8 with --fp8-param-gather):
    # weights, gradients and states sharded, each layer gathered before use with the next one prefetched;
    # optim_grads keeps the gathered weights from the first forward to the last backward of a step
    "fsdp2": (2, "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --fsdp-double-buffer"),
    "fsdp2_optim_grads": (2, "--use-torch-fsdp2 --data-parallel-sharding-strategy optim_grads --fsdp-double-buffer"),
    # Megatron-LM's FSDP2 "ZeRO-2": each unit kept gathered from its forward to its backward (one all-gather per unit
    # and micro-batch instead of two; the whole model gathered at the end of each forward)
    "fsdp2_noreshard": (
        2,
        "--use-torch-fsdp2 --data-parallel-sharding-strategy optim_grads_params --torch-fsdp2-no-reshard-after-forward"
        " --fsdp-double-buffer",
    ),
    # optim_grads on the distributed optimizer's flat buckets (megatron/parallel/fsdp/flat_shards.py): each
    # micro-batch's buckets reduce-scattered into persistent fp32 gradient shards, every bucket allocated only while it
    # is in use
    "mfsdp2_optim_grads": (
        2,
        "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads --overlap-grad-reduce"
        " --overlap-param-gather",
    ),
    # the same with each micro-batch's reduce-scatter in bf16 (half the bytes; fp32 gradient shards)
    "mfsdp2_optim_grads_bf16comm": (
        2,
        "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads --overlap-grad-reduce"
        " --overlap-param-gather --megatron-fsdp-grad-comm-dtype bf16",
    ),
    # and in buckets of 100M / 200M parameters instead of 40M (llama-1b: 10 / ~6 buckets instead of 19): fewer
    # reduce-scatters, and less host work per micro-batch (each bucket's allocation, hooks, launch and shard add)
    "mfsdp2_optim_grads_bf16comm_b100m": (
        2,
        "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads --overlap-grad-reduce"
        " --overlap-param-gather --megatron-fsdp-grad-comm-dtype bf16 --ddp-bucket-size 100000000",
    ),
    "mfsdp2_optim_grads_bf16comm_b200m": (
        2,
        "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads --overlap-grad-reduce"
        " --overlap-param-gather --megatron-fsdp-grad-comm-dtype bf16 --ddp-bucket-size 200000000",
    ),
    # bf16 gradient shards too (half their bytes; each shard add in bf16, not the mixed bf16-into-fp32 one)
    "mfsdp2_bf16grads": (
        2,
        "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads --overlap-grad-reduce"
        " --overlap-param-gather --megatron-fsdp-main-grads-dtype bf16",
    ),
    # each micro-batch's reduce-scatter sent as FP8 and summed in fp32 (O1's gradient communication): half the
    # bytes of the bf16 one
    "mfsdp2_fp8comm": (
        2,
        "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads --overlap-grad-reduce"
        " --overlap-param-gather --fp8-grad-reduce",
    ),
    # and O2's states (as fsdp2_o2states below): the 8B's weights stay whole (FP8), gradients and states sharded
    "mfsdp2_o2states": (
        2,
        "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads --overlap-grad-reduce"
        " --overlap-param-gather --megatron-fsdp-main-grads-dtype bf16 --use-precision-aware-optimizer"
        " --main-params-dtype fp16 --exp-avg-dtype fp8 --exp-avg-sq-dtype fp16",
    ),
    # units of at least 200M parameters (llama-1b: four layers; the 8B's layers are larger): fewer, larger
    # collectives and a quarter of the per-unit hooks, one more unit's worth of gathered weights
    "fsdp2_units200m": (
        2,
        "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --fsdp-double-buffer"
        " --suggested-communication-unit-size 200000000",
    ),
    # optim_grads keeps every unit gathered from the first forward to the last backward, so larger units cost no
    # gathered memory: they only coarsen the reduce-scatters (a larger last one in each backward) and cut FSDP2's
    # per-unit host work (hooks, reduce-scatter staging) per micro-batch; llama-1b: two and four layers per unit.
    # Losses are bitwise those of one-layer units (each element's reduction is the same; CPU test in test_fsdp.py)
    "fsdp2_optim_grads_units100m": (
        2,
        "--use-torch-fsdp2 --data-parallel-sharding-strategy optim_grads --fsdp-double-buffer"
        " --suggested-communication-unit-size 100000000",
    ),
    "fsdp2_optim_grads_units200m": (
        2,
        "--use-torch-fsdp2 --data-parallel-sharding-strategy optim_grads --fsdp-double-buffer"
        " --suggested-communication-unit-size 200000000",
    ),
    # fp32 gradient shards, reduce-scattered in bf16 (half the bytes of each micro-batch's reduce-scatter)
    "fsdp2_bf16comm": (
        2,
        "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --fsdp-double-buffer"
        " --megatron-fsdp-grad-comm-dtype bf16",
    ),
    # fp32 gradient shards, each unit's reduce-scatter sent as FP8 (e4m3 + a scale per 128 values) and summed in fp32:
    # a quarter of the fp32 reduce-scatter's bytes (O1 under FSDP, megatron/parallel/fsdp/fp8_reduce_scatter.py)
    "fsdp2_fp8comm": (
        2,
        "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --fsdp-double-buffer"
        " --fp8-grad-reduce",
    ),
    "fsdp2_optim_grads_bf16comm": (
        2,
        "--use-torch-fsdp2 --data-parallel-sharding-strategy optim_grads --fsdp-double-buffer"
        " --megatron-fsdp-grad-comm-dtype bf16",
    ),
    # bf16 gradient shards, reduce-scattered in bf16: 2 bytes per parameter less (the Llama-3-8B shape's fit on 80 GB)
    "fsdp2_bf16grads": (
        2,
        "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --fsdp-double-buffer"
        " --megatron-fsdp-main-grads-dtype bf16",
    ),
    # and O2's optimizer states (precision-aware: fp16 main weights + remainder, FP8 / fp16 moments) beside bf16
    # weight shards: 10.1 bytes per parameter over the ranks instead of 14 (room for the 8B's activations, so that
    # fewer layers are recomputed)
    "fsdp2_o2states": (
        2,
        "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --fsdp-double-buffer"
        " --megatron-fsdp-main-grads-dtype bf16 --use-precision-aware-optimizer --main-params-dtype fp16"
        " --exp-avg-dtype fp8 --exp-avg-sq-dtype fp16",
    ),
    # the same with units of two of the 8B's layers (218M parameters each): half the per-unit hooks and collectives
    # (the 8B's step left the GPU idle 69 ms in host gaps), one more layer's weights gathered at a time
    "fsdp2_o2states_units400m": (
        2,
        "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --fsdp-double-buffer"
        " --megatron-fsdp-main-grads-dtype bf16 --use-precision-aware-optimizer --main-params-dtype fp16"
        " --exp-avg-dtype fp8 --exp-avg-sq-dtype fp16 --suggested-communication-unit-size 400000000",
    ),
    # FSDP with tensor (+ sequence) or context parallelism on 4 GPUs: each tensor-parallel piece sharded over the
    # two data-parallel ranks; under CP=2 the four data x context parallel ranks shard everything
    "fsdp2_tp2": (
        4,
        "--tensor-model-parallel-size 2 --sequence-parallel --use-megatron-fsdp"
        " --data-parallel-sharding-strategy optim_grads_params --fsdp-double-buffer",
    ),
    "fsdp2_cp2": (
        4,
        "--context-parallel-size 2 --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"
        " --fsdp-double-buffer",
    ),
    "tp2": (2, "--tensor-model-parallel-size 2 --sequence-parallel"),
    "tp2_overlap": (2, "--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap"),
    "pp2": (2, "--pipeline-model-parallel-size 2"),
    "pp2_vpp": (2, "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 4"),
    # 32 layers (llama3-8b): the last stage one layer short per the output layer's ~2 layers of work (docs/pipeline.md)
    "pp2_vpp_balanced": (
        2,
        "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et*4|t*4|t*5|t*4|t*4|t*4|t*4|t*3L",
    ),
    "cp2": (2, "--context-parallel-size 2"),
    # the optimizer's states sharded over the context-parallel pair (the data x context group)
    "cp2_distopt": (
        2,
        "--context-parallel-size 2 --overlap-grad-reduce --use-distributed-optimizer --overlap-param-gather",
    ),
    "tp2_pp2": (4, "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2"),
    "tp2_dp2": (4, "--tensor-model-parallel-size 2 --sequence-parallel --overlap-grad-reduce"),
    "dp4": (4, "--overlap-grad-reduce"),
}

_FIELDS = {
    "ms_per_iter": r"elapsed time per iteration \(ms\): ([\d.]+)",
    "tflops": r"throughput per GPU \(TFLOP/s/GPU\): ([\d.]+)",
    "tokens_per_s": r"tokens/s: ([\d.]+)",
    "mfu": r"MFU: ([\d.]+)%",
    "loss": r"lm loss: ([\d.E+-]+)",
}


@dataclass
class Result:
    preset: str
    config: str
    layout: str = "1gpu"
    gpus: int = 1
    tokens_per_s: float | None = None
    tflops: float | None = None
    mfu: float | None = None
    ms_per_iter: float | None = None
    ms_min: float | None = None
    ms_max: float | None = None
    loss: float | None = None
    peak_gib: float | None = None
    error: str | None = None


def parse_log(text: str) -> dict[str, float]:
    """Numbers from the Megatron iteration lines and the peak-memory line of a pretrain_gpt.py log. Each iteration
    line averages its log interval; the first interval holds the first step's allocations, autotuning and lazily made
    communicators, so with two or more intervals the time per iteration is the mean of the later ones (`ms_min` and
    `ms_max` their range: one interval's hiccup on a shared host shows there instead of passing for the row's speed),
    and tokens/s, TFLOP/s and MFU are the last line's scaled to that mean. The loss is the last line's."""
    lines = [line for line in text.splitlines() if " iteration " in line and "tokens/s:" in line]
    out: dict[str, float] = {}
    if lines:
        for name, pattern in _FIELDS.items():
            match = re.search(pattern, lines[-1])
            if match:
                out[name] = float(match.group(1))
        intervals = [float(m.group(1)) for line in lines[1:] if (m := re.search(_FIELDS["ms_per_iter"], line))]
        if intervals and "ms_per_iter" in out:
            mean = sum(intervals) / len(intervals)
            for name in ("tokens_per_s", "tflops", "mfu"):
                if name in out:
                    out[name] *= out["ms_per_iter"] / mean
            out.update(ms_per_iter=mean, ms_min=min(intervals), ms_max=max(intervals))
    peak = re.search(r"peak memory allocated: ([\d.]+) GiB", text)
    if peak:
        out["peak_gib"] = float(peak.group(1))
    return out


def failure_reason(text: str, returncode: int) -> str:
    """The one line that says why a run failed: our one-line error, else the exception line of a traceback."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("pretrain_gpt.py: error:"):
            return line.removeprefix("pretrain_gpt.py: error:").strip()
    for line in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception)\b", line):
            return line
    return f"exit code {returncode}: {lines[-1] if lines else 'no output'}"[:300]


def _flag(flags: str, name: str, default: int = 1) -> int:
    match = re.search(rf"{name} (\d+)", flags)
    return int(match.group(1)) if match else default


def train_flags(
    preset: str,
    config: str,
    iters: int,
    log_interval: int,
    layout: str = "1gpu",
    weak: bool = False,
    extra: str = "",
) -> list[str]:
    """pretrain_gpt.py's flags; `weak`: multiply the preset's global batch by the data-parallel size (each GPU then
    runs as many micro-batches per step as one GPU does: weak scaling). A config named `<config>+graphs` adds
    --cuda-graph-impl transformer_engine. `extra`: flags appended to every run (--extra-flags)."""
    gpus, layout_flags = LAYOUTS[layout]
    graphs = " --cuda-graph-impl transformer_engine" if config.endswith(GRAPHS) else ""
    config = config.removesuffix(GRAPHS)
    flags = f"{COMMON} {PRESETS[preset]} {CONFIGS[config]}{graphs} {layout_flags} --train-iters {iters}"
    flags += f" --log-interval {log_interval} {extra}"
    if weak:
        model_parallel = _flag(layout_flags, "--tensor-model-parallel-size") * _flag(
            layout_flags, "--pipeline-model-parallel-size"
        )
        flags += f" --global-batch-size {_flag(PRESETS[preset], '--global-batch-size') * gpus // model_parallel}"
    return flags.split()


def launcher(gpus: int) -> list[str]:
    """This Python, through torchrun on one host for several GPUs."""
    if gpus == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}"]


def command(
    preset: str, config: str, iters: int, log_interval: int, layout: str = "1gpu", weak: bool = False, extra: str = ""
) -> list[str]:
    """The launch command of one benchmark run (see `train_flags`)."""
    flags = train_flags(preset, config, iters, log_interval, layout, weak, extra)
    return [*launcher(LAYOUTS[layout][0]), str(ROOT / "pretrain_gpt.py"), *flags]


def run_env(layout: str) -> dict[str, str]:
    """The environment of a run: NVLink SHARP (multicast) off, as some hosts lend GPUs without it configured (NCCL
    then hangs at start-up; TE's userbuffers follow it); CUDA_DEVICE_MAX_CONNECTIONS=1 for --tp-comm-overlap, as
    Megatron-LM runs it."""
    env = {"NCCL_NVLS_ENABLE": "0", **os.environ, "PYTHONUNBUFFERED": "1"}
    if "--tp-comm-overlap" in LAYOUTS[layout][1]:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    return env


def execute(
    cmd: list[str], timeout: float, env: dict[str, str], echo: Callable[[str], None] | None = None
) -> tuple[str, int]:
    """Run `cmd` in the repository root with stdout and stderr merged, and return (output, exit code); after `timeout`
    seconds the run is stopped and counts as exit code -1, keeping the output so far. `echo` is called with each line
    as it arrives (progress of long runs)."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", env=env, cwd=ROOT
    )
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if echo is not None:
                echo(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        # SIGTERM first: torchrun passes it on to its ranks, which a SIGKILL of torchrun alone would leave running
        # (holding the GPUs and the output pipe).
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    finally:  # also on Ctrl-C or any other error here: the run does not outlive the caller
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=30)  # a rank that ignored the signals may hold the pipe open; do not wait for it forever
    text = "".join(lines)
    if timed_out:
        return text + f"\ntimed out after {timeout} s", -1
    return text, proc.returncode


def run(
    preset: str,
    config: str,
    iters: int,
    log_interval: int,
    timeout: int,
    log_dir: Path | None,
    layout: str = "1gpu",
    weak: bool = False,
    extra: str = "",
) -> Result:
    cmd = command(preset, config, iters, log_interval, layout, weak, extra)
    text, code = execute(cmd, timeout, run_env(layout))
    if log_dir is not None:
        name = f"{preset}.{config.replace(GRAPHS, '-graphs')}.{layout}.log"  # no '+' in file names
        (log_dir / name).write_text(" ".join(cmd) + "\n" + text)
    numbers = parse_log(text)
    gpus = LAYOUTS[layout][0]
    if code != 0 or "tokens_per_s" not in numbers:
        return Result(preset, config, layout, gpus, error=failure_reason(text, code))
    return Result(preset, config, layout, gpus, **numbers)


def table(results: list[Result]) -> str:
    """Markdown table. "vs bf16": against the same preset and layout's te-bf16 row (else local-bf16); "scaling":
    tokens/s per GPU against the same preset and config on one GPU."""
    rows = [
        "| preset | config | layout | tokens/s | tokens/s/GPU | TFLOP/s/GPU | MFU | vs bf16 | scaling | peak GiB"
        " | ms/iter | loss |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def find(preset: str, config: str, layout: str) -> Result | None:
        return next(
            (b for b in results if (b.preset, b.config, b.layout) == (preset, config, layout) and not b.error), None
        )

    for r in results:
        if r.error:
            rows.append(f"| {r.preset} | {r.config} | {r.layout} | failed: {r.error.replace('|', '/')} |" + " |" * 8)
            continue
        graphs = GRAPHS if r.config.endswith(GRAPHS) else ""  # like against like
        base = find(r.preset, "te-bf16" + graphs, r.layout) or find(r.preset, "local-bf16", r.layout)
        speedup = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base and base.tokens_per_s else ""
        single = find(r.preset, r.config, "1gpu")
        per_gpu = r.tokens_per_s / r.gpus
        scaling = f"{100 * per_gpu / single.tokens_per_s:.0f}%" if single and r.gpus > 1 else ""
        mfu = f"{r.mfu:.1f}%" if r.mfu is not None else ""
        rows.append(
            f"| {r.preset} | {r.config} | {r.layout} | {r.tokens_per_s / 1e3:.1f}k | {per_gpu / 1e3:.1f}k"
            f" | {r.tflops:.0f} | {mfu} | {speedup} | {scaling} | {r.peak_gib:.1f} | {_ms(r)}"
            f" | {r.loss:.3f} |"
        )
    return "\n".join(rows)


def _ms(r: Result) -> str:
    """The ms/iter cell: the mean of the intervals after the first, with their range where they differ by 1 ms or
    more (`parse_log`)."""
    if r.ms_min is None or r.ms_max - r.ms_min < 1:
        return f"{r.ms_per_iter:.0f}"
    return f"{r.ms_per_iter:.0f} ({r.ms_min:.0f}-{r.ms_max:.0f})"


def short_kernel_name(name: str) -> str:
    """A kernel's name without the namespaces and `void` that fill the first 110 characters of PyTorch's templated
    kernels (the foreach kernels then show their functor: CopyFunctor, LpNormFunctor, ZeroFunctor)."""
    for noise in ("void ", "at::native::", "(anonymous namespace)::", "at::", "c10::"):
        name = name.replace(noise, "")
    return name


def trainer_step(argv: list[str], device_type: str = "cuda") -> tuple[object, Callable[[], object]]:
    """A Trainer for `argv` built in this process (one rank: of the process group already started, or of torchrun's
    WORLD_SIZE), and its training step as a call: the next batch of its training data at the configured learning
    rate (a step's time does not depend on the rate). What --profile, scripts/sync_check.py and scripts/ab_steps.py
    run."""
    import torch.distributed as dist

    from megatron.config import parse_args
    from megatron.training.trainer import Trainer

    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    trainer = Trainer(parse_args(argv, world_size=world_size, device_type=device_type))
    batches, lr = iter(trainer.loader(trainer.datasets.train, 0)), trainer.cfg.optimizer.lr
    return trainer, lambda: trainer.train_step(batches, lr)


def build_trainers(
    preset: str, config: str, layouts: list[str], extra: str, steps: int, device_type: str
) -> list[tuple[object, Callable[[], object]]]:
    """`trainer_step` per layout (train_flags' run of `steps` iterations, `extra` flags added), in this order on every
    rank (each builds its own process groups): scripts/ab_steps.py's and scripts/engine_timers.py's trainers, all in
    one process per rank."""
    return [
        trainer_step(train_flags(preset, config, steps, steps, layout, extra=extra), device_type) for layout in layouts
    ]


def one_size(parser: argparse.ArgumentParser, layouts: list[str]) -> int:
    """The GPU count of `layouts` (LAYOUTS' names), which must agree: else a one-line parser error (scripts that
    build several layouts' trainers in one process per rank)."""
    unknown = [layout for layout in layouts if layout not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout {unknown[0]}: one of benchmark.py's LAYOUTS")
    gpus = {LAYOUTS[layout][0] for layout in layouts}
    if len(gpus) != 1:
        parser.error(f"{' and '.join(layouts)} run on different numbers of GPUs: compare layouts of one size")
    return gpus.pop()


def relaunch(script: str, gpus: int, layout: str, argv: list[str] | None = None) -> int | None:
    """Run `script` again under torchrun with `gpus` ranks when started without it, and return its exit code; None
    where this process is already a rank (or one GPU is asked for): the caller goes on."""
    if gpus == 1 or "LOCAL_RANK" in os.environ:
        return None
    cmd = [*launcher(gpus), str(Path(script).resolve()), *(sys.argv[1:] if argv is None else argv)]
    return subprocess.run(cmd, env=run_env(layout), cwd=ROOT).returncode


def meet() -> None:
    """Wait for this rank's GPU work, then for the other ranks (where a process group is started): timed windows
    start together on every rank."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def profile(
    argv: list[str], steps: int, warmup: int = 2, top: int = 15, host_top: int = 0, host_stats: Path | None = None
) -> tuple[str, dict]:
    """Build the trainer for `argv`, time `steps` optimizer steps, then profile as many with torch.profiler, and
    report GPU kernel time by category (the lower bound's, megatron/perf/report.py), the top kernels, and how much
    of the step the GPU was busy; also as a dict (step, busy and kernel ms per step, ms per category). Under
    torchrun every rank profiles and the report is rank 0's. `host_top`: then as many steps again under cProfile,
    and the host functions taking the most of their own time (where a step whose GPU idles in gaps spends it);
    `host_stats`: and the whole cProfile of each rank written there (`rank<r>.pstats`)."""
    import torch

    _, step = trainer_step(argv)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    kernels: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type == cuda:
            time_us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
            kernels[event.key] = kernels.get(event.key, 0.0) + time_us / 1e3 / steps
    total = sum(kernels.values())
    spans = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type == cuda]
    busy = _length(_union([(a, b) for a, b, _ in spans])) / 1e3 / steps
    idle_long, idle_short = _idle_between_kernels(spans)
    by_category: dict[str, float] = {}
    for name, ms in kernels.items():
        category = perf.kernel_category(name)
        by_category[category] = by_category.get(category, 0.0) + ms
    lines = [
        f"{environment()}; {' '.join(argv)}",
        f"step {wall_ms:.1f} ms (unprofiled), GPU busy {busy:.1f} ms per step ({100 * busy / wall_ms:.1f}%),"
        f" kernels {total:.1f} ms (more than busy where kernels run concurrently)",
        f"GPU idle between kernels (profiled steps): {idle_long / steps:.1f} ms per step in gaps over 20 us (the host"
        f" behind), {idle_short / steps:.1f} ms in shorter ones (launch latency)",
    ]
    if by_category.get("communication"):
        exposed = {name: us / 1e3 / steps for name, us in _exposed_communication(spans).items()}
        lines.append(
            f"communication: {by_category['communication']:.1f} ms of kernels and copies per step,"
            f" {sum(exposed.values()):.1f} ms of it with no other kernel running (exposed): "
            + ", ".join(f"{name} {ms:.1f}" for name, ms in sorted(exposed.items(), key=lambda kv: -kv[1])[:4])
        )
    lines += ["", "| category | ms/step | share of kernel time |", "|---|---:|---:|"]
    for category, ms in sorted(by_category.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {category} | {ms:.1f} | {100 * ms / total:.1f}% |")
    lines += ["", "| top kernels | ms/step |", "|---|---:|"]
    for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {short_kernel_name(name)[:110]} | {ms:.1f} |")
    summary = {"step_ms": wall_ms, "busy_ms": busy, "kernel_ms": total, "categories": by_category}
    if host_top:
        summary["host"] = host_profile(step, steps, host_top, host_stats)
        lines += ["", *summary["host"]]
    return "\n".join(lines), summary


def host_profile(step: Callable[[], object], steps: int, top: int, stats_dir: Path | None = None) -> list[str]:
    """`steps` calls of `step` under cProfile: the `top` functions by their own time per step (cProfile's overhead
    inflates Python-heavy functions; the ranking is what it is for). A step that waits for the GPU spends it in the
    call that waits (a synchronization, or a tensor read on the host). `stats_dir`: the whole profile is written
    there as `rank<RANK>.pstats` (`python -m pstats`, or two layouts' files compared function by function)."""
    import cProfile
    import pstats

    import torch

    meet()  # every rank's window starts together (their reports took unequal time)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    profiler.disable()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    if stats_dir is not None:
        stats_dir.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(stats_dir / f"rank{os.environ.get('RANK', '0')}.pstats")
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (primitive calls, calls, own s, cumulative s, ...)
    calls = sum(entry[1] for entry in stats.values()) / steps
    lines = [
        f"host (cProfile, rank's main thread): {wall_ms:.1f} ms per step, {calls:.0f} calls per step",
        "",
        "| host function | calls/step | own ms/step | cumulative ms/step |",
        "|---|---:|---:|---:|",
    ]
    for key, (_, ncalls, own, cumulative, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]:
        lines.append(
            f"| {profiled_name(key)[:100]} | {ncalls / steps:.0f} | {own * 1e3 / steps:.1f} |"
            f" {cumulative * 1e3 / steps:.1f} |"
        )
    return lines


def profiled_name(key: tuple[str, int, str]) -> str:
    """A cProfile entry's (file, line, function) as `file:line function` (a C function by its name alone): how
    host_profile and scripts/pstats_diff.py name a function."""
    file, line, name = key
    return name if file == "~" else f"{Path(file).name}:{line} {name}"


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted intervals covering `spans`."""
    merged: list[tuple[float, float]] = []
    for start, stop in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(stop - start for start, stop in intervals)


def _exposed_communication(spans: list[tuple[float, float, str]]) -> dict[str, float]:
    """Time (us) in which a communication kernel or copy runs and no other kernel does, by communication kernel:
    what overlapping the communication with computation has not hidden. Where communication kernels overlap each
    other, the time counts once, for the one that started first."""
    communication, other = [], []
    for span in spans:
        (communication if re.search(COMMUNICATION, span[2], re.IGNORECASE) else other).append(span)
    compute = _union([(a, b) for a, b, _ in other])  # disjoint and sorted: starts and ends both ascending
    compute_ends = [b for _, b in compute]
    exposed: dict[str, float] = {}
    covered = 0.0  # communication time already attributed (a later kernel's overlap with it is not counted again)
    for start, stop, name in sorted(communication):
        start = max(start, covered)
        if start >= stop:
            continue
        covered = stop
        hidden = 0.0
        i = bisect.bisect_right(compute_ends, start)  # the first compute interval ending after `start`
        while i < len(compute) and compute[i][0] < stop:
            hidden += min(stop, compute[i][1]) - max(start, compute[i][0])
            i += 1
        key = re.sub(r"\(.*", "", name).strip()[:60]
        exposed[key] = exposed.get(key, 0.0) + (stop - start) - hidden
    return exposed


def _idle_between_kernels(spans: list[tuple[float, float, str]]) -> tuple[float, float]:
    """GPU idle time (ms) inside the profiled window: gaps between one kernel's end and the next one's start, split
    at 20 us. Long gaps are the GPU waiting on the host (a synchronization, slow launches); short ones are the
    latency between back-to-back kernels, which only fewer kernels reduce."""
    intervals = _union([(a, b) for a, b, _ in spans])
    long_us = short_us = 0.0
    for (_, end), (start, _) in zip(intervals, intervals[1:]):
        gap = start - end
        if gap > 20:
            long_us += gap
        else:
            short_us += gap
    return long_us / 1e3, short_us / 1e3


def profile_run(
    result: Result, timeout: int, log_dir: Path | None, weak: bool = False, extra: str = ""
) -> tuple[dict | None, str]:
    """The `--profile` pass of a row in its own process (as its GPUs' only user): (its summary, "") or (None, why
    it failed)."""
    import tempfile

    graphs = ["--cuda-graphs"] if result.config.endswith(GRAPHS) else []
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "profile.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--profile",
            result.preset,
            result.config.removesuffix(GRAPHS),
        ]
        cmd += ["--layouts", result.layout, "--profile-json", str(out), *graphs, *(["--weak-scaling"] if weak else [])]
        cmd += [f"--extra-flags={extra}"] if extra else []
        text, code = execute(cmd, timeout, run_env(result.layout))
        if log_dir is not None:
            name = f"{result.preset}.{result.config.replace(GRAPHS, '-graphs')}.{result.layout}.profile.log"
            (log_dir / name).write_text(" ".join(cmd) + "\n" + text)
        if code != 0 or not out.exists():
            return None, failure_reason(text, code)
        return json.loads(out.read_text()), ""


def bound_row(result: Result, args: argparse.Namespace, probes: perf.Probes) -> perf.Row:
    """A row's lower bound (megatron/perf) beside its measured step and, unless --no-bound-profile, its profile.
    Any failure becomes a one-line note in the row, never an exception."""
    import torch

    from megatron.config import parse_args

    row = perf.Row(result.preset, result.config, result.layout, measured_ms=result.ms_per_iter)
    if result.error:
        row.errors.append(f"run failed: {result.error}")
    flags = train_flags(
        result.preset, result.config, args.iters, args.log_interval, result.layout, args.weak_scaling, args.extra_flags
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        cfg = parse_args(flags, world_size=result.gpus, device_type=device)
        row.bound = perf.lower_bound(cfg, probes, log=lambda line: print(f"bound: {line}", flush=True))
    except Exception as error:  # a configuration this machine cannot parse, a probe with no fallback, ...
        row.errors.append(f"no bound: {perf.one_line(error)}")
    if args.bound_profile and not result.error:
        summary, why = profile_run(result, args.timeout, args.log_dir, args.weak_scaling, args.extra_flags)
        if summary is None:
            row.errors.append(f"profile failed: {why}")
        else:
            row.profile = {**summary["categories"], perf.IDLE: summary["step_ms"] - summary["busy_ms"]}
    return row


def bound_report(rows: list[perf.Row]) -> str:
    """The bound table, then per row its categories and terms."""
    parts = ['Lower bound per iteration (docs/benchmarks.md, "Lower bound")', "", perf.bound_table(rows)]
    for row in rows:
        if row.bound is not None:
            parts += ["", perf.category_table(row), "", perf.terms_table(row.bound)]
            parts += [f"note: {line}" for line in row.bound.notes]
    return "\n".join(parts)


def environment() -> str:
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    try:
        import transformer_engine

        te = transformer_engine.__version__
    except Exception:  # not installed, or not importable here
        te = "not importable"
    return f"{device}, torch {torch.__version__}, Transformer Engine {te}, {time.strftime('%Y-%m-%d')}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["llama-1b", "llama-8b-4l"], choices=list(PRESETS))
    default_configs = [c for c in CONFIGS if c not in FSDP_ONLY_CONFIGS]
    parser.add_argument("--configs", nargs="+", default=default_configs, choices=list(CONFIGS))
    parser.add_argument("--layouts", nargs="+", default=["1gpu"], choices=list(LAYOUTS))
    parser.add_argument("--weak-scaling", action="store_true", help="global batch x data-parallel size")
    parser.add_argument("--cuda-graphs", action="store_true", help="TE configs with their layers as CUDA graphs")
    parser.add_argument("--iters", type=int, default=10, help="training iterations per run")
    parser.add_argument(
        "--log-interval", type=int, default=5, help="the reported numbers average the intervals after the first"
    )
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run before it counts as failed")
    parser.add_argument(
        "--extra-flags", default="", help="pretrain_gpt.py flags added to every run, e.g. '--manual-gc' (printed)"
    )
    parser.add_argument("--log-dir", type=Path, help="keep each run's full log here")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--profile", nargs=2, metavar=("PRESET", "CONFIG"), help="profile one run instead")
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument(
        "--profile-warmup", type=int, default=2, help="steps run before the profiled ones (a late window: 30)"
    )
    parser.add_argument("--profile-top", type=int, default=15, help="how many kernels the profile lists")
    parser.add_argument("--profile-json", type=Path, help="with --profile: also write its summary here (rank 0)")
    parser.add_argument(
        "--profile-host",
        type=int,
        default=0,
        metavar="N",
        help="with --profile: the N host functions taking the most of their own time (cProfile, after the GPU profile)",
    )
    parser.add_argument(
        "--profile-host-stats", type=Path, metavar="DIR", help="with --profile-host: each rank's whole cProfile there"
    )
    parser.add_argument(
        "--bound", action="store_true", help="print each row's lower bound, measured/bound and where the rest goes"
    )
    parser.add_argument(
        "--no-bound-profile", dest="bound_profile", action="store_false", help="--bound without the profile pass"
    )
    parser.add_argument(
        "--probe-cache",
        type=Path,
        default=Path.home() / ".cache" / "megatron-fp8" / "probes.json",
        help="--bound's microbenchmark results, per device and shape",
    )
    args = parser.parse_args()
    if args.profile_host and not args.profile or args.profile_host_stats and not args.profile_host:
        parser.error("--profile-host N profiles a --profile run's host; --profile-host-stats DIR needs --profile-host")
    if args.profile:
        preset, config = args.profile
        if len(args.layouts) != 1:
            parser.error("--profile profiles one layout: pass one --layouts value")
        layout = args.layouts[0]
        # profile every rank under torchrun, report rank 0's
        if (code := relaunch(__file__, LAYOUTS[layout][0], layout)) is not None:
            return code
        config += GRAPHS if args.cuda_graphs else ""
        flags = train_flags(preset, config, 100, 100, layout, args.weak_scaling, args.extra_flags)
        report, summary = profile(
            flags, args.profile_steps, args.profile_warmup, args.profile_top, args.profile_host, args.profile_host_stats
        )
        rank = os.environ.get("RANK", "0")
        if rank == "0":
            print(report)
            if args.profile_json:
                args.profile_json.write_text(json.dumps(summary, indent=1) + "\n")
        else:  # which rank is behind: the others' step, busy and gap lines, and host profile, marked
            print("\n".join(f"[rank {rank}] {line}" for line in [*report.splitlines()[1:4], *summary.get("host", [])]))
        return 0
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    results, rows = [], []
    probes = None
    if args.bound:
        import torch

        measure = perf.cuda_measure if torch.cuda.is_available() else None
        probes = perf.Probes(perf.device_name(), measure, args.probe_cache)
    for preset in args.presets:
        for config in args.configs:
            if args.cuda_graphs and config.startswith("te-"):
                config += GRAPHS
            for layout in args.layouts:
                result = run(
                    preset,
                    config,
                    args.iters,
                    args.log_interval,
                    args.timeout,
                    args.log_dir,
                    layout,
                    args.weak_scaling,
                    args.extra_flags,
                )
                results.append(result)
                print(json.dumps(asdict(result)), flush=True)
                if probes is not None:
                    rows.append(bound_row(result, args, probes))
                    print(perf.bound_table(rows[-1:]).splitlines()[-1], flush=True)  # progress, in case of a timeout
    print(f"\n{environment()}" + (f"; every run with {args.extra_flags}" if args.extra_flags else "") + "\n")
    print(table(results))
    if rows:
        print("\n" + bound_report(rows))
    if args.json:
        records = [asdict(r) for r in results]
        for record, row in zip(records, rows):  # rows exist with --bound only
            record["bound_ms"] = row.bound.total_ms if row.bound else None
            record["bound_categories"] = row.bound.by_category() if row.bound else None
            record["profile_categories"], record["bound_errors"] = row.profile, row.errors
        args.json.write_text(json.dumps(records, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
