"""A DAG step: a task (its name, stage, settings, input and output files), its contract (those
files by name, apps/contracts.py) and the Parsl app that runs it; the plan of which steps run
(the stamps), and their submission to Parsl, each started when the steps that make its inputs
have made them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from apps.contracts import Contract
from pipeline.core.errors import FFNError
from pipeline.core.stamps import Task, plan

STAGES = (
    "stage", "preprocess", "train", "select", "infer", "stitch", "consensus", "agglomerate",
    "evaluate", "export", "study",
)  # fmt: skip


# Which stages' outputs a stage reads: --stages checks that those it leaves out left them.
_STAGE_INPUTS = {
    "preprocess": ["stage"],
    "train": ["stage", "preprocess"],
    "select": ["stage", "train"],
    "infer": ["stage", "select"],
    "stitch": ["stage", "infer"],
    "consensus": ["stage", "stitch"],
    "agglomerate": ["stage", "stitch"],
    "evaluate": ["stage", "stitch"],
    "export": ["stage", "stitch"],
    "study": ["train"],
}


def check_stage_inputs(stages: frozenset[str], steps: list[Step]) -> None:
    """Every stage left out by --stages whose outputs a selected stage reads must have left
    them: every output of its tasks in this run's plan."""
    for stage in [s for s in STAGES if s in stages]:
        for needed in [n for n in _STAGE_INPUTS.get(stage, []) if n not in stages]:
            outputs = (o for step in steps if step.task.stage == needed for o in step.task.outputs)
            if (missing := next((o for o in outputs if not o.exists()), None)) is not None:
                raise FFNError(
                    f"--stages leaves out {needed!r}, but {stage!r} needs its output {missing}; run it too"
                )


@dataclass(frozen=True)
class Step:
    """A task of the DAG (pipeline.core.stamps.Task) and how to submit it: its app, the contract
    the app reads its inputs and outputs from, and the app's other arguments."""

    task: Task
    app: object  # the Parsl app that runs it: apps.stage.stage_volume
    contract: Contract  # the task's inputs and outputs by name: apps.contracts.StageVolume
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    @property
    def app_name(self) -> str:
        """The app as `module.function` under apps/ ("stage.stage_volume"): for reports, counts."""
        return f"{self.app.func.__module__.removeprefix('apps.')}.{self.app.__name__}"


def task_step(
    name: str,
    settings: dict,
    contract: Contract,
    app: object,
    *args,
    **kwargs,
) -> Step:
    """The step of task `name` (its stage: the name up to "["), run by `app`; its inputs and
    outputs are `contract`'s, in the order of its fields, and the parts of its inputs it reads
    are too (`Contract.parts`, which its app tells `stamps.run_once`)."""
    stage = name.partition("[")[0]
    regions = contract.parts(settings)
    task = Task(name, stage, settings, contract.inputs(), contract.outputs(), regions)
    return Step(task, app, contract, args, kwargs)


def plan_run(
    steps: list[Step], stages: frozenset[str] = frozenset(STAGES)
) -> dict[str, str | None]:
    """{task: why it runs, or None when it is up to date or left out by --stages}."""
    return plan([s.task for s in steps], runnable=lambda t: t.stage in stages)


def describe_plan(
    steps: list[Step], reasons: dict[str, str | None], stages: frozenset[str] = frozenset(STAGES)
) -> list[str]:
    """Per stage: how many tasks are up to date, and why the others run; a stage --stages leaves
    out says so, with how many of its tasks are up to date all the same."""
    left_out = {s.task.stage for s in steps} - stages
    whole = plan_run(steps) if left_out else reasons  # what a run of every stage would do
    lines = []
    for stage in dict.fromkeys(s.task.stage for s in steps):
        names = [s.task.name for s in steps if s.task.stage == stage]
        if stage in left_out:
            kept = sum(whole[n] is None for n in names)
            lines.append(f"  {stage:<10} left out by --stages; {kept}/{len(names)} up to date")
            continue
        kept = sum(reasons[n] is None for n in names)
        why: dict[str, list[str]] = {}
        for name in names:
            if reasons[name] is not None:
                why.setdefault(reasons[name], []).append(name)
        runs = "; ".join(
            (f"{', '.join(n)}: " if len(names) > 1 else "") + reason for reason, n in why.items()
        )
        lines.append(
            f"  {stage:<10} {kept}/{len(names)} up to date" + (f"; runs: {runs}" if runs else "")
        )
    return lines


def stale_left_out(steps: list[Step], stages: frozenset[str]) -> list[str]:
    """Stages --stages left out that are not up to date now: a report would mix two runs."""
    whole = plan_run(steps)
    stale = [s.task.stage for s in steps if s.task.stage not in stages and whole[s.task.name]]
    return list(dict.fromkeys(stale))


def executor_labels(steps: list[Step], reasons: dict[str, str | None]) -> set[str]:
    """The executors ("cpu", "mpi") of the tasks that run."""
    return {label for s in steps if reasons[s.task.name] is not None for label in s.app.executors}


def build_dag(steps: list[Step], reasons: dict[str, str | None]) -> dict[str, object]:
    """Submit the tasks that must run; returns {task name: future}. Parsl starts each when its
    inputs are ready: a rebuilt input as the future of the task that rebuilds it. The app reads
    its paths by name from its contract (`io`); `inputs` and `outputs` are for Parsl."""
    from parsl.data_provider.files import File

    futures: dict[str, object] = {}
    made_by: dict[Path, tuple[object, int]] = {}
    for step in steps:
        task = step.task
        if reasons[task.name] is None:
            continue
        inputs = [
            made_by[p][0].outputs[made_by[p][1]] if p in made_by else File(str(p))
            for p in task.inputs
        ]
        future = step.app(task.settings, *step.args, io=step.contract, inputs=inputs,
                          outputs=[File(str(p)) for p in task.outputs], **step.kwargs)  # fmt: skip
        futures[task.name] = future
        made_by |= {p: (future, i) for i, p in enumerate(task.outputs)}
    return futures
