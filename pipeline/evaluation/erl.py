"""Expected run length (ERL) along ground-truth skeletons, the score the FFN paper (Januszewski
et al., Nature Methods 2018) reports first: how far, on average, one follows a neurite from a
random point of it before the segmentation errs.

The definition is funlib.evaluate's `expected_run_length` (github.com/funkelab/funlib.evaluate,
funlib/evaluate/run_length.py: `evaluate_skeletons` and `expected_run_length`), followed here:

  * each ground-truth body is skeletonized (kimimaro's TEASAR, `skeletons_of`); an edge's length
    is the distance in nm between its two nodes;
  * a segment *merges* when it holds nodes of two or more skeletons; every edge of a skeleton
    with a node in a merging segment counts as wrong (a skeleton merged anywhere scores 0);
  * an edge of an unmerged skeleton is *correct* when both its nodes lie in one segment; its
    *run* is all the correct edges of that skeleton in that segment (a segment left and entered
    again along the skeleton is one run: following the segment one sees both pieces);
  * ERL = sum over runs of (run length)^2 / (total length of every skeleton), in nm.

One departure from funlib: segment 0 (voxels the segmentation left unsegmented) is no segment.
It merges nothing and its edges are not correct (funlib scores 0 as a segment like any other, so
two skeletons both crossing unsegmented voxels would both count as merged). The counts beside
ERL: `merges`, the segments that hold nodes of two or more skeletons; `splits`, the skeleton edges
whose two nodes lie in different segments (neither 0), in every skeleton, merged or not.

Ground-truth voxels 0 (membranes, unlabeled) have no skeleton: what a segmentation puts there is
not scored. The skeletons depend on the ground truth alone, so an evaluation makes them once
(`skeletons_of`) and scores every segmentation against them (`run_length`, `run_length_at`).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.core.errors import (
    EmptyLabelsError,
    VolumeDtypeError,
    VolumeShapeError,
    VoxelSizeError,
)
from pipeline.export.skeletons import SkeletonConfig


@dataclass(frozen=True)
class Skeletons:
    """The skeletons of every body of a ground truth, as one graph."""

    shape: tuple[int, int, int]  # of the labels they were made from
    nodes: np.ndarray  # (n, 3) int64: voxel index (z, y, x) of each node
    body: np.ndarray  # (n,) uint64: the ground-truth id of each node
    edges: np.ndarray  # (m, 2) int64: node indices; both nodes of an edge are of one body
    edge_nm: np.ndarray  # (m,) float64: each edge's length

    @property
    def length_nm(self) -> float:
        return float(self.edge_nm.sum())

    def record(self) -> dict:
        """JSON-ready: how many bodies, nodes and how long; `erl_nm`, the ERL of the ground truth
        itself (every run a whole skeleton), the most any segmentation can score."""
        runs = np.bincount(
            np.unique(self.body, return_inverse=True)[1][self.edges[:, 0]], weights=self.edge_nm
        )
        return {
            "bodies": len(np.unique(self.body)),
            "nodes": len(self.body),
            "length_nm": self.length_nm,
            "erl_nm": _erl(runs, self.length_nm),
        }


@dataclass(frozen=True)
class RunLength:
    """One segmentation's ERL and its errors along the skeletons; `to_dict` is JSON-ready, its
    keys those of an evaluation row."""

    erl_nm: float
    merges: int  # segments holding nodes of two or more skeletons
    splits: int  # skeleton edges whose nodes lie in two segments (neither unsegmented)

    def to_dict(self) -> dict:
        return {"erl_nm": self.erl_nm, "erl_merges": self.merges, "erl_splits": self.splits}


def _checked_voxel_size(voxel_size_nm: Sequence[float]) -> np.ndarray:
    size = np.asarray(voxel_size_nm, dtype=np.float64).ravel()
    if size.shape != (3,) or not np.all(np.isfinite(size)) or np.any(size <= 0):
        raise VoxelSizeError(
            f"skeletons: the voxel size must be 3 positive numbers (z, y, x) in nm, got {voxel_size_nm!r}"
        )
    return size


def skeletons_of(
    labels: np.ndarray, voxel_size_nm: Sequence[float], config: SkeletonConfig | None = None
) -> Skeletons:
    """The kimimaro skeletons of every body of a (z, y, x) ground truth (0: no body), traced in
    nm (`voxel_size_nm`, z, y, x); `EmptyLabelsError` when it holds no body."""
    import kimimaro  # seconds to import: only where skeletons are made

    config = config or SkeletonConfig()
    if labels.ndim != 3:
        raise VolumeShapeError(f"skeletons: labels must be 3-D (z, y, x), got shape {labels.shape}")
    if labels.dtype.kind not in "iu":
        raise VolumeDtypeError(f"skeletons: labels must be an integer type, got {labels.dtype}")
    size = _checked_voxel_size(voxel_size_nm)
    if not labels.any():
        raise EmptyLabelsError(
            "skeletons: the ground truth has no labeled voxel: nothing to skeletonize"
        )
    traced = kimimaro.skeletonize(
        np.ascontiguousarray(labels),
        teasar_params={"scale": config.scale, "const": config.const_nm},
        anisotropy=tuple(size),  # per axis of the array: (z, y, x); vertices come back in nm
        dust_threshold=config.dust_voxels,
        progress=False,
        parallel=1,  # the task's own core: the workers share the node
    )
    return _joined(traced, size, labels.shape)


def _joined(traced: dict, size: np.ndarray, shape: tuple[int, ...]) -> Skeletons:
    """kimimaro's skeletons (one per body id) as one graph, bodies in the order of their ids."""
    nodes, body, edges, offset = [], [], [], 0
    for body_id in sorted(traced):
        skeleton = traced[body_id]
        nodes.append(np.rint(skeleton.vertices / size).astype(np.int64))
        body.append(np.full(len(skeleton.vertices), body_id, np.uint64))
        edges.append(skeleton.edges.astype(np.int64) + offset)
        offset += len(skeleton.vertices)
    nodes = np.concatenate(nodes) if nodes else np.zeros((0, 3), np.int64)
    edges = np.concatenate(edges) if edges else np.zeros((0, 2), np.int64)
    edge_nm = np.linalg.norm((nodes[edges[:, 0]] - nodes[edges[:, 1]]) * size, axis=1)
    return Skeletons(
        tuple(int(n) for n in shape),
        nodes,
        np.concatenate(body) if body else np.zeros(0, np.uint64),
        edges,
        edge_nm.astype(np.float64),
    )


def _erl(runs: np.ndarray, total_nm: float) -> float:
    """sum(run^2) / total: the expected run length at a random point of the skeletons."""
    return float(np.sum(np.square(runs)) / total_nm) if total_nm > 0 else 0.0


def run_length_at(skeletons: Skeletons, segment: np.ndarray) -> RunLength:
    """ERL, merges and splits of a segmentation given by the segment id at each node
    (`segment[i]` at `skeletons.nodes[i]`; 0: unsegmented)."""
    segment = np.asarray(segment, dtype=np.uint64)
    if segment.shape != skeletons.body.shape:
        raise VolumeShapeError(
            f"skeletons: {segment.shape[0] if segment.ndim else 0} segment ids for "
            f"{len(skeletons.body)} skeleton nodes"
        )
    pairs = np.unique(np.stack([segment, skeletons.body], axis=1), axis=0)
    pairs = pairs[pairs[:, 0] > 0]  # unsegmented voxels merge nothing
    segments, skeletons_in = np.unique(pairs[:, 0], return_counts=True)
    merging = segments[skeletons_in > 1]
    merged_bodies = np.unique(pairs[np.isin(pairs[:, 0], merging), 1])

    first, second = skeletons.edges[:, 0], skeletons.edges[:, 1]
    at_first, at_second = segment[first], segment[second]
    edge_body = skeletons.body[first]
    segmented = (at_first > 0) & (at_second > 0)
    splits = segmented & (at_first != at_second)
    correct = segmented & (at_first == at_second) & ~np.isin(edge_body, merged_bodies)
    # A run: every correct edge of one skeleton in one segment.
    keys = np.stack([edge_body[correct], at_first[correct]], axis=1)
    run_of_edge = np.unique(keys, axis=0, return_inverse=True)[1].ravel()
    runs = np.bincount(run_of_edge, weights=skeletons.edge_nm[correct])
    return RunLength(_erl(runs, skeletons.length_nm), len(merging), int(splits.sum()))


def run_length(skeletons: Skeletons, segmentation: np.ndarray) -> RunLength:
    """ERL, merges and splits of a (z, y, x) segmentation of the volume the skeletons were made
    from (`VolumeShapeError` for another shape)."""
    if segmentation.shape != skeletons.shape:
        raise VolumeShapeError(
            f"segmentation shape {segmentation.shape} differs from ground truth {skeletons.shape}"
        )
    return run_length_at(skeletons, segmentation[tuple(skeletons.nodes.T)])
