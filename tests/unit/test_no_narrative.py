"""The repository speaks of the project alone: no file tells how the work went.

Every tracked text file (``git ls-files``; the tree where git or its metadata is absent) is read line by line and
each line that names a work session, a wave of work, an issue number or a numbered stop fails the test, as
``path:line: text``. History lives in git and, for what users see, in CHANGELOG.md.

A word that also has a technical meaning is allowed only in that meaning, and the rule says which:
- "session" only qualified as a process, test, Slurm, login, interactive or HTTP session (``os.setsid``,
  ``start_new_session``, pytest's ``pytest_sessionstart(session)`` and ``scope="session"`` fixtures); an
  unqualified "session" is the work sense ("the tenth session", "this session's device time").
- "wave" only in "wave quantization" (the GPU's last partial wave of thread blocks).
- an upstream project's issue is cited by its URL (``.../issues/2681``), which no rule matches.
"""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The one file allowed to spell the forbidden words: this test states them.
ALLOWED_FILES = {"tests/unit/test_no_narrative.py"}

SESSION = re.compile(r"\bsessions?\b", re.IGNORECASE)
# What may stand right before "session" for the technical meaning ("a new process session", "the test session").
SESSION_QUALIFIER = re.compile(
    r"\b(process|test|pytest|slurm|login|interactive|http|ssh|tmux|new|own)\s*$|\b(pytest_session\w*|setsid)\(\s*$",
    re.IGNORECASE,
)
# Whole-line technical uses: pytest's session hooks and fixture scope, requests' Session.
SESSION_LINE = re.compile(r"pytest_session\w*\(session\)|scope=[\"']session[\"']|\bSession\(")

RULES = {
    "wave": re.compile(r"\bwaves?\b(?!\s+quantization)", re.IGNORECASE),
    "issue number": re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE),
    "numbered stop": re.compile(r"\bstops?\s+#?\d+\b", re.IGNORECASE),
}


def tracked_files() -> list[str]:
    """The repository's tracked files, relative to its root (the whole tree, less caches, without git)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30
        ).stdout.decode()
        return [name for name in out.split("\0") if name]
    except (OSError, subprocess.SubprocessError):
        skip = {".git", "__pycache__", ".pytest_cache", ".ruff_cache", "node_modules"}
        return [
            str(p.relative_to(ROOT))
            for p in ROOT.rglob("*")
            if p.is_file() and not skip.intersection(p.relative_to(ROOT).parts)
        ]


def narrative_in(line: str) -> list[str]:
    """The rules a line breaks (empty when it tells nothing of how the work went)."""
    broken = [name for name, rule in RULES.items() if rule.search(line)]
    if not SESSION_LINE.search(line):
        for match in SESSION.finditer(line):
            if not SESSION_QUALIFIER.search(line[: match.start()]):
                broken.append("work session")
                break
    return broken


def test_rules_tell_work_narrative_from_technical_words():
    narrative = [
        "measured in the tenth session (2026-11-26)",
        "the sixteenth session's changes",
        "this session's device time ran out",
        "## Third wave, first session",
        "Sessions 3-5 measured it",
        "a next wave of fixes",
        "the fix of issue 30",
        "Issue #31's target",
        "see stop 3 of the plan",
    ]
    technical = [
        "proc = subprocess.Popen(cmd, start_new_session=True)",
        "os.setsid()  # a new process session, so that one kill reaches every rank",
        "def pytest_sessionstart(session):",
        '@pytest.fixture(scope="session")',
        "each test starts from the environment the test session had",
        "inside a Slurm session (salloc), srun inherits the allocation",
        "the last partial wave quantization of the GEMM's tiles",
        "TE's bug (https://github.com/NVIDIA/TransformerEngine/issues/2681)",
        "the non-finite check stops the step",
    ]
    assert all(narrative_in(line) for line in narrative), [line for line in narrative if not narrative_in(line)]
    assert not any(narrative_in(line) for line in technical), [line for line in technical if narrative_in(line)]


def test_no_file_tells_how_the_work_went():
    found = []
    for name in tracked_files():
        if name in ALLOWED_FILES:
            continue
        try:
            text = (ROOT / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary data or a file listed but absent (a sparse checkout)
        for number, line in enumerate(text.splitlines(), start=1):
            broken = narrative_in(line)
            if broken:
                found.append(f"{name}:{number}: [{', '.join(broken)}] {line.strip()[:120]}")
    assert not found, f"{len(found)} lines tell how the work went (say what is true now):\n" + "\n".join(found)
