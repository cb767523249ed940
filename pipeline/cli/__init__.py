"""The command-line entry points, apart from the science they call (imports flow one way: these
modules import `pipeline`, no module of `pipeline` imports these). One module per command:

    python -m pipeline.cli.synthetic    python -m pipeline.cli.partitions
    python -m pipeline.cli.train        python -m pipeline.cli.selection
    python -m pipeline.cli.infer        python -m pipeline.cli.metrics
    python -m pipeline.cli.export       python -m pipeline.cli.viewer
    python -m pipeline.cli.pretrained

This package holds what they share. Expected failures end in one line, not a traceback:

    @one_line_errors
    def main(argv=None) -> int: ...

A pipeline error (bad input, bad setting) exits 2, an operating-system error (disk full, no
permission, file gone) exits 1, Ctrl-C exits 130; each prints `error: ...` on stderr.

A stage's config dataclass becomes flags with `add_arguments` and comes back with
`from_arguments` (one `--flag` per field, so the dataclass stays the one source of its settings).
"""

import argparse
import dataclasses
import functools
import sys
import typing
from collections.abc import Callable, Sequence
from typing import TypeVar

from pipeline.core import config_io
from pipeline.core.errors import FFNError, first_line

T = TypeVar("T")
Main = Callable[[Sequence[str] | None], int]


def describe_os_error(exc: OSError) -> str:
    """`path: reason` where the error names a file, else the library's first line."""
    if exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return first_line(exc)


def one_line_errors(main: Main) -> Main:
    @functools.wraps(main)
    def wrapper(argv: Sequence[str] | None = None) -> int:
        try:
            return main(argv)
        except FFNError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"error: {describe_os_error(exc)}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("error: interrupted", file=sys.stderr)
            return 130

    return wrapper


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
    return config_io.from_dict(
        cls, _given_values(cls, args, config_io.to_dict(base) if base is not None else {}, prefix)
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
