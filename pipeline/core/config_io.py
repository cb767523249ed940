"""Frozen dataclass configs: build them from dicts/TOML, save them resolved as JSON.

Each stage owns one dataclass (its fields are the single source of truth for its settings);
this module only converts between those dataclasses and the outside world. Command-line flags
for a dataclass: `pipeline.cli.add_arguments` / `from_arguments`.

A setting that names a file is declared with `path_setting`: in a config file a relative path
means relative to that file's folder (`resolve_paths`), so the file reads the same data from any
current directory, and the run's saved settings name it absolutely.
"""

import dataclasses
import json
import os
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pipeline.core.atomic import atomic_path
from pipeline.core.errors import ConfigError

T = TypeVar("T")
# How a path setting's text is made absolute against a folder; kept in the field's metadata.
Resolver = Callable[[str, Path], str]
RESOLVER = "resolve_against_folder"


def resolve_file(text: str, folder: Path) -> str:
    """A relative file or folder name, made absolute against `folder`; "" (not set), an
    absolute path and a URL (`scheme://...`) stay as they are."""
    if not text or "://" in text or Path(text).is_absolute():
        return text
    # normpath, not resolve(): a linked file keeps the name the config gives it.
    return os.path.normpath(folder / text)


def path_setting(resolve: Resolver = resolve_file) -> Any:
    """A `str` field, "" by default, that names a file or folder; `resolve` makes a relative one
    absolute against a config file's folder."""
    return dataclasses.field(default="", metadata={RESOLVER: resolve})


def resolve_paths(cls: type, values: dict[str, Any], folder: Path) -> dict[str, Any]:
    """`values` for `cls`, as a config file in `folder` gives them, with every path setting
    (`path_setting`, in nested settings too) made absolute against `folder`. Anything else,
    unknown keys included, stays for `from_dict` to build or refuse."""
    hints = typing.get_type_hints(cls)
    resolved = dict(values)
    for field in dataclasses.fields(cls):
        value = values.get(field.name)
        if isinstance(value, str) and RESOLVER in field.metadata:
            resolved[field.name] = field.metadata[RESOLVER](value, folder)
        elif isinstance(value, dict) and dataclasses.is_dataclass(hints[field.name]):
            resolved[field.name] = resolve_paths(hints[field.name], value, folder)
    return resolved


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
