"""The repository's scripts/ and tools/ files loaded in-process as modules (they are scripts, not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]  # the repository


def load_file(folder: str, name: str) -> ModuleType:
    """{folder}/{name}.py as a module named {folder}_{name}, run afresh at every call."""
    spec = importlib.util.spec_from_file_location(f"{folder}_{name}", ROOT / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_script(name: str) -> ModuleType:
    """scripts/{name}.py as a module; call its functions or main(argv)."""
    return load_file("scripts", name)
