"""A run from its resolved settings: the dry run's description, or the checks, the records, the
plan, its execution through Parsl and the report."""

from __future__ import annotations

import sys
from pathlib import Path

from apps.execute import _say, execute
from apps.plan.dag import steps_of
from apps.plan.describe import describe_dag, describe_training
from apps.plan.resolved import RunPlan
from apps.plan.step import STAGES, Step, check_stage_inputs, describe_plan, plan_run, stale_left_out
from apps.plan.study import describe_study
from apps.run_setup import ResolvedRun, _check_given_forest, describe_code, save_site_record
from pipeline.core import config_io
from pipeline.core.errors import ConfigError
from pipeline.run.code_copy import copy_name, last_copy


def dry_run(command: str, resolved: ResolvedRun, plan: RunPlan, environment, stages) -> int:
    """Print the DAG, the site and, for a run dir that exists, what is up to date; run nothing."""
    from site_configs.dry_run import describe_block_scripts
    from site_configs.environment import check_environment, describe_environment

    print((describe_study if command == "study" else describe_dag)(plan))
    print(f"  {resolved.origin}")
    if retired := getattr(resolved.site, "RETIRED", None):  # a site whose machine is gone
        print(f"  {retired}")
    print(f"  {describe_environment(environment)}")
    try:
        if warning := check_environment(resolved.spec, environment):
            print(f"  {warning}")
    except ConfigError as refusal:  # the dry run shows what the run would refuse
        print(f"  a run would be refused: {refusal}")
    # Each pool's batch script and submit command, as the site's own providers would make them.
    print(describe_block_scripts(resolved.site, resolved.spec, resolved.paths.root))
    if plan.paths.root.is_dir():
        steps = steps_of(plan)
        print(
            f"tasks in {plan.paths.root}:",
            *describe_plan(steps, plan_run(steps, stages), stages),
            sep="\n",
        )
    return 0


def refused_start(resolved: ResolvedRun, resume: bool) -> str | None:
    """Why the run may not start here (an earlier run without --resume), before anything is
    written; a given forest that is missing or the run's own copy raises."""
    config, paths = resolved.config, resolved.paths
    if paths.runinfo.exists() and not resume:
        return f"{paths.root} holds an earlier run; add --resume, or choose another --run-dir"
    if config.boundary_forest:
        _check_given_forest(Path(config.boundary_forest), paths)
    return None


def record_run(resolved: ResolvedRun, steps: list[Step]) -> None:
    """config.json, site.json and each training's requested_config.json (what its launch reads)."""
    from pipeline.training.train_config import TrainConfig

    config_io.save_json(resolved.paths.config, resolved.config)
    save_site_record(resolved.paths.site, resolved.site_source, resolved.spec)
    for step in [s for s in steps if s.task.stage == "train"]:
        requested = step.task.outputs[0].parent / "requested_config.json"
        train = config_io.from_dict(TrainConfig, step.task.settings["train"])
        config_io.save_json(requested, train)


def announce(resolved: ResolvedRun, steps, reasons, stages, resume: bool, lines: list[str]) -> None:
    """What the run starts with: where, which site and environment, the model, the plan."""
    config, paths = resolved.config, resolved.paths
    _say(f"run dir {paths.root}, {resolved.origin}")
    for line in lines:
        _say(line)
    if not config.pretrained_model and not config.study.rank_counts:
        _say(describe_training(config, resolved.spec.mpi_launch().num_ranks))
    _say(("resuming" if resume else "tasks") + f" in {paths.root}:")
    for line in describe_plan(steps, reasons, stages):
        _say(line)
    if (copy := last_copy(paths.root)) and copy.name != copy_name():
        _say(f"code: {describe_code(paths.root)}")


def start_run(
    resolved: ResolvedRun,
    plan: RunPlan,
    stages: frozenset[str] | None,
    resume: bool,
    notes: list[str],
) -> int:
    """Take the run dir, plan, run what is not up to date and write the report. `stages`: those
    --stages names (None: every stage)."""
    # Imported before the run starts, as the rest this process uses: the checkout may change
    # while it runs (its workers import a copy, pipeline.run.code_copy).
    from pipeline.run.run_lock import hand_down, hold
    from pipeline.run.run_report import write_report

    config, paths = resolved.config, resolved.paths
    given, stages = stages is not None, stages or frozenset(STAGES)
    if refusal := refused_start(resolved, resume):
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    lock = hold(paths.root)  # noqa: F841  (held until this process ends)
    hand_down(paths.root)  # what this process starts from now on works for it
    if config.pretrained_model:  # inference only: the model's checkpoint is the selection
        from pipeline.selection.released_models import stage_pretrained_selection

        stage_pretrained_selection(config.pretrained_model, paths.selection)
        stages = stages - {"preprocess", "train", "select"}
    steps = steps_of(plan)
    check_stage_inputs(stages, steps)  # before any worker starts
    record_run(resolved, steps)
    reasons = plan_run(steps, stages)
    announce(resolved, steps, reasons, stages, resume, notes)
    if all(r is None for r in reasons.values()):
        _say("nothing to do: every task is up to date")
    elif status := execute(steps, reasons, resolved.site, resolved.spec, paths):
        return status
    if given and (stale := stale_left_out(steps, stages)):
        _say(
            f"report not written: --stages left out {', '.join(stale)}, not up to date; run them "
            "(or --resume without --stages) for a report of one consistent run"
        )
        return 0
    write_report(paths.root)
    _say(f"done: {paths.report}; view it with: python workflow.py view --run-dir {paths.root}")
    return 0
