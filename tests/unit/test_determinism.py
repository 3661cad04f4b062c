"""--deterministic-mode: PyTorch's deterministic algorithms and the library switches, as Megatron-LM sets them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.errors import UserError
from megatron.training import determinism

ROOT = Path(__file__).resolve().parents[2]

# Two tiny runs in a fresh process (the mode is process-wide and must not leak into this one), with dropout on.
SCRIPT = """
import json, os, sys, torch
from megatron.config import parse_args
from megatron.training import Trainer
flags = ("--mock-data --vocab-size 64 --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16"
         " --micro-batch-size 2 --global-batch-size 4 --train-iters 4 --eval-iters 0 --log-interval 100"
         " --transformer-impl local --deterministic-mode --attention-backend ").split()
before = torch.are_deterministic_algorithms_enabled()
runs = [Trainer(parse_args(flags + [b])).train().losses for b in ("auto", "auto", "unfused", "unfused")]
env = {k: os.environ.get(k) for k in ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO")}
print(json.dumps({"before": before, "after": torch.are_deterministic_algorithms_enabled(), "runs": runs, "env": env}))
"""


def test_deterministic_mode_sets_torch_and_env_and_repeats_bitwise():
    env = {k: v for k, v in os.environ.items() if k not in determinism.DETERMINISTIC_ENV}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert not result["before"] and result["after"]
    assert result["env"] == determinism.DETERMINISTIC_ENV
    auto, auto_again, unfused, unfused_again = result["runs"]
    assert auto == auto_again and unfused == unfused_again  # JSON floats round-trip exactly: bitwise equal losses
    assert len(auto) == len(unfused) == 4


def test_environment_values_are_checked_then_defaulted(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda mode: calls.append(mode))
    env = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    determinism.apply_deterministic_mode(env)
    assert env == {**determinism.DETERMINISTIC_ENV, "CUBLAS_WORKSPACE_CONFIG": ":16:8"} and calls == [True]
    for name, value in (
        ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1"),
        ("CUBLAS_WORKSPACE_CONFIG", ":0:0"),
        ("NCCL_ALGO", "Tree"),
        ("NCCL_ALGO", "Ring,Tree"),
    ):
        with pytest.raises(UserError, match=f"--deterministic-mode: {name}="):
            determinism.apply_deterministic_mode({name: value})
    assert calls == [True]
    determinism.check_deterministic_env({"NCCL_ALGO": "Ring,CollnetDirect"})


def test_a_test_that_turns_deterministic_mode_on_in_process():
    """With its twin below: tests/conftest.py undoes the mode after each test (an in-process run with
    --deterministic-mode would otherwise reach every later test, e.g. cost TE its FP8 attention kernels)."""
    determinism.apply_deterministic_mode()
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"


SESSION_ENV = {name: os.environ.get(name) for name in determinism.DETERMINISTIC_ENV}


def test_the_next_test_starts_without_it():
    assert not torch.are_deterministic_algorithms_enabled()
    assert {name: os.environ.get(name) for name in determinism.DETERMINISTIC_ENV} == SESSION_ENV
