"""megatron/fp8/gemm.py's probe on a CPU: torch._scaled_mm is taken when it matches the emulation and is not many
times slower than it (oneDNN's reference kernel, where the CPU has no FP8 instructions, runs it ~1000x slower)."""

import time

import pytest
import torch

from megatron.fp8 import gemm

E4M3 = torch.float8_e4m3fn


@pytest.fixture
def fake_native(monkeypatch):
    """torch._scaled_mm replaced by the emulation's product after a wait of `delay[0]` seconds, and an empty probe
    cache (restored after the test)."""
    delay = [0.0]

    def native(a, b, out_dtype, fast_accum, bias):
        time.sleep(delay[0])
        return torch.mm(a.dequantize(), b.dequantize().t()).to(out_dtype)

    monkeypatch.setattr(gemm, "_scaled_mm", native)
    monkeypatch.setattr(gemm, "_PROBED", {})
    return delay


def path() -> str:
    return gemm.describe_path(torch.device("cpu"), "tensor", "tensor", E4M3, E4M3, torch.float32)


def test_a_native_gemm_as_fast_as_the_emulation_is_taken(fake_native):
    assert path() == "torch._scaled_mm (tensor x tensor)"


def test_a_native_gemm_many_times_slower_is_emulated_and_the_log_says_why(fake_native):
    fake_native[0] = 1.0  # the probe's emulated GEMM takes a few ms
    name = path()
    assert name.startswith(gemm.EMULATED_CPU) and "x slower here" in name, name
