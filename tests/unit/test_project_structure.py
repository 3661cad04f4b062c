"""Project-wide rules: the flag list is a visible decision, files stay readable, Transformer Engine and Triton stay
lazy (every module imports on a CPU machine)."""

import ast
import importlib
import pkgutil
import re
from pathlib import Path

import megatron
from megatron.config import all_flags

ROOT = Path(__file__).resolve().parents[2]
TE_MODULES = {
    "megatron/config/te_rules.py",
    "megatron/fp8/te_recipe.py",
    "megatron/fp8/params.py",
    "megatron/parallel/fsdp/te_fp8_gather.py",  # the gathered weight under FSDP is a TE Float8Tensor
    "megatron/parallel/fsdp/te_blockwise_gather.py",  # ... or, blockwise, a TE Float8BlockwiseQTensor
    "megatron/model/te_attention.py",
    "megatron/model/te_fp8.py",
    "megatron/model/te_layers.py",
    "megatron/model/te_linear.py",
    "megatron/model/te_mlp.py",
    "megatron/model/swiglu_kernel.py",  # the fused Smooth-SwiGLU kernels write TE's Float8Tensor
    "megatron/model/cuda_graphs.py",
    "megatron/model/te_comm_overlap.py",
    "megatron/perf/probes.py",  # times TE's fused attention for the benchmark's lower bound
}
#: GPU-only packages: the CPU build of torch brings no Triton, and Transformer Engine needs CUDA.
GPU_ONLY = {"triton", "transformer_engine", "transformer_engine_torch"}


def test_flag_list_matches_snapshot():
    """A new, renamed or removed flag changes users' scripts: update tests/unit/flags.txt in the same change."""
    snapshot = (ROOT / "tests/unit/flags.txt").read_text().split()
    assert all_flags() == snapshot, set(all_flags()) ^ set(snapshot)


def _sources():
    yield from (ROOT / "megatron").rglob("*.py")
    yield from (ROOT / "tools").rglob("*.py")
    yield ROOT / "pretrain_gpt.py"


def test_files_stay_under_800_lines():
    long = {str(p.relative_to(ROOT)): n for p in _sources() if (n := len(p.read_text().splitlines())) > 800}
    assert not long, f"split these along a seam a reader would recognise: {long}"


def _imports(tree: ast.AST):
    """(import node, whether it runs when the module is imported: outside every function body), for each import."""

    def visit(node: ast.AST, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, not in_function
            yield from visit(
                child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            )

    yield from visit(tree, False)


def _packages(node: ast.Import | ast.ImportFrom) -> set[str]:
    """The top-level packages an import names (none for a relative import)."""
    if isinstance(node, ast.Import):
        return {alias.name.split(".")[0] for alias in node.names}
    return {node.module.split(".")[0]} if node.module and node.level == 0 else set()


def test_transformer_engine_is_imported_by_the_te_modules_only():
    for path in _sources():
        rel = str(path.relative_to(ROOT))
        for node, _ in _imports(ast.parse(path.read_text())):
            if _packages(node) & {"transformer_engine", "transformer_engine_torch"}:
                assert rel in TE_MODULES, f"{rel}:{node.lineno} imports Transformer Engine"


def test_triton_and_transformer_engine_are_never_imported_at_module_level():
    """Read from the source, so that it fails on a machine that has Triton too (where importing every module, below,
    would not notice): an import at module level, also inside a module-level `try` or `if`, or a class body."""
    found = []
    for path in _sources():
        for node, at_import in _imports(ast.parse(path.read_text())):
            if at_import and (names := _packages(node) & GPU_ONLY):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {', '.join(sorted(names))}")
    assert not found, (
        "import these inside the functions that use them (Triton kernels: plain functions jitted by a build() called"
        f" on first use, as megatron/fp8/triton_rounding.py): {found}"
    )


def test_every_module_imports_on_a_cpu_machine():
    failed = {}
    for module in pkgutil.walk_packages(megatron.__path__, "megatron."):
        try:
            importlib.import_module(module.name)
        except ImportError as exc:
            failed[module.name] = str(exc)
    assert not failed, f"these modules do not import without a GPU's packages: {failed}"


def test_the_flags_help_names_only_files_that_exist():
    """--help points users at this project's modules (megatron/config's docstrings): a renamed or never-made module
    leaves them a dead end."""
    named = {
        m for p in (ROOT / "megatron/config").rglob("*.py") for m in re.findall(r"megatron/[\w/]+\.py", p.read_text())
    }
    missing = sorted(name for name in named if not (ROOT / name).exists())
    assert not missing, missing
