"""The evaluation stage: FFN's segmentation and the watershed baseline, scored on one volume.

FFN's scores come from overlap counts read slab by slab (`pipeline.metrics.count_overlaps`), so
a volume need not fit in memory; the watershed baseline segments the whole image in one process
and is for volumes that do (`WatershedConfig.enabled`).
"""

import json
import time
from collections.abc import Sequence
from pathlib import Path

from pipeline.atomic import atomic_path
from pipeline.metrics import (
    OverlapCounts,
    WatershedConfig,
    count_overlaps,
    score_counts,
    watershed_baseline,
)
from pipeline.roi import Roi
from pipeline.volumes import label_ids, open_volume, read_raw


def evaluate_volume(
    raw_spec: str,
    labels_spec: str,
    segmentation_spec: str,
    watershed: WatershedConfig | None = None,
    output: str | Path | None = None,
    scored: Roi | None = None,
    voxel_size_nm: Sequence[float] | None = None,
) -> dict:
    """{"ffn": scores, "watershed": scores, "watershed_seconds": s} (the watershed's only when
    enabled); written to `output` if given. Only the `scored` part of the volume (default: all)
    counts; the watershed segments all of it."""
    watershed = watershed or WatershedConfig()
    with open_volume(labels_spec) as truth, open_volume(segmentation_spec) as segmentation:
        part = scored or Roi.whole(truth.shape)
        result = {"ffn": score_counts(count_overlaps(truth, segmentation, part)).to_dict()}
        truth_part = label_ids(truth[part.slices], labels_spec) if watershed.enabled else None
    if watershed.enabled:
        started = time.perf_counter()
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
