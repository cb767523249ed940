"""The evaluation stage: FFN's segmentation and the watershed baseline, scored on one volume."""

import json
import time
from pathlib import Path

from pipeline.atomic import atomic_path
from pipeline.metrics import WatershedConfig, score_segmentation, watershed_baseline
from pipeline.roi import Roi
from pipeline.volumes import read_labels, read_volume_pair


def evaluate_volume(
    raw_spec: str,
    labels_spec: str,
    segmentation_spec: str,
    watershed: WatershedConfig | None = None,
    output: str | Path | None = None,
    scored: Roi | None = None,
) -> dict:
    """{"ffn": scores, "watershed": scores, "watershed_seconds": s}; written to `output` if given.
    Both methods segment the whole volume; only the `scored` part of it (default: all) counts."""
    volume = read_volume_pair(raw_spec, labels_spec)
    segmentation, _ = read_labels(segmentation_spec)
    started = time.perf_counter()
    baseline = watershed_baseline(volume.raw, watershed or WatershedConfig())
    part = (scored or Roi.whole(volume.shape)).slices
    truth = volume.labels[part]
    result = {
        "ffn": score_segmentation(segmentation[part], truth).to_dict(),
        "watershed": score_segmentation(baseline[part], truth).to_dict(),
        "watershed_seconds": round(time.perf_counter() - started, 3),
    }
    if scored is not None:
        result["scored_roi"] = str(scored)
    if output is not None:
        with atomic_path(output) as tmp:
            tmp.write_text(json.dumps(result, indent=2) + "\n")
    return result
