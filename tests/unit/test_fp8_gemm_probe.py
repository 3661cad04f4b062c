"""megatron/fp8/gemm.py's probe on a CPU: torch._scaled_mm is taken when it matches the emulation and is not many
times slower than it (oneDNN's reference kernel, where the CPU has no FP8 instructions, runs it ~1000x slower)."""

import time

import pytest
import torch

from megatron.fp8 import gemm

E4M3 = torch.float8_e4m3fn


@pytest.fixture
def fake_native(monkeypatch):
    """torch._scaled_mm replaced by the emulation's product after a wait of `delay[rows]` seconds (rows: A's; 0 if
    not listed), recording each call's M, and an empty probe cache (restored after the test)."""
    delay, calls = {}, []

    def native(a, b, out_dtype, fast_accum, bias):
        calls.append(a.data.shape[0])
        time.sleep(delay.get(a.data.shape[0], 0.0))
        return torch.mm(a.dequantize(), b.dequantize().t()).to(out_dtype)

    monkeypatch.setattr(gemm, "_scaled_mm", native)
    monkeypatch.setattr(gemm, "_PROBED", {})
    return delay, calls


def path() -> str:
    return gemm.describe_path(torch.device("cpu"), "tensor", "tensor", E4M3, E4M3, torch.float32)


def test_a_native_gemm_as_fast_as_the_emulation_is_taken(fake_native):
    assert path() == "torch._scaled_mm (tensor x tensor)"
    assert fake_native[1] == [64, 64, 256]  # the small GEMM twice (kernel set-up, then timed), then the large one


def test_a_native_gemm_many_times_slower_is_emulated_without_the_large_gemm_and_the_log_says_why(fake_native):
    delay, calls = fake_native
    delay[64] = 1.0  # the small emulated GEMM: under a millisecond alone, 10 ms while the fork server starts
    name = path()
    assert name.startswith(gemm.EMULATED_CPU) and "x slower here" in name, name
    assert calls == [64, 64]  # refused at the small size: the large GEMM (seconds on the reference kernel) never ran


def test_a_native_gemm_slower_only_at_the_large_size_is_still_emulated(fake_native):
    fake_native[0][256] = 2.0  # the probe's large emulated GEMM takes a few ms, tens under load
    name = path()
    assert name.startswith(gemm.EMULATED_CPU) and "x slower here" in name, name
