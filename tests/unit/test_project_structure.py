"""Project-wide rules: the flag list is a visible decision, files stay readable, Transformer Engine stays lazy."""

import ast
import importlib
import pkgutil
from pathlib import Path

import megatron
from megatron.config import all_flags

ROOT = Path(__file__).resolve().parents[2]
TE_MODULES = {
    "megatron/config/te_rules.py",
    "megatron/fp8/te_recipe.py",
    "megatron/fp8/params.py",
    "megatron/model/te_attention.py",
    "megatron/model/te_fp8.py",
    "megatron/model/te_layers.py",
    "megatron/model/te_linear.py",
    "megatron/model/te_mlp.py",
    "megatron/model/cuda_graphs.py",
    "megatron/model/te_comm_overlap.py",
}


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


def test_transformer_engine_is_imported_lazily_and_by_the_te_modules_only():
    for path in _sources():
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n.split(".")[0] in ("transformer_engine", "transformer_engine_torch") for n in names):
                assert rel in TE_MODULES, f"{rel} imports Transformer Engine"
                assert node not in tree.body, f"{rel} imports Transformer Engine at module level"


def test_every_module_imports_on_a_cpu_machine():
    for module in pkgutil.walk_packages(megatron.__path__, "megatron."):
        if module.name == "megatron.fp8.triton_kernels":  # GPU only, imported lazily where CUDA is present
            continue
        importlib.import_module(module.name)
