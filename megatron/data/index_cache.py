"""Cached index arrays: built once, memory-mapped by every rank, rebuilt when the data or the recipe changes.

A cache entry is named by a hash of its description (which data files, with their size and modification time, and
every parameter the arrays depend on), so stale entries are never read: changed data or flags give a new name.
Several processes may start at once. The first takes an exclusive `flock` on the entry's lock file and builds; the
others block on the lock and then find the entry complete. Files are written under temporary names and renamed into
place, and the description `.json` is renamed last, so a reader that sees the `.json` sees complete arrays: this
stays safe across nodes sharing a file system even where `flock` is not shared (both nodes build the same bytes).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
from collections.abc import Callable

import numpy as np

from .errors import DataError


def file_fingerprint(path: str) -> dict[str, int | str]:
    """What identifies a data file's version cheaply: its absolute path, size and modification time."""
    stat = os.stat(path)
    return {"path": os.path.abspath(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _atomic_save(path: str, array: np.ndarray) -> None:
    tmp = f"{path}.{socket.gethostname()}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
    os.replace(tmp, path)


def load_or_build(
    cache_dir: str, stem: str, description: dict, build: Callable[[], dict[str, np.ndarray]]
) -> tuple[dict[str, np.ndarray], bool]:
    """The arrays of the entry `description` names, memory-mapped read-only, and whether this call built them.

    `build()` returns {name: array}; it runs at most once per entry while the lock holds.
    """
    key = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]
    base = os.path.join(cache_dir, f"{stem}-{key}")
    done = base + ".json"
    built = False
    if not os.path.exists(done):
        try:
            os.makedirs(cache_dir, exist_ok=True)
            lock_file = open(base + ".lock", "a")
        except OSError as err:
            raise DataError(
                f"cannot write the index cache in {cache_dir} ({err.strerror}); pass --data-cache-path"
            ) from None
        with lock_file:
            # Exclusive; the kernel drops it when the file closes or the holder dies, so a crash never blocks others.
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            if not os.path.exists(done):
                arrays = build()
                for name, array in arrays.items():
                    _atomic_save(f"{base}-{name}.npy", array)
                tmp = f"{done}.{socket.gethostname()}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    json.dump({"description": description, "arrays": sorted(arrays)}, f, indent=1, sort_keys=True)
                os.replace(tmp, done)
                built = True
    with open(done) as f:
        names = json.load(f)["arrays"]
    return {name: np.load(f"{base}-{name}.npy", mmap_mode="r") for name in names}, built
