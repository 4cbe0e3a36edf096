"""``--config FILE.yaml``: flags from a YAML file, the command line on top, and the source of
every value.

A config file is a mapping whose keys are flag names, with or without the leading
``--`` (``tensor-model-parallel-size: 2``; underscores are accepted for dashes). A value is
what the flag takes on the command line: a number, a string, a list (joined with commas,
as ``--task`` and ``--logra-targets`` take them), or ``true`` / ``false`` for a switch.
One extra key, ``defaults: OTHER.yaml`` (a path relative to the file), inherits another
recipe's keys first, so a family of recipes shares one base.

The file's flags go in front of the command line's, so the command line overrides them
(argparse keeps the last value of a flag), and the file is parsed through the same
parser: its values are checked exactly as typed flags are. Unknown keys are refused with
a "did you mean". ``resolve(parser, argv)`` returns the parsed namespace and, for every
flag, where its value came from: ``default``, the file's path, or ``command line``.
Nothing here imports torch or megatron.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable
from pathlib import Path

CONFIG_FLAG = "--config"
DEFAULTS_KEY = "defaults"
COMMAND_LINE = "command line"
DEFAULT = "default"


class ConfigFileError(ValueError):
    """A bad config file: the message names the file, the key and the fix."""


class _RaisingParser(argparse.ArgumentParser):
    """argparse that raises instead of printing and exiting (config-file values)."""

    def error(self, message):
        raise ConfigFileError(message)


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {opt: a for a in parser._actions for opt in a.option_strings
            if opt.startswith("--") and a.dest != "help"}


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[str, object, Path]]:
    """[(key, value, file it came from)] in order, ``defaults`` files first."""
    import yaml

    if path in seen:
        raise ConfigFileError(f"{path}: 'defaults' chain loops back to itself")
    if not path.is_file():
        where = f" (named by 'defaults' in {seen[-1]})" if seen else ""
        raise ConfigFileError(f"--config {path}: file not found{where}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"--config {path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config {path}: expected a mapping of flag names to values, "
                              f"got {type(data).__name__}")
    items = []
    base = data.pop(DEFAULTS_KEY, None)
    if base is not None:
        items = _read_yaml((path.parent / str(base)).resolve(), (*seen, path))
    return items + [(str(k), v, path) for k, v in data.items()]


def _flag_of(key: str, options: dict[str, argparse.Action], path: Path) -> str:
    flag = "--" + key.lstrip("-").replace("_", "-")
    if flag == CONFIG_FLAG:
        raise ConfigFileError(f"{path}: 'config' cannot be set inside a config file; use "
                              f"'{DEFAULTS_KEY}: OTHER.yaml' to build on another file")
    if flag not in options:
        close = difflib.get_close_matches(flag, list(options), n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(c.lstrip('-') for c in close)}?" if close else \
            "; see --help for the flags"
        raise ConfigFileError(f"{path}: unknown key {key!r}{hint}")
    return flag


def _tokens(flag: str, value: object, action: argparse.Action, path: Path) -> list[str]:
    """The command-line tokens that set ``flag`` to ``value``."""
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ConfigFileError(f"{path}: {flag.lstrip('-')} is a switch: give true or false")
        return [flag] if value else ["--no-" + flag[2:]]
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise ConfigFileError(f"{path}: {flag.lstrip('-')} is a switch: give true or false")
        return [flag] if value else []
    if value is None:
        raise ConfigFileError(f"{path}: {flag.lstrip('-')} has no value; leave the key out "
                              f"for the default")
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    elif isinstance(value, dict):
        raise ConfigFileError(f"{path}: {flag.lstrip('-')} takes a single value, not a mapping")
    return [flag, str(value)]


def file_tokens(make_parser: Callable[..., argparse.ArgumentParser], path: str | Path
                ) -> tuple[list[str], dict[str, str]]:
    """(tokens, {dest: the file that set it}) of a config file, every value checked by the
    parser's own types and choices (raises ``ConfigFileError`` naming the file)."""
    options = _options(make_parser())
    tokens: list[str] = []
    sources: dict[str, str] = {}
    for key, value, origin in _read_yaml(Path(path).resolve()):
        flag = _flag_of(key, options, origin)
        tokens += _tokens(flag, value, options[flag], origin)
        sources[options[flag].dest] = str(_display(origin))
    try:
        make_parser(parser_class=_RaisingParser).parse_args(tokens)
    except ConfigFileError as exc:
        raise ConfigFileError(f"--config {_display(Path(path))}: {exc}") from None
    return tokens, sources


def _display(path: Path) -> Path:
    """The path relative to the working directory where it lies under it."""
    try:
        return Path(path).resolve().relative_to(Path.cwd())
    except ValueError:
        return Path(path)


def resolve(make_parser: Callable[..., argparse.ArgumentParser], argv: list[str]
            ) -> tuple[argparse.Namespace, dict[str, str]]:
    """Parse ``argv`` (which may hold ``--config FILE``) with ``make_parser()`` ->
    (namespace, {dest: source}); ``make_parser(parser_class=...)`` builds the same parser
    on another ``ArgumentParser`` class."""
    parser = make_parser()
    dests = [a.dest for a in parser._actions if a.option_strings and a.dest != "help"]
    # argparse fills in a default only where the namespace lacks the attribute: what is
    # still the marker after parsing was not on the command line
    marker = object()
    on_cli = parser.parse_args(argv, namespace=argparse.Namespace(**dict.fromkeys(dests,
                                                                                  marker)))
    path = None if on_cli.config is marker else on_cli.config
    tokens, from_file = file_tokens(make_parser, path) if path else ([], {})
    args = parser.parse_args(tokens + list(argv))
    sources = {d: COMMAND_LINE if getattr(on_cli, d) is not marker else
               from_file.get(d, DEFAULT) for d in dests}
    return args, sources
