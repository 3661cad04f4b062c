"""Files someone else may have written (checkpoints, tokenizer files, datasets, config.json) are read with limits,
checked before the work they bound, so that a small hostile file costs little: JSON's size and nesting depth here,
and the walk that bounds what an unpickled object expands to (megatron/checkpoint/safe_load.py uses it). A refusal
is one `UserError` line naming the file and the limit. The limits lie far above what real files reach (the numbers
are beside each); a file past one is damaged or made to hurt."""

from __future__ import annotations

import gc
import json
import os
import re
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np

from megatron.errors import UserError

MAX_JSON_BYTES = 1 << 30
"""1 GiB. The largest JSON files that training and conversion read are tokenizer files (a 256k-token
tokenizer.json is about 35 MB) and a folder's checksum list (metadata.json, about 100 bytes a file)."""

MAX_JSON_DEPTH = 100
"""Nesting of JSON arrays and objects. Real files nest at most 6 deep (tokenizer.json's post-processor templates);
Python's own JSON parser and printer recurse, and fail near 1,000."""

MAX_OBJECT_DEPTH = 200
"""Nesting of an unpickled object. Megatron-LM's args and optimizer states nest under 10, DCP's index under 8."""

MAX_EXPANDED_FLOOR = 1 << 20
MAX_EXPANSION = 64
"""What an unpickled object expands to when walked or printed (every shared reference counted as a copy, a string as
one node per 16 characters) may exceed 1M nodes only by 64 times the references the file holds. Real files share
little (an enum member, a dtype), so they stay near 1x; a chain of lists each holding the previous one twice, a few
hundred bytes, expands to 2**n."""

MAX_ELEMENTS = 1 << 24
"""Elements of a sequence a pickle asks a constructor to make (a range, a bytearray, a set): 16M. The largest real
ones are a few thousand (a tensor's shape has at most 64 dimensions; DCP lists a chunk per rank)."""


class LimitExceeded(UserError):
    """A file goes past one of this module's limits; the message names the file (or the object) and the limit."""


def require_file(path: os.PathLike | str, what: str, fix: str = "pass the file itself") -> Path:
    """`path` as a Path; raises UserError naming `what` and `fix` when it is a directory (open() of one is a
    traceback)."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{what} {path} is a directory, not a file: {fix}")
    return path


def check_size(path: os.PathLike | str, limit: int, what: str = "") -> int:
    """The size of the file at `path`; raises LimitExceeded when it is over `limit` bytes."""
    size = os.stat(path).st_size
    if size > limit:
        raise LimitExceeded(f"{what or path} holds {size:,} bytes, over the limit of {limit:,} for such a file")
    return size


_KEEP = bytes(range(256)).translate(None, b'"[]{}')  # every byte but these is deleted from the skeleton
_STRING = re.compile(rb'"[^"]*"')


def json_depth(data: bytes) -> int:
    """How deep the arrays and objects of JSON text nest, without parsing it (C-speed: strings removed, brackets
    counted). Exact for valid JSON; for invalid JSON a number the parser's own error makes moot."""
    skeleton = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _KEEP)
    brackets = np.frombuffer(_STRING.sub(b"", skeleton), dtype=np.uint8)
    if brackets.size == 0:
        return 0
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1).astype(np.int64)
    return int(np.cumsum(steps).max())


def check_json(data: bytes | str, source: str, max_bytes: int = MAX_JSON_BYTES) -> bytes:
    """`data` (as bytes) when it is within JSON's size and depth limits; LimitExceeded naming `source` otherwise.
    For text another library parses (Hugging Face's tokenizer.json)."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise LimitExceeded(f"{source} holds {len(raw):,} bytes of JSON, over the limit of {max_bytes:,}")
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:  # else it cannot nest that deep: skip the scan
        depth = json_depth(raw)
        if depth > MAX_JSON_DEPTH:
            raise LimitExceeded(f"{source} nests JSON {depth} deep, over the limit of {MAX_JSON_DEPTH}")
    return raw


def check_json_file(path: os.PathLike | str, what: str = "", max_bytes: int = MAX_JSON_BYTES) -> None:
    """Raises (UserError, LimitExceeded) unless the file at `path` is a file whose JSON is within the limits; for
    files another library then reads."""
    path = require_file(path, what or "the JSON file")
    check_size(path, max_bytes, str(path))
    check_json(path.read_bytes(), str(path), max_bytes)


def parse_json(data: bytes | str, source: str, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """`json.loads` within the limits: LimitExceeded naming `source` past one (size, depth, an integer of more
    digits than Python converts). Invalid JSON raises json.JSONDecodeError as json.loads does."""
    raw = check_json(data, source, max_bytes)
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        raise
    except (ValueError, RecursionError) as exc:  # int digits past sys.get_int_max_str_digits()
        raise LimitExceeded(f"{source}: {str(exc).splitlines()[0]}") from None


def read_json(path: os.PathLike | str, what: str = "", max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The JSON file at `path`, read within the limits (its size checked before it is read)."""
    path = require_file(path, what or "the JSON file")
    check_size(path, max_bytes, str(path))
    return parse_json(path.read_bytes(), str(path), max_bytes)


def check_expansion(obj: Any, source: str) -> None:
    """Raises LimitExceeded naming `source` when `obj` (an unpickled object) nests deeper than MAX_OBJECT_DEPTH or
    expands past MAX_EXPANSION times its references (see there). Walks each distinct object once, without recursion,
    and numbers without visiting them; a reference back to an object being walked (a cycle) counts as one node, as
    repr prints it."""
    collecting = gc.isenabled()
    gc.disable()  # the walk makes millions of small tuples for a large index; none of them is garbage
    try:
        total, references = _expanded(obj, source)
    finally:
        if collecting:
            gc.enable()
    limit = max(MAX_EXPANDED_FLOOR, MAX_EXPANSION * (references + 1))
    if total > limit:
        raise LimitExceeded(
            f"{source} expands to {total:,} nodes through shared references, over the limit of {limit:,}"
        )


def _expanded(obj: Any, source: str) -> tuple[int, int]:
    """(what `obj` expands to, the references it holds), for check_expansion."""
    sizes: dict[int, int] = {}  # id -> expanded size, once walked (everything stays alive: `obj` holds it)
    get = sizes.get
    references = 0
    stack: list[tuple[Any, int, Any]] = [(obj, 1, None)]
    while stack:
        node, depth, children = stack.pop()
        if children is not None:  # its children are walked: a number (never in `sizes`) counts 1
            sizes[id(node)] = 1 + sum(map(get, map(id, children), repeat(1)))
            continue
        if id(node) in sizes:
            continue
        if depth > MAX_OBJECT_DEPTH:
            raise LimitExceeded(f"{source} nests objects over {MAX_OBJECT_DEPTH} deep (the limit)")
        children = _children(node)
        if not children:
            sizes[id(node)] = 1 + (len(node) // 16 if isinstance(node, (str, bytes, bytearray)) else 0)
            continue
        sizes[id(node)] = 1  # in progress: a cycle back here counts once
        references += len(children)
        stack.append((node, depth, children))
        stack.extend([(c, depth + 1, None) for c in children if type(c) not in _NUMBERS and id(c) not in sizes])
    return sizes[id(obj)], references


_NUMBERS = frozenset((int, float, complex, bool, type(None)))


def _children(node: Any) -> Any:
    """What a plain container (or a plain object's attributes) holds; tensors, arrays and scalars hold nothing
    to walk."""
    if isinstance(node, (list, tuple)):
        return node
    if isinstance(node, dict):
        return [*node.keys(), *node.values()]
    if isinstance(node, (set, frozenset)):
        return list(node)
    attributes = getattr(node, "__dict__", None) if not isinstance(node, type) else None
    if isinstance(attributes, dict) and type(node).__module__ != "torch":
        return [*attributes.values()]
    return ()
