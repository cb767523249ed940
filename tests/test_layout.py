"""Imports flow one way: workflow -> apps -> pipeline, and no module of pipeline/ reaches itself
through the modules it imports (function-level imports included)."""

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


def test_the_science_imports_no_parsl_no_apps_and_no_workflow():
    for path in sorted((ROOT / "pipeline").glob("*.py")):
        outside = {
            m for m in imported_modules(path) if m.split(".")[0] in ("parsl", "apps", "workflow")
        }
        assert not outside, f"{path.name} imports {sorted(outside)}"


def test_no_module_of_the_science_imports_itself_through_others():
    modules = {f"pipeline.{p.stem}": p for p in (ROOT / "pipeline").glob("*.py")}
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
