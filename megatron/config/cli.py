"""Megatron-LM-style command line, generated from the configuration dataclasses."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Sequence
from typing import Any

from .base import ConfigError, field_docs, flag_name
from .config import SECTIONS, Config


def scalar_type(annotation: Any) -> Any:
    """`int | None` -> int, `list[str] | None` -> str; the argparse `type` of a field."""
    if isinstance(annotation, str):
        annotation = eval(annotation, {}, {})  # annotations are postponed strings; they name builtins only
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        origin = typing.get_origin(annotation)
    if origin is list:
        (annotation,) = typing.get_args(annotation)
    return annotation


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:  # one line, like every other configuration error
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pretrain_gpt.py",
        description="Pretrain a GPT model (Megatron-LM compatible flags).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        docs = field_docs(cls)
        for field in dataclasses.fields(cls):
            kwargs = dict(field.metadata.get("argparse", {}))
            kwargs.setdefault("help", docs.get(field.name, "").replace("%", "%%"))  # argparse %-formats help
            kwargs["dest"] = f"{section}.{field.name}"
            kind = scalar_type(field.type)
            if kind is bool:
                kwargs.setdefault("action", "store_true")
            else:
                kwargs.setdefault("type", kind)
            if field.default is not dataclasses.MISSING:
                kwargs["default"] = field.default
            elif field.default_factory is not dataclasses.MISSING:  # list defaults
                kwargs["default"] = field.default_factory()
            group.add_argument(flag_name(field), **kwargs)
    return parser


def parse_args(
    argv: Sequence[str] | None = None, *, world_size: int = 1, device_type: str = "cpu", check_files: bool = True
) -> Config:
    """Parse flags into a finalized Config. Raises ConfigError (one line) on any bad value or combination, or
    (`check_files`: flags of a run on this machine) a data or tokenizer file that does not exist."""
    namespace = build_parser().parse_args(argv)
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for dest, value in vars(namespace).items():
        section, name = dest.split(".", 1)
        sections[section][name] = value
    config = Config(
        **{name: cls(**sections[name]) for name, cls in SECTIONS.items()},
        world_size=world_size,
        device_type=device_type,
    )
    return config.finalize(check_files)


def all_flags() -> list[str]:
    """Every flag the CLI accepts, sorted (a snapshot test makes new flags a visible decision)."""
    flags = []
    for cls in SECTIONS.values():
        for field in dataclasses.fields(cls):
            flags.append(flag_name(field))
            if field.metadata.get("argparse", {}).get("action") is argparse.BooleanOptionalAction:
                flags.append("--no-" + flag_name(field)[2:])  # argparse adds the negative form
    return sorted(flags)
