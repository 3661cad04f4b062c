"""The repository's scripts/ and tools/ files loaded in-process as modules (they are scripts, not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]  # the repository


def load_file(folder: str, name: str) -> ModuleType:
    """{folder}/{name}.py as a module named {folder}_{name} (slashes as underscores), run afresh at every call. The
    folder goes on sys.path first, as `python {folder}/{name}.py` puts it, so that the script imports its
    neighbours (scripts/bench_checkpoint.py's `import benchmark`)."""
    if str(ROOT / folder) not in sys.path:
        sys.path.insert(0, str(ROOT / folder))
    module_name = f"{folder.replace('/', '_')}_{name}"
    spec = importlib.util.spec_from_file_location(module_name, ROOT / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def load_script(name: str) -> ModuleType:
    """scripts/{name}.py as a module; call its functions or main(argv)."""
    return load_file("scripts", name)


def load_probe(name: str) -> ModuleType:
    """scripts/probes/{name}.py as a module."""
    return load_file("scripts/probes", name)
