"""The --save folder: checked at start, tidied before each save, and written without following symbolic links.

Every file the project creates there is created anew (O_CREAT | O_EXCL | O_NOFOLLOW) after whatever held its name
is removed (a link itself, never what it points to), and files that replace others (`latest`, config.json) are
written under a temporary name, flushed, and renamed over the old one; rename replaces a link, it does not follow
it. So a link planted in the folder, such as config.json or latest_checkpointed_iteration.txt.tmp pointing outside,
is replaced, and nothing is written outside --save. (The --save path itself may be a link: that is the user's.)

Folders a save leaves only when it is killed (docs/checkpoints.md, "Publication"): `iter_N.tmp`, a checkpoint not
yet complete, removed; `iter_N.old`, the previous copy of a re-saved iteration, which loads in place of `iter_N` if
the kill came between the two renames that publish the re-save, and is renamed back to `iter_N` (or removed, once
`iter_N` is in place) by the next save.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
from pathlib import Path

from megatron.errors import UserError

TMP, OLD = ".tmp", ".old"
_LEFT_BY_A_SAVE = re.compile(r"^iter_\d{7}(\.tmp|\.old)$")
PROBE_BYTES = 64 << 10
"""The start check's probe write: enough to need new blocks, so a full disk fails it."""


class SaveFolderError(UserError, OSError):
    """--save cannot take checkpoints (not a directory, read-only, full); the message is one line."""


def remove(path: Path) -> None:
    """Remove a file, a link (not what it points to) or a folder tree; nothing when `path` does not exist."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def write_new(path: Path, data: bytes, sync: bool = False) -> None:
    """Write `data` into a file created at `path`: whatever held the name first is removed, and the file is
    created without following links (O_EXCL | O_NOFOLLOW), so the bytes land in `path`'s folder and nowhere else."""
    remove(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with a file holding `text`: written under `path`.tmp, flushed, renamed over `path` (a reader
    sees the old file or the new one), and the folder flushed so that the rename survives a power loss."""
    tmp = path.with_name(path.name + TMP)
    write_new(tmp, text.encode(), sync=True)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (files created, renamed or removed in it) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush every file and folder under `path`, folders after what they hold."""
    for folder, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(folder))


def tidy(root: Path) -> None:
    """Before a save (one rank): remove every `iter_N.tmp` a killed save left, and settle every `iter_N.old`: renamed
    back to `iter_N` when that is missing (a re-save killed between its renames), else removed."""
    if not root.is_dir():
        return
    changed = False
    for entry in sorted(root.iterdir()):
        if not _LEFT_BY_A_SAVE.match(entry.name):
            continue
        final = entry.with_name(entry.name[: -len(OLD)])
        if entry.name.endswith(OLD) and entry.is_dir() and not entry.is_symlink() and not final.exists():
            os.replace(entry, final)
        else:
            remove(entry)
        changed = True
    if changed:
        fsync_dir(root)


def check_save_folder(path: str) -> None:
    """At start, before anything is built: --save is (or can be made) a folder this process can write, with room
    for a probe write; else SaveFolderError, one line naming the cause and the fix."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise SaveFolderError(f"--save {path} is a file, not a folder: give a folder for the checkpoints")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (NotADirectoryError, FileExistsError):
        above = next((p for p in folder.parents if p.exists() and not p.is_dir()), None)
        raise SaveFolderError(
            f"--save {path} cannot be a folder: {above or 'a part of its path'} is a file; give a folder for the"
            " checkpoints"
        ) from None
    except OSError as exc:
        raise _unwritable(path, exc) from None
    probe = folder / f".write-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        write_new(probe, bytes(PROBE_BYTES), sync=True)
    except OSError as exc:
        raise _unwritable(path, exc) from None
    finally:
        try:
            remove(probe)
        except OSError:
            pass


def _unwritable(path: str, exc: OSError) -> SaveFolderError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return SaveFolderError(
            f"--save {path} has no room ({exc.strerror}: a {PROBE_BYTES >> 10} KiB probe write failed): free space,"
            " or give a folder on another file system"
        )
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return SaveFolderError(
            f"--save {path} is not writable ({exc.strerror}): give a folder this user can write, or fix its"
            " permissions or mount"
        )
    return SaveFolderError(f"--save {path} cannot be written ({exc.strerror or exc}): fix the file system or the path")
