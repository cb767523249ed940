"""A stage's contract (apps/contracts.py): its named inputs and outputs, which the planner builds
and the app reads by name. Flattened in the order of the fields they are the task's inputs and
outputs, whose order a task's stamp digests: the plan of a run is as it was before contracts."""

import ast
import dataclasses
import importlib
import inspect
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from parsl.app.python import PythonApp

import apps.contracts as contracts
from apps.contracts import Contract, FinishAgglomeration, input_field, output_field
from apps.plan.dag import dag_steps
from apps.plan.resolved import resolve_plan
from apps.plan.step import Step, build_dag, task_step
from apps.plan.study import study_steps
from pipeline.run.run_config import demo_config, load_run_config
from pipeline.run.run_layout import RunPaths
from site_configs import local

ROOT = Path(__file__).resolve().parents[2]
STAGE_MODULES = (
    "agglomerate", "consensus", "evaluate", "export", "infer", "preprocess", "select", "stage",
    "stitch", "study", "train",
)  # fmt: skip
CONTRACTS = [
    c for c in vars(contracts).values()
    if isinstance(c, type) and issubclass(c, Contract) and c is not Contract
]  # fmt: skip


def stage_apps() -> dict[str, PythonApp]:
    found = {}
    for name in STAGE_MODULES:
        module = importlib.import_module(f"apps.{name}")
        found |= {
            f"{name}.{k}": v
            for k, v in vars(module).items()
            if isinstance(v, PythonApp) and v.func.__module__ == module.__name__
        }
    return found


def contract_of(app: PythonApp) -> type:
    return inspect.signature(app.func).parameters["io"].annotation


def test_every_app_reads_a_contract_of_its_own():
    apps = stage_apps()
    taken = {name: contract_of(app) for name, app in apps.items()}
    assert all(c in CONTRACTS for c in taken.values()), taken
    assert sorted(c.__name__ for c in taken.values()) == sorted(c.__name__ for c in CONTRACTS)
    for name, app in apps.items():
        parameters = inspect.signature(app.func).parameters
        assert parameters["inputs"].default == () and parameters["outputs"].default == (), name


def test_every_contract_says_what_its_stage_reads_and_writes():
    for c in CONTRACTS:
        assert "reads" in c.__doc__ and "writes" in c.__doc__, c.__name__
        kinds = [f.metadata["io"] for f in dataclasses.fields(c)]
        assert "output" in kinds, c.__name__
        # Inputs first, then outputs: the fields read as the task's lists do.
        assert kinds == sorted(kinds), c.__name__


def test_inputs_and_outputs_flatten_the_fields_in_their_order():
    io = FinishAgglomeration(
        volume="v", merges="m", stitched="s", boundary=("f", "v"), sizes=(),
        records=("r0", "r1"), decisions=("d0",), summary="a.json", full_resolution="l",
    )  # fmt: skip
    assert io.inputs() == tuple(map(Path, ["v", "m", "s", "f", "v", "r0", "r1", "d0"]))
    assert io.outputs() == (Path("a.json"), Path("l"))
    assert io.records == (Path("r0"), Path("r1")) and io.volume == Path("v")


def test_a_contract_is_built_by_name_and_refuses_a_path_for_a_tuple():
    with pytest.raises(TypeError):
        contracts.PairBlock(("a",), "b")  # positional: refused
    with pytest.raises(TypeError, match="tuple of paths"):
        contracts.PairBlock(results="a.npz", pairs="b.npz")


def test_a_field_must_be_declared_an_input_or_an_output():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Loose(Contract):
        read: Path = input_field()
        other: Path = dataclasses.field(default=Path("x"))
        written: Path = output_field()

    with pytest.raises(TypeError, match="input_field or output_field"):
        Loose(read="a", written="b")


def plans(tmp_path: Path):
    demo = demo_config()
    second = replace(demo.agglomeration, enabled=True, consensus=True)
    paths = RunPaths(tmp_path / "run")
    yield dag_steps(resolve_plan(demo, paths, local.SITE))
    unsharded = replace(demo.export, sharded=False)
    both = replace(demo, agglomeration=second, export=unsharded)
    yield dag_steps(resolve_plan(both, paths, local.SITE))
    study = load_run_config(ROOT / "configs" / "study.toml")
    yield study_steps(resolve_plan(study, paths, local.SITE))


def test_every_step_gives_its_app_the_contract_it_reads(tmp_path):
    seen = set()
    for steps in plans(tmp_path):
        for step in steps:
            assert isinstance(step.contract, contract_of(step.app)), step.task.name
            assert step.task.inputs == step.contract.inputs(), step.task.name
            assert step.task.outputs == step.contract.outputs(), step.task.name
            seen.add(step.app_name)
    # Every app of a run, with the second pass and a study (not the stand-ins of benchmarks or
    # another run's forest).
    assert {*seen, "infer.ground_truth_block", "evaluate.given_boundary_forest"} == set(
        stage_apps()
    )


def test_the_plan_and_the_app_key_a_task_on_the_parts_its_contract_names(tmp_path):
    keyed = {c for c in CONTRACTS if "parts" in vars(c)}
    assert {c.__name__ for c in keyed} >= {
        "InferBlock",
        "RelabelPart",
        "ExportRegion",
        "CountRegion",
    }
    for steps in plans(tmp_path):
        for step in steps:
            assert step.task.regions == step.contract.parts(step.task.settings), step.task.name
            assert len(step.task.regions) <= len(step.task.inputs), step.task.name
    for name, app in stage_apps().items():
        if contract_of(app) in keyed:  # the app stamps with the parts the plan decided on
            assert "io.parts(settings)" in inspect.getsource(app.func), name


def test_build_dag_hands_each_app_its_contract_and_parsl_the_futures(tmp_path):
    calls = []

    def app(settings, *args, **kwargs):
        calls.append((settings, args, kwargs))
        return SimpleNamespace(outputs=[("future", f.filepath) for f in kwargs["outputs"]])

    made = contracts.JoinPairs(contacts=(tmp_path / "a.npz",), pairs=tmp_path / "pairs.npz")
    used = contracts.MergePairs(
        volume=tmp_path / "v.h5", decisions=(made.pairs,), merges=tmp_path / "m.npz"
    )
    steps = [task_step("agglomerate[join]", {"k": 1}, made, app),
             task_step("agglomerate[merge]", {"k": 2}, used, app, "folder")]  # fmt: skip
    assert isinstance(steps[0], Step) and steps[1].contract is used
    build_dag(steps, {"agglomerate[join]": "never run", "agglomerate[merge]": "never run"})
    (_, args0, first), (_, args1, second) = calls
    assert first["io"] is made and second["io"] is used and args1 == ("folder",) and not args0
    assert second["inputs"][0].filepath == str(used.volume)
    assert second["inputs"][1] == ("future", str(made.pairs))  # the join's, waited on
    assert [f.filepath for f in second["outputs"]] == [str(used.merges)]


def imported(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


@pytest.mark.parametrize("name", STAGE_MODULES)
def test_no_app_imports_another(name):
    others = {m for m in imported(ROOT / "apps" / f"{name}.py") if m.startswith("apps")}
    assert others <= {"apps.contracts"}, f"apps/{name}.py imports {sorted(others)}"
