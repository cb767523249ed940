"""Frozen dataclass configs: build them from dicts/TOML/CLI flags, save them resolved as JSON.

Each stage owns one dataclass (its fields are the single source of truth for its settings);
this module only converts between those dataclasses and the outside world.
"""

import argparse
import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from pipeline.atomic import atomic_path
from pipeline.errors import ConfigError

T = TypeVar("T")


def to_dict(config: Any) -> dict[str, Any]:
    """A JSON-ready dict (tuples become lists, nested dataclasses become dicts)."""
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (annotation,) = [a for a in args if a is not type(None)]
        return _coerce(value, annotation, where)
    if dataclasses.is_dataclass(annotation):
        return from_dict(annotation, value, where)
    if origin is tuple:
        items = list(value) if isinstance(value, list | tuple) else [value]
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], where) for v in items)
        if len(items) != len(args):
            raise ConfigError(f"{where}: expected {len(args)} values, got {value!r}")
        return tuple(_coerce(v, a, where) for v, a in zip(items, args, strict=True))
    if annotation is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if annotation in (int, str, bool) and not isinstance(value, annotation):
        raise ConfigError(f"{where}: expected {annotation.__name__}, got {value!r}")
    return value


def from_dict(cls: type[T], values: dict[str, Any], where: str = "") -> T:
    """Build `cls` from a plain mapping; unknown keys are an error (a typo must not pass silently)."""
    where = where or cls.__name__
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: expected a table of settings, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown setting(s) {unknown}; known: {sorted(names)}")
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}") for k, v in values.items()}
    return cls(**kwargs)


def save_json(path: str | Path, config: Any) -> Path:
    """Write the resolved config (every field, defaults included) atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(to_dict(config), indent=2) + "\n")
    return Path(path)


def load_json(cls: type[T], path: str | Path) -> T:
    return from_dict(cls, json.loads(Path(path).read_text()), str(path))


def add_arguments(parser: argparse.ArgumentParser, cls: type, prefix: str = "") -> None:
    """One `--flag` per field of `cls`, nested configs as `--model-depth` etc.; tuples take several
    values. Every default is None so `from_arguments` can tell a given flag from an absent one."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        annotation = hints[field.name]
        if dataclasses.is_dataclass(annotation):
            add_arguments(parser, annotation, f"{prefix}{field.name}_")
            continue
        is_tuple = typing.get_origin(annotation) is tuple
        base = typing.get_args(annotation)[0] if is_tuple else annotation
        flag = "--" + (prefix + field.name).replace("_", "-")
        default = field.default if field.default is not dataclasses.MISSING else "required"
        if base is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, help=f"default: {default}"
            )
            continue
        parser.add_argument(
            flag,
            type=base if base in (int, float, str) else str,
            nargs="+" if is_tuple else None,
            help=f"default: {default}",
        )


def from_arguments(
    cls: type[T], args: argparse.Namespace, base: T | None = None, prefix: str = ""
) -> T:
    """Flags that were given override `base` (or the defaults); the rest stay as they were."""
    return from_dict(
        cls, _given_values(cls, args, to_dict(base) if base is not None else {}, prefix)
    )


def _given_values(cls: type, args: argparse.Namespace, values: dict, prefix: str) -> dict:
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        annotation = hints[field.name]
        if dataclasses.is_dataclass(annotation):
            nested = _given_values(
                annotation, args, values.get(field.name, {}), f"{prefix}{field.name}_"
            )
            if nested:
                values[field.name] = nested
            continue
        given = getattr(args, prefix + field.name, None)
        if given is not None:
            values[field.name] = given
    return values
