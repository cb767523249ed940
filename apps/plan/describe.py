"""What the dry run, the run and `status` print: the DAG, the model and what a step costs, a
running block's progress."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from apps.plan.resolved import RunPlan
from apps.plan.training import training_command

if TYPE_CHECKING:
    from pipeline.run.run_config import RunConfig


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


def describe_dag(plan: RunPlan) -> str:
    config, paths, site = plan.config, plan.paths, plan.site
    from site_configs import describe
    from site_configs.launch import expanded_launch_line

    blocks = plan.blocks
    baseline = (
        f"  baseline   learned watershed: forest of {paths.train_volume} -> {paths.boundary_forest}"
        f"{' (the fill floods its map too)' if config.agglomeration.fill_unsegmented else ''}, "
        f"tuned on {plan.selection_volume} -> {paths.learned_baseline}"
    )
    if config.pretrained_model:
        staged = [paths.train_volume, plan.selection_volume] if plan.learns_baseline else []
        return "\n".join([
            f"run {config.name} in {paths.root}: inference only with {config.pretrained_model}",
            f"  stage      -> {', '.join(map(str, dict.fromkeys([*staged, paths.eval_volume])))}",
            f"  infer      {len(blocks)} block(s) of {config.blocks.block_shape_zyx} (z, y, x), in parallel",
            *([baseline] if plan.learns_baseline else []),
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
        f"             $ {expanded_launch_line(site, launch, training_command(plan, launch))}",
        f"  select     on {paths.select_volume if config.data.has_select_part else paths.train_volume}"
        f" -> {paths.selection}",
        f"  infer      {len(blocks)} block(s) of {config.blocks.block_shape_zyx} (z, y, x), in parallel -> {paths.blocks_dir}",
        f"  stitch     -> {plan.full_resolution(plan.inference_passes[0].folder)}",
        *(
            [f"  consensus  with a second pass, seeds in the other order -> {plan.consensus_into}"]
            if config.agglomeration.consensus
            else []
        ),
        *([f"  agglomerate -> {paths.precomputed}"] if config.agglomeration.writes_layer else []),
        *(
            [
                f"             the merges -> {paths.merge_graph}, the merged objects -> {paths.merged}"
            ]
            if config.agglomeration.enabled
            else []
        ),
        *([baseline] if plan.learns_baseline else []),
        f"  evaluate   -> {paths.evaluation}"
        if plan.eval_has_labels
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
    precision = f" in {record['precision']}" if "precision" in record else ""
    return (
        f"{name} {record['block']}: {record['objects']} objects, {record['fov_evaluations']:,} FOV "
        f"evaluations, {record['fov_per_s']:.1f} FOV/s{precision}, "
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
