"""Megatron-LM's own launch scripts run here unchanged but for their sizes, GPU counts and paths: the FP8
Llama-3 8B recipe and the GPT-3 175B fp16 script, with the flag lists of tests/assets/megatron_scripts.py, through
torchrun as the scripts launch them. On CPUs (gloo, FP8 emulated by the local engine) and on one GPU (TE)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.checkpoint import latest_iteration
from tests.assets.data_helpers import write_documents
from tests.assets.megatron_scripts import GPT3_175B, LLAMA3_8B_FP8, argv

ROOT = Path(__file__).resolve().parents[2]
GPU = pytest.mark.gpu
ON_GPU = torch.cuda.is_available()


def _torchrun(args: list[str], nproc: int) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "pretrain_gpt.py", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    if result.returncode != 0:  # the error lines first: the flag dump fills the tail of stdout
        lines = (result.stdout + result.stderr).splitlines()
        errors = [line for line in lines if "rror" in line or "Traceback" in line]
        pytest.fail("\n".join([f"exit {result.returncode}", *errors[-20:], "--- stderr tail:", *lines[-40:]]))
    return result.stdout


def _final(stdout: str) -> dict:
    return json.loads(next(line for line in reversed(stdout.splitlines()) if line.startswith('{"final_iteration"')))


def llama3_8b_fp8(tmp_path: Path, gpus: int) -> list[str]:
    variables = {
        "NUM_LAYERS": "2",
        "SEQ_LENGTH": "64",
        "MAX_POSITION_EMBEDDINGS": "64",
        "MICRO_BATCH_SIZE": "1",
        "GLOBAL_BATCH_SIZE": str(2 * gpus),
        "TP_SIZE": "1",
        "CP_SIZE": "1",
        "DATA_CACHE_PATH": str(tmp_path / "cache"),
        "CHECKPOINT_PATH": str(tmp_path / "ckpt"),
        "TENSORBOARD_LOGS_PATH": str(tmp_path / "tb"),
    }
    sizes = {
        "--hidden-size": "128",
        "--ffn-hidden-size": "256",
        "--num-attention-heads": "4",
        "--num-query-groups": "2",
        "--kv-channels": "32",
        "--train-samples": str(8 * 2 * gpus),
        "--lr-decay-samples": str(8 * 2 * gpus),
        "--lr-warmup-samples": str(2 * gpus),
        "--vocab-size": "1024",
        "--eval-iters": "2",
    }
    return argv(LLAMA3_8B_FP8, variables, sizes)


def gpt3_175b(tmp_path: Path, tp: int, pp: int) -> list[str]:
    data = write_documents(tmp_path / "corpus", [60] * 50)
    assets = ROOT / "megatron/data/assets"
    variables = {
        "DATA_PATH": data,
        "VOCAB_FILE": str(assets / "stdlib-bpe-vocab.json"),
        "MERGE_FILE": str(assets / "stdlib-bpe-merges.txt"),
        "CHECKPOINT_PATH": str(tmp_path / "ckpt"),
        "TENSORBOARD_LOGS_PATH": str(tmp_path / "tb"),
    }
    sizes = {
        "--num-layers": "4",
        "--hidden-size": "64",
        "--num-attention-heads": "4",
        "--seq-length": "64",
        "--max-position-embeddings": "64",
        "--global-batch-size": "16",
        # the script's schedule in 1/2.4M of its tokens: batch 4, then 8 from 1K tokens (15 samples), 16 from 2K
        "--step-batch-size-schedule": "0:4 1K:8 2K:16",
        "--train-iters": "6",
        "--lr-decay-iters": "6",
        "--tensor-model-parallel-size": str(tp),
        "--pipeline-model-parallel-size": str(pp),
        "--log-interval": "1",
        "--save-interval": "3",
        "--eval-interval": "3",
        "--eval-iters": "1",
    }
    return argv(GPT3_175B, variables, sizes)


def _check_llama(stdout: str, tmp_path: Path) -> None:
    assert _final(stdout)["final_iteration"] == 8 and "fp8" in stdout
    assert latest_iteration(str(tmp_path / "ckpt")) == 8
    assert list((tmp_path / "tb").iterdir()), "no TensorBoard events"


def _check_gpt3(stdout: str, tmp_path: Path) -> None:
    final = _final(stdout)
    assert final["final_iteration"] == 6
    lines = [line for line in stdout.splitlines() if " iteration " in line and "global batch size" in line]
    sizes = [int(line.split("global batch size:")[1].split("|")[0]) for line in lines]
    assert sizes == [4, 4, 4, 4, 8, 8], sizes
    assert "loss scale:" in lines[-1]
    assert latest_iteration(str(tmp_path / "ckpt")) == 6


@pytest.mark.slow
def test_llama3_8b_fp8_script_on_cpu(tmp_path):
    """Two processes (data-parallel, distributed optimizer, FP8 weights emulated), mock data, torch_dist saves."""
    _check_llama(_torchrun(llama3_8b_fp8(tmp_path, gpus=2), nproc=2), tmp_path)


@pytest.mark.slow
def test_gpt3_175b_script_on_cpu(tmp_path):
    """Four processes: tensor x pipeline parallel 2 x 2, fp16 with dynamic loss scaling, the batch-size schedule."""
    _check_gpt3(_torchrun(gpt3_175b(tmp_path, tp=2, pp=2), nproc=4), tmp_path)


@GPU
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_llama3_8b_fp8_script_on_one_gpu(tmp_path):
    _check_llama(_torchrun(llama3_8b_fp8(tmp_path, gpus=1), nproc=1), tmp_path)


@GPU
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_gpt3_175b_script_on_one_gpu(tmp_path):
    _check_gpt3(_torchrun(gpt3_175b(tmp_path, tp=1, pp=1), nproc=1), tmp_path)
