"""Seeded mutations for the fuzz suite (tests/unit/test_fuzz_inputs.py): bytes, JSON-like trees and tensors."""

from __future__ import annotations

import copy
import random
import signal
from typing import Any

import torch

from megatron.errors import UserError

CASE_TIMEOUT_S = 20  # generous: the machine is shared; a hang is what it catches


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """One of: flipped bytes, a truncation, inserted junk, a deleted or duplicated range, an overwritten range,
    random bytes instead, nothing at all."""
    n = len(data)
    kind = rng.randrange(8)
    if kind == 0 or n == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
    i, j = sorted(rng.randrange(n + 1) for _ in range(2))
    if kind == 1:
        out = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(n)] ^= 1 << rng.randrange(8)
        return bytes(out)
    if kind == 2:
        return data[:i]
    if kind == 3:
        return data[:i] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 32))) + data[i:]
    if kind == 4:
        return data[:i] + data[j:]
    if kind == 5:
        return data[:j] + data[i:j] + data[j:]
    if kind == 6:
        return data[:i] + bytes([rng.choice((0, 0xFF))]) * (j - i) + data[j:]
    return b""


STRINGS = ["", " ", "x", "../../etc/passwd", "/", "\x00", "é", "٤", "nan", "-1", "1e400", "true", "None", "a" * 300]
INTS = [0, -1, 1, 2, 3, 7, 2**31, 2**63, -(2**63), 10**30]
FLOATS = [0.0, -0.0, 1.5, float("nan"), float("inf"), -float("inf"), 1e308]


def random_value(rng: random.Random, depth: int = 0, tensors: bool = False) -> Any:
    """A plain value of a random type (and, with `tensors`, a tensor of a random shape and dtype)."""
    kinds = ["none", "bool", "int", "float", "str", "list", "dict"] + (["tensor"] * 2 if tensors else [])
    kind = rng.choice(kinds if depth < 2 else kinds[:5])
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice(INTS)
    if kind == "float":
        return rng.choice(FLOATS)
    if kind == "str":
        return rng.choice(STRINGS)
    if kind == "list":
        return [random_value(rng, depth + 1, tensors) for _ in range(rng.randrange(4))]
    if kind == "dict":
        return {rng.choice(STRINGS + ["tp", "pp", "dp"]): random_value(rng, depth + 1, tensors) for _ in range(3)}
    shape = [rng.choice((0, 1, 2, 3, 17)) for _ in range(rng.randrange(4))]
    dtype = rng.choice((torch.float32, torch.int64, torch.bool, torch.uint8, torch.bfloat16))
    return torch.zeros(shape, dtype=dtype)


def _paths(tree: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out += _paths(v, prefix + (i,))
    return out


def mutate_tree(tree: Any, rng: random.Random, tensors: bool = False) -> Any:
    """A copy of `tree` with one node deleted, replaced by a value of another type, or (tensors) reshaped."""
    tree = copy.deepcopy(tree)
    path = rng.choice(_paths(tree)[1:] or [()])
    if not path:
        return random_value(rng, tensors=tensors)
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    if isinstance(parent, tuple):  # tuples (the RNG states) are rebuilt as lists with the change
        return mutate_tree(_untuple(tree), rng, tensors)
    if isinstance(parent, dict) and rng.random() < 0.3:
        del parent[key]
    elif isinstance(parent[key], torch.Tensor) and rng.random() < 0.5:
        parent[key] = torch.zeros([rng.choice((0, 1, 5)) for _ in range(rng.randrange(3))], dtype=parent[key].dtype)
    else:
        parent[key] = random_value(rng, tensors=tensors)
    return tree


def _untuple(tree: Any) -> Any:
    if isinstance(tree, dict):
        return type(tree)((k, _untuple(v)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        return [_untuple(v) for v in tree]
    return tree


class Tally:
    """Per format: how many cases were refused (one-line error) and how many loaded (a harmless mutation)."""

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, int]] = {}
        self.messages: dict[str, list[str]] = {}

    def run(self, fmt: str, case: Any, names: list[str]) -> str:
        """Run `case()`; it must return or raise the project's one-line error naming one of `names`, in time."""

        def hang(*_: Any) -> None:
            raise TimeoutError(f"{fmt}: a case ran over {CASE_TIMEOUT_S} s")

        previous = signal.signal(signal.SIGALRM, hang)
        signal.alarm(CASE_TIMEOUT_S)
        try:
            case()
            outcome = "loaded"
        except UserError as exc:
            message = str(exc).strip()
            assert "\n" not in message, f"{fmt}: a refusal of more than one line: {message!r}"
            assert any(n in message for n in names), f"{fmt}: the refusal names none of {names}: {message}"
            outcome = "refused"
            self.messages.setdefault(fmt, []).append(message)
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
        self.counts.setdefault(fmt, {"refused": 0, "loaded": 0})[outcome] += 1
        return outcome

    def total(self, fmt: str) -> int:
        return sum(self.counts.get(fmt, {}).values())
