"""The whole run's steps in dependency order: staging, training (or a pretrained model), inference
block by block, stitching, the second pass, export, evaluation; or a study's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import apps.evaluate
import apps.infer
import apps.stage
from apps.contracts import BoundaryForest, GivenBoundaryForest, InferBlock, StageVolume
from apps.plan.evaluation import evaluate_steps
from apps.plan.export import export_steps
from apps.plan.resolved import RunPlan
from apps.plan.segmentation import agglomerate_steps, consensus_steps, stitch_steps
from apps.plan.step import Step, task_step
from apps.plan.study import study_steps
from apps.plan.training import _labelled_parts, _training_steps
from pipeline.core import config_io

if TYPE_CHECKING:
    from pipeline.run.run_config import RunConfig
    from site_configs.spec import SiteSpec


def dag_steps(plan: RunPlan) -> list[Step]:
    """Every task of the run in dependency order. With a pretrained model there is no training:
    run() writes its checkpoint as the selection."""
    config, paths = plan.config, plan.paths
    from pipeline.data.staging import role_settings, source_files
    from pipeline.inference.blocks import block_path

    steps = [
        task_step("stage[eval]", role_settings(config.data, "eval", plan.eval_context),
                  StageVolume(sources=source_files(config.data, "eval"), staged=paths.eval_volume),
                  apps.stage.stage_volume),
    ]  # fmt: skip
    learns_forest = not config.boundary_forest and (
        plan.learns_baseline or config.agglomeration.reads_boundary_map
    )
    if not config.pretrained_model:
        steps += _training_steps(plan)
    elif learns_forest:
        steps += _labelled_parts(plan)
    if learns_forest:  # one forest for both: the baseline's map and the fill's
        # Its settings are pipeline.evaluation.learned_watershed's defaults.
        files = BoundaryForest(train_volume=paths.train_volume, forest=paths.boundary_forest)
        steps.append(task_step("evaluate[boundary forest]", {"boundary": "learned forest"}, files,
                               apps.evaluate.boundary_forest))  # fmt: skip
    elif config.boundary_forest:  # another run's, checked and copied: the run keeps what it used
        files = GivenBoundaryForest(
            source=Path(config.boundary_forest), forest=paths.boundary_forest
        )
        steps.append(task_step("evaluate[boundary forest]", {"boundary": "given forest"}, files,
                               apps.evaluate.given_boundary_forest))  # fmt: skip
    blocks = plan.blocks
    passes = plan.inference_passes
    for one in passes:
        inference = config_io.to_dict(one.inference)
        for i, block in enumerate(blocks):
            settings = {
                "inference": inference,
                "start": list(block.start),
                "stop": list(block.stop),
            }
            files = InferBlock(volume=paths.eval_volume, selection=paths.selection,
                               result=block_path(one.blocks_dir, block))  # fmt: skip
            steps.append(
                task_step(f"infer[{one.prefix}{i}]", settings, files, apps.infer.infer_block)
            )
        steps += stitch_steps(plan, one)
    if config.agglomeration.consensus:
        steps += consensus_steps(plan)
    if config.agglomeration.writes_layer:
        steps += agglomerate_steps(plan)
    steps += export_steps(plan)
    if plan.eval_has_labels:
        steps += evaluate_steps(plan)
    return steps


def steps_of(plan: RunPlan) -> list[Step]:
    """The tasks of a study, or of a run."""
    config = plan.config
    return study_steps(plan) if config.study.rank_counts else dag_steps(plan)


def checkpoints_within(config: RunConfig, site: SiteSpec) -> RunConfig:
    """The training's checkpoint interval, at most the site's (`SiteSpec.checkpoint_every_seconds`)."""
    limit = site.checkpoint_every_seconds
    if limit is None or config.train.checkpoint_every_seconds <= limit:
        return config
    return replace(config, train=replace(config.train, checkpoint_every_seconds=float(limit)))
