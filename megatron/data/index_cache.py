"""Cached index arrays: built once, memory-mapped by every rank, rebuilt when the data or the recipe changes.

A cache entry is named by a hash of its description (which data files, with their size and modification time, and
every parameter the arrays depend on), so stale entries are never read: changed data or flags give a new name.
Several processes may start at once. The first takes an exclusive `flock` on the entry's lock file and builds; the
others block on the lock and then find the entry complete. Files are written under temporary names and renamed into
place, and the description `.json` is renamed last, so a reader that sees the `.json` sees complete arrays: this
stays safe across nodes sharing a file system even where `flock` is not shared (both nodes build the same bytes).
An entry that does not read back (a truncated or garbled `.npy` or `.json`, an array missing) is derived data: it is
rebuilt, with a warning, as if it were absent.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import warnings
from collections.abc import Callable

import numpy as np

from megatron.untrusted import read_json

from .errors import DataError
from .indexed_dataset import map_readonly


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
    cache_dir: str,
    stem: str,
    description: dict,
    build: Callable[[], dict[str, np.ndarray]],
    names: tuple[str, ...] = (),
) -> tuple[dict[str, np.ndarray], bool]:
    """The arrays of the entry `description` names (at least `names`), memory-mapped read-only, and whether this call
    built them. A damaged entry is rebuilt with a warning.

    `build()` returns {name: array}; it runs at most once per entry while the lock holds.
    """
    key = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]
    base = os.path.join(cache_dir, f"{stem}-{key}")
    done = base + ".json"
    arrays = _read_entry(base, names)
    if arrays is not None:
        return arrays, False
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
        arrays = _read_entry(base, names, warn=True)  # another process may have built it meanwhile
        if arrays is not None:
            return arrays, False
        built = build()
        for name, array in built.items():
            _atomic_save(f"{base}-{name}.npy", array)
        tmp = f"{done}.{socket.gethostname()}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            shapes = {name: [array.dtype.str, len(array)] for name, array in built.items()}
            json.dump(
                {"description": description, "arrays": sorted(built), "shapes": shapes}, f, indent=1, sort_keys=True
            )
        os.replace(tmp, done)
    arrays = _read_entry(base, names)
    if arrays is None:
        raise DataError(f"the index cache entry {done} does not read back after it was written: check {cache_dir}")
    return arrays, True


def _map_npy(path: str) -> np.ndarray:
    """A cached 1-D integer array, memory-mapped without holding a file open (map_readonly); ValueError when its
    header is not such an array's or the file is shorter than the header says."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(f)
        offset = f.tell()
    if len(shape) != 1 or dtype.kind not in "iu":
        raise ValueError(f"{os.path.basename(path)} is a {dtype} array of shape {shape}, not integers")
    return map_readonly(path, dtype, shape[0], offset)


def _read_entry(base: str, names: tuple[str, ...], warn: bool = False) -> dict[str, np.ndarray] | None:
    """The entry's arrays; None when it is absent or damaged (then, with `warn`, a warning says it is rebuilt)."""
    done = base + ".json"
    if not os.path.exists(done):
        return None
    try:
        entry = read_json(done, "the index cache entry")
        listed, shapes = entry.get("arrays"), entry.get("shapes", {})
        if not (isinstance(listed, list) and all(isinstance(n, str) and n.isidentifier() for n in listed)):
            raise ValueError("it lists no arrays")
        if not set(names) <= set(listed):
            raise ValueError(f"it lacks {', '.join(sorted(set(names) - set(listed)))}")
        arrays = {name: _map_npy(f"{base}-{name}.npy") for name in listed}
        for name, array in arrays.items():  # entries written before shapes were recorded have none to compare
            if name in shapes and shapes[name] != [array.dtype.str, len(array)]:
                raise ValueError(f"its {name} is {array.dtype.str} x {len(array)}, not the {shapes[name]} it records")
        return arrays
    except Exception as err:  # any entry that does not read back is rebuilt: it is derived data
        if warn:
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            warnings.warn(f"the index cache entry {done} is damaged ({reason}); rebuilding it", stacklevel=3)
        return None
