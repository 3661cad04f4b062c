"""Transformer Engine's rules on the flags, checked when the configuration is validated (no GPU needed): whether TE
imports, which --fp8-recipe values have a TE recipe, and the shapes TE's FP8 GEMMs accept. megatron/fp8/te_recipe.py
builds the TE recipe itself and checks the real GPU at startup.

Nothing here imports transformer_engine at module level: CPU machines never load it.
"""

from __future__ import annotations

import functools

from .base import require
from .model import ModelConfig
from .parallel import ParallelConfig
from .precision import PrecisionConfig

TE_RECIPES = {
    "delayed": "DelayedScaling",
    "tensorwise": "Float8CurrentScaling",
    "blockwise": "Float8BlockScaling",
    "mxfp8": "MXFP8BlockScaling",
}
"""Our --fp8-recipe -> the TE recipe class (rowwise has none)."""


@functools.cache
def te_import_error() -> str | None:
    """None when `transformer_engine.pytorch` imports, else the reason in one line. Importing it loads TE's CUDA
    libraries but does not create a CUDA context, so it is safe before `torch.cuda.set_device`."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # ImportError, or OSError/RuntimeError from a TE built for another torch/CUDA
        return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]
    return None


def require_te() -> None:
    """Raise ConfigError when Transformer Engine does not import."""
    reason = te_import_error()
    require(
        reason is None,
        f"--transformer-impl transformer_engine: Transformer Engine does not import ({reason});"
        " install it or use --transformer-impl local",
    )


def check_te_recipe_name(precision: PrecisionConfig) -> None:
    """rowwise scaling has no TE recipe."""
    require(
        not precision.fp8 or precision.fp8_recipe in TE_RECIPES,
        f"--fp8-recipe {precision.fp8_recipe} has no Transformer Engine recipe; use --transformer-impl local"
        f" (or one of --fp8-recipe {', '.join(TE_RECIPES)})",
    )


def check_te_fp8_shapes(
    model: ModelConfig, micro_batch_size: int, precision: PrecisionConfig, parallel: ParallelConfig | None = None
) -> None:
    """TE's FP8 GEMMs take [tokens, features] operands in both orientations (x and x^T, dY and dY^T) and assert that
    both dimensions are multiples of 16 (32 for mxfp8, its block size): check every linear's sizes up front. Under
    tensor parallelism the GEMMs see this rank's shard of the features, and with sequence parallelism TE quantizes
    this rank's sequence shard before gathering it, so those are the sizes checked."""
    if not precision.fp8:
        return
    tp = parallel.tensor_model_parallel_size if parallel else 1
    sp = bool(parallel and parallel.sequence_parallel)
    multiple = 32 if precision.fp8_recipe == "mxfp8" else 16
    rule = f"Transformer Engine's FP8 GEMMs ({precision.fp8_recipe}) need multiples of {multiple}"
    cp = parallel.context_parallel_size if parallel else 1  # each rank's GEMMs see its part of the sequence
    tokens = micro_batch_size * model.seq_length // cp // (tp if sp else 1)
    require(
        tokens % multiple == 0,
        f"{rule}: --micro-batch-size x --seq-length{' / context-parallel size' if cp > 1 else ''}"
        f"{' / tensor-parallel size' if sp else ''} is {tokens}; change"
        " --seq-length or --micro-batch-size",
    )
    heads, groups, head_dim = model.num_attention_heads, model.num_query_groups, model.kv_channels
    per_rank = " / tensor-parallel size" if tp > 1 else ""
    sizes = [  # (what, size on this rank, the flag to change)
        ("--hidden-size", model.hidden_size, "--hidden-size"),
        (f"--ffn-hidden-size{per_rank}", model.ffn_hidden_size // tp, "--ffn-hidden-size"),
        (
            f"--kv-channels x --num-attention-heads{per_rank}",
            head_dim * heads // tp,
            "--kv-channels or --num-attention-heads",
        ),
        (
            f"--kv-channels x (--num-attention-heads + 2 x --num-query-groups){per_rank}",
            head_dim * (heads + 2 * groups) // tp,
            "--kv-channels or --num-query-groups",
        ),
    ]
    for what, size, fix in sizes:
        require(size % multiple == 0, f"{rule}: {what} is {size}; change {fix}")


def check_te_config(
    model: ModelConfig, micro_batch_size: int, precision: PrecisionConfig, parallel: ParallelConfig | None = None
) -> None:
    """Flag-only checks for --transformer-impl transformer_engine (no GPU, no TE import needed)."""
    check_te_recipe_name(precision)
    check_te_fp8_shapes(model, micro_batch_size, precision, parallel)
