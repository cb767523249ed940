"""The evaluation's steps: overlap counts per region, the learned watershed, the scores."""

from __future__ import annotations

import apps.evaluate
from apps.plan.resolved import RunPlan
from apps.plan.step import Step, task_step
from pipeline.core import config_io


def evaluate_steps(plan: RunPlan) -> list[Step]:
    """The FFN segmentation and the watershed baseline scored against the labels: a task per
    region counts overlaps, the last sums and scores (apps/evaluate.py)."""
    config, paths = plan.config, plan.paths
    from pipeline.evaluation.evaluate import count_regions

    regions = count_regions(plan.eval_shape, config.evaluation)
    scored = plan.scored_segmentations
    steps, counts = [], []
    for key, folder in scored.items():
        segmented = [paths.eval_volume, plan.full_resolution(folder)]
        # The export's segmentation is "ffn"; the steps before it have folders of their own.
        name = "" if key == "ffn" else f"{key} "
        paths_of = [paths.counts_dir / name.strip() / f"{k}.npz" for k in range(len(regions))]
        steps += [
            task_step(f"evaluate[count {name}{k}]", {"region": str(region)}, segmented, [path],
                      apps.evaluate.count_region, str(folder))
            for k, (region, path) in enumerate(zip(regions, paths_of, strict=True))
        ]  # fmt: skip
        counts += paths_of
    also = list(scored)[1:]
    # Only with a second pass: runs made before keep their evaluation.
    settings = {"watershed": config_io.to_dict(config.watershed)} | ({"also": also} if also else {})
    if plan.learns_baseline:
        parts = [paths.boundary_forest, plan.selection_volume, paths.eval_volume]
        learned = [paths.learned_baseline, paths.learned_baseline_record]
        # The tuning grid's settings are pipeline.evaluation.learned_watershed's defaults.
        steps.append(task_step("evaluate[learned watershed]", {"baseline": "learned watershed"}, parts,
                               learned, apps.evaluate.learned_baseline))  # fmt: skip
        settings, counts = settings | {"learned_watershed": True}, counts + learned[:1]
    steps.append(task_step("evaluate", settings, [paths.eval_volume, *counts],
                           [paths.evaluation], apps.evaluate.evaluate))  # fmt: skip
    return steps
