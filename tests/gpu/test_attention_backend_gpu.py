"""--attention-backend on a GPU: each TE backend and the local SDPA kernels give the same model output, and the
flag reaches TE through the NVTE_* environment (restored after each test by tests/conftest.py)."""

import importlib.util
import os

import pytest
import torch

from megatron.config import parse_args
from megatron.config.te_rules import te_import_error
from megatron.errors import UserError
from megatron.model import GPTModel, attention

pytestmark = pytest.mark.gpu
VOCAB = 256
FLAGS = (
    "--mock-data --vocab-size 256 --num-layers 2 --hidden-size 128 --num-attention-heads 4 --group-query-attention"
    " --num-query-groups 2 --seq-length 64 --position-embedding-type rope --normalization RMSNorm"
    " --hidden-dropout 0 --attention-dropout 0 --micro-batch-size 2"
)


def logits(impl: str, backend: str, extra: str = "") -> torch.Tensor:
    cfg = parse_args(
        f"{FLAGS} --transformer-impl {impl} --attention-backend {backend} {extra}".split(), device_type="cuda"
    )
    torch.manual_seed(0)
    model = GPTModel(cfg.model, VOCAB, precision=cfg.precision).to("cuda", torch.bfloat16).eval()
    tokens = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        return model(tokens).float()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).norm() / b.norm()) < 2e-2


@pytest.mark.parametrize("backend", ["flash", "fused", "unfused", "local"])
def test_local_engine_backends_match_auto(backend):
    assert close(logits("local", backend), logits("local", "auto"))


@pytest.mark.skipif(te_import_error() is not None, reason=f"needs Transformer Engine ({te_import_error()})")
@pytest.mark.parametrize("backend", ["flash", "fused", "unfused", "local"])
def test_te_backends_match_auto_and_set_the_environment(backend):
    reference = logits("transformer_engine", "auto")
    if backend == "flash" and importlib.util.find_spec("flash_attn") is None:
        # TE's flash backend is the flash-attn package's kernel: without it, the one-line error
        forced = r"no attention kernel .* --attention-backend flash allows only that kernel"
        with pytest.raises(UserError, match=forced):
            logits("transformer_engine", backend)
        return
    out = logits("transformer_engine", backend, "--apply-layernorm-1p --qk-layernorm --no-rope-fusion")
    expected = attention.te_attention_env(backend)
    assert {k: os.environ[k] for k in expected} == expected
    assert close(out, logits("transformer_engine", "auto", "--apply-layernorm-1p --qk-layernorm --no-rope-fusion"))
    assert close(logits("transformer_engine", backend), reference)
    assert close(logits("local", "unfused"), reference)  # the engines agree too
