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
A flag's help is its default, then the field's own `# comment` in the class's source (the lines
right above the field and the one at the end of its line, `field_help`), then its choices where
the field is a `Literal[...]` or the class checks it against a tuple of names (`field_choices`).
Parsers show it with `HelpFormatter`, which keeps those lines apart.
"""

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
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


class HelpFormatter(argparse.HelpFormatter):
    """argparse's layout, but each line of a help text wrapped on its own: a config flag's help
    shows its default on the first line (`default: X`, beside or under the flag), then what the
    setting does, then its choices."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        split = super()._split_lines  # (a comprehension has no zero-argument super())
        return [row for line in text.splitlines() for row in split(line, width)]


# Comments that talk to tools, not to readers.
_PRAGMA = re.compile(r"(noqa\b|type: ?ignore|fmt: ?(skip|off|on)|pragma:|pylint:|ruff:)")


@functools.cache
def _field_comments(cls: type) -> dict[str, str]:
    """Each field of `cls` (the class itself, not its bases) with the comment its source gives it:
    the comment lines right above the field, then those at the end of its line(s). A comment that
    starts with "..." goes on from an earlier field's, which is put in front of it."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (a class made at runtime, a frozen executable)
        return {}
    lines = source.splitlines()
    comments: dict[int, tuple[str, bool]] = {}  # line number: (text, alone on its line)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, column = token.start
            text = token.string.lstrip("#").strip()
            if text and not _PRAGMA.match(text):
                comments[row] = (text, not lines[row - 1][:column].strip())
    (classdef,) = [node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)]
    own: dict[str, str] = {}
    for node in classdef.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, row = [], node.lineno - 1
        while row in comments and comments[row][1]:
            above.insert(0, comments[row][0])
            row -= 1
        end = node.end_lineno or node.lineno
        inline = [comments[r][0] for r in range(node.lineno, end + 1) if r in comments]
        own[node.target.id] = " ".join(above + inline)
    found: dict[str, str] = {}
    names = list(own)
    for index, name in enumerate(names):
        text = own[name]
        if text.startswith("..."):
            earlier = names[:index][::-1]
            context = next(
                (
                    own[e]
                    for e in earlier
                    if own[e].endswith("...") or e.split("_")[0] == name.split("_")[0]
                ),
                "",
            )
            if context:
                text = context.removesuffix("...").rstrip() + " " + text
        found[name] = text
    return found


def field_help(cls: type, name: str) -> str:
    """What the source says of field `name` of dataclass `cls` (its `# comment`), "" if nothing;
    a field a base class declares takes that class's comment."""
    for klass in cls.__mro__:
        if name in klass.__dict__.get("__annotations__", {}):
            return _field_comments(klass).get(name, "")
    return ""


@functools.cache
def _checked_against(cls: type) -> dict[str, tuple]:
    """Fields that `cls` checks with `self.field (not) in NAME`, NAME a module-level tuple (or
    list, set) of strings or numbers: field -> those values."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    namespace = vars(sys.modules[cls.__module__])
    found = {}
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Compare)
            and len(node.ops) == 1
            and isinstance(node.ops[0], ast.In | ast.NotIn)
            and isinstance(node.left, ast.Attribute)
            and isinstance(node.left.value, ast.Name)
            and node.left.value.id == "self"
            and isinstance(node.comparators[0], ast.Name)
        ):
            continue
        values = namespace.get(node.comparators[0].id)
        if isinstance(values, tuple | list | set | frozenset) and values:
            if all(isinstance(v, str | int | float) for v in values):
                ordered = values if isinstance(values, tuple | list) else sorted(values)
                found[node.left.attr] = tuple(ordered)
    return found


def field_choices(cls: type, name: str) -> tuple | None:
    """The values field `name` of `cls` may take: its `Literal[...]` type's (also inside a tuple
    or an Optional), else the tuple `cls` checks it against; None when any value of its type may
    do."""
    base = _scalar_type(typing.get_type_hints(cls)[name])
    if typing.get_origin(base) is typing.Literal:
        return typing.get_args(base)
    for klass in cls.__mro__:
        if dataclasses.is_dataclass(klass) and name in _checked_against(klass):
            return _checked_against(klass)[name]
    return None


def _optional_of(annotation: typing.Any) -> typing.Any:
    """`X` for `X | None` (and Optional[X]), else the annotation as it is."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        others = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(others) == 1:
            return others[0]
    return annotation


def _scalar_type(annotation: typing.Any) -> typing.Any:
    """The type of one value a flag takes: a tuple's item type, an Optional's inner type."""
    annotation = _optional_of(annotation)
    if typing.get_origin(annotation) is tuple:
        return _optional_of(typing.get_args(annotation)[0])
    return annotation


def _default(field: dataclasses.Field) -> typing.Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return "required"


def add_arguments(parser: argparse.ArgumentParser, cls: type, prefix: str = "") -> None:
    """One `--flag` per field of `cls`, nested configs as `--model-depth` etc.; tuples take their
    values one after the other. Every default is None so `from_arguments` can tell a given flag
    from an absent one. Each flag's help: its default, the field's comment, its choices (a
    `Literal` field's, which argparse checks; or those the class checks it against, left to the
    class, whose one-line error names the setting as a config file's would)."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]):
            add_arguments(parser, hints[field.name], f"{prefix}{field.name}_")
            continue
        annotation = _optional_of(hints[field.name])
        flag = "--" + (prefix + field.name).replace("_", "-")
        choices = field_choices(cls, field.name)
        help_lines = [f"default: {_default(field)}", field_help(cls, field.name)]
        if choices:
            help_lines.append("choices: " + ", ".join(str(c) for c in choices))
        help_text = "\n".join(line for line in help_lines if line).replace("%", "%%")
        base = _scalar_type(annotation)
        if base is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
            continue
        literal = typing.get_origin(base) is typing.Literal
        if literal:
            base = type(choices[0])
        options: dict[str, typing.Any] = {
            "type": base if base in (int, float, str) else str,
            "choices": choices if literal else None,
            "help": help_text,
        }
        if choices and not literal and typing.get_origin(annotation) is not tuple:
            options["metavar"] = "{" + ",".join(map(str, choices)) + "}"
        if typing.get_origin(annotation) is tuple:
            items = typing.get_args(annotation)
            variadic = len(items) == 2 and items[1] is Ellipsis
            options["nargs"] = "+" if variadic else len(items)
            if not variadic and not choices and field.name.endswith("_zyx") and len(items) == 3:
                options["metavar"] = ("Z", "Y", "X")
        parser.add_argument(flag, **options)


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
