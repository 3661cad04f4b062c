"""scripts/ and tools/ stay sorted: each file listed in its folder's README, none over 500 lines, none editing
sys.path (the project installs as a package; a script run as `python scripts/x.py` has its own folder on sys.path)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {
    "scripts": "scripts/README.md",
    "tools": "scripts/README.md",
    "scripts/probes": None,
    "scripts/megatron_lm": None,
}
EXEMPT: set[str] = set()  # none: a file that grows past 500 lines is split


def _files() -> list[Path]:
    found = [p for folder in ("scripts", "tools") for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh")]
    return sorted(p for p in found if "__pycache__" not in p.parts)


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("folder, readme", FOLDERS.items())
def test_every_script_is_listed_in_its_readme(folder, readme):
    text = (ROOT / (readme or f"{folder}/README.md")).read_text()
    names = [_rel(p).removeprefix(f"{folder}/") for p in _files() if _rel(p.parent) == folder]
    if folder == "tools":
        names += [_rel(p).removeprefix("tools/") for p in (ROOT / "tools/checkpoint").glob("convert.py")]
    assert names, folder
    assert not [name for name in names if f"`{name}`" not in text], f"list them in {readme or folder + '/README.md'}"


def test_no_script_is_over_500_lines():
    long = {_rel(p): n for p in _files() if (n := len(p.read_text().splitlines())) > 500 and _rel(p) not in EXEMPT}
    assert not long, f"split these along a seam a reader would recognise: {long}"


def _edits_sys_path(tree: ast.AST) -> list[int]:
    """Lines that insert into, append to or assign sys.path."""
    lines = []
    for node in ast.walk(tree):
        target = node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else None
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
        if isinstance(target, ast.Attribute) and target.attr == "path" and getattr(target.value, "id", "") == "sys":
            lines.append(node.lineno)
    return sorted(lines)


def test_no_script_edits_sys_path():
    edits = {
        _rel(p): lines
        for p in _files()
        if p.suffix == ".py" and _rel(p) not in EXEMPT and (lines := _edits_sys_path(ast.parse(p.read_text())))
    }
    assert not edits, f"import the installed package instead: {edits}"
    assert _edits_sys_path(ast.parse("import sys\nsys.path.insert(0, 'x')\nsys.path += ['y']")) == [2, 3]
