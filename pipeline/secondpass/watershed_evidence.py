"""Second-pass evidence from the learned watershed (issue 58): two touching FFN segments that lie
mostly inside one segment of the learned watershed, with little boundary between them by the
forest's map, are taken for one object.

Why: FFN reads a dark, thin body's cytoplasm as membrane (its grey is the membranes' own) and
cuts it into pieces; the forest's features (Hessian eigenvalues at several scales, not grey
alone) keep more of such a body in one basin (BENCHMARKS.md, "Why FFN cuts the dark body").

Everything here adds up over the parts of a large volume: overlap counts and contact sums of
each part are summed before any decision, so the rule is the same part by part as on the whole.
"""

import numpy as np

from pipeline.evaluation.scores import OverlapCounts


def dominant_basins(overlaps: OverlapCounts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(segments, basins, shares): each segment of `overlaps` (segment ids as its "truth", basin
    ids as its "prediction"), the basin holding most of its voxels and the share it holds (of
    the segment's voxels, basin 0 included in the total, never dominant)."""
    segments, first = np.unique(overlaps.truth_ids, return_index=True)
    totals = np.add.reduceat(overlaps.voxels, first) if len(first) else np.zeros(0, np.int64)
    basin_voxels = np.where(overlaps.predicted_ids > 0, overlaps.voxels, 0)
    # Largest basin overlap per segment: sort by (segment, voxels) and take each group's last.
    order = np.lexsort((basin_voxels, overlaps.truth_ids))
    last = np.r_[first[1:], len(order)] - 1
    best = order[last] if len(order) else order
    shares = basin_voxels[best] / np.maximum(totals, 1)
    basins = np.where(basin_voxels[best] > 0, overlaps.predicted_ids[best], 0)
    return segments, basins.astype(np.uint64), shares


def contact_boundary_sums(
    segmentation: np.ndarray, boundary: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pairs (N, 2) with a < b, sums, faces): for each pair of touching non-zero segments, the
    sum over their shared voxel faces of the two voxels' mean P(boundary), and the faces."""
    pairs, values = [], []
    for axis in range(3):
        low, high = [slice(None)] * 3, [slice(None)] * 3
        low[axis], high[axis] = slice(None, -1), slice(1, None)
        u, v = segmentation[tuple(low)], segmentation[tuple(high)]
        touching = (u != v) & (u > 0) & (v > 0)
        a, b = u[touching], v[touching]
        pairs.append(np.stack([np.minimum(a, b), np.maximum(a, b)], axis=1))
        values.append((boundary[tuple(low)][touching] + boundary[tuple(high)][touching]) / 2)
    return summed_contacts(np.concatenate(pairs), np.concatenate(values), None)


def summed_contacts(
    pairs: np.ndarray, sums: np.ndarray, faces: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of the same pair added up (`faces` None: one face per row), pairs sorted."""
    faces = np.ones(len(pairs), np.int64) if faces is None else faces
    ids, group = np.unique(pairs.astype(np.uint64).reshape(-1, 2), axis=0, return_inverse=True)
    group = group.reshape(-1)
    return (
        ids,
        np.bincount(group, sums, len(ids)),
        np.bincount(group, faces, len(ids)).astype(np.int64),
    )


def supported_pairs(
    pairs: np.ndarray,
    contact_boundary: np.ndarray,
    dominant: tuple[np.ndarray, np.ndarray, np.ndarray],
    min_share: float,
    max_boundary: float,
) -> np.ndarray:
    """The rows of `pairs` (N, 2) whose two segments have the same dominant basin, each with at
    least `min_share` of its voxels in it, and whose contact's mean P(boundary)
    (`contact_boundary`, per row) is at most `max_boundary`."""
    segments, basins, shares = dominant
    pairs = np.asarray(pairs, np.uint64).reshape(-1, 2)
    where = np.searchsorted(segments, pairs)
    known = np.all(where < len(segments), axis=1)
    where = np.minimum(where, max(len(segments) - 1, 0))
    known &= np.all(segments[where] == pairs, axis=1) if len(segments) else False
    basin, share = basins[where], shares[where]
    keep = (
        known
        & (basin[:, 0] == basin[:, 1])
        & (basin[:, 0] > 0)
        & (share.min(axis=1) >= min_share)
        & (np.asarray(contact_boundary) <= max_boundary)
    )
    return pairs[keep]
