"""Run configurations in TOML: ``fedkl run --config FILE.toml``, and the value checks every
experiment file shares.

A run config is a TOML file whose keys are :class:`fedkl.runner.RunConfig` field names
(``noise-seed`` or ``noise_seed``); a flag given on the command line overrides the file. Every value
is checked by the same parser as its flag (a bad value or an unknown key exits 2 with one line).
TOML has no null: write ``"none"`` for an optional field's "unset". A sweep file's top-level keys,
its axes and its ``[[sweep.when]]`` settings are checked by the same :func:`coerce_value`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


class ConfigError(ValueError):
    """A bad configuration file or value: the CLI prints the message on one line and exits 2."""


def run_fields() -> dict[str, dataclasses.Field]:
    """Every ``fedkl run`` setting: RunConfig field name -> its dataclass field."""
    from fedkl.runner import settings_fields

    return settings_fields()


def dest_of(field_name: str) -> str:
    """The argparse destination of a RunConfig field in ``fedkl run`` (``reference`` is the negated
    ``--no-reference``)."""
    return "no_reference" if field_name == "reference" else field_name


def run_actions() -> dict[str, argparse.Action]:
    """The argparse actions of ``fedkl run``'s options, by destination."""
    from fedkl.flags import build_parser

    run = build_parser().subcommands["run"]  # type: ignore[attr-defined]
    return {a.dest: a for a in run._actions if a.dest not in ("help",)}


def field_name(key: str) -> str:
    return key.replace("-", "_")


def _optional(f: dataclasses.Field) -> bool:
    return "None" in str(f.type)


def coerce_value(
    name: str,
    value: Any,
    *,
    actions: Mapping[str, argparse.Action] | None = None,
    fields: Mapping[str, dataclasses.Field] | None = None,
    extra_algorithms: Iterable[str] = (),
    extra_settings: Mapping[str, Any] | None = None,
) -> Any:
    """``value`` (from TOML) checked and converted exactly as ``fedkl run``'s flag for field
    ``name`` would check and convert its text; ``extra_settings``: external runners' own settings,
    name -> default, checked against the default's type. Raises :class:`ConfigError`."""
    fields = fields if fields is not None else run_fields()
    actions = actions if actions is not None else run_actions()
    if extra_settings and name in extra_settings and name not in fields:
        kind = type(extra_settings[name])
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if type(value) is not kind:
            raise ConfigError(f"key {name!r}: expected {kind.__name__}, got {value!r}")
        return value
    flag = "--" + dest_of(name).replace("_", "-")
    if name not in fields:
        import difflib

        close = difflib.get_close_matches(name, list(fields), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else "; the keys are fedkl run's options"
        raise ConfigError(f"unknown key {name!r} (not a fedkl run setting{hint})")
    f = fields[name]
    if isinstance(value, (dict, list)):
        raise ConfigError(f"key {name!r}: expected a single value, got {type(value).__name__} {value!r}")
    if isinstance(value, str) and value.strip().lower() == "none":
        if _optional(f):
            return None
        raise ConfigError(f"key {name!r} cannot be none")
    if name == "reference" or str(f.type) == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"key {name!r}: expected true or false, got {value!r}")
        return value
    action = actions.get(dest_of(name))
    if action is None:  # a field without a flag: accept its annotated type only
        raise ConfigError(f"key {name!r} has no `fedkl run` flag and cannot be set from a file")
    if isinstance(value, bool):
        raise ConfigError(f"key {name!r} ({flag}): expected a {str(f.type).split(' ')[0]}, got {value!r}")
    if isinstance(value, float) and math.isinf(value):
        text = "inf" if value > 0 else "-inf"
    else:
        text = str(value)
    if action.type is not None:
        try:
            out = action.type(text)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            raise ConfigError(f"key {name!r} ({flag}): {exc}") from None
    else:
        if not isinstance(value, str):
            raise ConfigError(f"key {name!r} ({flag}): expected a string, got {value!r}")
        out = value
    choices = action.choices
    if choices is not None and out not in choices and out not in tuple(extra_algorithms):
        raise ConfigError(f"key {name!r} ({flag}): invalid choice {out!r} (choose from {', '.join(map(str, choices))})")
    return out


def read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path!r} is not valid TOML: {exc}") from None


def run_settings(mapping: Mapping[str, Any], where: str, **kw: Any) -> dict[str, Any]:
    """RunConfig field -> checked value, for the plain (non-table) keys of ``mapping``."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        name = field_name(key)
        if name in out:
            raise ConfigError(f"{where}: key {key!r} is given twice (dashes and underscores name the same field)")
        try:
            out[name] = coerce_value(name, value, **kw)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return out


def load_run_config_file(path: str) -> dict[str, Any]:
    """The RunConfig settings of a ``fedkl run --config`` file (no tables allowed)."""
    data = read_toml(path)
    tables = [k for k, v in data.items() if isinstance(v, dict)]
    if tables:
        raise ConfigError(
            f"{path}: unexpected table [{tables[0]}] (a run config holds RunConfig keys only; "
            "[sweep] belongs in a `fedkl sweep` file)"
        )
    return run_settings(data, path)


def explicit_run_dests(argv: Sequence[str]) -> set[str]:
    """Destinations of the ``fedkl run`` options actually present in ``argv`` (abbreviations
    included): the same parser with every default suppressed keeps only what was given."""
    from fedkl.flags import build_parser

    parser = build_parser()
    run = parser.subcommands["run"]  # type: ignore[attr-defined]
    for action in run._actions:
        action.default = argparse.SUPPRESS
    ns = parser.parse_args(list(argv))
    return set(vars(ns)) - {"command"}


def apply_config_file(args: argparse.Namespace, argv: Sequence[str]) -> argparse.Namespace:
    """Fill ``args`` (parsed ``fedkl run`` options) from ``args.config``: a file value replaces the
    default of every option that was not given explicitly on the command line."""
    settings = load_run_config_file(args.config)
    given = explicit_run_dests(argv)
    for name, value in settings.items():
        dest = dest_of(name)
        if dest in given:
            continue
        setattr(args, dest, (not value) if name == "reference" else value)
    return args
