"""Seconds to build a big model's initial weights on the CPU: every draw at once from the global generator (the model
before megatron/model/init_draws.py) against the parts drawn in a pool of threads, and whether both give bitwise the
same weights. Llama-3-8B's widths (hidden 4096, ffn 14336, 32 heads / 8 groups, vocabulary 128256), untied, local
layers in bf16, with --layers of its 32 layers (the embedding and the output layer are a quarter of 8B's draws).

python scripts/probes/init_draws_bench.py --layers 2 --threads 1 2
python scripts/probes/init_draws_bench.py --layers 4 --threads 1 8 16     (a 16-core machine; ~14 GB of memory)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import resource
import time
from unittest import mock

import torch

from megatron.config import parse_args
from megatron.model import GPTModel, gpt

LLAMA3_8B = (
    "--hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --num-query-groups 8 --group-query-attention"
    " --seq-length 8192 --max-position-embeddings 8192 --vocab-size 128256 --swiglu --normalization RMSNorm"
    " --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear --mock-data"
    " --tokenizer-type NullTokenizer --micro-batch-size 1 --global-batch-size 8 --train-iters 1 --bf16"
    " --transformer-impl local"
)


def build(layers: int, threads: int | None) -> tuple[float, float, float, str, int]:
    """(seconds, user and system CPU seconds, the weights' SHA-256, elements) of one build; `threads` None: every
    draw at once, one after another, from the global generator."""
    cfg = parse_args(f"{LLAMA3_8B} --num-layers {layers}".split(), world_size=1, device_type="cpu")
    sequential = mock.patch.object(gpt, "parallel_draws", lambda threads: contextlib.nullcontext())
    torch.manual_seed(1234)
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    with sequential if threads is None else contextlib.nullcontext():
        model = GPTModel(cfg.model, 128256, torch.bfloat16, init_threads=threads or 1)
    seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    digest = hashlib.sha256()
    for name, value in model.state_dict().items():
        digest.update(name.encode())
        digest.update(value.contiguous().view(torch.uint8).numpy().tobytes())
    elements = sum(p.numel() for p in model.parameters())
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    return seconds, user, system, digest.hexdigest()[:16], elements


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--torch-threads", type=int, default=1, help="torch.set_num_threads (the casts' threads)")
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    print(f"torch.set_num_threads({args.torch_threads}); {args.layers} layers of Llama-3-8B's widths")
    reference = None
    for threads in [None, *args.threads]:
        seconds, user, system, digest, elements = build(args.layers, threads)
        reference = reference or digest
        label = "every draw at once (before)" if threads is None else f"parts in {threads} thread(s)"
        print(
            f"{label:28s}: {seconds:6.2f} s ({seconds / elements * 1e9:.1f} ns/element; user {user:.1f} s, system"
            f" {system:.1f} s), weights {digest} {'the same' if digest == reference else 'DIFFERENT'}"
        )


if __name__ == "__main__":
    main()
