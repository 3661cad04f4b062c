"""--deterministic-mode: the process-wide switches that make a run bitwise reproducible (Megatron-LM's meaning).

Libraries read these once (cuBLAS when its handle is created, NCCL when a communicator is, Transformer Engine when
an attention module is built), so `apply_deterministic_mode` runs first thing when training starts, before the
process groups and the model exist.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

import torch

from megatron.errors import UserError

DETERMINISTIC_ENV: dict[str, str] = {
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",  # TE: only deterministic attention backends and GEMM paths
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",  # cuBLAS: fixed workspaces, hence fixed reduction order
    "NCCL_ALGO": "Ring",  # NCCL: a ring's summation order does not depend on timing or topology
}
"""Set where the environment does not already hold a value."""

ACCEPTED_VALUES: dict[str, frozenset[str]] = {
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": frozenset({"0"}),
    "CUBLAS_WORKSPACE_CONFIG": frozenset({":4096:8", ":16:8"}),  # the two NVIDIA documents as deterministic
}
"""Values a user may have set already; anything else would silently break reproducibility."""

ACCEPTED_NCCL_ALGOS = frozenset({"Ring", "CollnetDirect", "CollnetChain", "^NVLS"})
"""NCCL algorithms (comma-separated in NCCL_ALGO) whose reductions keep a fixed order; Tree's does not."""


def check_deterministic_env(env: MutableMapping[str, str]) -> None:
    """UserError (one line) for an environment value that contradicts --deterministic-mode."""
    for name, accepted in ACCEPTED_VALUES.items():
        value = env.get(name)
        if value is not None and value not in accepted:
            raise UserError(
                f"--deterministic-mode: {name}={value} is not deterministic; unset it or use one of"
                f" {', '.join(sorted(accepted))}"
            )
    algos = env.get("NCCL_ALGO")
    if algos is not None:
        tokens = [t.strip() for t in algos.split(",") if t.strip()]
        if not tokens or any(t not in ACCEPTED_NCCL_ALGOS for t in tokens):
            raise UserError(
                f"--deterministic-mode: NCCL_ALGO={algos} may reduce in a varying order; unset it or use"
                f" {', '.join(sorted(ACCEPTED_NCCL_ALGOS))}"
            )


def apply_deterministic_mode(env: MutableMapping[str, str] = os.environ) -> None:
    """Check the environment, fill in the deterministic defaults, and make PyTorch use deterministic algorithms
    only (an op without one then raises instead of running nondeterministically)."""
    check_deterministic_env(env)
    for name, value in DETERMINISTIC_ENV.items():
        env.setdefault(name, value)
    torch.use_deterministic_algorithms(True)
