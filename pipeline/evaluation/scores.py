"""Segmentation quality against ground truth, and a classical baseline to compare FFN with.

Scores ignore voxels whose ground truth is 0 (membranes, unlabeled). Predicted 0s (voxels left
unsegmented) count as one more segment for VI and adapted Rand, so unsegmented voxels of several
objects cost merge error; the split and merge counts leave them out.

  * Variation of information (bits), split part H(prediction | truth) and merge part
    H(truth | prediction) (scikit-image `variation_of_information`).
  * Adapted Rand error (SNEMI3D, scikit-image `adapted_rand_error`), with its precision (pairs
    together in both / pairs together in the prediction) and recall (... / in the truth).
  * Counts: a ground-truth object is *split* when two or more predicted segments each cover a
    substantial part of it; a predicted segment is a *merge* when it covers substantial parts of
    two or more ground-truth objects. Substantial: at least `min_overlap_voxels` voxels and at
    least `min_overlap_fraction` of the ground-truth object.

The baseline is a seeded watershed: markers at the h-maxima of the distance transform that FFN's
seeds come from (`pipeline.inference.flood_fill.edge_distance`), flooding the smoothed, inverted image
(membranes are dark in EM, so they become the ridges).

CLI: `python -m pipeline.cli.metrics --segmentation seg.h5:segmentation --labels vol.h5:labels
[--raw vol.h5:raw] [--output scores.json]`.
"""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import cc3d
import fastremap
import numpy as np
from scipy import sparse
from skimage.metrics import adapted_rand_error, variation_of_information

from pipeline.core.atomic import atomic_path
from pipeline.core.errors import ConfigError, VolumeShapeError
from pipeline.core.roi import Roi
from pipeline.data.volumes import label_ids

if TYPE_CHECKING:
    import h5py

_NO_IMAGE = np.empty(0)


@dataclass(frozen=True)
class SegmentationScores:
    """Scores of one segmentation against ground truth; `to_dict` is JSON-ready."""

    vi_split: float  # bits, H(prediction | truth): over-segmentation
    vi_merge: float  # bits, H(truth | prediction): under-segmentation
    adapted_rand_error: float
    adapted_rand_precision: float
    adapted_rand_recall: float
    gt_objects: int
    segments: int  # non-zero predicted ids on ground-truth voxels
    split_objects: int  # ground-truth objects split substantially
    merged_segments: int  # predicted segments that substantially cover >= 2 objects
    unsegmented_fraction: float  # ground-truth voxels the prediction left at 0
    voxels: int  # ground-truth voxels scored

    @property
    def vi(self) -> float:
        return self.vi_split + self.vi_merge

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"vi": self.vi}


def _renumbered(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`values` as int64 indices 1..n, and the value of each index (index i: `ids[i - 1]`)."""
    renumbered, mapping = fastremap.renumber(np.array(values), preserve_zero=False)
    ids = np.zeros(len(mapping), values.dtype)
    ids[np.fromiter(mapping.values(), np.int64, len(mapping)) - 1] = np.fromiter(
        mapping.keys(), values.dtype, len(mapping)
    )
    return renumbered.astype(np.int64), ids


@dataclass(frozen=True)
class OverlapCounts:
    """Voxel counts of each (truth id, predicted id) pair over the voxels with truth > 0: all
    that the scores need. Counts of the blocks of a large volume add up (`+`), so a volume is
    scored without ever being whole in memory."""

    truth_ids: np.ndarray  # uint64, one per pair
    predicted_ids: np.ndarray  # uint64
    voxels: np.ndarray  # int64

    @classmethod
    def of(cls, truth: np.ndarray, prediction: np.ndarray) -> "OverlapCounts":
        """The counts of two label arrays of one shape (a whole volume or one block)."""
        if prediction.shape != truth.shape:
            raise VolumeShapeError(
                f"segmentation shape {prediction.shape} differs from ground truth {truth.shape}"
            )
        labeled = truth > 0
        pairs = np.stack(
            [truth[labeled].astype(np.uint64), prediction[labeled].astype(np.uint64)], axis=1
        )
        return cls._of_pairs(pairs, np.ones(len(pairs), np.int64))

    @classmethod
    def _of_pairs(cls, pairs: np.ndarray, voxels: np.ndarray) -> "OverlapCounts":
        # Each column's ids renumbered 1..n by hashing (fastremap), then each pair as one integer:
        # no sort of the voxels, only of the distinct pairs (np.unique over rows is ~20x slower).
        pairs = pairs.reshape(-1, 2)
        truth, truth_ids = _renumbered(pairs[:, 0])
        predicted, predicted_ids = _renumbered(pairs[:, 1])
        width = len(predicted_ids) + 1
        pair, pair_keys = _renumbered(truth * width + predicted)
        summed = np.bincount(pair, weights=voxels, minlength=len(pair_keys) + 1)[1:]
        truth_of, predicted_of = (
            truth_ids[pair_keys // width - 1],
            predicted_ids[pair_keys % width - 1],
        )
        order = np.lexsort((predicted_of, truth_of))
        return cls(truth_of[order], predicted_of[order], summed[order].astype(np.int64))

    def __add__(self, other: "OverlapCounts") -> "OverlapCounts":
        return OverlapCounts.total([self, other])

    @classmethod
    def total(cls, parts: Sequence["OverlapCounts"]) -> "OverlapCounts":
        """The counts of the parts together (their voxels apart): one pass, whatever their number."""
        parts = [p for p in parts if len(p.voxels)]
        if len(parts) <= 1:
            return parts[0] if parts else cls.empty()
        pairs = np.concatenate([np.stack([p.truth_ids, p.predicted_ids], axis=1) for p in parts])
        return cls._of_pairs(pairs, np.concatenate([p.voxels for p in parts]))

    @classmethod
    def empty(cls) -> "OverlapCounts":
        """The counts of no labeled voxel."""
        return cls(np.zeros(0, np.uint64), np.zeros(0, np.uint64), np.zeros(0, np.int64))

    def save(self, path: "str | Path") -> None:
        """Write the counts to `path` (.npz), atomically."""
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            np.savez(
                f, truth_ids=self.truth_ids, predicted_ids=self.predicted_ids, voxels=self.voxels
            )

    @classmethod
    def load(cls, path: "str | Path") -> "OverlapCounts":
        with np.load(path) as f:
            return cls(f["truth_ids"], f["predicted_ids"], f["voxels"])


_COUNT_VOXELS = 2**20  # voxels counted at a time by `count_overlaps`


def count_overlaps(
    truth: "np.ndarray | h5py.Dataset",
    prediction: "np.ndarray | h5py.Dataset",
    region: Roi | None = None,
    slab_voxels: int = 2**24,
) -> OverlapCounts:
    """`OverlapCounts` of two volumes of one shape (arrays, or datasets read part by part) over
    `region` (default: all), read in slabs along z of about `slab_voxels` voxels: the memory
    is a slab's, whatever the volume's size."""
    if tuple(prediction.shape) != tuple(truth.shape):
        raise VolumeShapeError(
            f"segmentation shape {tuple(prediction.shape)} differs from ground truth {tuple(truth.shape)}"
        )
    region = region or Roi.whole(truth.shape)
    plane = int(np.prod(region.shape[1:]))
    depth = max(1, slab_voxels // max(plane, 1))
    (z0, z1), rows, cols = (
        (region.start[0], region.stop[0]),
        region.slices[1],
        region.slices[2],
    )
    # Counted in thinner slices than read: the counting's temporaries (about 60 bytes a voxel)
    # stay in cache; on 256^3 voxels, slices of 2^20 voxels took a third of the time of one.
    step = max(1, _COUNT_VOXELS // max(plane, 1))
    parts = []
    for z in range(z0, z1, depth):
        slab = (slice(z, min(z + depth, z1)), rows, cols)
        truth_slab = label_ids(np.asarray(truth[slab]), "ground truth")
        predicted_slab = label_ids(np.asarray(prediction[slab]), "segmentation")
        parts += [
            OverlapCounts.of(truth_slab[k : k + step], predicted_slab[k : k + step])
            for k in range(0, len(truth_slab), step)
        ]
    return OverlapCounts.total(parts)


def score_segmentation(
    segmentation: np.ndarray,
    ground_truth: np.ndarray,
    *,
    min_overlap_voxels: int = 20,
    min_overlap_fraction: float = 0.1,
) -> SegmentationScores:
    """Compare a (z, y, x) segmentation with ground truth of the same shape (0 = ignored)."""
    return score_counts(
        OverlapCounts.of(ground_truth, segmentation),
        min_overlap_voxels=min_overlap_voxels,
        min_overlap_fraction=min_overlap_fraction,
    )


def score_counts(
    counts: OverlapCounts, *, min_overlap_voxels: int = 20, min_overlap_fraction: float = 0.1
) -> SegmentationScores:
    """The scores of `OverlapCounts` (of a whole volume, or summed over its blocks)."""
    if not counts.voxels.sum():
        raise ConfigError("ground truth has no labeled voxel: nothing to score")
    rows, _ = fastremap.renumber(counts.truth_ids, preserve_zero=True)
    cols, _ = fastremap.renumber(counts.predicted_ids, preserve_zero=True)
    table = sparse.csr_array(
        (counts.voxels.astype(np.float64), (rows.astype(np.int64), cols.astype(np.int64)))
    )
    # scikit-image checks that two images agree in shape, then scores only the table.
    vi_split, vi_merge = variation_of_information(_NO_IMAGE, _NO_IMAGE, table=table / table.sum())
    are, *_ = adapted_rand_error(_NO_IMAGE, _NO_IMAGE, table=table)
    # Precision and recall from their definitions (scikit-image 0.26 returns them swapped).
    together = float(table.data @ table.data - table.sum())
    truth_sizes, predicted_sizes = table.sum(axis=1), table.sum(axis=0)
    recall = together / float(truth_sizes @ truth_sizes - truth_sizes.sum())
    precision = together / float(predicted_sizes @ predicted_sizes - predicted_sizes.sum())

    coo = table.tocoo()
    rows, cols, counts = coo.row, coo.col, coo.data
    substantial = (counts >= min_overlap_voxels) & (
        counts >= min_overlap_fraction * truth_sizes[rows]
    )
    substantial &= cols > 0  # being left unsegmented is not a split piece nor a merge
    pieces = np.bincount(rows[substantial], minlength=table.shape[0])
    objects_per_segment = np.bincount(cols[substantial], minlength=table.shape[1])
    return SegmentationScores(
        vi_split=float(vi_split),
        vi_merge=float(vi_merge),
        adapted_rand_error=float(are),
        adapted_rand_precision=precision,
        adapted_rand_recall=recall,
        gt_objects=int(np.count_nonzero(truth_sizes[1:])),
        segments=int(np.count_nonzero(predicted_sizes[1:])),
        split_objects=int(np.count_nonzero(pieces >= 2)),
        merged_segments=int(np.count_nonzero(objects_per_segment >= 2)),
        unsegmented_fraction=float(predicted_sizes[0] / table.sum()),
        voxels=int(table.sum()),
    )


def truth_in_pieces(truth: np.ndarray) -> dict:
    """What a part's own ground truth costs every segmentation of it. A body that lies in several
    pieces within the part (26-connected; they join outside it) is split there by any segmentation
    whose segments are connected and merge nothing: the ground truth cut into its pieces scores
    that VI split. {"vi_split": bits, "bodies": labelled bodies, "bodies_in_pieces": how many}."""
    pieces = cc3d.connected_components(truth, connectivity=26, out_dtype=np.uint64)
    body_of = fastremap.component_map(pieces, truth)
    bodies = np.array([body for piece, body in body_of.items() if piece], np.uint64)
    _, per_body = np.unique(bodies, return_counts=True)
    return {
        "vi_split": score_counts(OverlapCounts.of(truth, pieces)).vi_split,
        "bodies": len(per_body),
        "bodies_in_pieces": int(np.count_nonzero(per_body > 1)),
    }


def largest_errors(counts: OverlapCounts, n: int = 5, overlaps: int = 4) -> dict:
    """Where a proofreader would look first: the `n` ground-truth bodies that add most to VI
    split and the `n` segments that add most to VI merge (each object's share, bits; all of them
    sum to the scores' VI split and merge; segment 0, the unsegmented voxels, counts as the scores
    count it), each with its `overlaps` largest overlaps. {"split": [{"id", "voxels", "bits",
    "largest": [[other id, voxels], ...]}, ...], "merge": [...]}, largest share first."""
    total = counts.voxels.sum()
    if not total:
        raise ConfigError("ground truth has no labeled voxel: nothing to score")

    def shares(ids: np.ndarray, others: np.ndarray) -> list[dict]:
        order = np.lexsort((-counts.voxels, ids))  # by object, its largest overlap first
        ids, others, voxels = ids[order], others[order], counts.voxels[order]
        objects, first, pairs = np.unique(ids, return_index=True, return_counts=True)
        sizes = np.add.reduceat(voxels, first)
        fraction = voxels / np.repeat(sizes, pairs)
        bits = -np.add.reduceat(voxels * np.log2(fraction), first) / total
        rows = []
        for i in np.argsort(-bits, kind="stable")[:n]:
            if bits[i] <= 0:
                break
            largest = slice(first[i], first[i] + min(pairs[i], overlaps))
            rows.append({
                "id": int(objects[i]), "voxels": int(sizes[i]), "bits": float(bits[i]),
                "largest": [[int(o), int(v)] for o, v in zip(others[largest], voxels[largest], strict=True)],
            })  # fmt: skip
        return rows

    return {
        "split": shares(counts.truth_ids, counts.predicted_ids),
        "merge": shares(counts.predicted_ids, counts.truth_ids),
    }


# ---------------------------------------------------------------------------------------------
# Baseline


def format_scores(scores: dict[str, dict]) -> str:
    """A small table, one row per method."""
    columns = (
        "vi_split",
        "vi_merge",
        "vi",
        "adapted_rand_error",
        "segments",
        "split_objects",
        "merged_segments",
    )
    lines = [f"{'method':<14}" + "".join(f"{c:>19}" for c in columns)]
    for method, row in scores.items():
        cells = (f"{row[c]:.4f}" if isinstance(row[c], float) else str(row[c]) for c in columns)
        lines.append(f"{method:<14}" + "".join(f"{c:>19}" for c in cells))
    return "\n".join(lines)
