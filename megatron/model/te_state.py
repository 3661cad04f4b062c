"""What Transformer Engine keeps of a run in its module-level state, and its release at the process's end
(`release_te_state`, an exit part of `megatron.training.shutdown.Shutdown` on the TE path).

TE (2.20) keeps the process groups its modules were given in structures that outlive the model, so dropping the
trainer does not drop them and `Shutdown.close` reports them "still referenced after their release":
  * `FP8GlobalStateManager.quantization_state.autocast_arguments` (quantization.py): every `te.autocast`'s
    (recipe, amax_reduction_group), keyed by the group's id, for the delayed-scaling amax reductions. Our FP8
    autocast passes the amax group (`TEFp8Autocast`). The same state holds the global amax and scale buffers
    (the modules' amax histories, device memory). `FP8GlobalStateManager.reset()` (TE's own) starts it afresh.
  * `_attention_backends["attention_params"]` (attention/dot_product_attention/dot_product_attention.py): the
    last `AttentionParams` of a `DotProductAttention` forward, whose `fp8_meta` is the module's, and with it its
    "fp8_group" (the amax group again); `_thd_policy_backend_cache` keeps more of them for THD masks.
  * `get_distributed_world_size` / `get_distributed_rank` (distributed.py): `lru_cache`s keyed by the group, filled
    with the tensor- and context-parallel groups of the linears and attention.
Userbuffers (--tp-comm-overlap) hold groups that TE made itself, not ours, and map peers' memory: they are left to
`te_comm_overlap.initialize_userbuffers` and the process's end.

transformer_engine is never imported here: only the modules already in `sys.modules` are touched, so a run that
never loaded TE (the CPU, --transformer-impl local) does nothing.
"""

from __future__ import annotations

import sys

QUANTIZATION = "transformer_engine.pytorch.quantization"
ATTENTION = "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention"
DISTRIBUTED = "transformer_engine.pytorch.distributed"


def release_te_state() -> list[str]:
    """Drop what TE's module-level state keeps of this run (its process groups first of all); the names of what
    was released. Call it once the run's TE modules are no longer used: a module used afterwards would find its
    FP8 tensors gone from TE's global buffers (its amaxes no longer reduced)."""
    released = []
    quantization = sys.modules.get(QUANTIZATION)
    manager = getattr(quantization, "FP8GlobalStateManager", None)
    if manager is not None and hasattr(manager, "reset"):
        manager.reset()
        released.append("FP8GlobalStateManager")
    attention = sys.modules.get(ATTENTION)
    backends = getattr(attention, "_attention_backends", None)
    if isinstance(backends, dict) and backends.get("attention_params") is not None:
        backends["attention_params"] = None
        backends["backend_selection_requires_update"] = True  # the next forward selects afresh
        released.append("_attention_backends")
    policy_cache = getattr(attention, "_thd_policy_backend_cache", None)
    if isinstance(policy_cache, list) and policy_cache:
        policy_cache.clear()
        released.append("_thd_policy_backend_cache")
    distributed = sys.modules.get(DISTRIBUTED)
    for name in ("get_distributed_world_size", "get_distributed_rank"):
        cache_clear = getattr(getattr(distributed, name, None), "cache_clear", None)
        if cache_clear is not None:
            cache_clear()
            released.append(name)
    return released
