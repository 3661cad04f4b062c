"""Helpers of the checkpoint-safety tests: digests of a folder (nothing written, nothing damaged) and pickles whose
loading would run a command."""

import hashlib
import os
from pathlib import Path


def tree_digest(root: Path) -> dict[str, str]:
    """Relative path -> SHA-256 of every file under `root`."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(root).rglob("*"))
        if p.is_file()
    }


class RunsCommand:
    """Unpickling it would create `marker` (through os.system, as a crafted checkpoint would run a command)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))
