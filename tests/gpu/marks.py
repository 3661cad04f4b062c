"""Marks shared by the GPU tests."""

import pytest
import torch

from megatron.config.te_rules import te_import_error

#: Transformer Engine on two GPUs (nvidia-h100-x2): the FSDP tests' pytestmark
TE_ON_TWO_GPUS = [
    pytest.mark.gpu,
    pytest.mark.skipif(te_import_error() is not None, reason=f"needs Transformer Engine ({te_import_error()})"),
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs (nvidia-h100-x2)"
    ),
]
