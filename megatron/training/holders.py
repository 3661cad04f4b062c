"""Who keeps an object alive, in one line: the shortest chain of referrers the garbage collector sees from the
object to a root (a module's global, a class attribute, a running frame not ours, or an object that nothing the
collector tracks refers to: held from C++). `Shutdown.close` prints it for each process group still referenced
after its release, so that one run's log names the holder.

Each `gc.get_referrers` scans every tracked object (a second or less on a large model's process), so the search is
bounded (`MAX_NODES`) and runs only when something is already wrong.
"""

from __future__ import annotations

import gc
import os
import types
from collections import deque
from collections.abc import Iterable, Iterator

MAX_NODES = 25
"""Objects whose referrers are looked up per chain at most (each one `gc.get_referrers` call, one more per
attribute dict); a longer search ends with "...". """

_OWN_FILES = {os.path.abspath(__file__), os.path.abspath(os.path.join(os.path.dirname(__file__), "shutdown.py"))}


def holder_chain(obj: object, skip: Iterable[object] = ()) -> str:
    """'A.attr <- B.attr <- module.name': what holds `obj`, then what holds that, up to a root. `skip`: objects
    that refer to `obj` only for the caller (its lists of the objects being checked)."""
    own = {id(x) for x in skip}
    via: dict[int, tuple[object, str]] = {}  # id(holder) -> (the object it holds, how)
    frontier: deque[object] = deque([obj])
    seen = {id(obj)}
    own.update({id(via), id(frontier), id(seen), id(own)})
    node = obj
    unreferenced = None  # the first object on the way that nothing tracked refers to
    for _ in range(MAX_NODES):
        if not frontier:
            break
        node = frontier.popleft()
        holders = list(_holders(node, own))
        own.update({id(holders), *(id(entry) for entry in holders)})
        if not holders:  # kept from C++; a root the collector sees, if another branch reaches one, says more
            unreferenced = unreferenced if unreferenced is not None else node
            continue
        for holder, label, is_root in holders:
            if id(holder) in seen:
                continue
            seen.add(id(holder))
            via[id(holder)] = (node, label)
            own.add(id(via[id(holder)]))
            if is_root:
                return _render(obj, holder, via)
            frontier.append(holder)
    if unreferenced is not None:
        return _render(obj, unreferenced, via, "(nothing the garbage collector sees: a C++ reference)")
    if frontier:
        return _render(obj, frontier[0], via, "...")
    # every holder found is already on the chain: a cycle that nothing the collector sees holds, kept from C++
    return _render(obj, node, via, "(a cycle held from outside Python: a C++ reference into it)")


def _render(obj: object, top: object, via: dict[int, tuple[object, str]], tail: str = "") -> str:
    labels = []
    node = top
    while node is not obj:
        node, label = via[id(node)]
        labels.append(label)
    labels.reverse()  # the innermost holder first
    return " <- ".join(labels + ([tail] if tail else [])) or tail


def _holders(node: object, own: set[int]) -> Iterator[tuple[object, str, bool]]:
    """(holder, how it holds `node`, whether it is a root) for each referrer of `node` that is not the search's."""
    found = gc.get_referrers(node)
    own.add(id(found))
    referrers = [ref for ref in found if id(ref) not in own]
    own.add(id(referrers))
    if not referrers and not gc.is_tracked(node):
        referrers += _untracked_containers(node)
    for ref in referrers:
        if isinstance(ref, types.FrameType):
            path = os.path.abspath(ref.f_code.co_filename)
            if path not in _OWN_FILES:
                yield ref, f"frame {ref.f_code.co_name} ({os.path.basename(path)}:{ref.f_lineno})", True
        elif isinstance(ref, dict):
            key = _key_of(ref, node)
            owner = _dict_owner(ref, key, own)
            if owner is None:
                yield ref, "dict key" if key is None else f"dict[{str(key)[:40]!r}]", False
            elif isinstance(owner, types.ModuleType):
                yield owner, f"{owner.__name__}.{key}", True
            elif isinstance(owner, type):
                yield owner, f"{owner.__module__}.{owner.__qualname__}.{key}", True
            else:
                yield owner, f"{type(owner).__qualname__}.{key}", False
        elif isinstance(ref, types.MethodType):
            yield ref, f"method {ref.__func__.__qualname__}", False
        elif isinstance(ref, types.FunctionType):
            yield ref, f"function {ref.__qualname__}", False
        else:
            yield ref, _attribute_label(ref, node), False


def _untracked_containers(node: object) -> list[object]:
    """The dicts and tuples that hold `node` but that the collector does not track, so `gc.get_referrers` misses
    them: a container of untracked objects only (a process group's Python object is one: `{name: group}`, torch's
    `{group: (name, store)}`). Found inside the tracked objects, two levels deep; one pass over every object."""
    found: list[object] = []
    for obj in gc.get_objects():
        pending = [(child, 0) for child in gc.get_referents(obj) if _untracked_container(child)]
        while pending:
            container, depth = pending.pop()
            children = gc.get_referents(container)
            for child in children:
                if child is node and not any(c is container for c in found):
                    found.append(container)
                elif depth < 2 and _untracked_container(child):
                    pending.append((child, depth + 1))
    return found


def _untracked_container(obj: object) -> bool:
    return type(obj) in (dict, tuple) and not gc.is_tracked(obj)


def _dict_owner(mapping: dict, key: object, own: set[int]) -> object | None:
    """The module, class or instance whose attributes `mapping` holds, if any."""
    referrers = gc.get_referrers(mapping)
    own.add(id(referrers))
    for ref in referrers:
        if getattr(ref, "__dict__", None) is mapping:  # an instance's or a module's
            return ref
        if isinstance(ref, type) and key is not None and vars(ref).get(key) is mapping.get(key):  # a class's
            return ref
    return None


def _key_of(mapping: dict, node: object) -> object | None:
    """The key under which `mapping` holds `node` (a plain loop: a generator expression's closure would hold
    `node` in a cell, one more referrer for the search to find)."""
    for key, value in mapping.items():
        if value is node:
            return key
    return None


def _attribute_label(holder: object, node: object) -> str:
    """'Type.attr' when `node` is one of `holder`'s attributes (instance dict or slots), else the type's name."""
    name = type(holder).__qualname__
    try:
        attributes = dict(vars(holder))
    except TypeError:  # no __dict__
        attributes = {}
    for cls in type(holder).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if isinstance(slot, str) and slot not in attributes:
                attributes[slot] = getattr(holder, slot, None)
    attribute = _key_of(attributes, node)
    return name if attribute is None else f"{name}.{attribute}"
