"""Command lines built from settings dataclasses: one flag per field, grouped like the class.

``python -m magrpo.train`` (``MAGRPOConfig``) and ``python -m magrpo.evaluate``
(``EvalSettings``) share one style: ``--kebab-case`` flags, lists as space-separated values
(``--models a b``), booleans as ``--flag`` / ``--no-flag``, and ``none`` for an optional
value. The help is grouped by the section comments of the class (``# Sampling ----``), and
each flag's help is its field's ``metadata["help"]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import types
import typing
from typing import Any

_GROUP = re.compile(r"^\s*# ([A-Z][\w ,]*?)\s*-{3,}\s*$")
_FIELD = re.compile(r"^    (\w+): ")


def flag_help(text: str) -> dict[str, str]:
    """A field's ``metadata``: the help text of its flag."""
    return {"help": text}


def field_groups(cls: type) -> list[tuple[str, list[str]]]:
    """(section title, field names) in the order of ``cls``'s source; fields before the
    first section comment go under "Options"."""
    names = {f.name for f in dataclasses.fields(cls)}
    groups: list[tuple[str, list[str]]] = []
    for line in inspect.getsource(cls).splitlines():
        group, found = _GROUP.match(line), _FIELD.match(line)
        if group:
            groups.append((group.group(1), []))
        elif found and found.group(1) in names:
            if not groups:
                groups.append(("Options", []))
            groups[-1][1].append(found.group(1))
    return groups


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of ``cls``; values the user does not give are left out of the
    parsed namespace (``argument_default=SUPPRESS``), so the dataclass keeps its defaults
    and a config file can sit between them and the flags."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for title, names in field_groups(cls):
        group = parser.add_argument_group(title)
        for name in names:
            convert, extra = _parser_for(hints[name])
            required = (
                fields[name].default is dataclasses.MISSING
                and fields[name].default_factory is dataclasses.MISSING
            )
            kwargs: dict[str, Any] = {
                # argparse expands %-formats in help texts; a plain "91%" must stay as it is
                "help": fields[name].metadata.get("help", "").replace("%", "%%"),
                "dest": name,
                "default": argparse.SUPPRESS,
                **({"required": True} if required else {}),
                **extra,
            }
            if convert is not None:
                kwargs["type"] = convert
            group.add_argument(f"--{name.replace('_', '-')}", **kwargs)


def split_commas(values: dict[str, Any]) -> dict[str, Any]:
    """A list flag given as one comma-separated value (``--models a,b``) as that list."""
    return {
        name: value[0].split(",")
        if isinstance(value, list)
        and len(value) == 1
        and isinstance(value[0], str)
        and "," in value[0]
        else value
        for name, value in values.items()
    }


def _parser_for(annotation: Any) -> tuple[Any, dict[str, Any]]:
    """Map a type annotation to (argparse type callable, extra add_argument kwargs)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    optional = origin in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        (annotation,) = [a for a in args if a is not type(None)]
        origin = typing.get_origin(annotation)
        args = typing.get_args(annotation)

    def maybe_none(convert: Any) -> Any:
        def parse(text: str) -> Any:
            if optional and text.lower() in ("none", "null"):
                return None
            return convert(text)

        parse.__name__ = getattr(convert, "__name__", "value")
        return parse

    if annotation is bool:
        return None, {"action": argparse.BooleanOptionalAction}
    if origin is list:  # items stay text: "1,3" must survive until split_commas
        return maybe_none(str), {"nargs": "+"}
    if origin is dict:
        return maybe_none(json.loads), {}
    if annotation in (int, float, str):
        return maybe_none(annotation), {}
    raise TypeError(f"unsupported settings type {annotation}")
