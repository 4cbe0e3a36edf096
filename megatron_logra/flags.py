"""Command-line flags built from the config dataclasses: one field is one flag.

Each component owns a frozen config dataclass whose fields carry their default and,
in the string under the field, their meaning (as megatron-core documents its own
configs). ``add_flags(parser, Config)`` turns the fields into argparse flags:

- the flag is ``--{FLAG_PREFIX}{field-name}`` (``FLAG_PREFIX``: the class's, e.g.
  ``"logra-"``; none by default) unless ``flag_spec(flag="--other")`` names it;
- its help is the field's docstring (read from the class source), its default the
  field's default (or ``flag_spec(cli_default=...)`` where the CLI derives the value);
- ``Literal[...]`` and ``StrEnum`` give choices, ``bool`` gives ``--x`` (``--x/--no-x``
  when it defaults to True),
  ``X | None`` an optional X; ``flag_spec(parse=f)`` converts the string;
- ``flag_spec(minimum=m)`` refuses values below m, ``flag_spec(zero_is_none=True)``
  maps 0 to None (``--tis-cap 0``: off);
- nested dataclass fields and ``flag_spec(cli=False)`` fields are not flags.
``from_flags(Config, args, **derived)`` builds the config back from the parsed
namespace.

Every config checks itself when it is built, from flags or in code alike: its
``__post_init__`` calls ``check_fields(self)`` (each field's declared range and choices,
the messages naming the flag) and then its own rules. Nothing here imports torch or
megatron.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import inspect
import textwrap
import types
import typing
from collections.abc import Callable
from functools import cache

_KEY = "megatron_logra.flag"


class FlagError(ValueError):
    """A config field outside its declared range or choices (the message names the flag)."""


def flag_spec(*, flag: str | None = None, cli: bool = True, cli_default=dataclasses.MISSING,
              parse: Callable[[str], object] | None = None, minimum: float | None = None,
              zero_is_none: bool = False) -> dict:
    """Field metadata: ``field(default=..., metadata=flag_spec(...))``."""
    return {_KEY: dict(flag=flag, cli=cli, cli_default=cli_default, parse=parse,
                       minimum=minimum, zero_is_none=zero_is_none)}


def _spec(f: dataclasses.Field) -> dict:
    return f.metadata.get(_KEY) or flag_spec()[_KEY]


@cache
def field_docs(cls: type) -> dict[str, str]:
    """{field: the docstring under it} of a dataclass, from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def flag_prefix(cls: type) -> str:
    """What the class's flags start with after ``--`` (its ``FLAG_PREFIX``; none by default)."""
    return getattr(cls, "FLAG_PREFIX", "")


def flag_name(cls: type, name: str) -> str:
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    return _spec(f)["flag"] or f"--{flag_prefix(cls)}{name.replace('_', '-')}"


@cache
def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def _dest(cls: type, name: str) -> str:
    return f"{flag_prefix(cls)}{name}".replace("-", "_")


def _flag_fields(cls: type):
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if not _spec(f)["cli"] or (isinstance(kind, type) and dataclasses.is_dataclass(kind)):
            continue
        yield f, kind


def _default(f: dataclasses.Field):
    spec = _spec(f)
    if spec["cli_default"] is not dataclasses.MISSING:
        return spec["cli_default"]
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"field {f.name} needs a default or flag_spec(cli_default=...)")


def _unwrap_optional(kind):
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return kind


def add_flags(parser: argparse.ArgumentParser, cls: type, title: str | None = None) -> None:
    """Add ``cls``'s fields as flags, in one argument group titled ``title``."""
    group = parser.add_argument_group(title or cls.__name__)
    docs = field_docs(cls)
    for f, kind in _flag_fields(cls):
        spec, base = _spec(f), _unwrap_optional(kind)
        kwargs: dict = {"default": _default(f), "help": docs.get(f.name, ""),
                        "dest": _dest(cls, f.name)}
        if spec["parse"] is not None:
            kwargs["type"] = spec["parse"]
        elif base is bool:  # off by default: --x; on by default: --x / --no-x
            kwargs["action"] = argparse.BooleanOptionalAction if kwargs["default"] else \
                "store_true"
        elif typing.get_origin(base) is typing.Literal:
            kwargs["choices"] = typing.get_args(base)
        elif isinstance(base, type) and issubclass(base, enum.Enum):
            kwargs["type"], kwargs["choices"] = base, list(base)
        elif base in (int, float, str):
            kwargs["type"] = base
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: no flag type for {kind}; give "
                            f"flag_spec(parse=...) or cli=False")
        group.add_argument(flag_name(cls, f.name), **kwargs)


def from_flags(cls: type, args: argparse.Namespace, **derived):
    """``cls`` from the parsed flags, with ``derived`` fields given by the caller; the class
    checks itself (``check_fields`` and its own rules: ValueError naming the flag)."""
    values = {}
    for f, _ in _flag_fields(cls):
        value = getattr(args, _dest(cls, f.name))
        if _spec(f)["zero_is_none"] and value == 0:
            value = None
        values[f.name] = value
    values.update(derived)
    return cls(**values)


def _choices(kind) -> tuple | None:
    base = _unwrap_optional(kind)
    if typing.get_origin(base) is typing.Literal:
        return typing.get_args(base)
    if isinstance(base, type) and issubclass(base, enum.Enum):
        return tuple(base)
    return None


def check_fields(config) -> None:
    """Refuse (``FlagError``) a field of ``config`` outside what it declares: a
    ``Literal``/enum value not among its choices, a value below ``flag_spec(minimum=...)``,
    or 0 where the flag's 0 means None (``zero_is_none``). Every config's ``__post_init__``
    calls it, so a config built in code is refused as the same flags would be."""
    cls = type(config)
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        value, spec = getattr(config, f.name), _spec(f)
        if value is None or dataclasses.is_dataclass(value):
            continue
        flag = flag_name(cls, f.name) if spec["cli"] else f"{cls.__name__}.{f.name}"
        choices = _choices(hints[f.name])
        if choices is not None and value not in choices:
            raise FlagError(f"{flag} {value!r}: choose from {', '.join(map(str, choices))}")
        if spec["minimum"] is not None and value < spec["minimum"]:
            raise FlagError(f"{flag} must be >= {spec['minimum']}, got {value}")
        if spec["zero_is_none"] and value == 0:
            raise FlagError(f"{flag}: 0 is how the command line says None; in code, give None")
