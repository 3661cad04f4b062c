"""Time tools/checkpoint/convert.py on llama-1b (CPU): build a random bf16 llama-1b checkpoint in this project's
format at a tensor x pipeline layout, then run the export to Hugging Face as a user would (a fresh process).

    python scripts/probes/bench_convert.py --tp 2 --pp 2 --dir /tmp/bench_convert
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from megatron.convert import FullModel, atomic_output_dir, write_torch
from megatron.convert.state import check_complete, expected_names, model_config

ROOT = Path(__file__).resolve().parents[2]  # the repository


def llama_1b() -> FullModel:
    """scripts/benchmark.py's llama-1b preset with random bf16 weights (a bf16 run saves its weights in bf16)."""
    cfg = model_config(
        num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32, group_query_attention=True,
        num_query_groups=8, seq_length=4096, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
        disable_bias_linear=True, untie_embeddings_and_output_weights=True,
    )  # fmt: skip
    vocab, h = 32000, cfg.hidden_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.kv_channels
    shapes = {"word_embeddings": (vocab, h), "output_layer": (vocab, h), "linear_qkv.weight": (qkv, h),
              "linear_proj.weight": (h, h), "linear_fc1.weight": (2 * cfg.ffn_hidden_size, h),
              "linear_fc2.weight": (h, cfg.ffn_hidden_size)}  # fmt: skip
    state = {}
    for name in expected_names(cfg):
        shape = next((s for key, s in shapes.items() if key in name), (h,))  # the rest: norm weights
        state[name] = torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02)
    full = FullModel(
        cfg, vocab, state, "random llama-1b", data={"tokenizer_type": "NullTokenizer", "vocab_size": vocab - 1}
    )
    check_complete(full)
    return full


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dir", default="/tmp/bench_convert")
    args = parser.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    with atomic_output_dir(root / "native") as out:
        write_torch(llama_1b(), out, args.tp, args.pp)
    command = [sys.executable, str(ROOT / "tools/checkpoint/convert.py"), "--loader", "native", "--saver", "hf"]
    command += ["--load-dir", str(root / "native"), "--save-dir", str(root / "hf")]
    start = time.perf_counter()
    subprocess.run(command, check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    seconds = time.perf_counter() - start
    print(f"llama-1b TP={args.tp} x PP={args.pp} -> Hugging Face: {seconds:.1f} s on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
