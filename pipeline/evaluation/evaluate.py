"""The evaluation stage: FFN's segmentation and the watershed baseline, scored on one volume.

FFN's scores come from overlap counts (`pipeline.evaluation.scores.OverlapCounts`), which add up: a task
per region of the volume (`count_regions`, `count_region`) counts its part, read slab by slab,
and one last task sums them and scores (`score_volume`), so no task holds the volume and the
counting spreads over the workers. The baseline is a watershed for volumes that fit in memory
(`WatershedConfig.enabled`): where the run has a labelled training part, the one a lab would
tune (`learned_baseline`, a task of its own: over the map of a boundary forest learned there,
`learn_boundary_forest`, tuned on the selection part); else the edge-distance watershed,
segmented in that last task. With the baseline (the scored part in memory) every row also gets
its expected run length along the ground truth's skeletons, made once for them all
(`pipeline.evaluation.erl`).
`evaluate_volume` does it all in one process.
"""

import json
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.core.atomic import atomic_path
from pipeline.core.errors import BoundaryForestError, ConfigError, VolumeShapeError, first_line
from pipeline.core.roi import ZYX, Roi, tiles
from pipeline.data.staging import StagedVolume
from pipeline.data.volumes import (
    label_ids,
    open_volume,
    read_header,
    read_labels,
    read_raw,
    write_volumes,
)
from pipeline.evaluation.erl import (
    SkeletonConfig,
    Skeletons,
    run_length,
    run_length_at,
    skeletons_of,
)
from pipeline.evaluation.scores import (
    OverlapCounts,
    count_overlaps,
    largest_errors,
    score_counts,
    truth_in_pieces,
)
from pipeline.evaluation.watershed import WatershedConfig, watershed_baseline


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


def segments_at_nodes(
    spec: str, skeletons: Skeletons, part: Roi, truth_shape: ZYX, slab_voxels: int = 2**24
) -> np.ndarray:
    """The segment id at each skeleton node (voxel indices within `part`) of the segmentation
    `spec` (of the ground truth's `truth_shape`), read in slabs along z of about `slab_voxels`
    voxels: a slab's memory, not the part's."""
    found = np.zeros(len(skeletons.nodes), np.uint64)
    depth = max(1, slab_voxels // max(int(np.prod(part.shape[1:])), 1))
    with open_volume(spec) as segmentation:
        if tuple(segmentation.shape) != tuple(truth_shape):
            raise VolumeShapeError(
                f"{spec}: segmentation shape {tuple(segmentation.shape)} differs from ground truth {tuple(truth_shape)}"
            )
        for z in range(0, part.shape[0], depth):
            inside = (skeletons.nodes[:, 0] >= z) & (skeletons.nodes[:, 0] < z + depth)
            if not inside.any():
                continue
            rows = slice(part.start[0] + z, part.start[0] + min(z + depth, part.shape[0]))
            slab = label_ids(np.asarray(segmentation[(rows, *part.slices[1:])]), spec)
            z_, y, x = skeletons.nodes[inside].T
            found[inside] = slab[z_ - z, y, x]
    return found


def score_volume(
    counts: OverlapCounts,
    raw_spec: str,
    labels_spec: str,
    watershed: WatershedConfig | None = None,
    output: str | Path | None = None,
    scored: Roi | None = None,
    voxel_size_nm: Sequence[float] | None = None,
    also: dict[str, OverlapCounts] | None = None,
    learned: str | None = None,
    segmentations: dict[str, str] | None = None,
    skeleton_config: SkeletonConfig | None = None,
) -> dict:
    """{"ffn": scores, "watershed": scores, "watershed_seconds": s} (the watershed's only when
    enabled) from FFN's `counts` over the `scored` part (default: all); written to `output` if
    given. The watershed segments the whole image and is scored on the same part. `also`: more
    segmentations' counts to score under their keys (FFN's steps before its second pass's end).
    `learned`: the spec of `learned_baseline`'s segmentation, scored as "learned_watershed"
    instead of the edge-distance watershed. "largest_errors": the bodies FFN splits most and
    the segments that merge most (`largest_errors`). With the baseline (the part in memory) also
    "truth_in_pieces": the split the part's own ground truth costs (`truth_in_pieces`), and the
    ground truth's skeletons ("skeletons": `Skeletons.record`, made with `skeleton_config`) with
    each row's ERL, merges and splits along them ("erl_nm", "erl_merges", "erl_splits"): the
    baseline's, and those of the rows `segmentations` names (key -> the spec of its
    segmentation: "ffn" and the keys of `also`); "erl_seconds" their time."""
    watershed = watershed or WatershedConfig()
    result = {"ffn": score_counts(counts).to_dict(), "largest_errors": largest_errors(counts)}
    for key, more in (also or {}).items():
        result[key] = score_counts(more).to_dict()
    if watershed.enabled:
        with open_volume(labels_spec) as truth:
            truth_shape = tuple(truth.shape)
            part = scored or Roi.whole(truth_shape)
            truth_part = label_ids(truth[part.slices], labels_spec)
        result["truth_in_pieces"] = truth_in_pieces(truth_part)
        started = time.perf_counter()
        voxel_size = read_header(labels_spec, voxel_size_nm, labels=True).voxel_size_nm
        skeletons = skeletons_of(truth_part, voxel_size, skeleton_config)
        result["skeletons"] = skeletons.record()
        for key, spec in (segmentations or {}).items():
            segments = segments_at_nodes(spec, skeletons, part, truth_shape)
            result[key] |= run_length_at(skeletons, segments).to_dict()
        result["erl_seconds"] = round(time.perf_counter() - started, 3)
        if learned:
            with open_volume(learned) as segmentation:
                baseline = label_ids(segmentation[part.slices], learned)
            result["learned_watershed"] = (
                score_counts(OverlapCounts.of(truth_part, baseline)).to_dict()
                | run_length(skeletons, baseline).to_dict()
            )
        else:
            started = time.perf_counter()
            raw, _ = read_raw(raw_spec, voxel_size_nm)
            baseline = watershed_baseline(raw, watershed)[part.slices]
            result["watershed"] = score_counts(OverlapCounts.of(truth_part, baseline)).to_dict()
            result["watershed_seconds"] = round(time.perf_counter() - started, 3)
            result["watershed"] |= run_length(skeletons, baseline).to_dict()
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
    """`score_volume` of the whole volume's counts, counted in this process (FFN's row is the
    segmentation's, ERL included)."""
    with open_volume(labels_spec) as truth:
        whole = Roi.whole(truth.shape)
    counts = count_region(labels_spec, segmentation_spec, whole, scored)
    return score_volume(
        counts, raw_spec, labels_spec, watershed, output, scored, voxel_size_nm,
        segmentations={"ffn": segmentation_spec},
    )  # fmt: skip


def image_and_labels(part: StagedVolume) -> tuple[np.ndarray, np.ndarray]:
    """A labelled staged part's image and labels, whole, checked as every reader checks them."""
    return (
        read_raw(part.raw, part.voxel_size_nm)[0],
        read_labels(part.labels, part.voxel_size_nm)[0],
    )


def learn_boundary_forest(train: StagedVolume, path: str | Path) -> None:
    """The learned watershed's forest (its default settings) learned on `train`, saved
    atomically to `path` (joblib): the baseline's map, and the one the second pass's fill
    floods part by part."""
    import joblib

    from pipeline.evaluation.learned_watershed import BoundaryForestConfig, train_boundary_forest

    forest = train_boundary_forest(*image_and_labels(train), BoundaryForestConfig())
    with atomic_path(path) as tmp:
        joblib.dump(forest, tmp)


def load_boundary_forest(path: str | Path):
    """The forest `learn_boundary_forest` saved (a scikit-learn RandomForestClassifier), checked;
    `BoundaryForestError` for a file that is not one."""
    import joblib

    from pipeline.evaluation.learned_watershed import BoundaryForestConfig, check_boundary_forest

    if not Path(path).is_file():
        raise BoundaryForestError(f"{path}: no such file")
    try:
        forest = joblib.load(path)
    except Exception as error:  # a truncated pickle, another format: each library its own error
        raise BoundaryForestError(
            f"{path}: not readable as a forest ({first_line(error)})"
        ) from error
    check_boundary_forest(forest, BoundaryForestConfig(), str(path))
    return forest


def copy_boundary_forest(source: str | Path, path: str | Path) -> None:
    """A forest another run learned (its `learn_boundary_forest` file), checked, then copied
    atomically to `path`."""
    load_boundary_forest(source)
    with atomic_path(path) as tmp:
        shutil.copyfile(source, tmp)


def learned_baseline(
    forest_path: str | Path,
    select: StagedVolume,
    volume: StagedVolume,
    segmentation_path: str | Path,
    record_path: str | Path,
) -> None:
    """The learned-boundary watershed of `volume` (over the map of the forest at `forest_path`,
    learned on the training part; tuned on `select`), written atomically: the segmentation as
    `segmentation_path:segmentation` (HDF5, the whole volume with its context) and the record
    (parameters, tuning trials, seconds)."""
    # scikit-learn takes seconds to import: not when the workflow only plans its tasks.
    from pipeline.evaluation.learned_watershed import learned_watershed

    raw, voxel_size = read_raw(volume.raw, volume.voxel_size_nm)
    forest = load_boundary_forest(forest_path)
    result = learned_watershed(forest, image_and_labels(select), raw)
    write_volumes(segmentation_path, {"segmentation": result.segmentation}, voxel_size)
    with atomic_path(record_path) as tmp:
        tmp.write_text(json.dumps(result.record(), indent=2) + "\n")
