"""Imports flow one way: workflow -> apps -> pipeline; inside pipeline/, each stage's group imports
only from itself and the groups before it (the order `pipeline.GROUPS`, written down in the
package's docstring), and no module reaches itself through the modules it imports (function-level
imports included). The command-line entry points (pipeline/cli/) sit apart from the science they
call: the science imports no command-line code and has no entry point of its own."""

import ast
from pathlib import Path

import pytest

import pipeline

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted((ROOT / "pipeline").rglob("*.py"))}
COMMANDS = {name: p for name, p in MODULES.items() if name.startswith("pipeline.cli")}
SCIENCE = {name: p for name, p in MODULES.items() if name not in COMMANDS and name != "pipeline"}


def group_of(module: str) -> str:
    return module.split(".")[1]


def test_every_module_is_in_a_group_and_every_group_is_written_down():
    folders = {p.name for p in (ROOT / "pipeline").iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(pipeline.GROUPS)
    loose = sorted(p.name for p in (ROOT / "pipeline").glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules outside a group: {loose}"
    for group in pipeline.GROUPS:
        assert f"\n    {group} " in pipeline.__doc__, (
            f"{group} not described in pipeline's docstring"
        )


def test_module_names_do_not_collide_across_groups():
    leaves = [name.rsplit(".", 1)[1] for name in MODULES if name.count(".") == 2]
    twice = sorted({leaf for leaf in leaves if leaves.count(leaf) > 1} - set(COMMAND_LEAVES))
    assert not twice, f"module names used in two groups: {twice}"


# A command is named after what it runs; its name may be a module's of the science.
COMMAND_LEAVES = {name.rsplit(".", 1)[1] for name in COMMANDS if name != "pipeline.cli"}


@pytest.mark.parametrize("name", sorted(SCIENCE))
def test_a_group_imports_only_itself_and_the_groups_before_it(name):
    order = pipeline.GROUPS.index(group_of(name))
    later = {
        m
        for m in imported_modules(SCIENCE[name])
        if m.startswith("pipeline.")
        and m.split(".")[1] in pipeline.GROUPS
        and pipeline.GROUPS.index(m.split(".")[1]) > order
    }
    assert not later, f"{name} ({group_of(name)}) imports from later groups: {sorted(later)}"


def test_the_command_line_has_its_own_package():
    assert "pipeline.cli" in COMMANDS  # the shared helpers
    assert "pipeline.cli.train" in COMMANDS and "pipeline.cli.infer" in COMMANDS
    assert "pipeline.training.trainer" in SCIENCE


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_of_pipeline_imports_parsl_apps_or_the_workflow(name):
    outside = {
        m
        for m in imported_modules(MODULES[name])
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
    graph = {
        name: {m for m in imported_modules(path) if m in MODULES} - {name}
        for name, path in MODULES.items()
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
    for path in sorted((ROOT / package).rglob("*.py")):
        assert "workflow" not in imported_modules(path), path.name
