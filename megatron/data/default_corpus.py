"""The embedded default corpus: English technical prose assembled from the running Python's own files, offline.

Every Python installation carries two bodies of real, edited English text:
  * the Python Language Reference and library topics that `help()` shows (`pydoc_data.topics`), and
  * the documentation strings of the standard library's modules, classes and functions.
Both are under the Python Software Foundation License (docs/data.md), so the corpus is built on the user's machine
from files already there: nothing to download, nothing large committed. Documents are one per help topic and one
per module (its docstring, then each class, function and method with its signature and docstring), in a sorted,
deterministic order. The text depends on the Python version (3.11 gives about 2,900 documents and 4 MB); the
tokenizer committed in `assets/` was trained on it (tools/train_tokenizer.py) and works on any version's text.
"""

from __future__ import annotations

import ast
import fcntl
import json
import os
import sys
import sysconfig
from collections.abc import Iterator

from megatron.config import DataConfig

from .errors import DataError
from .preprocess import output_prefix_for, preprocess_jsonl

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
VOCAB_FILE = os.path.join(ASSETS, "stdlib-bpe-vocab.json")
"""GPT-2 style byte-level BPE vocabulary trained on the default corpus (8192 entries, `<|endoftext|>` included)."""
MERGE_FILE = os.path.join(ASSETS, "stdlib-bpe-merges.txt")
"""Its merge rules."""

# Standard-library folders left out: test suites (code-heavy, repetitive), third-party packages, the IDLE and
# turtle demos.
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "turtledemo"}


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    return f"{node.name}({ast.unparse(node.args)})"


def module_document(name: str, source: str) -> str | None:
    """A module's docstrings as one document, or None when it has none worth keeping."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    parts = []
    docstring = ast.get_docstring(tree)
    parts.append(f"Module {name}\n\n{docstring}" if docstring else f"Module {name}")

    def visit(body: list[ast.stmt], qualifier: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                bases = ", ".join(ast.unparse(b) for b in node.bases)
                doc = ast.get_docstring(node)
                if doc:
                    parts.append(f"class {qualifier}{node.name}({bases})\n\n{doc}")
                visit(node.body, f"{qualifier}{node.name}.")
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    parts.append(f"{qualifier}{_signature(node)}\n\n{doc}")

    visit(tree.body, "")
    return "\n\n".join(parts) if len(parts) > 1 or docstring else None


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def iter_documents() -> Iterator[dict[str, str]]:
    """The corpus, one {"text", "source"} dict per document: help topics first, then modules by path."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip it; the docstrings remain
        topics = {}
    for name in sorted(topics):
        yield {"text": topics[name].strip(), "source": f"pydoc_data.topics:{name}"}
    root = stdlib_root()
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in _SKIP_DIRS and not d.startswith("config-"))
        for file in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, file)
            module = os.path.relpath(path, root)[: -len(".py")].replace(os.sep, ".").removesuffix(".__init__")
            with open(path, encoding="utf-8", errors="replace") as f:
                text = module_document(module, f.read())
            if text:
                yield {"text": text, "source": module}


def write_jsonl(path: str) -> tuple[int, int]:
    """Write the corpus as JSON lines (keys text, source); returns (documents, bytes of text)."""
    documents = chars = 0
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for doc in iter_documents():
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")
            documents += 1
            chars += len(doc["text"].encode("utf-8"))
    if documents == 0:
        os.remove(tmp)
        raise DataError(f"no standard-library sources under {stdlib_root()}; bring your own JSONL (docs/data.md)")
    os.replace(tmp, path)
    return documents, chars


def corpus_name() -> str:
    """A name that changes with the Python version (whose files make the corpus)."""
    return f"python{sys.version_info.major}.{sys.version_info.minor}-docs"


def tokenizer_config() -> DataConfig:
    """The tokenizer flags of the committed default tokenizer."""
    return DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=VOCAB_FILE, merge_file=MERGE_FILE)


def prepare(output_dir: str, workers: int = 1, log=lambda line: print(line, file=sys.stderr, flush=True)) -> str:
    """Build `{output_dir}/{corpus_name()}.jsonl` and tokenize it with the default tokenizer (documents end with
    <|endoftext|>) unless already there; returns the --data-path prefix. Safe when several processes call it."""
    os.makedirs(output_dir, exist_ok=True)
    jsonl = os.path.join(output_dir, corpus_name() + ".jsonl")
    prefix = output_prefix_for(os.path.join(output_dir, corpus_name()), "text")
    with open(os.path.join(output_dir, f".{corpus_name()}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(jsonl):
            documents, size = write_jsonl(jsonl)
            log(f"wrote {jsonl}: {documents} documents, {size / 1e6:.2f} MB of text")
        if not os.path.exists(prefix + ".idx"):
            output = os.path.join(output_dir, corpus_name())
            stats = preprocess_jsonl(jsonl, output, tokenizer_config(), append_eod=True, workers=workers, log=log)
            log(f"wrote {prefix}.bin/.idx: {stats.documents} documents, {stats.tokens} tokens")
    return prefix
