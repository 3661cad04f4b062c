"""Seeded hostile inputs that are well-formed on the outside (tests/unit/test_fuzz_structured.py): pickles, JSON, .npy
and .idx headers that parse, but nest too deep, ask for too much, share references that expand, confuse types, or
name numpy dtypes whose bytes would be read as pointers. Each generator returns the bytes of one file."""

from __future__ import annotations

import codecs
import collections
import io
import json
import pathlib
import pickle
import random
import struct
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import metadata as dcp_metadata

_numpy = getattr(np, "_core", None) or np.core  # numpy 2 renamed numpy.core


class R:
    """Pickles as `fn(*args)`, BUILD with `state` when given: what a crafted file holds, without the object."""

    def __init__(self, fn: Any, args: tuple, state: Any = None):
        self.fn, self.args, self.state = fn, args, state

    def __reduce__(self):
        return (self.fn, self.args) if self.state is None else (self.fn, self.args, self.state)


DTYPE_CODES = ["O", "V8", "i4,O", "(2,)i4", "M8[s]", "U4", "S3", "u4", "f8", "b1", "c16", "<i8", ">f4", "float", 7,
               None, b"u4", "i4" * 9, "O8", "|V16"]  # fmt: skip
DTYPE_FLAGS = [0, 0, 0x01, 0x7D, 0x3F, 0x02, 0xFF, -1, 1 << 40]
SHAPES = [(2,), (0,), (1, 2), (2**62,), (-1,), (2**31, 2**31), tuple(range(70)), "x", (1.5,), [2], None]


def hostile_dtype(rng: random.Random) -> R:
    code = rng.choice(DTYPE_CODES)
    plain = (3, rng.choice("<>|="), None, None, None, -1, -1, rng.choice(DTYPE_FLAGS))
    obj = R(np.dtype, ("O", False, True))
    fields = (3, "|", None, ("a",), {"a": (obj, 0)}, 8, 1, 0x3F)  # an object field, through the state
    subarray = (3, "<", (obj, (2,)), None, None, 16, 8, 0)
    state = rng.choice([plain, plain, fields, subarray, (9,), "x", None])
    return R(np.dtype, (code, False, True), state)


def hostile_numpy(rng: random.Random) -> R:
    dtype = rng.choice([hostile_dtype(rng), R(np.dtype, ("u4", False, True), (3, "<", None, None, None, -1, -1, 0))])
    shape = rng.choice(SHAPES)
    data = rng.choice([b"\x41" * 16, b"\x00" * 8, b"", [1, 2], "AAAA", b"\x41" * rng.randrange(64)])
    kind = rng.randrange(3)
    if kind == 0:
        cls = rng.choice([np.ndarray, np.ndarray, dict, pickle.PickleError])
        return R(_numpy.multiarray._reconstruct, (cls, (0,), b"b"), (1, shape, dtype, rng.random() < 0.2, data))
    if kind == 1:
        return R(_numpy.multiarray.scalar, (dtype, data if not isinstance(data, list) else b"\x41" * 8))
    return dtype


def shared_chain(rng: random.Random) -> Any:
    """Lists (or dicts, tuples) holding the previous one twice: small in the file, 2**depth when printed."""
    node: Any = rng.choice(["leaf", 1, b"x" * 100])
    for _ in range(rng.choice((8, 20, 22, 40, 64))):
        node = rng.choice([lambda n: [n, n], lambda n: {"a": n, "b": n}, lambda n: (n, n)])(node)
    return node


def huge(rng: random.Random) -> R:
    n = rng.choice((10**6, 2**24 + 1, 10**9, 10**12, 2**63))
    return rng.choice([
        R(range, (n,)), R(bytearray, (n,)), R(set, (R(range, (n,)),)), R(frozenset, (R(range, (n,)),)),
        R(torch.Size, (R(range, (n,)),)), R(collections.OrderedDict, (R(range, (n,)),)),
        R(codecs.encode, ("x" * 64, rng.choice(["zlib", "bz2", "rot13", "hex", "latin1", "utf-16"]))),
        R(io.BytesIO, (n,)), R(bytearray, ("é" * 8, "utf-8")), R(slice, (0, n, 1)), R(complex, (n, n)),
        R(pathlib.PosixPath, tuple("a" for _ in range(rng.choice((1, 500))))),
    ])  # fmt: skip


def forbidden(rng: random.Random) -> R:
    import os
    import subprocess

    calls = [(os.system, ("true",)), (subprocess.call, (["true"],)), (eval, ("1",)), (getattr, (dict, "fromkeys")),
             (getattr, (torch.Tensor, "__reduce_ex__")), (pickle.loads, (b"N.",))]  # fmt: skip
    return R(*rng.choice(calls))


LEAVES = [None, 0, -1, 2**70, 1.5, float("nan"), "", "s" * 5000, b"\x00" * 3, True]


def random_plain(rng: random.Random, depth: int = 0) -> Any:
    """A plain value of a random type: type confusion where a real file holds something else."""
    if depth >= 3 or rng.random() < 0.5:
        return rng.choice(LEAVES)
    children = [random_plain(rng, depth + 1) for _ in range(rng.randrange(4))]
    return [children, {f"k{i}": c for i, c in enumerate(children)}, tuple(children), {"x", 1}][rng.randrange(4)]


def hostile_node(rng: random.Random) -> Any:
    """One hostile value to put somewhere in a real file's tree."""
    return rng.choices(
        [hostile_numpy, shared_chain, huge, forbidden, random_plain, _confused_tensor],
        [5, 2, 3, 1, 2, 1],
    )[0](rng)


def _confused_tensor(rng: random.Random) -> Any:
    return R(torch._utils._rebuild_tensor_v2, (rng.choice([None, 3, b"x", "s"]), 0, (2**40,), (1,), False,
                                                collections.OrderedDict()))  # fmt: skip


def raw_pickle(rng: random.Random) -> bytes:
    """Opcodes no pickler writes: nesting far past any recursion limit, a memo read that was never written, a
    BUILD on a dtype, an unterminated stream."""
    n = rng.choice((300, 5_000, 100_000))
    kind = rng.randrange(6)
    if kind == 0:  # lists nested n deep
        return b"\x80\x02" + b"]" * n + b"a" * (n - 1) + b"."
    if kind == 1:  # dicts nested n deep: d0 0 d1 0 ... dn, then SETITEM n times
        return b"\x80\x02" + b"}K\x00" * n + b"}" + b"s" * n + b"."
    if kind == 2:  # tuples nested n deep
        return b"\x80\x02" + b"(" * n + b"N" + b"t" * n + b"."
    if kind == 3:
        return b"\x80\x02h\x05."  # a memo entry never written
    if kind == 4:  # numpy dtype 'O' with its list-pickle flag dropped, on the raw stack
        return (b"\x80\x02cnumpy\ndtype\nX\x01\x00\x00\x00O\x89\x88\x87R(K\x03X\x01\x00\x00\x00|NNNJ\xff\xff\xff\xffJ"
                b"\xff\xff\xff\xffK}tb.")  # fmt: skip
    return b"\x80\x02" + b"]" * 10 + b"\x8e" + struct.pack("<Q", 2**40)  # BINBYTES8 promising 1 TB


def place(tree: Any, value: Any, rng: random.Random) -> Any:
    """`tree` (a real file's object, copied) with `value` at a random node: a dict value, a list item, an
    attribute of an object."""
    tree = pickle.loads(pickle.dumps(tree))
    nodes = [tree]
    slots: list[tuple[Any, Any]] = []
    while nodes and len(slots) < 400:
        node = nodes.pop()
        if isinstance(node, dict):
            slots += [(node, k) for k in node]
            nodes += list(node.values())
        elif isinstance(node, list):
            slots += [(node, i) for i in range(len(node))]
            nodes += node
        elif hasattr(node, "__dict__") and not isinstance(node, (torch.Tensor, type)):
            slots += [(node, ("attr", k)) for k in vars(node)]
            nodes += list(vars(node).values())
    if not slots:
        return value
    parent, key = rng.choice(slots)
    if isinstance(key, tuple) and key[:1] == ("attr",):
        setattr(parent, key[1], value)
    else:
        parent[key] = value
    return tree


def hostile_index(metadata: dcp_metadata.Metadata, rng: random.Random) -> bytes:
    """DCP's `.metadata`: the real index with a hostile node somewhere (or a record's field confused), or raw."""
    if rng.random() < 0.1:
        return raw_pickle(rng)
    md = pickle.loads(pickle.dumps(metadata))
    if rng.random() < 0.4:
        entry = rng.choice(list(md.state_dict_metadata.values()))
        field = rng.choice(["size", "chunks", "properties"] if hasattr(entry, "size") else ["x"])
        setattr(entry, field, hostile_node(rng) if rng.random() < 0.7 else random_plain(rng))
        return pickle.dumps(md, protocol=2)
    return pickle.dumps(place(md, hostile_node(rng), rng), protocol=2)


# JSON: a hostile fragment put in place of a node of a real file's tree


def _deep(rng: random.Random) -> str:
    n = rng.choice((99, 100, 101, 1_000, 50_000))
    return rng.choice([("[" * n) + ("]" * n), ('{"a":' * n) + "0" + ("}" * n), "[{" * (n // 2) + "}]" * (n // 2)])


JSON_FRAGMENTS = [
    _deep,
    lambda rng: "1" * rng.choice((4_301, 100_000)),  # past Python's digit limit
    lambda rng: rng.choice(["1e999999", "-1e999", "NaN", "Infinity", "-0", "0.0000000001e-400"]),
    lambda rng: json.dumps("x" * rng.choice((10**5, 10**6))),
    lambda rng: '"\\ud800"',  # a lone surrogate
    lambda rng: "[" + ",".join(["0"] * rng.choice((10**4, 2 * 10**5))) + "]",
    lambda rng: json.dumps(rng.choice([None, True, 0, -1, 2**64, "", [], {}, [[]], {"": {}}, "../../x", "\x00"])),
    lambda rng: '{"a": 1, "a": [2], "a": {"b": null}}',  # duplicate keys
]


def hostile_json(tree: Any, rng: random.Random) -> bytes:
    """The JSON of `tree` with one node replaced by a hostile fragment (or the whole document), as text: nesting
    deeper than any JSON writer recurses is written directly."""
    hole = "\x00HOLE\x00"
    fragment = rng.choice(JSON_FRAGMENTS)(rng)
    if rng.random() < 0.15:
        return fragment.encode()
    text = json.dumps(place(tree, hole, rng) if isinstance(tree, (dict, list)) and tree else hole)
    return text.replace(json.dumps(hole), fragment, 1).encode()


# .npy headers (the index cache's arrays)

NPY_DESCRS = ["'<i8'", "'|O'", "'<V8'", "[('a', '<i4')]", "[('a', '|O')]", "'<M8[s]'", "'<U3'", "'<f8'", "'<u4'",
              "'x'", "7", "None", "('<i4', (2,))", "'" + "<i8" * 100 + "'"]  # fmt: skip
NPY_SHAPES = ["(10,)", "()", "(2, 5)", "(-1,)", "(2**62,)", "(99999999999999999999,)", "(1.5,)", "[10]", "10",
              "(" * 150 + ")" * 150, "(" + "1," * 2000 + ")"]  # fmt: skip


def hostile_npy(rng: random.Random, good: bytes) -> bytes:
    """A `.npy` whose header parses as a dict of the three keys numpy wants, with hostile values; or the good file
    with its version or header length changed."""
    if rng.random() < 0.2:
        data = bytearray(good)
        at, value = rng.choice([(6, rng.choice((0, 2, 3, 9))), (8, rng.randrange(256)), (9, rng.choice((0, 255)))])
        data[at] = value
        return bytes(data)
    descr = rng.choice(NPY_DESCRS + ["'<i8'"] * 4)
    fortran = rng.choice(["False", "False", "True", "1", "'no'"])
    shape = rng.choice(NPY_SHAPES + ["(10,)"] * 4)
    header = "{" + f"'descr': {descr}, 'fortran_order': {fortran}, 'shape': {shape}, " + "}"
    if rng.random() < 0.1:
        header = header.replace("'shape'", "'shape2'")
    header += " " * (-(len(header) + 11) % 64) + "\n"
    major = rng.choice((1, 1, 2))
    size = struct.pack("<H", len(header)) if major == 1 else struct.pack("<I", len(header))
    body = good[-80:] if rng.random() < 0.7 else good[-80 : -rng.randrange(1, 80)]
    return b"\x93NUMPY" + bytes([major, 0]) + size + header.encode("latin1") + body


# .idx headers (Megatron's indexed dataset)

IDX_COUNTS = [0, 1, 3, 2**31, 2**63 - 1, 2**64 - 1]


def hostile_idx(rng: random.Random) -> tuple[bytes, bytes]:
    """An .idx (and its .bin) whose header fields are each plausible or hostile and whose arrays agree with the
    header's counts (so the file size checks pass) or not."""
    magic = rng.choice([b"MMIDIDX\x00\x00"] * 4 + [b"MMIDIDX\x00\x01", b"\x00" * 9])
    version = rng.choice([1, 1, 1, 0, 2, 2**64 - 1])
    code = rng.choice([1, 4, 4, 8, 6, 0, 9, 255])
    count = rng.choice([3, 3, 3, 0, 1] + IDX_COUNTS)
    docs = min(rng.choice([count + 1, count + 1, 2, 0, 1]), 2**64 - 1)
    itemsize = np.dtype({1: np.uint8, 4: np.int32, 8: np.uint16, 6: np.float64}.get(code, np.int32)).itemsize
    real = min(count, 16)
    lengths = np.array([rng.choice((0, 1, 5, -1, 2**31 - 1)) if rng.random() < 0.2 else 4 for _ in range(real)],
                       dtype="<i4")  # fmt: skip
    pointers = np.concatenate([[0], np.cumsum(lengths.astype(np.int64) * itemsize)[:-1]]).astype("<i8")[:real]
    if real and rng.random() < 0.2:
        pointers[rng.randrange(real)] = rng.choice((-8, 2**62, 3))
    doc_index = np.array(sorted(rng.randrange(real + 1) for _ in range(min(max(docs - 2, 0), 16))), dtype="<i8")
    doc_index = np.concatenate([[0], doc_index, [real]])[: min(docs, 18)].astype("<i8")
    if rng.random() < 0.15:
        doc_index = doc_index[::-1].copy()
    header = struct.pack("<9sQBQQ", magic, version, code, count, docs)
    body = lengths.tobytes() + pointers.tobytes() + doc_index.tobytes()
    if rng.random() < 0.2:
        body = body[: rng.randrange(len(body) + 1)]
    bin_size = int(lengths.clip(0, 64).sum()) * itemsize + rng.choice((0, 0, 0, 1, -1))
    return header + body, b"\x01" * max(bin_size, 0)
