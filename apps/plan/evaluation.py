"""The evaluation's steps: overlap counts per region, the learned watershed, the scores."""

from __future__ import annotations

import apps.evaluate
from apps.contracts import CountRegion, Evaluate, LearnedBaseline
from apps.plan.resolved import RunPlan
from apps.plan.step import Step, task_step
from pipeline.core import config_io


def evaluate_steps(plan: RunPlan) -> list[Step]:
    """The FFN segmentation and the watershed baseline scored against the labels: a task per
    region counts overlaps, the last sums and scores (apps/evaluate.py)."""
    config, paths = plan.config, plan.paths
    from pipeline.evaluation.evaluate import count_regions
    from pipeline.export.skeletons import SkeletonConfig

    regions = count_regions(plan.eval_shape, config.evaluation)
    scored = plan.scored_segmentations
    steps, counts = [], []
    for key, folder in scored.items():
        segmented = {"volume": paths.eval_volume, "segmentation": plan.full_resolution(folder)}
        # The export's segmentation is "ffn"; the steps before it have folders of their own.
        name = "" if key == "ffn" else f"{key} "
        paths_of = [paths.counts_dir / name.strip() / f"{k}.npz" for k in range(len(regions))]
        steps += [
            task_step(f"evaluate[count {name}{k}]", {"region": str(region)},
                      CountRegion(**segmented, counts=path), apps.evaluate.count_region, str(folder))
            for k, (region, path) in enumerate(zip(regions, paths_of, strict=True))
        ]  # fmt: skip
        counts += paths_of
    also = list(scored)[1:]
    # Only with a second pass: runs made before keep their evaluation.
    settings = {"watershed": config_io.to_dict(config.watershed)} | ({"also": also} if also else {})
    if config.watershed.enabled:  # ERL's skeletons: made where the baseline holds the part
        settings["skeletons"] = config_io.to_dict(SkeletonConfig())
    learned = ()
    if plan.learns_baseline:
        files = LearnedBaseline(forest=paths.boundary_forest, tuned_on=plan.selection_volume, volume=paths.eval_volume,
                                segmentation=paths.learned_baseline, record=paths.learned_baseline_record)  # fmt: skip
        # The tuning grid's settings are pipeline.evaluation.learned_watershed's defaults.
        steps.append(task_step("evaluate[learned watershed]", {"baseline": "learned watershed"}, files,
                               apps.evaluate.learned_baseline))  # fmt: skip
        settings, learned = settings | {"learned_watershed": True}, (files.segmentation,)
    files = Evaluate(
        volume=paths.eval_volume, counts=tuple(counts),
        segmentations=tuple(plan.full_resolution(folder) for folder in scored.values()),
        learned=learned, evaluation=paths.evaluation,
    )  # fmt: skip
    folders = {key: str(folder) for key, folder in scored.items()}
    steps.append(task_step("evaluate", settings, files, apps.evaluate.evaluate, folders))
    return steps
