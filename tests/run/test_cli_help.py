"""Every command's --help says what each option does: a config flag's help is its default, then the
field's own comment in its config class (nested configs' fields their own class's), then its
choices where the field has a fixed set (a Literal's refused by argparse, a checked tuple's by the class)."""

import argparse
import dataclasses
import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys
import typing
from pathlib import Path
from typing import Literal

import pytest

import pipeline.cli
from pipeline.cli import HelpFormatter, add_arguments, field_help, from_arguments
from pipeline.core.errors import ConfigError
from pipeline.inference.blocks import BlockConfig
from pipeline.inference.flood_fill import InferenceConfig
from pipeline.network.model import ModelConfig
from pipeline.selection.checkpoints import SelectionConfig
from pipeline.training.examples import ExampleConfig
from pipeline.training.train_config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = sorted(m.name for m in pkgutil.iter_modules(pipeline.cli.__path__))


def squeezed(text: str) -> str:
    """`text` without whitespace: argparse wraps lines (and breaks words at hyphens)."""
    return "".join(text.split())


def written_comment(cls: type, name: str) -> str:
    """The comment the source of `cls` writes for field `name`, read from its text: the comment
    lines right above the field's line, then the comments on the field's own line(s)."""
    lines = inspect.getsource(cls).splitlines()
    (start,) = [i for i, line in enumerate(lines) if re.match(rf"\s+{name}:", line)]
    above, row = [], start - 1
    while lines[row].strip().startswith("#"):
        above.insert(0, lines[row].strip().lstrip("#").strip())
        row -= 1
    end = start
    if lines[start].rstrip().endswith("("):  # `name: type = (` ... `)`
        end = next(i for i in range(start, len(lines)) if lines[i].strip() == ")")
    inline = [line.split("#", 1)[1].strip() for line in lines[start : end + 1] if "#" in line]
    return " ".join(above + inline)


def flag_help(help_text: str, flag: str) -> str:
    """The help of `flag` in a command's --help: from its line to the next option's."""
    match = re.search(rf"^  {flag}\b.*?(?=^  -|\Z)", help_text, re.MULTILINE | re.DOTALL)
    assert match, f"{flag} not in the help"
    return match.group(0)


@pytest.fixture(scope="module")
def train_help() -> str:
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli.train", "--help"],
        cwd=ROOT,
        env=os.environ | {"COLUMNS": "100"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize(
    ("flag", "cls", "name"),
    [
        ("--learning-rate", TrainConfig, "learning_rate"),  # a comment inside `= (...)`
        ("--virtual-ranks", TrainConfig, "virtual_ranks"),  # comment lines above the field
        ("--horovod-cycle-time-ms", TrainConfig, "horovod_cycle_time_ms"),
        ("--model-depth", ModelConfig, "depth"),  # a nested config's field: its own class's
        ("--model-precision", ModelConfig, "precision"),
        ("--examples-augment", ExampleConfig, "augment"),  # a --flag/--no-flag
        ("--examples-fov-moves", ExampleConfig, "fov_moves"),
    ],
)
def test_train_help_gives_each_setting_its_fields_comment(train_help, flag, cls, name):
    comment = written_comment(cls, name)
    assert len(comment.split()) >= 3, f"{cls.__name__}.{name} has no comment to show"
    shown = flag_help(train_help, flag)
    assert squeezed(comment) in squeezed(shown), shown
    default = getattr(cls(), name)
    # The default comes first, on the flag's line or right under it.
    assert re.match(rf"  {flag}[^\n]*?\s+default: {re.escape(str(default))}\n", shown), shown


def test_learning_rate_help_reads_as_the_comment_says(train_help):
    shown = " ".join(flag_help(train_help, "--learning-rate").split())
    assert "default: 0.001" in shown
    assert "base rate for one worker; lr_policy scales it with the world size" in shown


def test_a_field_checked_against_a_tuple_lists_its_choices_and_its_class_refuses_others(
    train_help,
):
    optimizer = flag_help(train_help, "--optimizer")
    assert "choices: adam, sgd_momentum" in " ".join(optimizer.split())
    assert "--optimizer {adam,sgd_momentum}" in optimizer
    assert "choices: float32, mixed_bfloat16" in flag_help(train_help, "--model-precision")
    from pipeline.cli import train

    required = ["--raw", "r.h5:raw", "--labels", "l.h5:l", "--coordinates", "c.npz"]
    parser = train._parser()
    args = parser.parse_args([*required, "--train-dir", "t", "--optimizer", "sgd_momentum"])
    assert from_arguments(TrainConfig, args).optimizer == "sgd_momentum"
    # The class refuses it, with the one line a config file's wrong value gets.
    wrong = parser.parse_args([*required, "--train-dir", "t", "--optimizer", "rmsprop"])
    with pytest.raises(ConfigError, match="optimizer must be one of"):
        from_arguments(TrainConfig, wrong)


def test_every_command_module_has_a_parser():
    assert {"train", "infer", "selection", "export", "partitions", "synthetic"} <= set(COMMANDS)
    for name in COMMANDS:
        assert hasattr(importlib.import_module(f"pipeline.cli.{name}"), "_parser"), name


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_of_every_command_says_what_it_does(command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    parser = importlib.import_module(f"pipeline.cli.{command}")._parser()
    help_text = parser.format_help()  # '%' in a help text would fail here
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[0] if action.option_strings else action.dest
        assert action.help, f"{command} {name}: no help"
        said = [line for line in action.help.splitlines() if not line.startswith("default:")]
        words = re.findall(r"[A-Za-z]{2,}", " ".join(said))
        assert len(words) >= 2, f"{command} {name}: help says no more than its default"
        if action.option_strings:
            assert re.search(rf"^  {re.escape(name)}\b", help_text, re.MULTILINE)


def uncommented(cls: type) -> list[str]:
    """Fields of `cls` and of the configs nested in it that have no comment."""
    hints = typing.get_type_hints(cls)
    missing = []
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]):
            missing += uncommented(hints[field.name])
        elif not field_help(cls, field.name):
            missing.append(f"{cls.__name__}.{field.name}")
    return missing


@pytest.mark.parametrize("cls", [TrainConfig, InferenceConfig, BlockConfig, SelectionConfig])
def test_every_field_of_a_commands_config_has_a_comment(cls):
    assert not uncommented(cls)


def test_a_comment_that_goes_on_from_an_earlier_fields_keeps_that_one_in_front():
    start = field_help(SelectionConfig, "start_as_candidate")
    assert start.startswith(field_help(SelectionConfig, "last_checkpoints").removesuffix("..."))
    assert "fine-tune's starting weights" in start


@dataclasses.dataclass(frozen=True)
class Toy:
    """A config with the kinds of fields a stage's may have."""

    # How the toy is cut:
    # round or square.
    shape: Literal["round", "square"] = "round"
    level: Literal[1, 2, 3] = 2  # how far up, 100% at 3
    sizes_zyx: tuple[int, int, int] = (1, 2, 3)  # one per axis
    weights: tuple[float, ...] = (0.5,)
    margin_zyx: tuple[int, int, int] | None = None
    plain: int = 7


def _toy_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="toy", formatter_class=HelpFormatter)
    add_arguments(parser, Toy)
    return parser


def test_a_literal_field_lists_its_choices_and_refuses_any_other(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    help_text = _toy_parser().format_help()
    shape = flag_help(help_text, "--shape")
    assert "--shape {round,square}" in shape
    assert shape.split("\n")[1:4] == [
        " " * 24 + "default: round",
        " " * 24 + "How the toy is cut: round or square.",
        " " * 24 + "choices: round, square",
    ]
    level = " ".join(flag_help(help_text, "--level").split())
    assert "how far up, 100% at 3" in level and "choices: 1, 2, 3" in level
    assert "--sizes-zyx Z Y X" in help_text and "one per axis" in help_text

    args = _toy_parser().parse_args(
        ["--shape", "square", "--level", "3", "--sizes-zyx", "4", "5", "6", "--margin-zyx", "1", "1", "1"]
    )  # fmt: skip
    toy = from_arguments(Toy, args)
    assert toy == Toy(shape="square", level=3, sizes_zyx=(4, 5, 6), margin_zyx=(1, 1, 1))
    assert from_arguments(Toy, _toy_parser().parse_args(["--weights", "1", "2"])).weights == (1, 2)
    for wrong in (["--shape", "oval"], ["--level", "4"], ["--sizes-zyx", "1", "2"]):
        with pytest.raises(SystemExit) as refused:
            _toy_parser().parse_args(wrong)
        assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'oval' (choose from 'round', 'square')" in err


def test_a_field_without_a_comment_shows_only_its_default():
    assert field_help(Toy, "plain") == ""
    (plain,) = [a for a in _toy_parser()._actions if a.dest == "plain"]
    assert plain.help == "default: 7"
