"""Marks shared by the GPU tests."""

import importlib.util
import os

import numpy as np
import pytest
import torch

from megatron.config.te_rules import te_import_error

#: Two GPUs (nvidia-h100-x2), NCCL between them
TWO_GPUS = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs (nvidia-h100-x2)"
    ),
]

#: Transformer Engine on two GPUs: the FSDP tests' pytestmark
TE_ON_TWO_GPUS = [
    *TWO_GPUS,
    pytest.mark.skipif(te_import_error() is not None, reason=f"needs Transformer Engine ({te_import_error()})"),
]

#: Triton's interpreter runs the kernels on the CPU (TRITON_INTERPRET=1, read when Triton is imported)
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")

#: A Triton kernel's tests: on a CUDA GPU, or on the CPU under the interpreter (`TRITON_INTERPRET=1 pytest
#: --noconftest ...`: tests/conftest.py skips tests/gpu on machines without CUDA)
TRITON_KERNEL = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (pip install triton)"),
    pytest.mark.skipif(
        not INTERPRET and not torch.cuda.is_available(), reason="needs a CUDA GPU, or TRITON_INTERPRET=1"
    ),
]


def fuse_interpreter_fma(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make Triton's interpreter round tl.fma once, as a GPU does. It computes x * y + z in the operands' dtype, two
    roundings (Triton 3.5), so a kernel's fma can differ from torch's in the last bit, which the bitwise tests see.
    fp32 operands go through `adam_kernel.fma32`."""
    from triton.runtime import interpreter

    from megatron.optim.adam_kernel import fma32

    unfused = interpreter.InterpreterBuilder.create_fma

    def create_fma(self, x, y, z):
        if z.data.dtype != np.float32:
            return unfused(self, x, y, z)
        fused = fma32(*(torch.from_numpy(np.asarray(a.data)) for a in (x, y, z)))
        return interpreter.TensorHandle(fused.numpy(), z.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fma", create_fma)


def _te_kernels_error() -> str | None:
    if INTERPRET:
        return "the interpreter runs on the CPU"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return te_import_error()


#: Why Transformer Engine's kernels cannot run here (None: they can): what a Triton kernel's test compares against
TE_KERNELS_ERROR = _te_kernels_error()
NEEDS_TE_KERNELS = pytest.mark.skipif(
    TE_KERNELS_ERROR is not None, reason=f"needs Transformer Engine ({TE_KERNELS_ERROR})"
)
