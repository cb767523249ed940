"""Frozen dataclass configs: build them from dicts/TOML, save them resolved as JSON.

Each stage owns one dataclass (its fields are the single source of truth for its settings);
this module only converts between those dataclasses and the outside world. Command-line flags
for a dataclass: `pipeline.cli.add_arguments` / `from_arguments`.
"""

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
