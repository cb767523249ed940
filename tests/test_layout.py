"""Imports flow one way: workflow -> apps -> pipeline, and the command-line entry points
(pipeline/cli/) sit apart from the science they call (pipeline/*.py): the science imports no
command-line code and has no entry point of its own. No module of pipeline/ reaches itself through
the modules it imports (function-level imports included)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def modules_in(folder: Path) -> dict[str, Path]:
    """Module name -> file for the .py files directly in `folder` (a package's __init__.py under
    the package's own name)."""
    package = ".".join(folder.relative_to(ROOT).parts)
    return {
        package if path.stem == "__init__" else f"{package}.{path.stem}": path
        for path in sorted(folder.glob("*.py"))
    }


SCIENCE = modules_in(ROOT / "pipeline")
COMMANDS = modules_in(ROOT / "pipeline" / "cli")


def test_the_command_line_has_its_own_package():
    assert "pipeline.cli" in COMMANDS  # the shared helpers
    assert "pipeline.cli.train" in COMMANDS and "pipeline.cli.infer" in COMMANDS
    assert "pipeline.train" in SCIENCE and "pipeline.cli" not in SCIENCE


@pytest.mark.parametrize("name", sorted(SCIENCE | COMMANDS))
def test_no_module_of_pipeline_imports_parsl_apps_or_the_workflow(name):
    outside = {
        m
        for m in imported_modules((SCIENCE | COMMANDS)[name])
        if m.split(".")[0] in ("parsl", "apps", "workflow")
    }
    assert not outside, f"{name} imports {sorted(outside)}"


@pytest.mark.parametrize("name", sorted(SCIENCE))
def test_the_science_imports_no_command_line_code(name):
    command_line = {
        m
        for m in imported_modules(SCIENCE[name])
        if m == "argparse" or m == "pipeline.cli" or m.startswith("pipeline.cli.")
    }
    assert not command_line, f"{name} imports {sorted(command_line)}: move it to pipeline/cli/"


def entry_point(path: Path) -> tuple[set[str], bool]:
    """The module's top-level functions, and whether it has an `if __name__ == "__main__"` block."""
    tree = ast.parse(path.read_text())
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    runs = any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)
    return functions, runs


@pytest.mark.parametrize("name", sorted(SCIENCE))
def test_the_science_has_no_entry_point(name):
    functions, runs = entry_point(SCIENCE[name])
    assert not {"main", "_parser"} & functions, f"{name} has a command line: pipeline/cli/"
    assert not runs, f"{name} has an `if __name__ == '__main__'` block"


@pytest.mark.parametrize("name", sorted(set(COMMANDS) - {"pipeline.cli"}))
def test_every_command_runs_as_a_module_under_its_own_name(name):
    functions, runs = entry_point(COMMANDS[name])
    assert {"main", "_parser"} <= functions and runs, name
    assert f'prog="python -m {name}"' in COMMANDS[name].read_text(), name


def test_no_module_of_pipeline_imports_itself_through_others():
    modules = SCIENCE | COMMANDS
    graph = {
        name: {m for m in imported_modules(path) if m in modules} - {name}
        for name, path in modules.items()
    }

    def reachable(start: str) -> set[str]:
        seen, stack = set(), [start]
        while stack:
            for nxt in graph[stack.pop()] - seen:
                seen.add(nxt)
                stack.append(nxt)
        return seen

    circles = sorted(name for name in graph if name in reachable(name))
    assert not circles, f"import circles through {circles}"


@pytest.mark.parametrize("package", ["apps", "site_configs"])
def test_apps_and_sites_do_not_import_the_workflow(package):
    for path in sorted((ROOT / package).glob("*.py")):
        assert "workflow" not in imported_modules(path), path.name
