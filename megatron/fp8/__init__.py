"""The FP8 engine of the local (pure PyTorch) layers: formats, recipes, quantizers, FP8 GEMMs and the FP8 linear.

Entry points: `attach_fp8(model, cfg, amax_group)` gives the transformer layers' linears an FP8 state and returns an
`Fp8Manager`, whose `step()` the trainer calls once per optimizer step. Semantics and formulas: docs/fp8.md and the
docstrings of `quantize.py` (quantizers), `scaling.py` (delayed scaling), `recipes.py`, `gemm.py` and `linear.py`.

Transformer Engine is imported by two modules only, inside functions, so that CPU machines never load it: the
mapping of the FP8 flags to TE's recipes (`te_recipe.py`) and the cast of main copies into TE's FP8 weights
(`params.py`); the FP8 monitor's taps (`te_monitor.py`) know TE's layers only by the methods they offer. The FP8
all-gather of sharded weights lives with FSDP, in megatron/parallel/fsdp/.
"""

from .formats import E4M3, E5M2, E8M0, Fp8Format, Role, fp8_max
from .gemm import fp8_gemm
from .linear import Fp8LinearState
from .manager import Fp8Manager, attach_fp8
from .quantize import Fp8Tensor, quantize
from .recipes import RECIPES, Recipe

__all__ = [
    "E4M3",
    "E5M2",
    "E8M0",
    "RECIPES",
    "Fp8Format",
    "Fp8LinearState",
    "Fp8Manager",
    "Fp8Tensor",
    "Recipe",
    "Role",
    "attach_fp8",
    "fp8_gemm",
    "fp8_max",
    "quantize",
]
