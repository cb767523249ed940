"""The evaluation stage: FFN's segmentation and the watershed baseline, scored on one volume.

FFN's scores come from overlap counts (`pipeline.metrics.OverlapCounts`), which add up: a task
per region of the volume (`count_regions`, `count_region`) counts its part, read slab by slab,
and one last task sums them and scores (`score_volume`), so no task holds the volume and the
counting spreads over the workers. The watershed baseline segments the whole image in that last
task and is for volumes that fit in memory (`WatershedConfig.enabled`). `evaluate_volume` does
it all in one process.
"""

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline.atomic import atomic_path
from pipeline.errors import ConfigError
from pipeline.metrics import (
    OverlapCounts,
    WatershedConfig,
    count_overlaps,
    score_counts,
    watershed_baseline,
)
from pipeline.roi import ZYX, Roi, tiles
from pipeline.volumes import label_ids, open_volume, read_raw


@dataclass(frozen=True)
class EvaluationConfig:
    """How the scoring is cut into tasks."""

    # Voxels per counting task along each axis: the volume's share of one task (its memory is a
    # slab's); 256^3 is counted in a few seconds.
    task_voxels: int = 256

    def __post_init__(self) -> None:
        if not (isinstance(self.task_voxels, int) and 16 <= self.task_voxels <= 4096):
            raise ConfigError(
                f"evaluation config: task_voxels must be an integer in [16, 4096], got {self.task_voxels!r}"
            )


def count_regions(shape_zyx: ZYX, config: EvaluationConfig) -> list[Roi]:
    """The regions of a volume of `shape_zyx` that counting tasks take, one each."""
    return tiles(Roi.whole(shape_zyx), (config.task_voxels,) * 3)


def count_region(
    labels_spec: str, segmentation_spec: str, region: Roi, scored: Roi | None = None
) -> OverlapCounts:
    """The overlap counts of `region` within the `scored` part (default: all)."""
    with open_volume(labels_spec) as truth, open_volume(segmentation_spec) as segmentation:
        part = region if scored is None else region.intersection(scored)
        if part is None:
            return OverlapCounts.empty()
        return count_overlaps(truth, segmentation, part)


def score_volume(
    counts: OverlapCounts,
    raw_spec: str,
    labels_spec: str,
    watershed: WatershedConfig | None = None,
    output: str | Path | None = None,
    scored: Roi | None = None,
    voxel_size_nm: Sequence[float] | None = None,
    also: dict[str, OverlapCounts] | None = None,
) -> dict:
    """{"ffn": scores, "watershed": scores, "watershed_seconds": s} (the watershed's only when
    enabled) from FFN's `counts` over the `scored` part (default: all); written to `output` if
    given. The watershed segments the whole image and is scored on the same part. `also`: more
    segmentations' counts to score under their keys (FFN's steps before its second pass's end)."""
    watershed = watershed or WatershedConfig()
    result = {"ffn": score_counts(counts).to_dict()}
    for key, more in (also or {}).items():
        result[key] = score_counts(more).to_dict()
    if watershed.enabled:
        started = time.perf_counter()
        with open_volume(labels_spec) as truth:
            part = scored or Roi.whole(truth.shape)
            truth_part = label_ids(truth[part.slices], labels_spec)
        raw, _ = read_raw(raw_spec, voxel_size_nm)
        baseline = watershed_baseline(raw, watershed)[part.slices]
        result["watershed"] = score_counts(OverlapCounts.of(truth_part, baseline)).to_dict()
        result["watershed_seconds"] = round(time.perf_counter() - started, 3)
    if scored is not None:
        result["scored_roi"] = str(scored)
    if output is not None:
        with atomic_path(output) as tmp:
            tmp.write_text(json.dumps(result, indent=2) + "\n")
    return result


def evaluate_volume(
    raw_spec: str,
    labels_spec: str,
    segmentation_spec: str,
    watershed: WatershedConfig | None = None,
    output: str | Path | None = None,
    scored: Roi | None = None,
    voxel_size_nm: Sequence[float] | None = None,
) -> dict:
    """`score_volume` of the whole volume's counts, counted in this process."""
    with open_volume(labels_spec) as truth:
        whole = Roi.whole(truth.shape)
    counts = count_region(labels_spec, segmentation_spec, whole, scored)
    return score_volume(counts, raw_spec, labels_spec, watershed, output, scored, voxel_size_nm)
