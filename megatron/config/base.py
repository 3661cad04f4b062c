"""Machinery shared by the configuration sections.

Every section is a dataclass whose fields are the flags Megatron-LM users type: a field ``num_layers`` is the flag
``--num-layers``. The docstring written under each field is its ``--help`` text (read from the source with ``ast``,
so there is one place to document a field). Field metadata can override the flag name or argparse action, e.g. the
field ``fp8_wgrad`` is set off by ``--no-fp8-wgrad``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
from typing import Any

from megatron.errors import UserError


class ConfigError(UserError, ValueError):
    """A wrong flag value or combination. Its message is one line naming the flag and the fix."""


def option(default: Any = dataclasses.MISSING, *, flag: str | None = None, **argparse_kwargs: Any) -> Any:
    """A dataclass field with CLI metadata: ``flag`` renames the flag, other keywords go to ``add_argument``."""
    metadata = {"flag": flag, "argparse": argparse_kwargs}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag_name(field: dataclasses.Field) -> str:
    """The command-line flag of a field: ``--`` plus the name with dashes unless the metadata names another."""
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass (the string literal written under each field), by field name."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, following in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def require(condition: bool, message: str) -> None:
    """Raise ConfigError(message) unless condition holds."""
    if not condition:
        raise ConfigError(message)
