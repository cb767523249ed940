"""A study's steps (`workflow.py study`): the paper's grid of trainings (pipeline.study.study_grid),
the site's jobs that hold its cells, and what the dry run says of it."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import apps.study
from apps.contracts import ReportStudy
from apps.plan.describe import describe_training
from apps.plan.resolved import RunPlan
from apps.plan.step import Step, task_step
from apps.plan.training import _preprocess_step, _train_part, _train_step
from pipeline.core import config_io
from pipeline.core.errors import ConfigError

if TYPE_CHECKING:
    from pipeline.run.run_config import RunConfig
    from pipeline.study.study_grid import StudyCell
    from site_configs.spec import SiteSpec


# -- a study (`workflow.py study`): the paper's grid of trainings (pipeline.study.study_grid) --
def study_capacity(site: SiteSpec) -> int | None:
    """Most real ranks a study's cell may have: one node's on this machine (more are virtual
    ranks), any number on a batch site (its queues say how many nodes a job may have)."""
    return site.ranks_per_node * site.nodes_per_block if site.scheduler == "local" else None


def _cell_nodes(site: SiteSpec, cell: StudyCell) -> tuple[int, int]:
    """(nodes, ranks per node) of a cell's real ranks: whole nodes of the site's ranks per node,
    or one node partly used by a smaller world."""
    per_node = min(cell.real_ranks, site.ranks_per_node)
    nodes, rest = divmod(cell.real_ranks, per_node)
    if rest:
        raise ConfigError(
            f"[study] {cell.ranks} ranks do not fill whole nodes of {site.ranks_per_node} ranks on "
            f"site {site.name}; choose rank counts that do"
        )
    return nodes, per_node


def study_site(site: SiteSpec, config: RunConfig, allocation: dict[str, str]) -> SiteSpec:
    """The site with the `allocation` given (account, queue, walltimes) and training jobs that
    hold the study's largest cell, running as many cells at once as fit: small cells side by side
    in one allocation. Where the queue takes no job that small (Theta's default: 128 nodes or
    more) the job has the queue's smallest size. ConfigError where no job of the queue holds the
    largest cell."""
    from pipeline.study.study_grid import study_cells
    from site_configs.queues import describe_queues, walltime_seconds

    cells = study_cells(config.study, config.train, study_capacity(site))
    nodes = max(_cell_nodes(site, cell)[0] for cell in cells)
    if site.scheduler == "local":
        return replace(site, **allocation)
    queue, walltime = allocation.get("queue", site.queue), allocation.get("walltime", site.walltime)
    known = site.limits_of(queue)
    sizes = sorted({nodes} | {q.min_nodes for q in known if q.min_nodes > nodes})
    taken = [n for n in sizes if not known or any(q.allows(n, walltime) for q in known)]
    if taken:  # anything else the site refuses (the cpu pool's queue) it names itself
        return replace(
            site,
            nodes_per_block=taken[0],
            mpi_tasks_per_block=min(taken[0], len(cells)),
            **allocation,
        )
    fit = [
        q for q in site.queue_limits
        if q.max_nodes >= nodes and walltime_seconds(q.max_walltime) >= walltime_seconds(walltime)
    ]  # fmt: skip
    raise ConfigError(
        f"[study] the largest cell needs a job of {nodes} nodes for {walltime}, which queue "
        f"{queue!r} does not take; give a --queue (and --walltime) that does: "
        f"{describe_queues(fit) or 'no queue of the site does'}"
    )


def study_steps(plan: RunPlan) -> list[Step]:
    """Stage the training volume, preprocess once, train every cell, write the study's report."""
    config, paths, site = plan.config, plan.paths, plan.site
    from pipeline.study.study_grid import study_cells

    cells = study_cells(config.study, config.train, study_capacity(site))
    steps = [_train_part(plan), _preprocess_step(plan)]
    for cell in cells:
        launch = site.mpi_launch(*_cell_nodes(site, cell))
        cell_train = cell.train_config(config.train, config.study.steps)
        steps.append(_train_step(f"train[{cell.name}]", plan, cell_train, launch,
                                 paths.study_cells / cell.name))  # fmt: skip
    settings = {
        "study": config_io.to_dict(config.study),
        "cells": [config_io.to_dict(c) for c in cells],
    }
    summaries = tuple(s.contract.train_summary for s in steps if s.task.stage == "train")
    files = ReportStudy(train_summaries=summaries, report=paths.study_report)
    return steps + [task_step("study", settings, files, apps.study.report_study)]


def describe_study(plan: RunPlan) -> str:
    """The cells per rank count, the jobs asked for and their node-hours."""
    config, paths, site = plan.config, plan.paths, plan.site
    from pipeline.study.study_grid import rates_for, study_cells
    from site_configs import describe
    from site_configs.queues import walltime_seconds

    study = config.study
    cells = study_cells(study, config.train, study_capacity(site))
    one_rank = replace(config, train=replace(config.train, virtual_ranks=1, max_steps=study.steps))
    lines = [
        f"study {config.name} in {paths.root}: {len(cells)} cells = {len(study.rank_counts)} rank "
        f"count(s) x rates x {len(study.optimizers)} optimizer(s) x {len(study.warmup)} warm-up "
        f"choice(s) x {study.repeats} seed(s)",
        f"  stage, preprocess -> {paths.coordinates} (shared by every cell)",
        f"  train      {describe_training(one_rank, 1)}; a cell of N ranks N times the FOVs",
    ]
    node_steps = 0
    for n in sorted(study.rank_counts):
        mine = [c for c in cells if c.ranks == n]
        nodes, per_node = _cell_nodes(site, mine[0])
        node_steps += nodes * study.steps * len(mine)
        split = (
            f"{mine[0].real_ranks} real x {mine[0].virtual_ranks} virtual"
            if mine[0].virtual_ranks > 1
            else "real"
        )
        rates = ", ".join(f"{r:.3g}" for r in rates_for(study, config.train.learning_rate, n))
        lines.append(
            f"  N={n:<5} {len(mine)} cells on {nodes} node(s) ({split} ranks), rates {rates}"
        )
    hours = site.nodes_per_block * walltime_seconds(site.walltime) / 3600
    lines += [
        f"  report     -> {paths.study_report}",
        f"  jobs: {site.nodes_per_block} node(s) x {site.walltime} each ({hours:,.1f} node-hours), up to "
        f"{site.max_blocks} at once, up to {site.mpi_tasks_per_block} cell(s) at once in a job as their nodes fit; another "
        f"job is asked for while cells wait; the cells need {node_steps:,} node-steps in all",
        describe(site, paths.root),
    ]  # fmt: skip
    return "\n".join(lines)
