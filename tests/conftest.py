"""Shared test fixtures: the `gpu` marker skips with a reason when no CUDA device is present."""

import multiprocessing.forkserver
import os
import sys

# The CPU tests' tolerances and bitwise checks assume oneDNN's AVX-512 kernels. On CPUs with AMX, oneDNN runs bf16
# matmuls on its tiles, which round and accumulate in another order (the layouts then differ from the one-process
# model by more than the FP8 tests allow); capping its instruction set keeps one numerics on every CI machine. Set
# before torch loads oneDNN; every rank and subprocess a test starts inherits it.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_sessionstart(session):
    """Start the fork server of the gloo ranks (tests/dist_utils.py) now, in the background: its imports take about
    3 s of one core, which overlap the collection (single-threaded, about 8 s) instead of delaying the first
    distributed test. Each rank still runs with the running test's environment (run_distributed passes it)."""
    if sys.platform.startswith("linux"):
        from tests import dist_utils  # noqa: F401  (sets the fork server's preload list)

        multiprocessing.forkserver.ensure_running()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run tests/gpu on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_trusted_checkpoints(monkeypatch):
    """--trust-checkpoint sets MEGATRON_TRUST_CHECKPOINT=1 in the process for good (every rank parses its own flags);
    a test that runs pretrain_gpt.main with it in-process would leave every later test, and the workers they start,
    loading hostile files the old way. Unset for each test and unset again after it."""
    monkeypatch.delenv("MEGATRON_TRUST_CHECKPOINT", raising=False)


TE_ATTENTION_SWITCHES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


@pytest.fixture(autouse=True)
def _te_attention_switches(monkeypatch):
    """Building a model writes TE's attention switches into os.environ (--attention-backend, as Megatron-LM does);
    each test starts from the environment the test session had, so one test's backend never reaches the next test's
    model or the training runs it launches."""
    from megatron.model import attention

    saved = {name: os.environ.pop(name, None) for name in TE_ATTENTION_SWITCHES}
    monkeypatch.setattr(attention, "_SET_BY_US", {})
    yield
    _restore(saved)


@pytest.fixture(autouse=True)
def _deterministic_mode_undone():
    """--deterministic-mode sets its environment (megatron/training/determinism.py) and PyTorch's deterministic
    algorithms for the rest of the process, as it must for a run; a test that trains with it in-process would pass
    both on to every later test (Transformer Engine then drops its non-deterministic attention kernels, FP8
    attention among them on Hopper). Each test ends with the process as it started."""
    from megatron.training.determinism import DETERMINISTIC_ENV

    saved = {name: os.environ.get(name) for name in DETERMINISTIC_ENV}
    algorithms = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    _restore(saved)
    torch.use_deterministic_algorithms(algorithms[0], warn_only=algorithms[1])


def _restore(saved: dict[str, str | None]) -> None:
    """Put the environment variables of `saved` back as they were (None: unset)."""
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
