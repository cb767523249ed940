"""The FFN workflow: EM volume to a segmentation browsable in Neuroglancer, as one Parsl DAG.

    python workflow.py --site local                      # this machine, the synthetic demo
    python workflow.py --site theta --config run.toml    # the same DAG on an HPC site
    python workflow.py --run-dir R --resume              # go on with R's own settings and site
    python workflow.py --site theta --dry-run            # print the DAG and the site, submit nothing
    python workflow.py study --config configs/study.toml # the paper's learning-rate/scaling study
    python workflow.py status --run-dir data/runs/demo   # what a run has done, where its logs are
    python workflow.py view --run-dir data/runs/demo     # open the result in Neuroglancer

stage_volume(train), stage_volume(eval) -> preprocess -> train (MPI, N ranks) -> select_checkpoint
-> infer_block x B (parallel) -> stitch -> evaluate, export -> report.md
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import re
import shlex
import signal
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from multiprocessing import resource_tracker
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pipeline  # noqa: F401  (oneDNN on before TensorFlow loads)
from pipeline.core import config_io
from pipeline.core.errors import BoundaryForestError, ConfigError, FFNError
from pipeline.core.stamps import STAMPED_INSIDE_SUFFIX, Task, as_path, plan
from pipeline.run.code_copy import CODE_DIR, copy_name, last_copy
from pipeline.run.run_layout import LAYOUT, RunPaths

if TYPE_CHECKING:  # Parsl and TensorFlow load in seconds: imported where used, so --help is quick
    from pipeline.inference.blocks import BlockGrid
    from pipeline.inference.flood_fill import InferenceConfig
    from pipeline.run.run_config import RunConfig
    from pipeline.study.study_grid import StudyCell
    from pipeline.training.train_config import TrainConfig
    from site_configs.base import SiteSpec

ROOT = Path(__file__).resolve().parent
STAGES = (
    "stage", "preprocess", "train", "select", "infer", "stitch", "consensus", "agglomerate",
    "evaluate", "export", "study",
)  # fmt: skip


def _eval_shape(config: RunConfig) -> tuple[int, int, int]:
    if config.data.synthetic:
        from pipeline.data.synthetic import PRESETS

        return (
            PRESETS[config.data.synthetic_preset]
            .with_geometry(config.data.synthetic_shape_zyx)
            .shape_zyx
        )
    from pipeline.data.volumes import volume_shape

    shape = volume_shape(config.data.eval_raw)
    if config.data.eval_roi:
        from pipeline.core.roi import Roi

        return Roi.parse(config.data.eval_roi).grown(_eval_context(config), shape).shape
    return shape


def _eval_voxel_size(config: RunConfig) -> tuple[float, float, float]:
    """The evaluated volume's voxel size (nm), read from its metadata (or the given one)."""
    if config.data.synthetic:
        from pipeline.data.synthetic import PRESETS

        return PRESETS[config.data.synthetic_preset].voxel_size_nm
    from pipeline.data.volumes import read_header

    return read_header(config.data.eval_raw, config.data.voxel_size_nm).voxel_size_nm


def _full_resolution(config: RunConfig, folder: Path) -> Path:
    """The folder of the full resolution of the segmentation layer in `folder`
    (pipeline.export.layers.new_segmentation): the export's, where evaluation and the export read the
    segmentation, or the first pass's before agglomeration."""
    from pipeline.export.layers import SEGMENTATION_LAYER, full_resolution_key

    return folder / SEGMENTATION_LAYER / full_resolution_key(_eval_voxel_size(config))


@dataclass(frozen=True)
class InferencePass:
    """One inference pass over the volume and its stitching: where each writes."""

    prefix: str  # of its tasks' names: "" (the first pass), "second " (a consensus's second)
    inference: InferenceConfig
    blocks_dir: Path
    stitch_dir: Path
    stitch_summary: Path
    folder: Path  # the folder whose segmentation layer its stitching writes


def inference_passes(config: RunConfig, paths: RunPaths) -> list[InferencePass]:
    """The first pass, stitched into the export's folder unless a second pass follows; with
    `[agglomeration] consensus`, a second pass in the other seed order."""
    from pipeline.inference.flood_fill import SEED_ORDERS

    second = config.agglomeration
    first = InferencePass(
        "", config.inference, paths.blocks_dir, paths.stitch_dir, paths.stitch_summary,
        paths.first_pass if second.writes_layer or second.consensus else paths.precomputed,
    )  # fmt: skip
    if not second.consensus:
        return [first]
    other = next(o for o in SEED_ORDERS if o != config.inference.seed_order)
    return [first, InferencePass(
        "second ", replace(config.inference, seed_order=other), paths.second_blocks_dir,
        paths.second_stitch_dir, paths.second_stitch_summary, paths.second_pass,
    )]  # fmt: skip


def _consensus_into(config: RunConfig, paths: RunPaths) -> Path:
    """Where the consensus writes: the export's folder, or its own if agglomeration follows."""
    return paths.consensus if config.agglomeration.writes_layer else paths.precomputed


def _segmenting_fov(config: RunConfig) -> tuple[int, int, int]:
    """The FOV of the model that segments: the given pretrained one, else the one trained."""
    if config.pretrained_model:
        from pipeline.inference.flood_fill import checkpoint_model_config
        from pipeline.network.released_weights import converted_checkpoint

        return checkpoint_model_config(converted_checkpoint(config.pretrained_model)).fov_shape_zyx
    return config.train.model.fov_shape_zyx


def _eval_context(config: RunConfig) -> tuple[int, int, int]:
    """Voxels segmented around an evaluated ROI: the inference model's FOV radius, so a FOV can
    be centred on the ROI's faces."""
    return tuple(int(f) // 2 for f in _segmenting_fov(config))


def training_command(
    config: RunConfig, paths: RunPaths, launch, train_dir: Path | None = None
) -> str:
    """The launch line of a training into `train_dir` (default: the run's), whose
    requested_config.json run() writes from the task's settings."""
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
    """A task of the DAG (pipeline.core.stamps.Task) and how to submit it: its app and the app's
    other arguments."""

    task: Task
    app: str  # attribute of apps.<module>: "stage.stage_volume"
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


def task_step(
    name: str,
    settings: dict,
    inputs: list,
    outputs: list,
    app: str,
    *args,
    regions: tuple = (),
    **kwargs,
) -> Step:
    """The step of task `name` (its stage: the name up to "["), run by `apps.<app>`; `regions`:
    the parts of its inputs it reads, as its app tells `stamps.run_once`."""
    stage = name.partition("[")[0]
    # A path already a Path is kept, not parsed again (`as_path`): a block's result is an input
    # of its 26 neighbours' tasks, and at 1024³ parsing them again doubled the steps' building.
    inputs, outputs = tuple(map(as_path, inputs)), tuple(map(as_path, outputs))
    task = Task(name, stage, settings, inputs, outputs, regions)
    return Step(task, app, args, kwargs)


def _training_steps(config: RunConfig, paths: RunPaths, site: SiteSpec) -> list[Step]:
    """Stage the training (and selection) volume, preprocess, train, select."""
    launch = site.mpi_launch()
    scored_on = _selection_volume(config, paths)
    return _labelled_parts(config, paths) + [
        _preprocess_step(config, paths),
        _train_step("train", config, paths, config.train, launch, paths.train_dir),
        task_step("select", {"selection": config_io.to_dict(config.selection)}, [paths.train_summary, scored_on],
              [paths.selection], "select.select_checkpoint"),
    ]  # fmt: skip


def _preprocess_step(config: RunConfig, paths: RunPaths) -> Step:
    partitions = {"partitions": config_io.to_dict(config.partitions_for_training())}
    return task_step("preprocess", partitions, [paths.train_volume], [paths.partitions, paths.coordinates],
                     "preprocess.preprocess")  # fmt: skip


def _train_step(
    name: str, config: RunConfig, paths: RunPaths, train: TrainConfig, launch, train_dir: Path
) -> Step:
    """A training of `train` by `launch`'s ranks into `train_dir` (its summary the output)."""
    init_from = str(Path(config.train_init_from).resolve()) if config.train_init_from else ""
    settings = {
        "train": config_io.to_dict(train),
        "ranks": launch.num_ranks,
        "init_from": init_from,
    }
    return task_step(name, settings, [paths.train_volume, paths.coordinates] + ([init_from] if init_from else []),
                     [train_dir / "train_summary.json"], "train.train",
                     training_command(config, paths, launch, train_dir), str(train_dir / "train.log"),
                     parsl_resource_specification=launch.resource_specification)  # fmt: skip


def _labelled_parts(config: RunConfig, paths: RunPaths) -> list[Step]:
    """Stage the selection part (where it has a volume of its own) and the training part."""
    from pipeline.data.staging import role_settings, source_files

    select_part = [
        task_step("stage[select]", role_settings(config.data, "select"), source_files(config.data, "select"),
              [paths.select_volume], "stage.stage_volume"),
    ] if config.data.has_select_part else []  # fmt: skip
    return select_part + [_train_part(config, paths)]


def _train_part(config: RunConfig, paths: RunPaths) -> Step:
    from pipeline.data.staging import role_settings, source_files

    return task_step("stage[train]", role_settings(config.data, "train"), source_files(config.data, "train"),
                     [paths.train_volume], "stage.stage_volume")  # fmt: skip


def _selection_volume(config: RunConfig, paths: RunPaths) -> Path:
    """Where checkpoints and the baseline's parameters are chosen: never the scored volume, a
    part of its own, else the training volume."""
    return paths.select_volume if config.data.has_select_part else paths.train_volume


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
    from site_configs.base import describe_queues, walltime_seconds

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


def study_steps(config: RunConfig, paths: RunPaths, site: SiteSpec) -> list[Step]:
    """Stage the training volume, preprocess once, train every cell, write the study's report."""
    from pipeline.study.study_grid import study_cells

    cells = study_cells(config.study, config.train, study_capacity(site))
    steps = [_train_part(config, paths), _preprocess_step(config, paths)]
    for cell in cells:
        launch = site.mpi_launch(*_cell_nodes(site, cell))
        cell_train = cell.train_config(config.train, config.study.steps)
        steps.append(_train_step(f"train[{cell.name}]", config, paths, cell_train, launch,
                                 paths.study_cells / cell.name))  # fmt: skip
    settings = {
        "study": config_io.to_dict(config.study),
        "cells": [config_io.to_dict(c) for c in cells],
    }
    summaries = [s.task.outputs[0] for s in steps if s.task.stage == "train"]
    return steps + [
        task_step("study", settings, summaries, [paths.study_report], "study.report_study")
    ]


def describe_study(config: RunConfig, paths: RunPaths, site: SiteSpec) -> str:
    """The cells per rank count, the jobs asked for and their node-hours."""
    from pipeline.study.study_grid import rates_for, study_cells
    from site_configs import describe
    from site_configs.base import walltime_seconds

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


def dag_steps(config: RunConfig, paths: RunPaths, site: SiteSpec) -> list[Step]:
    """Every task of the run in dependency order. With a pretrained model there is no training:
    run() writes its checkpoint as the selection."""
    from pipeline.data.staging import role_settings, source_files
    from pipeline.inference.blocks import block_path, infer_regions, plan_blocks

    steps = [
        task_step("stage[eval]", role_settings(config.data, "eval", _eval_context(config)), source_files(config.data, "eval"),
              [paths.eval_volume], "stage.stage_volume"),
    ]  # fmt: skip
    learns_forest = not config.boundary_forest and (
        _learns_baseline(config) or config.agglomeration.fill_unsegmented
    )
    if not config.pretrained_model:
        steps += _training_steps(config, paths, site)
    elif learns_forest:
        steps += _labelled_parts(config, paths)
    if learns_forest:  # one forest for both: the baseline's map and the fill's
        # Its settings are pipeline.evaluation.learned_watershed's defaults.
        steps.append(task_step("evaluate[boundary forest]", {"boundary": "learned forest"}, [paths.train_volume],
                               [paths.boundary_forest], "evaluate.boundary_forest"))  # fmt: skip
    elif config.boundary_forest:  # another run's, checked and copied: the run keeps what it used
        steps.append(task_step("evaluate[boundary forest]", {"boundary": "given forest"}, [Path(config.boundary_forest)],
                               [paths.boundary_forest], "evaluate.given_boundary_forest"))  # fmt: skip
    blocks = plan_blocks(_eval_shape(config), config.blocks)
    passes = inference_passes(config, paths)
    for one in passes:
        inference = config_io.to_dict(one.inference)
        for i, block in enumerate(blocks):
            settings = {
                "inference": inference,
                "start": list(block.start),
                "stop": list(block.stop),
            }
            steps.append(task_step(f"infer[{one.prefix}{i}]", settings, [paths.eval_volume, paths.selection],
                               [block_path(one.blocks_dir, block)], "infer.infer_block",
                               regions=infer_regions(block)))  # fmt: skip
        steps += stitch_steps(config, paths, blocks, one)
    if config.agglomeration.consensus:
        steps += consensus_steps(config, paths, blocks, passes)
    if config.agglomeration.writes_layer:
        steps += agglomerate_steps(config, paths, blocks)
    steps += export_steps(config, paths)
    if _eval_has_labels(config):
        steps += evaluate_steps(config, paths)
    return steps


def evaluate_steps(config: RunConfig, paths: RunPaths) -> list[Step]:
    """The FFN segmentation and the watershed baseline scored against the labels: a task per
    region counts overlaps, the last sums and scores (apps/evaluate.py)."""
    from pipeline.evaluation.evaluate import count_regions

    regions = count_regions(_eval_shape(config), config.evaluation)
    scored = _scored_segmentations(config, paths)
    steps, counts = [], []
    for key, folder in scored.items():
        segmented = [paths.eval_volume, _full_resolution(config, folder)]
        # The export's segmentation is "ffn"; the steps before it have folders of their own.
        name = "" if key == "ffn" else f"{key} "
        paths_of = [paths.counts_dir / name.strip() / f"{k}.npz" for k in range(len(regions))]
        steps += [
            task_step(f"evaluate[count {name}{k}]", {"region": str(region)}, segmented, [path],
                      "evaluate.count_region", str(folder))
            for k, (region, path) in enumerate(zip(regions, paths_of, strict=True))
        ]  # fmt: skip
        counts += paths_of
    also = list(scored)[1:]
    # Only with a second pass: runs made before keep their evaluation.
    settings = {"watershed": config_io.to_dict(config.watershed)} | ({"also": also} if also else {})
    if _learns_baseline(config):
        parts = [paths.boundary_forest, _selection_volume(config, paths), paths.eval_volume]
        learned = [paths.learned_baseline, paths.learned_baseline_record]
        # The tuning grid's settings are pipeline.evaluation.learned_watershed's defaults.
        steps.append(task_step("evaluate[learned watershed]", {"baseline": "learned watershed"}, parts,
                               learned, "evaluate.learned_baseline"))  # fmt: skip
        settings, counts = settings | {"learned_watershed": True}, counts + learned[:1]
    steps.append(task_step("evaluate", settings, [paths.eval_volume, *counts],
                           [paths.evaluation], "evaluate.evaluate"))  # fmt: skip
    return steps


def _learns_baseline(config: RunConfig) -> bool:
    """Whether the baseline is the learned watershed: asked for, and the run has a labelled
    training part (synthetic runs have one)."""
    baseline = config.watershed
    has_train_part = config.data.synthetic or bool(config.data.train_raw)
    return baseline.enabled and baseline.learned and has_train_part and _eval_has_labels(config)


def _scored_segmentations(config: RunConfig, paths: RunPaths) -> dict[str, Path]:
    """evaluation.json's keys and the folders of what they score: "ffn", the export's (the
    last step's), then with a second pass the steps before it."""
    second = config.agglomeration
    scored = {"ffn": paths.precomputed}
    if second.writes_layer or second.consensus:
        scored["ffn_first_pass"] = paths.first_pass
    if second.writes_layer and second.consensus:
        scored["ffn_consensus"] = paths.consensus
    return scored


def _layout(config: RunConfig) -> dict:
    """How the full resolution of every segmentation layer the run writes is stored (as the
    export's settings say), a setting of every task that writes one."""
    from pipeline.export.layers import segmentation_layout

    layout = segmentation_layout(
        _eval_shape(config), _eval_voxel_size(config), config.export, config.blocks.chunks
    )
    return config_io.to_dict(layout)


def _layer_parts(config: RunConfig, blocks: BlockGrid) -> list[tuple[slice, ...]]:
    """The parts its writers write a segmentation layer in, a task each
    (pipeline.inference.stitching.layer_part)."""
    from pipeline.export.layers import SegmentationLayout
    from pipeline.inference.stitching import layer_parts

    return layer_parts(blocks, config_io.from_dict(SegmentationLayout, _layout(config)))


def stitch_steps(
    config: RunConfig, paths: RunPaths, blocks: BlockGrid, one: InferencePass
) -> list[Step]:
    """A pairs task per block, one join, a relabel task per part of the layer (a block's core,
    or a shard) writing it, then the check that writes stitch.json (apps/stitch.py), for pass
    `one`."""
    from pipeline.inference.blocks import block_path
    from pipeline.inference.stitching import later_neighbours, part_name, part_neighbours

    results = [block_path(one.blocks_dir, b) for b in blocks]
    pairs = [one.stitch_dir / "pairs" / f"{b.name}.npz" for b in blocks]
    parts = _layer_parts(config, blocks)
    cores = [one.stitch_dir / "parts" / f"{part_name(p)}.json" for p in parts]
    table = one.stitch_dir / "ids.npy"
    # The folder is an argument, not a setting: a run moved elsewhere stays up to date.
    folder = str(one.folder)
    name = one.prefix
    base = {
        "blocks": config_io.to_dict(config.blocks),
        "shape": list(_eval_shape(config)),
        "layout": _layout(config),
    }
    steps = []
    for k in range(len(blocks)):
        reads = [k, *later_neighbours(k, blocks)]
        steps.append(task_step(f"stitch[{name}pairs {k}]", {**base, "block": k, "reads": reads},
                           [results[i] for i in reads], [pairs[k]], "stitch.pair_block"))  # fmt: skip
    steps.append(task_step(f"stitch[{name}join]", base, [paths.eval_volume, *pairs], [table],
                       "stitch.join_blocks", folder))  # fmt: skip
    for k, part in enumerate(parts):
        reads = part_neighbours(part, blocks)
        steps.append(task_step(f"stitch[{name}relabel {k}]", {**base, "part": k, "reads": reads},
                           [table, *(results[i] for i in reads)], [cores[k]], "stitch.relabel_part",
                           folder))  # fmt: skip
    every = {**base, "reads": list(range(len(blocks)))}
    steps.append(task_step(f"stitch[{name.strip()}]" if name else "stitch", every,
                           [paths.eval_volume, table, *cores, *results],
                           [one.stitch_summary, _full_resolution(config, one.folder)], "stitch.finish_stitch",
                           folder))  # fmt: skip
    return steps


def consensus_steps(
    config: RunConfig, paths: RunPaths, blocks: BlockGrid, passes: list[InferencePass]
) -> list[Step]:
    """The split consensus of the two passes: a task per block core lists its pairs of ids, one
    joins them into a table, a relabel task per part of the layer (a block's core, or a shard)
    writes it, the last checks (apps/consensus.py)."""
    from pipeline.inference.stitching import part_name

    first, second = (str(one.folder) for one in passes)  # arguments: a moved run stays up to date
    layers = [_full_resolution(config, one.folder) for one in passes]
    into = _consensus_into(config, paths)
    base = {
        "blocks": config_io.to_dict(config.blocks),
        "shape": list(_eval_shape(config)),
        "layout": _layout(config),
    }
    cores = range(len(blocks))
    parts = _layer_parts(config, blocks)
    pairs = [paths.consensus_dir / "pairs" / f"{b.name}.npz" for b in blocks]
    records = [paths.consensus_dir / "parts" / f"{part_name(p)}.json" for p in parts]
    table = paths.consensus_dir / "ids.npy"
    steps = [task_step(f"consensus[pairs {k}]", {**base, "block": k}, layers, [pairs[k]],
                       "consensus.consensus_pairs", first, second) for k in cores]  # fmt: skip
    # Slivers where the passes disagree on a border go, as objects too small do in a pass.
    join = {**base, "min_size": config.inference.min_segment_size}
    steps.append(task_step("consensus[join]", join, [paths.eval_volume, *pairs], [table],
                           "consensus.join_consensus_pairs", str(into)))  # fmt: skip
    steps += [task_step(f"consensus[relabel {k}]", {**base, "part": k}, [table, *layers], [records[k]],
                        "consensus.relabel_consensus_part", first, second, str(into))
              for k in range(len(parts))]  # fmt: skip
    steps.append(task_step("consensus", base, [paths.eval_volume, table, *layers, *records],
                           [paths.consensus_summary, _full_resolution(config, into)],
                           "consensus.finish_consensus", first, second, str(into)))  # fmt: skip
    return steps


def agglomerate_steps(config: RunConfig, paths: RunPaths, blocks: BlockGrid) -> list[Step]:
    """FFN's second pass over the stitched first pass: a pairs task per block core, one join, a
    decision task per core (flood fills), one merge table, a relabel task per part of the layer
    (a block's core, or a shard) writing the export's segmentation layer, then the check that
    writes agglomerate.json (apps/agglomerate.py)."""
    from pipeline.inference.stitching import part_name
    from pipeline.secondpass.agglomeration import FILL_SETTINGS

    folder = paths.agglomerate_dir
    # What it agglomerates: the consensus if one is made, else the first pass.
    source = paths.consensus if config.agglomeration.consensus else paths.first_pass
    first_pass = str(source)  # arguments, not settings: a moved run stays up to date
    export = str(paths.precomputed)
    stitched = _full_resolution(config, source)
    base = {
        "blocks": config_io.to_dict(config.blocks),
        "shape": list(_eval_shape(config)),
        "layout": _layout(config),
    }
    # The fills' measures do not depend on the merge thresholds: new thresholds re-run only the
    # merge and what follows it.
    second = config.agglomeration
    fills = {**base, "agglomeration": second.fill_settings()}
    # The merges do not depend on the fill: without it, every setting is as before it was added.
    merging = {k: v for k, v in config_io.to_dict(second).items() if k not in FILL_SETTINGS}
    thresholds = {**base, "agglomeration": merging}
    cores = range(len(blocks))
    parts = _layer_parts(config, blocks)
    contacts = [folder / "contacts" / f"{b.name}.npz" for b in blocks]
    decisions = [folder / "decisions" / f"{b.name}.npz" for b in blocks]
    records = [folder / "parts" / f"{part_name(p)}.json" for p in parts]
    pairs, merges = folder / "pairs.npz", folder / "merges.npz"
    decide = {**fills, "inference": config_io.to_dict(config.inference)}
    steps = []
    if second.enabled:  # else no pair is merged: the pass only fills
        steps += [task_step(f"agglomerate[pairs {k}]", {**fills, "block": k}, [stitched], [contacts[k]],
                            "agglomerate.pair_core", first_pass) for k in cores]  # fmt: skip
        steps.append(
            task_step("agglomerate[join]", fills, contacts, [pairs], "agglomerate.join_pairs")
        )
        steps += [task_step(f"agglomerate[decide {k}]", {**decide, "block": k},
                            [paths.eval_volume, stitched, pairs, paths.selection], [decisions[k]],
                            "agglomerate.decide_core", first_pass) for k in cores]  # fmt: skip
    else:
        decisions = []
    steps.append(task_step("agglomerate[merge]", thresholds, [paths.eval_volume, *decisions], [merges],
                           "agglomerate.merge_pairs", export))  # fmt: skip
    # The fill of unsegmented voxels: the learned watershed's forest (dag_steps plans it), its
    # map predicted and flooded part by part. Without it, the parts' settings are as before it
    # was added (runs stay done).
    fill_inputs, written = [], base
    if second.fill_unsegmented:
        fill_inputs = [paths.boundary_forest, paths.eval_volume]
        written = {**base, "agglomeration": second.part_settings()}
    if second.fill_min_size:  # the objects' sizes in the whole volume: a count per part, a sum
        counts = [folder / "sizes" / f"{part_name(p)}.npz" for p in parts]
        steps += [task_step(f"agglomerate[sizes {k}]", {**base, "part": k}, [stitched], [counts[k]],
                            "agglomerate.count_part", first_pass) for k in range(len(parts))]  # fmt: skip
        fill_inputs.append(folder / "sizes.npz")
        steps.append(
            task_step("agglomerate[sizes]", base, counts, fill_inputs[-1:], "agglomerate.sum_sizes")
        )
    steps += [task_step(f"agglomerate[relabel {k}]", {**written, "part": k}, [merges, stitched, *fill_inputs],
                        [records[k]], "agglomerate.relabel_merged_part", first_pass, export)
              for k in range(len(parts))]  # fmt: skip
    filling = config_io.to_dict(second) if second.fill_unsegmented else merging
    finish = {**base, "agglomeration": filling, "parts": len(parts)}
    steps.append(task_step("agglomerate", finish, [paths.eval_volume, merges, stitched, *fill_inputs, *records, *decisions],
                           [paths.agglomerate_summary, _full_resolution(config, paths.precomputed)],
                           "agglomerate.finish_agglomeration", first_pass, export))  # fmt: skip
    return steps


def export_steps(config: RunConfig, paths: RunPaths) -> list[Step]:
    """One task begins the export, one per region writes every scale (sharded: and meshes it,
    then one plans the mesh shards and a task per shard merges it; unsharded: one per igneous
    meshing task meshes), the last checks and sums up (apps/export.py). Each task's record is
    in the export's folder."""
    from pipeline.export.layers import (
        RECORDS_DIR,
        export_regions,
        export_tasks,
        mesh_shards,
        task_record_path,
    )

    shape = _eval_shape(config)
    base = {"export": config_io.to_dict(config.export), "shape": list(shape)}
    segmented = [paths.eval_volume, _full_resolution(config, paths.precomputed)]
    # In the export's folder: a folder lost whole (its records with it) begins again.
    begun = paths.precomputed / RECORDS_DIR / f"begun{STAMPED_INSIDE_SUFFIX}"
    folder = str(paths.precomputed)  # an argument, not a setting: a moved run stays up to date
    chunks, voxel_size = config.blocks.chunks, _eval_voxel_size(config)
    regions = export_regions(shape, voxel_size, config.export, chunks)
    tasks = export_tasks(shape, voxel_size, config.export, chunks)
    records = {
        kind: [task_record_path(paths.precomputed, kind, k) for k in range(count)]
        for kind, count in tasks.items()
    }
    steps = [task_step("export[begin]", base, segmented, [begun], "export.begin_export", folder)]
    for k, (region, record) in enumerate(zip(regions, records["region"], strict=True)):
        steps.append(task_step(f"export[region {k}]", {**base, "region": str(region), "index": k}, [begun, *segmented],
                           [record], "export.export_region", folder))  # fmt: skip
    # Unsharded meshing reads only the full resolution: it need not wait for the regions' scales.
    for j, mesh in enumerate(records["mesh"]):
        steps.append(task_step(f"export[mesh {j}]", {**base, "mesh": j}, [begun, segmented[1]], [mesh],
                           "export.export_meshes", folder))  # fmt: skip
    shards = mesh_shards(tasks["region"])
    for planned in records["plan"]:  # the mesh shards, from the regions' fragments
        steps.append(task_step("export[mesh plan]", {**base, "shards": shards}, records["region"], [planned],
                               "export.plan_meshes", folder))  # fmt: skip
    for j, merge in enumerate(records["merge"]):
        merging = {**base, "merge": j, "merges": tasks["merge"]}
        steps.append(task_step(f"export[mesh merge {j}]", merging, records["plan"],
                               [merge], "export.merge_meshes", folder))  # fmt: skip
    every = [record for kind in records.values() for record in kind]
    steps.append(task_step("export", {**base, "tasks": tasks}, [*segmented, *every],
                       [paths.precomputed], "export.finish_export", folder))  # fmt: skip
    return steps


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


def _app(step: Step):
    """The Parsl app that runs `step`: `apps.<module>.<name>`."""
    import importlib

    module, _, name = step.app.rpartition(".")
    return getattr(importlib.import_module(f"apps.{module}"), name)


def executor_labels(steps: list[Step], reasons: dict[str, str | None]) -> set[str]:
    """The executors ("cpu", "mpi") of the tasks that run."""
    return {label for s in steps if reasons[s.task.name] is not None for label in _app(s).executors}


def build_dag(steps: list[Step], reasons: dict[str, str | None]) -> dict[str, object]:
    """Submit the tasks that must run; returns {task name: future}. Parsl starts each when its
    inputs are ready: a rebuilt input as the future of the task that rebuilds it."""
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
        future = _app(step)(task.settings, *step.args, inputs=inputs, outputs=[File(str(p)) for p in task.outputs],
                     **step.kwargs)  # fmt: skip
        futures[task.name] = future
        made_by |= {p: (future, i) for i, p in enumerate(task.outputs)}
    return futures


def _eval_has_labels(config: RunConfig) -> bool:
    return config.data.synthetic or bool(config.data.eval_labels)


def describe_training(config: RunConfig, ranks: int) -> str:
    """The model and what a step costs, so a wrong model is seen before the first step."""
    from pipeline.network.model import forward_flops_per_fov, weight_count

    model, batch = config.train.model, config.train.batch_size
    fov = "x".join(map(str, model.fov_shape_zyx))
    virtual = config.train.virtual_ranks
    world = f"{ranks} rank(s) x {virtual} virtual" if virtual > 1 else f"{ranks} rank(s)"
    # Training costs about 3 forward passes per FOV (forward, input and weight gradients).
    gflop = 3 * forward_flops_per_fov(model) * batch * ranks * virtual / 1e9
    return (
        f"model: depth {model.depth}, {model.features} features, FOV {fov} (z, y, x), "
        f"{weight_count(model.depth, model.features):,} weights; batch {batch} per rank x {world}; "
        f"about {gflop:.1f} GFLOP per step, {config.train.max_steps} steps"
    )


def describe_dag(config: RunConfig, paths: RunPaths, site: SiteSpec) -> str:
    from pipeline.inference.blocks import plan_blocks
    from site_configs import describe
    from site_configs.base import expanded_launch_line

    blocks = plan_blocks(_eval_shape(config), config.blocks)
    baseline = (
        f"  baseline   learned watershed: forest of {paths.train_volume} -> {paths.boundary_forest}"
        f"{' (the fill floods its map too)' if config.agglomeration.fill_unsegmented else ''}, "
        f"tuned on {_selection_volume(config, paths)} -> {paths.learned_baseline}"
    )
    if config.pretrained_model:
        staged = (
            [paths.train_volume, _selection_volume(config, paths)]
            if _learns_baseline(config)
            else []
        )
        return "\n".join([
            f"run {config.name} in {paths.root}: inference only with {config.pretrained_model}",
            f"  stage      -> {', '.join(map(str, dict.fromkeys([*staged, paths.eval_volume])))}",
            f"  infer      {len(blocks)} block(s) of {config.blocks.block_shape_zyx} (z, y, x), in parallel",
            *([baseline] if _learns_baseline(config) else []),
            *([f"  forest     {config.boundary_forest} (given) -> {paths.boundary_forest}, the fill's map"]
              if config.boundary_forest else []),
            f"  stitch, {'agglomerate, ' if config.agglomeration.writes_layer else ''}evaluate (with labels), export, report",
            describe(site, paths.root),
        ])  # fmt: skip
    launch = site.mpi_launch()
    lines = [
        f"run {config.name} in {paths.root}",
        f"  stage      -> {paths.train_volume}, {paths.eval_volume}",
        f"  preprocess -> {paths.coordinates}",
        f"  train      {launch.num_ranks} rank(s) on {launch.num_nodes} node(s), "
        f"{config.train.max_steps} steps -> {paths.train_dir}",
        f"             {describe_training(config, launch.num_ranks)}",
        f"             $ {expanded_launch_line(site, launch, training_command(config, paths, launch))}",
        f"  select     on {paths.select_volume if config.data.has_select_part else paths.train_volume}"
        f" -> {paths.selection}",
        f"  infer      {len(blocks)} block(s) of {config.blocks.block_shape_zyx} (z, y, x), in parallel -> {paths.blocks_dir}",
        f"  stitch     -> {_full_resolution(config, inference_passes(config, paths)[0].folder)}",
        *(
            [
                f"  consensus  with a second pass, seeds in the other order -> {_consensus_into(config, paths)}"
            ]
            if config.agglomeration.consensus
            else []
        ),
        *([f"  agglomerate -> {paths.precomputed}"] if config.agglomeration.writes_layer else []),
        *([baseline] if _learns_baseline(config) else []),
        f"  evaluate   -> {paths.evaluation}"
        if _eval_has_labels(config)
        else "  evaluate   (no labels: skipped)",
        f"  export     -> {paths.precomputed}",
        f"  report     -> {paths.report}",
        describe(site, paths.root),
    ]
    return "\n".join(lines)


def describe_progress(name: str, record: dict) -> str:
    """One line on a running block (its progress file, pipeline.inference.blocks.block_progress_path)."""
    eta = record.get("eta_s")
    left = (
        f", about {eta / 60:.0f} min left in this seed pass"
        if eta is not None
        else f", too early for a time left ({record.get('seeds_tried', 0)} seeds tried)"
    )
    segmented = record.get("segmented_share")  # absent from records older runs wrote
    return (
        f"{name} {record['block']}: {record['objects']} objects, {record['fov_evaluations']:,} FOV "
        f"evaluations, {record['fov_per_s']:.1f} FOV/s, "
        + (f"{segmented:.0%} of the voxels segmented, " if segmented is not None else "")
        + f"{record['seed_share']:.0%} of the seeds tried{left}"
    )


def _progress_of(path: Path, seen: dict[str, int]) -> dict | None:
    """A block's progress record, if it is new since the last look."""
    try:
        mtime = path.stat().st_mtime_ns
        if seen.get(str(path)) == mtime:
            return None
        seen[str(path)] = mtime
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def progress_seen_before(progress_files: Iterable[Path]) -> dict[str, int]:
    """The progress files a stopped run left, as `_progress_of` marks them seen: a resumed block
    goes on from its last saved state, not from what its last record said."""
    seen: dict[str, int] = {}
    for path in progress_files:
        _progress_of(path, seen)
    return seen


def _watch(futures: dict[str, object], paths: RunPaths, progress_files: dict[str, Path]) -> None:
    """Print each task's start and end, training progress and each running block's progress
    (every minute), until every task is done."""
    reported: dict[str, str] = {}
    progress_seen = progress_seen_before(progress_files.values())
    # The log is appended to by every run: show only lines this run adds.
    last_train_line, started = _last_train_line(paths.train_log), time.monotonic()
    while True:
        for name, future in futures.items():
            state = future.task_record["status"].name
            if reported.get(name) == state:
                continue
            reported[name] = state
            elapsed = f"{time.monotonic() - started:6.0f} s"
            if state in ("launched", "running"):
                _say(f"{elapsed} {name} started")
            elif state == "exec_done":
                note = " (found up to date)" if future.result() == "up to date" else ""
                _say(f"{elapsed} {name} finished{note}")
            elif state in ("failed", "dep_fail"):
                _say(f"{elapsed} {name} {state.replace('_', ' ')}")
        training = reported.get("train") in ("launched", "running")
        line = _last_train_line(paths.train_log) if training else ""
        if line and line != last_train_line:
            _say(f"         {line}")
            last_train_line = line
        for name, path in progress_files.items():
            if name in futures and reported.get(name) in ("launched", "running"):
                if record := _progress_of(path, progress_seen):
                    _say(f"         {describe_progress(name, record)}")
        pending = [f for f in futures.values() if not f.done()]
        if not pending:
            return
        # A second between reports, cut short when the last task ends.
        concurrent.futures.wait(pending, timeout=1)


def _say(text: str) -> None:
    print(f"[workflow {time.strftime('%H:%M:%S')}] {text}", flush=True)


def _last_train_line(log: Path) -> str:
    if not log.is_file():
        return ""
    lines = [
        line for line in log.read_text(errors="replace").splitlines() if line.startswith("[train]")
    ]
    return lines[-1] if lines else ""


class Stopped(Exception):
    """SIGINT or SIGTERM reached the workflow: its workers are stopped and it exits."""


def _stop(signum: int, frame) -> None:
    raise Stopped(signal.Signals(signum).name)


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """Hold SIGINT back from the processes and threads Parsl starts meanwhile: they inherit the
    mask. A terminal's Ctrl-C reaches the whole foreground process group; Parsl's interchange and
    monitoring processes died of it and its cleanup then waited forever on the dead interchange.
    Held, it reaches this process alone (after the start, not lost), which stops them in order."""
    # multiprocessing unblocks SIGINT when it starts its resource tracker: started first here.
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def execute(
    steps: list[Step], reasons: dict[str, str | None], site, spec: SiteSpec, paths: RunPaths
) -> int:
    """Run the planned tasks through Parsl; on SIGINT/SIGTERM stop every worker of the run."""
    import parsl

    from pipeline.run.watchdog import start as start_watchdog
    from site_configs.base import child_pids, only_executors, shutdown, stop_failed_start

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    dfk, ours = None, child_pids()  # processes this one had before Parsl: not Parsl's to stop
    try:
        try:
            config = site.make_config(paths.root, spec)
            start_watchdog(
                paths.root
            )  # ends the run if this process is killed (pipeline.run.watchdog)
            with _sigint_held():
                dfk = parsl.load(only_executors(config, executor_labels(steps, reasons)))
        except Exception:
            # A Ctrl-C held back during Parsl's start arrives once `dfk` is set: `shutdown` below.
            if dfk is None:
                stop_failed_start(ours)
            raise
        from pipeline.inference.blocks import block_progress_path

        futures = build_dag(steps, reasons)
        progress = {
            s.task.name: block_progress_path(s.task.outputs[0])
            for s in steps
            if s.task.stage == "infer"
        }
        _watch(futures, paths, progress)
    except Stopped as stop:
        _say(f"stopped by {stop}: workers shut down; go on later with --resume")
        return 128 + getattr(signal, str(stop)).value
    finally:
        for sig in previous:  # a second signal must not cut the shutdown short
            signal.signal(sig, signal.SIG_IGN)
        if dfk is not None:
            shutdown(dfk, ours)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    failed = {
        n: f.exception() for n, f in futures.items() if f.task_record["status"].name == "failed"
    }
    for name, exc in failed.items():
        print(f"[workflow] {name} failed: {exc}", file=sys.stderr)
    if failed:
        print(f"[workflow] Parsl's logs: {paths.runinfo}", file=sys.stderr)
        return 1
    return 0


def _site_source(name_or_path: str) -> str:
    """How a run records its site: a known site's name, or a user module's absolute path (a
    resume from another directory must find the same module)."""
    from site_configs import known_sites

    if name_or_path in known_sites():
        return name_or_path
    return str(Path(name_or_path).expanduser().resolve())


def save_site_record(path: Path, source: str, spec: SiteSpec) -> None:
    """site.json: the site module the run uses and its resolved settings (account, queue, job
    sizes): what `--resume` and `status` go on with."""
    from pipeline.core.atomic import atomic_path

    with atomic_path(path) as tmp:
        tmp.write_text(
            json.dumps({"site": source, "spec": config_io.to_dict(spec)}, indent=2) + "\n"
        )


def load_site_record(path: Path) -> tuple[str, SiteSpec]:
    """(site module, settings) a run recorded. Runs made before the module was recorded saved the
    settings alone: their site is the known site of that name."""
    from site_configs import known_sites
    from site_configs.base import SiteSpec

    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise FFNError(f"{path}: the run's site record cannot be read ({exc})") from None
    if "spec" not in record:
        record = {"site": record.get("name", ""), "spec": record}
        if record["site"] not in known_sites():
            raise FFNError(
                f"{path} does not say which site module made the run (site {record['site']!r}); "
                "give it with --site and --move-site"
            )
    return record["site"], config_io.from_dict(SiteSpec, record["spec"], str(path))


def _allocation(args: argparse.Namespace, recorded: bool) -> dict[str, str]:
    """--account, --queue, --walltime, --cpu-queue, --cpu-walltime as given; for a site not recorded by the run
    also $FFN_ACCOUNT/$FFN_QUEUE (a resumed run keeps what it recorded over the environment's)."""
    import os

    changes = {
        name: value
        for name in ("account", "queue", "walltime", "cpu_queue", "cpu_walltime")
        if (value := getattr(args, name))
    }
    if not recorded:
        for name in ("account", "queue"):
            if name not in changes and (value := os.environ.get(f"FFN_{name.upper()}")):
                changes[name] = value
    return changes


def choose_site(args: argparse.Namespace, paths: RunPaths) -> tuple[str, SiteSpec | None]:
    """The site module a run uses and, when it goes on with what it recorded, its settings.

    A new run: --site (default local). A resume: the site in the run's site.json with its
    settings; another --site only with --move-site, which takes that module's current settings
    (a batch run must never move to the login node because --site was left out)."""
    if args.move_site and not args.resume:
        raise FFNError("--move-site goes with --resume: it moves an earlier run to another site")
    if not args.resume:
        return args.site or "local", None
    if not paths.site.is_file():
        if args.site is None:
            raise FFNError(
                f"--resume: {paths.site} is missing, so the run's site is not known; give --site"
            )
        return args.site, None
    source, spec = load_site_record(paths.site)
    if args.move_site:
        return args.site or source, None
    if args.site is not None and _site_source(args.site) != source:
        raise FFNError(
            f"--resume: the run in {paths.root} was made on site {source}; it resumes there "
            f"(leave out --site), or add --move-site to go on on {args.site}"
        )
    return source, spec


# Characters a path may hold where Parsl puts it into a shell line unquoted (LocalProvider runs
# `bash <run_dir>/runinfo/.../submit_scripts/x.sh`; the batch providers likewise): a space splits
# it (the pool never starts, and nothing says why), a `;` would run what follows as a command.
_SHELL_SAFE_PATH = re.compile(r"[A-Za-z0-9._/+,:=@%-]+")


def check_shell_safe(path: Path, what: str) -> None:
    """Refuse a run dir or venv path that a shell would split or run as a command."""
    if not _SHELL_SAFE_PATH.fullmatch(str(path)):
        bad = sorted({c for c in str(path) if not _SHELL_SAFE_PATH.fullmatch(c)})
        raise ConfigError(
            f"{what} {str(path)!r} holds {' '.join(repr(c) for c in bad)}: Parsl puts it into shell "
            "lines unquoted; choose a path of letters, digits and . _ / + , : = @ % -"
        )


@dataclass(frozen=True)
class ResolvedRun:
    """What a run, its dry run and its resume go on with, and where each came from."""

    config: RunConfig
    paths: RunPaths
    site: ModuleType  # the site module: make_config
    site_source: str  # its name, or the path of a user's module (recorded in site.json)
    spec: SiteSpec  # its settings for this run
    origin: str  # one line: which site and settings, from where


def resolve_run(args: argparse.Namespace) -> ResolvedRun:
    """The run's settings, paths and site, the same for a run, its dry run and its resume."""
    from pipeline.data.staging import reads_in_place
    from pipeline.run.run_config import load_run_config
    from site_configs import load_site
    from site_configs.base import for_run

    config = load_run_config(args.config)
    paths = RunPaths(Path(args.run_dir or ROOT / "data" / "runs" / config.name).resolve())
    if args.resume:
        if not paths.config.is_file():
            raise FFNError(
                f"--resume: {paths.root} holds no run (no config.json); leave out --resume to start one"
            )
        if args.config is None:  # the run's own settings, not the demo's
            config = load_run_config(paths.config)
    if args.train_nodes is not None:
        config = replace(config, train_nodes=args.train_nodes)
    paths = replace(paths, eval_in_place=reads_in_place(config.data))
    check_shell_safe(paths.root, "run dir")
    source, recorded = choose_site(args, paths)
    site = load_site(source)
    allocation = _allocation(args, recorded is not None)
    if args.command == "study":  # jobs that hold its largest cell
        check_command(args.command, config)
        spec = study_site(recorded or site.SITE, config, allocation)
    else:  # one job = the nodes training uses
        spec = for_run(recorded or site.SITE, train_nodes=config.train_nodes, **allocation)
    config = checkpoints_within(config, spec)
    settings = args.config or (
        f"the run's own {paths.config.name}" if args.resume else "the demo's defaults"
    )
    site_from = "as the run recorded it" if recorded is not None else f"from {site.__file__}"
    origin = f"site {spec.name} ({site_from}), settings: {settings}"
    return ResolvedRun(config, paths, site, _site_source(source), spec, origin)


def checkpoints_within(config: RunConfig, site: SiteSpec) -> RunConfig:
    """The training's checkpoint interval, at most the site's (`SiteSpec.checkpoint_every_seconds`)."""
    limit = site.checkpoint_every_seconds
    if limit is None or config.train.checkpoint_every_seconds <= limit:
        return config
    return replace(config, train=replace(config.train, checkpoint_every_seconds=float(limit)))


def steps_of(config: RunConfig, paths: RunPaths, site: SiteSpec) -> list[Step]:
    """The tasks of a study, or of a run."""
    return (
        study_steps(config, paths, site)
        if config.study.rank_counts
        else dag_steps(config, paths, site)
    )


def check_command(command: str, config: RunConfig) -> None:
    """A study's config runs as a study, any other as a run: neither half-does the other."""
    if command == "study" and not config.study.rank_counts:
        raise ConfigError("study: the config has no [study] rank_counts; see configs/study.toml")
    if command == "study" and config.pretrained_model:
        raise ConfigError(
            "study: a study trains; leave out pretrained_model (train_init_from may stay)"
        )
    if command == "run" and config.study.rank_counts:
        raise ConfigError(
            "the config holds a study ([study] rank_counts): run it with `python workflow.py study`"
        )


def describe_code(run_dir: Path) -> str:
    """Which code the run dir's last run imported (pipeline.run.code_copy), against the checkout's."""
    copy = last_copy(run_dir)
    if copy is None:
        return f"no copy in {run_dir / CODE_DIR} (where a run keeps the code its workers import)"
    if copy.name == copy_name():
        return f"the last run's workers imported {copy}, the checkout's code as it is now"
    return (
        f"the last run's workers imported {copy}; the checkout's code has changed since. A run's "
        "workers import the checkout as the run starts; what is up to date stays as the earlier "
        "code made it (delete an output to make it again)"
    )


def run(args: argparse.Namespace) -> int:
    # Imported before the run starts, as the rest this process uses: the checkout may change
    # while it runs (its workers import a copy, pipeline.run.code_copy).
    from pipeline.data.staging import check_sources
    from pipeline.run.run_lock import hold
    from pipeline.run.run_report import write_report
    from pipeline.training.train_config import TrainConfig
    from site_configs.base import venv_path
    from site_configs.environment import check_environment, describe_environment, read_environment

    resolved = resolve_run(args)
    config, paths, spec = resolved.config, resolved.paths, resolved.spec
    check_command(args.command, config)
    check_sources(config.data, _segmenting_fov(config))  # before a job is submitted
    venv = venv_path(spec)
    if venv is not None:
        check_shell_safe(venv, "venv")
    environment = read_environment(venv)
    stages = frozenset(args.stages or STAGES)
    if args.dry_run:
        print((describe_study if args.command == "study" else describe_dag)(config, paths, spec))
        print(f"  {resolved.origin}")
        print(f"  {describe_environment(environment)}")
        try:
            if warning := check_environment(spec, environment):
                print(f"  {warning}")
        except ConfigError as refusal:  # the dry run shows what the run would refuse
            print(f"  a run would be refused: {refusal}")
        if paths.root.is_dir():
            steps = steps_of(config, paths, spec)
            print(
                f"tasks in {paths.root}:",
                *describe_plan(steps, plan_run(steps, stages), stages),
                sep="\n",
            )
        return 0
    # A GPU site with a CPU-only TensorFlow is refused here, before a job is asked for.
    environment_warning = check_environment(spec, environment)
    spec.require_submittable()  # a placeholder account: refused before the run dir is touched
    if paths.runinfo.exists() and not args.resume:
        print(
            f"error: {paths.root} holds an earlier run; add --resume, or choose another --run-dir",
            file=sys.stderr,
        )
        return 2
    if config.boundary_forest:
        _check_given_forest(Path(config.boundary_forest), paths)
    lock = hold(paths.root)  # noqa: F841  (held until this process ends)
    if config.pretrained_model:  # inference only: the model's checkpoint is the selection
        from pipeline.selection.released_models import stage_pretrained_selection

        stage_pretrained_selection(config.pretrained_model, paths.selection)
        stages = stages - {"preprocess", "train", "select"}
    steps = steps_of(config, paths, spec)
    check_stage_inputs(stages, steps)  # before any worker starts
    config_io.save_json(paths.config, config)
    save_site_record(paths.site, resolved.site_source, spec)
    for step in [s for s in steps if s.task.stage == "train"]:  # what each training's launch reads
        requested = step.task.outputs[0].parent / "requested_config.json"
        config_io.save_json(
            requested, config_io.from_dict(TrainConfig, step.task.settings["train"])
        )
    reasons = plan_run(steps, stages)
    _say(f"run dir {paths.root}, {resolved.origin}")
    _say(describe_environment(environment))
    if environment_warning:
        _say(environment_warning)
    if not config.pretrained_model and not config.study.rank_counts:
        _say(describe_training(config, spec.mpi_launch().num_ranks))
    _say(("resuming" if args.resume else "tasks") + f" in {paths.root}:")
    for line in describe_plan(steps, reasons, stages):
        _say(line)
    if (copy := last_copy(paths.root)) and copy.name != copy_name():
        _say(f"code: {describe_code(paths.root)}")
    if all(r is None for r in reasons.values()):
        _say("nothing to do: every task is up to date")
    else:
        status = execute(steps, reasons, resolved.site, spec, paths)
        if status:
            return status
    if args.stages and (stale := stale_left_out(steps, stages)):
        _say(
            f"report not written: --stages left out {', '.join(stale)}, not up to date; run them "
            "(or --resume without --stages) for a report of one consistent run"
        )
        return 0
    write_report(paths.root)
    _say(f"done: {paths.report}; view it with: python workflow.py view --run-dir {paths.root}")
    return 0


def _check_given_forest(given: Path, paths: RunPaths) -> None:
    """`boundary_forest` names a file, and not the copy this run keeps of it."""
    if not given.is_file():
        raise BoundaryForestError(f"boundary_forest {given}: no such file")
    if given.resolve() == paths.boundary_forest.resolve():
        raise BoundaryForestError(
            f"boundary_forest {given} is this run's own copy: name the file of the run that learned it"
        )


def status(args: argparse.Namespace) -> int:
    """What a run has done, from its stamps, monitoring.db and files; starts nothing."""
    from pipeline.data.staging import reads_in_place
    from pipeline.inference.blocks import block_progress_path
    from pipeline.run.run_config import load_run_config
    from pipeline.run.run_lock import holder
    from pipeline.run.run_report import failed_tasks, task_states
    from pipeline.training.train_metrics import last_metrics

    paths = RunPaths(Path(args.run_dir).resolve())
    if not paths.config.is_file() or not paths.site.is_file():
        raise FFNError(f"status: {paths.root} holds no run (no config.json / site.json)")
    config = load_run_config(paths.config)
    paths = replace(paths, eval_in_place=reads_in_place(config.data))
    source, spec = load_site_record(paths.site)
    steps = steps_of(config, paths, spec)
    print(f"run {config.name} in {paths.root} (site {source})")
    running = holder(paths.root)
    print(f"workflow: {running.describe() if running else 'no workflow has run here'}")
    print(f"code: {describe_code(paths.root)}")
    print("stamps (what is done and valid now):", *describe_plan(steps, plan_run(steps)), sep="\n")
    for step in [s for s in steps if s.task.stage == "infer"]:
        progress = block_progress_path(step.task.outputs[0])
        if record := _progress_of(progress, {}):  # a block begun and not finished
            when = time.strftime("%H:%M:%S", time.localtime(progress.stat().st_mtime))
            print(f"  at {when}: {describe_progress(step.task.name, record)}")
    db = paths.monitoring_db
    if states := task_states(db):
        counts = {stage: {s: v.count(s) for s in set(v)} for stage, v in states.items()}
        print(
            "last Parsl run (monitoring.db):",
            *(f"  {st:<10} {c}" for st, c in counts.items()),
            sep="\n",
        )
    for app, output, error in failed_tasks(db):
        print(f"  failed: {app} -> {output}: {error}")
    if (metrics := last_metrics(paths.train_dir / "metrics.csv")) is not None:
        print(
            f"training: step {metrics['step']:.0f}/{config.train.max_steps}, loss {metrics['loss']:.4f}, "
            f"{metrics['fov_per_s']:.1f} FOV/s"
        )
    runs = sorted(paths.runinfo.glob("[0-9][0-9][0-9]"))
    latest = runs[-1] if runs else paths.runinfo
    train_logs = (
        paths.study_cells / "*" / "train.log" if config.study.rank_counts else paths.train_log
    )
    print(f"logs: {train_logs}, {latest / 'parsl.log'}, {latest / 'submit_scripts'}/")
    return 0


def view(args: argparse.Namespace) -> int:
    from pipeline.export.viewer import serve_forever

    folder = Path(args.run_dir) / LAYOUT["precomputed"]
    serve_forever(folder, args.port, args.segments, args.viewer_port)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "command", nargs="?", default="run", choices=["run", "study", "status", "view"]
    )
    parser.add_argument(
        "--site",
        help="local, theta, polaris, slurm, or a path to a site module (default: local; with "
        "--resume the site the run recorded)",
    )
    parser.add_argument(
        "--move-site", action="store_true",
        help="with --resume: go on on --site (its current settings) instead of the run's own site",
    )  # fmt: skip
    parser.add_argument(
        "--config",
        help="TOML of run settings (see configs/) over each section's own defaults "
        "(pipeline/run/run_config.py); relative paths in it are relative to the file; default: the "
        "demo, or with --resume the run's own config.json",
    )
    parser.add_argument("--run-dir", help="default: data/runs/<name from the config>")
    parser.add_argument(
        "--account",
        help="allocation charged by batch jobs (default: $FFN_ACCOUNT, else the site's)",
    )
    parser.add_argument(
        "--queue", help="batch queue or partition (default: $FFN_QUEUE, else the site's)"
    )
    parser.add_argument(
        "--walltime", metavar="HH:MM:SS", help="walltime of the training's batch jobs"
    )
    parser.add_argument(
        "--cpu-queue", help="batch queue of the single-process tasks' jobs (default: --queue's)"
    )
    parser.add_argument(
        "--cpu-walltime", metavar="HH:MM:SS",
        help="walltime of the batch jobs of single-process tasks (inference, export, ...)",
    )  # fmt: skip
    parser.add_argument(
        "--train-nodes", type=int, metavar="N",
        help="nodes the training uses, and so the size of its batch job (the config's train_nodes; "
        "default: the site's nodes_per_block)",
    )  # fmt: skip
    parser.add_argument(
        "--resume", action="store_true", help="reuse what an earlier run in --run-dir finished"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the DAG and site settings; run nothing"
    )
    parser.add_argument(
        "--stages", nargs="+", choices=STAGES, metavar="STAGE",
        help=f"run only these ({', '.join(STAGES)}); the others' outputs must exist from an earlier run",
    )  # fmt: skip
    parser.add_argument("--port", type=int, default=0, help="view: data server port (0 = any free)")
    parser.add_argument(
        "--viewer-port", type=int, default=0, help="view: Neuroglancer port (0 = any free)"
    )
    parser.add_argument(
        "--segments", type=int, nargs="+", metavar="ID",
        help="view: the segments to show, e.g. a body's pieces from the report (default: the largest)",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "status":
            if not args.run_dir:
                raise FFNError("status needs --run-dir")
            return status(args)
        if args.command == "view":
            if not args.run_dir:
                raise FFNError("view needs --run-dir")
            return view(args)
        return run(args)
    except FFNError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
