"""The layers of megatron/ (docs/architecture.md): a module imports from its own package or a lower one, never a
higher one, and no modules import each other in a circle. Lazy imports (inside functions) count like module-level
ones: they run too, only later. A lazy import may be exempted by a trailing `# layering: <reason>` comment; each
exemption is listed in EXEMPTIONS below, so a new one is a visible decision. The goal is none.

Edges: `from a import b` imports `a` and, where it is a module, `a.b`; a package's `__init__.py` importing its own
submodules is no edge, nor is a module importing its own package's `__init__.py` (which Python has already run by
then). Imports under `if TYPE_CHECKING:` count too: a circle that only type checkers follow is still a circle."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs/architecture.md"
_ORDER_LINE = re.compile(r"\s*\w+(\s*<\s*\w+)+\s*")
_EXEMPT = re.compile(r"#\s*layering:\s*(\S.*)$")

# (importing file, imported module) of every exempted lazy import; the goal is none.
EXEMPTIONS: list[tuple[str, str]] = []


def layer_order(doc: Path = ARCHITECTURE) -> list[str]:
    """The packages lowest first, read from the one line of the form `a < b < c` in docs/architecture.md."""
    lines = [line for line in doc.read_text().splitlines() if _ORDER_LINE.fullmatch(line)]
    assert len(lines) == 1, f"{doc} must write the layer order once, as one line `a < b < c`; found {lines}"
    return [name.strip() for name in lines[0].split("<")]


@dataclass(frozen=True)
class Import:
    path: str
    """The importing file, relative to the tree's root."""
    line: int
    source: str
    """The importing module."""
    targets: frozenset[str]
    """The package's modules this statement runs (after the `__init__` rules)."""
    names: tuple[str, ...]
    """What it imports, fully qualified: `megatron.parallel.pipeline.stage_layer_numbers`."""
    lazy: bool
    reason: str | None
    """The `# layering:` comment's reason, if any."""

    def where(self) -> str:
        return f"{self.path}:{self.line} imports {', '.join(self.names)}"


def _modules(root: Path, package: str) -> dict[str, Path]:
    paths = sorted((root / package).rglob("*.py"))
    return {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p for p in paths}


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _in_function(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return True
    return False


def imports(root: Path, package: str) -> list[Import]:
    """Every import statement of `package` (under `root`) that runs another of its modules."""
    mods = _modules(root, package)
    found = []
    for module, path in mods.items():
        text = path.read_text()
        lines, tree = text.splitlines(), ast.parse(text)
        here = module if path.name == "__init__.py" else module.rpartition(".")[0]
        parents = _parents(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
                candidates = names
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [f"{base}.{alias.name}" for alias in node.names]
                candidates = [base, *names]
            else:
                continue
            targets = {
                name
                for name in candidates
                if name in mods
                and name != module
                and not name.startswith(module + ".")  # an __init__ importing its own submodules
                and not module.startswith(name + ".")  # a module importing its own package's __init__
            }
            if targets:
                reason = _EXEMPT.search(lines[node.lineno - 1])
                found.append(
                    Import(
                        str(path.relative_to(root)),
                        node.lineno,
                        module,
                        frozenset(targets),
                        tuple(names),
                        _in_function(node, parents),
                        reason.group(1).strip() if reason else None,
                    )
                )
    return sorted(found, key=lambda i: (i.path, i.line))


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # the root package's __init__ belongs to no layer


def _circles(edges: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): every import between two modules of one
    component lies on a circle."""
    graph: dict[str, set[str]] = {}
    for imp in edges:
        graph.setdefault(imp.source, set()).update(imp.targets)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(components)


def check(root: Path, package: str, order: list[str]) -> tuple[list[str], list[Import]]:
    """(findings, exempted imports). A finding names the file, line and imported names and the rule it breaks."""
    rank = {name: i for i, name in enumerate(order)}
    findings = []
    for module in _modules(root, package):
        layer = _layer(module)
        if layer is not None and layer not in rank:
            findings.append(f"{module}: package {layer} has no place in the layer order {' < '.join(order)}")
    all_imports = imports(root, package)
    exempted = [i for i in all_imports if i.reason is not None and i.lazy]
    counted = [i for i in all_imports if not (i.reason is not None and i.lazy)]
    for imp in counted:
        if imp.reason is not None:
            findings.append(f"{imp.where()}: only a lazy import (inside a function) may be exempted with # layering:")
        source = _layer(imp.source)
        higher = sorted({_layer(t) for t in imp.targets if source in rank and rank.get(_layer(t), -1) > rank[source]})
        if higher:
            findings.append(f"{imp.where()}: {source} imports from the higher layer {', '.join(higher)}")
    for component in _circles(counted):
        inside = set(component)
        findings.append(
            f"import circle among {', '.join(component)}:\n"
            + "\n".join(f"    {imp.where()}" for imp in counted if imp.source in inside and imp.targets & inside)
        )
    return findings, exempted


def test_megatron_imports_follow_the_layer_order_without_circles():
    findings, _ = check(ROOT, "megatron", layer_order())
    assert not findings, "imports against docs/architecture.md's layers:\n" + "\n".join(findings)


def test_exempted_lazy_imports_are_a_visible_decision():
    _, exempted = check(ROOT, "megatron", layer_order())
    listed = [(imp.path, target) for imp in exempted for target in sorted(imp.targets)]
    assert listed == EXEMPTIONS, (
        f"{len(listed)} lazy imports carry # layering: (goal: 0); list each in EXEMPTIONS or remove it:\n"
        + "\n".join(f"{imp.where()}  # layering: {imp.reason}" for imp in exempted)
    )


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_reports_circles_and_upward_imports(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low/__init__.py": "from .a import f\n",  # an __init__ re-exporting its own module: no edge
            "pkg/low/a.py": (
                "from pkg.low import b\n"  # a circle inside one package: a -> b -> c -> a
                "def f():\n"
                "    from pkg.high.x import g\n"  # lazy, and upward
                "    from pkg.high import y  # layering: a reason\n"  # exempted
                "    return g, y\n"
            ),
            "pkg/low/b.py": "import pkg.low.c\nfrom pkg.low import f\n",  # the second: its own package's __init__
            "pkg/low/c.py": "def h():\n    from . import a\n",
            "pkg/high/__init__.py": "",
            "pkg/high/x.py": "g = 1\n",
            "pkg/high/y.py": "from pkg.low import c  # layering: not lazy, so no exemption\n",
            "pkg/extra/__init__.py": "",
        },
    )
    findings, exempted = check(tmp_path, "pkg", ["low", "high"])
    assert findings == [
        "pkg.extra: package extra has no place in the layer order low < high",
        "pkg/high/y.py:1 imports pkg.low.c: only a lazy import (inside a function) may be exempted with # layering:",
        "pkg/low/a.py:3 imports pkg.high.x.g: low imports from the higher layer high",
        "import circle among pkg.low.a, pkg.low.b, pkg.low.c:\n"
        "    pkg/low/a.py:1 imports pkg.low.b\n"
        "    pkg/low/b.py:1 imports pkg.low.c\n"
        "    pkg/low/c.py:2 imports pkg.low.a",
    ]
    assert [(imp.path, imp.line, imp.reason) for imp in exempted] == [("pkg/low/a.py", 4, "a reason")]
