"""megatron/training/holders.py: the chain from an object to what keeps it alive, in one line. The objects are built
in helpers and reached through weak references, so no test frame (a root of its own) holds them."""

from __future__ import annotations

import weakref

import torch

from megatron.training.holders import holder_chain


class _Group:
    pass


class _Buffers:
    def __init__(self, group: _Group) -> None:
        self.group = group


_REGISTRY: dict[str, list] = {}


def _registered(key: str) -> weakref.ref:
    group = _Group()
    _REGISTRY[key] = [_Buffers(group)]
    return weakref.ref(group)


def _held_from_cpp() -> tuple[torch.Tensor, weakref.ref]:
    """A group reached only through a parameter whose Python object the autograd graph (C++) keeps."""
    param = torch.nn.Parameter(torch.ones(2))
    group = _Group()
    param.buffers = _Buffers(group)
    return (param * 2).sum(), weakref.ref(group)


def test_a_chain_up_to_a_module_global():
    group = _registered("run")
    try:
        chain = holder_chain(group())
        assert chain.startswith("_Buffers.group <- list <- dict['run'] <- ") and chain.endswith("._REGISTRY"), chain
    finally:
        _REGISTRY.clear()


def test_a_holder_kept_from_cpp_is_named_as_such_unless_a_root_is_found():
    loss, group = _held_from_cpp()
    chain = holder_chain(group())
    assert chain == "_Buffers.group <- Parameter.buffers <- (nothing the garbage collector sees: a C++ reference)"
    _REGISTRY["also"] = [group()]
    try:
        assert holder_chain(group()).startswith("list <- dict['also'] <- ")  # the module global says more
    finally:
        _REGISTRY.clear()
    del loss
    assert group() is None
