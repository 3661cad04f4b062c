"""Transformer Engine's userbuffers for --tp-comm-overlap: the buffers TE's linears all-gather into and
reduce-scatter from while their GEMMs run, set up once per process before the TE modules are built.

With sequence parallelism every column-parallel GEMM waits for an all-gather of its input and every row-parallel
GEMM's output waits for a reduce-scatter; NCCL runs those between the GEMMs. The userbuffers split each GEMM into
chunks and move the neighbouring chunk between the tensor-parallel GPUs (peer-to-peer copies over NVLink) while
the current one multiplies, so the collectives hide behind the GEMMs. TE allocates one buffer per GEMM name
(`qkv_fprop`, `fc2_dgrad`, ...) of the layer input's full shape, [sequence x micro-batch, hidden]; with FP8 the
all-gather buffers hold FP8 data, and layers kept in bf16 (--first-last-layers-bf16) get bf16 buffers as well.

transformer_engine is imported inside the function only.
"""

from __future__ import annotations

import os

from megatron.config import Config


def initialize_userbuffers(cfg: Config, tp_size: int) -> None:
    """Allocate TE's userbuffers for this run's micro-batch shape (replacing those of an earlier trainer in this
    process). Every rank calls it: the buffers' memory handles are exchanged over a new process group."""
    from transformer_engine.pytorch.module import base as te_base

    if os.environ.get("NCCL_NVLS_ENABLE") == "0":
        # NVLink multicast is switched off for NCCL on this machine (it can take shared GPUs out of service, or the
        # fabric lacks it): keep the userbuffers off it too, on CUDA IPC copies. TE reads only whether it is set.
        os.environ.setdefault("UB_SKIPMC", "1")
    if te_base.is_ub_initialized():
        te_base.destroy_ub()
    model, prec = cfg.model, cfg.precision
    fp8_layers = set(prec.fp8_layer_numbers(model.num_layers))
    modes = []
    if fp8_layers:
        modes.append(te_base.UserBufferQuantizationMode.FP8)
    if len(fp8_layers) < model.num_layers:
        modes.append(te_base.UserBufferQuantizationMode.NONE)
    te_base.initialize_ub(
        shape=[model.seq_length * cfg.training.micro_batch_size, model.hidden_size],
        tp_size=tp_size,
        quantization_modes=modes,
        dtype=prec.params_dtype,  # of the buffers that hold no FP8
        bootstrap_backend=cfg.parallel.tp_comm_bootstrap_backend,
    )
