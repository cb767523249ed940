"""The training's steps: stage the training (and selection) volume, preprocess, train on the site's
MPI launcher, select a checkpoint."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import apps.preprocess
import apps.select
import apps.stage
import apps.train
from apps.contracts import Preprocess, SelectCheckpoint, StageVolume, Train
from apps.plan.resolved import RunPlan
from apps.plan.step import Step, task_step
from pipeline.core import config_io

if TYPE_CHECKING:
    from pipeline.training.train_config import TrainConfig


def training_command(plan: RunPlan, launch, train_dir: Path | None = None) -> str:
    """The launch line of a training into `train_dir` (default: the run's), whose
    requested_config.json run() writes from the task's settings."""
    config, paths = plan.config, plan.paths
    train_dir = train_dir or paths.train_dir
    train_config = train_dir / "requested_config.json"
    program = [
        sys.executable, "-m", "pipeline.cli.train",
        "--raw", f"{paths.train_volume}:raw", "--labels", f"{paths.train_volume}:labels",
        "--coordinates", str(paths.coordinates), "--train-dir", str(train_dir),
        "--config", str(train_config), "--intra-op-threads", str(launch.threads_per_rank),
        "--expected-ranks", str(launch.num_ranks),
    ]  # fmt: skip
    if config.train_init_from:
        program += ["--init-from", str(Path(config.train_init_from).resolve())]
    return launch.command(shlex.join(program))


def _training_steps(plan: RunPlan) -> list[Step]:
    """Stage the training (and selection) volume, preprocess, train, select."""
    config, paths, site = plan.config, plan.paths, plan.site
    launch = site.mpi_launch()
    scored_on = plan.selection_volume
    return _labelled_parts(plan) + [
        _preprocess_step(plan),
        _train_step("train", plan, config.train, launch, paths.train_dir),
        task_step("select", {"selection": config_io.to_dict(config.selection),
                             # held-out FOVs leave out the objects training leaves out
                             "partitions": {"min_object_voxels": config.partitions.min_object_voxels}},
                  SelectCheckpoint(train_summary=paths.train_summary, scored_on=scored_on, selection=paths.selection),
                  apps.select.select_checkpoint),
    ]  # fmt: skip


def _preprocess_step(plan: RunPlan) -> Step:
    config, paths = plan.config, plan.paths
    partitions = {"partitions": config_io.to_dict(config.partitions_for_training())}
    files = Preprocess(train_volume=paths.train_volume, partitions=paths.partitions,
                       coordinates=paths.coordinates)  # fmt: skip
    return task_step("preprocess", partitions, files, apps.preprocess.preprocess)


def _train_step(name: str, plan: RunPlan, train: TrainConfig, launch, train_dir: Path) -> Step:
    """A training of `train` by `launch`'s ranks into `train_dir` (its summary the output)."""
    config, paths = plan.config, plan.paths
    init_from = str(Path(config.train_init_from).resolve()) if config.train_init_from else ""
    settings = {
        "train": config_io.to_dict(train),
        "ranks": launch.num_ranks,
        "init_from": init_from,
    }
    files = Train(
        train_volume=paths.train_volume,
        coordinates=paths.coordinates,
        init_from=(init_from,) if init_from else (),
        train_summary=train_dir / "train_summary.json",
    )
    return task_step(name, settings, files, apps.train.train,
                     training_command(plan, launch, train_dir), str(train_dir / "train.log"),
                     parsl_resource_specification=launch.resource_specification)  # fmt: skip


def _labelled_parts(plan: RunPlan) -> list[Step]:
    """Stage the selection part (where it has a volume of its own) and the training part."""
    config, paths = plan.config, plan.paths
    from pipeline.data.staging import role_settings, source_files

    select_part = [
        task_step("stage[select]", role_settings(config.data, "select"),
                  StageVolume(sources=source_files(config.data, "select"), staged=paths.select_volume),
                  apps.stage.stage_volume),
    ] if config.data.has_select_part else []  # fmt: skip
    return select_part + [_train_part(plan)]


def _train_part(plan: RunPlan) -> Step:
    config, paths = plan.config, plan.paths
    from pipeline.data.staging import role_settings, source_files

    files = StageVolume(sources=source_files(config.data, "train"), staged=paths.train_volume)
    return task_step(
        "stage[train]", role_settings(config.data, "train"), files, apps.stage.stage_volume
    )
