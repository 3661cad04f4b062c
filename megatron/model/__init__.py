"""GPT model and its layers.

Modules import one way, lower floors first (none imports a module above it, lazily or not):

    1  attention.py, cross_entropy.py, grad_accumulation.py, recompute.py, te_fp8.py, te_comm_overlap.py,
       te_state.py        (TE's module-level state, released at the process's end), rope_kernel.py (the fused
       RoPE kernel on the packed QKV output, Triton imported lazily), swiglu_kernel.py (--smooth-swiglu's fused
       SwiGLU under delayed scaling, Triton and TE imported lazily)
    2  layers.py          local norms, linears, rotary embedding (named and shaped like TE's modules)
    3  transformer.py     the local layer;  te_linear.py  TE's linears built like the local ones
    4  te_attention.py, te_mlp.py
    5  te_layers.py       the TE layer (transformer_engine imported lazily in every te_*.py)
    6  gpt.py             the model over either layer
    7  cuda_graphs.py
"""

from .gpt import GPTModel, Stage, count_parameters

__all__ = ["GPTModel", "Stage", "count_parameters"]
