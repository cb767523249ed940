"""FFN's second pass: agglomeration (removes splits) and split consensus (removes merges).

Agglomeration (google/ffn `ffn/inference/resegmentation.py`, measures as in
`resegmentation_analysis.py`; Januszewski et al. 2018): a flood fill is unsure where an object
narrows or its membrane fades, and stops there, so one neurite ends up as two segments that touch.
For two touching segments A and B:

  1. `candidate_pairs`: the pairs that touch over at least `min_contact` voxel faces, with one
     contact point each (block by block, `merge_contact_tables` adds the blocks' tables up);
  2. `pair_measures`: in a window around the contact point, one fill seeded in A and one in B. As
     in google/ffn, A and B are cleared from the canvas and the other segments stay on it, so no
     FOV is centred in them; neither fill sees the other. A seed is the voxel of its segment
     farthest from the segment's boundary (distance transform) within the analysis box around
     the contact, where a FOV fits. Within the analysis box: the Jaccard index of the two fills,
     and the share of A's voxels that B's fill recovers and of B's that A's fill recovers. If A
     and B are one object, each fill runs into the other segment and the two fills nearly
     coincide; if a membrane separates them, each stays on its side. Merge when all three
     measures pass. google/ffn seeds anywhere in its (larger) window and retries a fill that
     recovers too little of its own segment; this keeps the window small instead (cost);
  3. `merge_lookup` and `relabel`: the merged pairs' connected components become one id each.

Split consensus (FFN's "oversegmentation consensus"): two segmentations of one volume with
different seed orders make different merge errors; keeping two voxels together only where both
did (`split_consensus`: the label of a voxel is the pair of both runs' labels) removes the merges
that only one run made, at the price of the splits either made, which agglomeration then repairs.

The fill (`fill_unsegmented`, last): every voxel the first pass left 0 goes to the segment whose
basin it lies in, a watershed from the segments over a learned boundary map; the relabel tasks
do it part by part with a margin of context (`filled_part`). Before it, objects under
`fill_min_size` voxels in the whole volume (`segment_sizes` per part, `total_sizes`,
`small_objects`) are set to 0, so their voxels go to their neighbours alike.

Coordinates are (z, y, x) voxels throughout. Images and segmentations are read through callables
that take a tuple of slices, so the same code serves in-memory arrays, HDF5, zarr or precomputed.
Flood fills use `pipeline.inference.flood_fill.Canvas.flood` itself.
"""

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import fastremap
import numpy as np
from scipy import ndimage, sparse
from scipy.sparse.csgraph import connected_components
from skimage.segmentation import watershed

from pipeline.core.atomic import atomic_path
from pipeline.core.errors import ConfigError, VolumeShapeError
from pipeline.core.roi import Roi, with_context
from pipeline.inference.blocks import BlockGrid
from pipeline.inference.flood_fill import Canvas, InferenceConfig, Predictor
from pipeline.inference.stitching import block_core
from pipeline.network.model import ModelConfig, normalize_image

Reader = Callable[[tuple[slice, ...]], np.ndarray]
Box = tuple[slice, ...]


# The settings of the fill of unsegmented voxels (`AgglomerationConfig.part_settings`).
FILL_SETTINGS = ("fill_unsegmented", "fill_margin", "fill_min_size")


@dataclass(frozen=True)
class AgglomerationConfig:
    """Which touching segments are tested, and when two are merged. Radii are in FOVs: a radius
    of r FOVs is floor(r x FOV shape) voxels along each axis, so the rule follows the model."""

    # Whether the workflow agglomerates after stitching (its tasks: apps/agglomerate.py).
    enabled: bool = False
    # A second inference pass with the other seed order (`InferenceConfig.seed_order`) and the
    # split consensus of the two passes (apps/consensus.py), before agglomerating if enabled:
    # it removes merges only one pass made, at the price of every split either made.
    consensus: bool = False
    # Half-size of the window the fills run in. 0.75 FOV leaves about half a FOV of moves on
    # either side of the contact, enough for a fill to show whether it crosses into the other
    # segment, in at most 64 FOV positions per fill (4 x 4 x 4 cells of `deltas` for the demo
    # model); on seed 2's planted splits and largest true contacts, 1 FOV decided the same at
    # 2-4 times the FOV evaluations.
    window_radius_fovs: float = 0.75
    # Half-size of the box around the contact where seeds are placed and the measures are taken:
    # half a FOV keeps both to the contact, not to far parts of A or B that the window happens to
    # hold (google/ffn's analysis radius is likewise smaller than its resegmentation radius).
    analysis_radius_fovs: float = 0.5
    # Voxel faces two segments must share to be tested: smaller contacts are mostly corners or
    # the sides of two neurites, which cost a pair of fills each, rarely hide a split and are
    # where the fills merge wrongly. On seed 2 (the synthetic selection volume; bench/agglomerate.py
    # --sweep) 500 tested 58 of 377 pairs and scored best of 20-2,000 at 4-16 FOVs per fill (VI
    # 1.205 -> 1.084, against 1.146 with 20). Objects' sizes set it: choose it on a selection part
    # of your tissue.
    min_contact: int = 500
    # Background voxels that may lie between two segments that count as touching: the first pass
    # often leaves a voxel-wide seam unsegmented between two segments (a membrane, or voxels it
    # was unsure of), and the ground truth its membranes.
    max_gap: int = 1
    # Merge thresholds. One object's two fills nearly coincide and fills of two objects barely
    # overlap (Jaccard index), and each fill should take most of the other segment (recovered
    # share). Where a membrane is too faint for the model, the fills of two objects coincide as
    # well, and those are where the first pass parted objects: on seed 2 (selection volume) with
    # the contacts and budget above, a recovered share of 0.5 merged 23 pairs (VI 1.21 -> 1.63);
    # 0.9 merged 8 (-> 1.08; 0.85 -> 1.07, 0.8 -> 1.15, 0.95 -> 1.13). The Jaccard index barely
    # mattered (0.3-0.7 the same).
    min_jaccard: float = 0.5
    min_recovered: float = 0.9
    # FOV evaluations per fill: a bound on the cost of a pair whatever the window. On seed 2, 16
    # (of the window's up to 64 positions) decided better than filling the window (VI 1.084
    # against 1.099) at half the cost: 6 % of the first pass's FOV evaluations, against 13 %.
    max_fov_evaluations_per_fill: int = 16
    # Whether a pair's fill from B is skipped when the fill from A already covers less than
    # `min_recovered` of B: that pair cannot merge whatever B's fill shows, so the merges are
    # the same for fewer FOV evaluations. Its decision then records B's fill as empty (Jaccard
    # and A's recovered share 0), so a new `min_recovered` fills the pairs again.
    skip_second_fill: bool = False
    # Pairs whose contact the boundary map calls membrane are not filled: their mean P(boundary)
    # across the contact, within the analysis box, above this. Two pieces of one neurite that the
    # first pass parted touch through cytoplasm; two neurites, through their membranes (the
    # forest's map: about 0.8 on bodies' surfaces, 0.1-0.4 inside them). 1 fills every pair.
    # Needs the boundary forest, as the fill does.
    max_contact_boundary: float = 1.0
    # Last (with or without `enabled`), every voxel the first pass left unsegmented (0) goes to
    # the segment whose basin it lies in, flooding a boundary map learned on the run's training
    # part (`fill_unsegmented`): a dense segmentation, as the ground truth is. Needs a labelled
    # training part.
    fill_unsegmented: bool = False
    # Voxels of context around each part of the layer the fill floods in: a basin is cut off at
    # a part's edge only beyond them.
    fill_margin: int = 16
    # Before the fill, objects under this many voxels (in the whole volume, after the pair
    # merges) are dropped and their voxels filled from their neighbours like the unsegmented
    # ones; 0 keeps every object. google/ffn recommends 1,000 as inference's min_segment_size;
    # dropping them here costs no FOV evaluation, where inference would try again every seed
    # inside a dropped object (on the FlyEM evaluated part, more seeds than the whole first
    # pass tried: BENCHMARKS.md). Needs `fill_unsegmented`.
    fill_min_size: int = 0

    def __post_init__(self) -> None:
        if self.window_radius_fovs < 0.5:
            raise ConfigError(
                f"window_radius_fovs must be >= 0.5 (a FOV must fit), got {self.window_radius_fovs}"
            )
        if not 0 < self.analysis_radius_fovs <= self.window_radius_fovs:
            raise ConfigError(
                "analysis_radius_fovs must be in (0, window_radius_fovs], got "
                f"{self.analysis_radius_fovs}"
            )
        for name in ("min_contact", "max_fov_evaluations_per_fill"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if min(self.max_gap, self.fill_margin, self.fill_min_size) < 0:
            raise ConfigError(
                "max_gap, fill_margin and fill_min_size must be >= 0, got "
                f"{self.max_gap}, {self.fill_margin}, {self.fill_min_size}"
            )
        if self.fill_min_size and not self.fill_unsegmented:
            raise ConfigError(
                "fill_min_size drops objects for the fill to give their voxels away: it needs "
                "fill_unsegmented = true"
            )
        for name in ("min_jaccard", "min_recovered", "max_contact_boundary"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"{name} must be in (0, 1], got {getattr(self, name)}")

    def merges(self, pair: "PairDecision") -> bool:
        """Whether a pair's fills show one object: both seeded and all three measures pass."""
        return (
            pair.seeded
            and pair.jaccard >= self.min_jaccard
            and min(pair.recovered_a, pair.recovered_b) >= self.min_recovered
        )

    def fill_settings(self) -> dict:
        """The settings the fills' measures depend on (not the thresholds, nor `enabled`; but
        `min_recovered` where it decides whether B is filled, `skip_second_fill`)."""
        thresholds = ("min_jaccard",) if self.skip_second_fill else ("min_jaccard", "min_recovered")
        return {
            k: v
            for k, v in dataclasses.asdict(self).items()
            if k not in ("enabled", "consensus", *thresholds, *FILL_SETTINGS)
        }  # fmt: skip

    @property
    def screens_contacts(self) -> bool:
        """Whether pairs are screened by the boundary map before they are filled."""
        return self.max_contact_boundary < 1

    @property
    def reads_boundary_map(self) -> bool:
        """Whether the pass needs the boundary forest: to fill, or to screen pairs."""
        return self.fill_unsegmented or (self.enabled and self.screens_contacts)

    @property
    def writes_layer(self) -> bool:
        """Whether the pass's tasks write the export's layer: to merge pairs, to fill, or both."""
        return self.enabled or self.fill_unsegmented

    def part_settings(self) -> dict:
        """What the layer's parts depend on beyond the merges: the unsegmented voxels' fill."""
        return {k: getattr(self, k) for k in FILL_SETTINGS}


# ---------------------------------------------------------------------------------------------
# Candidate pairs


@dataclass(frozen=True, eq=False)
class ContactTable:
    """Touching pairs of segments: ids (N, 2) uint64 with a < b, sorted; contacts (N,) int64,
    the voxel faces they share (and voxels facing across a gap); points (N, 3) int64, a contact
    voxel of each (global coordinates)."""

    ids: np.ndarray
    contacts: np.ndarray
    points: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)

    def select(self, keep: np.ndarray) -> "ContactTable":
        return ContactTable(self.ids[keep], self.contacts[keep], self.points[keep])


def _shifted(segmentation: np.ndarray, axis: int, start: int, stop: int) -> np.ndarray:
    """The view of `segmentation` from `start` to `stop` (negative: from the end) along `axis`."""
    box = [slice(None)] * 3
    box[axis] = slice(start, stop if stop < 0 else None)
    return segmentation[tuple(box)]


def _touching(segmentation: np.ndarray, max_gap: int) -> Iterator[tuple[int, int, np.ndarray]]:
    """(axis, step, mask): where a non-zero segment faces another one `step` voxels on along
    `axis` with only background between (step 1 to `max_gap` + 1); the mask is over the low
    voxels (`_shifted(segmentation, axis, 0, -step)`)."""
    for axis in range(3):
        for step in range(1, min(max_gap + 1, segmentation.shape[axis] - 1) + 1):
            u = _shifted(segmentation, axis, 0, -step)
            v = _shifted(segmentation, axis, step, 0)
            touching = (u != v) & (u > 0) & (v > 0)
            for between in range(1, step):
                touching &= _shifted(segmentation, axis, between, between - step) == 0
            yield axis, step, touching


def _faces(segmentation: np.ndarray, max_gap: int) -> tuple[np.ndarray, np.ndarray]:
    """Every contact between two different non-zero segments along an axis, directly or across
    up to `max_gap` background voxels: the (a, b) pair (a < b), (M, 2), and the voxel on the
    contact's low side, (M, 3)."""
    pairs, voxels = [], []
    for axis, step, touching in _touching(segmentation, max_gap):
        a = _shifted(segmentation, axis, 0, -step)[touching]
        b = _shifted(segmentation, axis, step, 0)[touching]
        pairs.append(np.stack([np.minimum(a, b), np.maximum(a, b)], axis=1))
        voxels.append(np.argwhere(touching))
    return np.concatenate(pairs).astype(np.uint64), np.concatenate(voxels).astype(np.int64)


def contact_boundary(
    labels: np.ndarray, boundary: np.ndarray, ids: tuple[int, int], max_gap: int
) -> float:
    """The mean P(boundary) across the contacts of segments `ids` in `labels` (each contact the
    mean of its voxels, from the one in A to the one in B, the gap between included); -1 where
    they do not touch."""
    total, count = 0.0, 0
    for axis, step, touching in _touching(labels, max_gap):
        u, v = _shifted(labels, axis, 0, -step), _shifted(labels, axis, step, 0)
        touching &= np.isin(u, ids) & np.isin(v, ids)
        across = sum(_shifted(boundary, axis, k, k - step) for k in range(step + 1)) / (step + 1)
        total += float(across[touching].sum())
        count += int(np.count_nonzero(touching))
    return total / count if count else -1.0


def _central_voxels(group: np.ndarray, voxels: np.ndarray, groups: int) -> np.ndarray:
    """Per group, the voxel nearest to the group's mean position (ties: the first in order)."""
    counts = np.bincount(group, minlength=groups)[:, None]
    means = np.stack([np.bincount(group, voxels[:, k], groups) for k in range(3)], 1) / counts
    distance = np.sum((voxels - means[group]) ** 2, axis=1)
    order = np.lexsort((np.arange(len(group)), distance, group))
    first = np.searchsorted(group[order], np.arange(groups))
    return voxels[order[first]]


def candidate_pairs(
    segmentation: np.ndarray,
    offset_zyx: Sequence[int] = (0, 0, 0),
    min_contact: int = 1,
    max_gap: int = 0,
    own_shape_zyx: Sequence[int] | None = None,
) -> ContactTable:
    """The touching pairs of one region, with at least `min_contact` contacts (voxel faces, or
    voxels facing each other across at most `max_gap` background voxels along an axis); the point
    of each is the contact voxel nearest to the middle of the contact.

    `offset_zyx`: the region's corner in the volume. Block by block, give each block `max_gap` + 1
    more voxels at its high end along each axis (where the volume goes on) but count only contacts
    whose low voxel is the block's own: pass `own_shape_zyx`, the block's shape without that
    margin. Keep `min_contact` 1 there and apply it in `merge_contact_tables`.
    """
    pairs, voxels = _faces(segmentation, max_gap)
    if own_shape_zyx is not None:
        own = np.all(voxels < np.asarray(own_shape_zyx), axis=1)
        pairs, voxels = pairs[own], voxels[own]
    ids, group, contacts = np.unique(pairs, axis=0, return_inverse=True, return_counts=True)
    group = group.reshape(-1)
    points = _central_voxels(group, voxels, len(ids)) + np.asarray(offset_zyx, np.int64)
    table = ContactTable(ids.reshape(-1, 2), contacts.astype(np.int64), points.reshape(-1, 3))
    return table.select(table.contacts >= min_contact)


def merge_contact_tables(tables: Sequence[ContactTable], min_contact: int = 1) -> ContactTable:
    """Several regions' tables as one: contacts summed per pair, the point of the region where
    the pair shares most faces (ties: the earlier table), then pairs below `min_contact` dropped."""
    ids = np.concatenate([t.ids for t in tables]).reshape(-1, 2)
    contacts = np.concatenate([t.contacts for t in tables])
    points = np.concatenate([t.points for t in tables]).reshape(-1, 3)
    unique, group = np.unique(ids, axis=0, return_inverse=True)
    group = group.reshape(-1)
    total = np.bincount(group, contacts, len(unique)).astype(np.int64)
    largest = np.lexsort((np.arange(len(group)), -contacts, group))
    first = largest[np.searchsorted(group[largest], np.arange(len(unique)))]
    table = ContactTable(unique, total, points[first])
    return table.select(table.contacts >= min_contact)


# ---------------------------------------------------------------------------------------------
# Deciding a pair by two flood fills


@dataclass(frozen=True)
class PairDecision:
    """What the two fills of one pair showed (measures within the analysis box); whether they
    show one object is the thresholds' call (`AgglomerationConfig.merges`), so that thresholds
    can change without filling again."""

    a: int
    b: int
    jaccard: float  # of the fill seeded in A and the fill seeded in B
    recovered_a: float  # share of A's voxels that B's fill covers
    recovered_b: float  # share of B's voxels that A's fill covers
    fov_evaluations: int  # both fills
    seeded: bool  # a seed was found on both sides (if not: no fill, no merge)
    # The mean P(boundary) across the contact in the analysis box, where pairs are screened
    # (`max_contact_boundary`; above it, no fill and no merge); -1 where not looked at, or where
    # they do not touch within the box.
    contact_boundary: float = -1.0


def _radius(fovs: float, model: ModelConfig) -> np.ndarray:
    return np.floor(fovs * np.asarray(model.fov_shape_zyx)).astype(np.int64)


def _window(point: np.ndarray, radius: np.ndarray, volume_shape: Sequence[int]) -> Box:
    """The box of half-size `radius` around `point`, moved (not cut) to fit in the volume, so
    that a FOV still fits at its faces; cut only where the volume is smaller."""
    shape = np.asarray(volume_shape)
    size = np.minimum(2 * radius + 1, shape)
    start = np.clip(point - radius, 0, shape - size)
    return tuple(slice(int(s), int(s + n)) for s, n in zip(start, size, strict=True))


def _seed(segment: np.ndarray, allowed: np.ndarray) -> tuple[int, ...] | None:
    """The voxel of `segment` farthest from its boundary among the `allowed` ones (ties: the
    first in raster order), or None if the segment has no allowed voxel."""
    distance = ndimage.distance_transform_edt(segment)
    distance[~allowed] = 0
    if not distance.any():
        return None
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(distance)), distance.shape))


def _fills(
    canvas: Canvas, seed: tuple[int, ...] | None, budgets: Sequence[int]
) -> list[tuple[np.ndarray, int]]:
    """The mask of one flood fill over the whole canvas (empty when unseeded or too weak) and its
    FOV evaluations, as a flood with each of `budgets` (ascending) evaluations would have ended:
    one flood with the largest, seen where each smaller one would have stopped."""
    empty = np.zeros(canvas.image.shape, bool)
    if seed is None:
        return [(empty, 0)] * len(budgets)
    stopped: dict[int, tuple[np.ndarray, int]] = {}

    def before_step(evaluations: int) -> None:
        for k, budget in enumerate(budgets):
            if evaluations >= budget and k not in stopped:
                stopped[k] = (canvas.logits >= canvas.segment_logit, evaluations)

    whole = tuple(slice(0, int(s)) for s in canvas.shape)
    before = canvas.counts["fov_evaluations"]
    canvas.before_step = before_step
    try:
        found = canvas.flood(seed)
    finally:
        canvas.before_step = None
    final = (
        found.within(whole) if found is not None else empty,
        canvas.counts["fov_evaluations"] - before,
    )
    return [stopped.get(k, final) for k in range(len(budgets))]


def _share(part: np.ndarray, of: np.ndarray) -> float:
    total = np.count_nonzero(of)
    return float(np.count_nonzero(part & of) / total) if total else 0.0


def _seeds(
    labels: np.ndarray, ids: tuple[int, int], analysis: np.ndarray, model: ModelConfig
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """A seed in each segment of the pair, in the analysis box where a FOV fits; None unless
    both segments have one."""
    radius = np.asarray(model.fov_shape_zyx) // 2
    allowed = np.zeros(labels.shape, bool)
    allowed[tuple(slice(r, s - r) for r, s in zip(radius, labels.shape, strict=True))] = True
    allowed &= analysis
    seed_a, seed_b = (_seed(labels == i, allowed) for i in ids)
    return (seed_a, seed_b) if seed_a is not None and seed_b is not None else None


def pair_measures(
    read_image: Reader,
    read_segmentation: Reader,
    volume_shape: Sequence[int],
    ids: tuple[int, int],
    point: Sequence[int],
    predict: Predictor,
    model: ModelConfig,
    inference_config: InferenceConfig,
    config: AgglomerationConfig,
    budgets: Sequence[int],
    read_boundary: Reader | None = None,
) -> list[PairDecision]:
    """Fill from A and from B around their contact `point` and measure (deterministic for a
    deterministic predictor), with each of `budgets` (ascending) as the FOV evaluations per fill,
    for the price of the largest: a flood with a smaller budget is the larger one's beginning
    (exactly so with `batch_size` 1), so budgets are chosen without filling again."""
    a, b = (int(i) for i in ids)
    point = np.asarray(point, np.int64)
    window = _window(point, _radius(config.window_radius_fovs, model), volume_shape)
    labels = read_segmentation(window)
    analysis = np.zeros(labels.shape, bool)
    centre = point - [s.start for s in window]
    near = _window(centre, _radius(config.analysis_radius_fovs, model), labels.shape)
    analysis[near] = True
    seeds = _seeds(labels, (a, b), analysis, model)
    screened = -1.0
    if config.screens_contacts:
        if read_boundary is None:
            raise ConfigError("max_contact_boundary screens pairs by a boundary map: none given")
        near_global = Roi.of(near).within(Roi.of(window)).slices
        screened = contact_boundary(
            labels[near], read_boundary(near_global), (a, b), config.max_gap
        )
        if screened > config.max_contact_boundary:  # membrane between them: neither is filled
            unfilled = PairDecision(a, b, 0.0, 0.0, 0.0, 0, seeds is not None, screened)
            return [unfilled for _ in budgets]
    fill_config = dataclasses.replace(inference_config, max_fov_evaluations_per_object=max(budgets))
    canvas = Canvas(normalize_image(read_image(window), model), predict, model, fill_config)
    # As google/ffn: the other segments stay as context, so no FOV is centred in them.
    np.copyto(canvas.segmentation, labels, where=(labels != a) & (labels != b))
    in_a, in_b = ((labels == i) & analysis for i in (a, b))
    from_a = _fills(canvas, seeds[0] if seeds else None, budgets)
    if config.skip_second_fill and all(
        _share(fill & analysis, in_b) < config.min_recovered for fill, _ in from_a
    ):
        from_b = _fills(canvas, None, budgets)  # cannot merge: B's fill is not needed
    else:
        from_b = _fills(canvas, seeds[1] if seeds else None, budgets)
    measures = []
    for (fill_a, fovs_a), (fill_b, fovs_b) in zip(from_a, from_b, strict=True):
        fill_a, fill_b = fill_a & analysis, fill_b & analysis
        union = np.count_nonzero(fill_a | fill_b)
        jaccard = float(np.count_nonzero(fill_a & fill_b) / union) if union else 0.0
        recovered_a, recovered_b = _share(fill_b, in_a), _share(fill_a, in_b)
        fovs, seeded = fovs_a + fovs_b, seeds is not None
        measures.append(
            PairDecision(a, b, jaccard, recovered_a, recovered_b, fovs, seeded, screened)
        )
    return measures


def decide_pairs(
    read_image: Reader,
    read_segmentation: Reader,
    volume_shape: Sequence[int],
    pairs: ContactTable,
    predict: Predictor,
    model: ModelConfig,
    inference_config: InferenceConfig,
    config: AgglomerationConfig,
    read_boundary: Reader | None = None,
) -> list[PairDecision]:
    """Every pair of the table measured with `config`'s budget per fill (`pair_measures`), in
    its order. `read_image` returns uint8 raw, `read_segmentation` the first pass's ids,
    `read_boundary` (where pairs are screened) P(boundary), each for a box of the volume (global
    slices)."""
    budget = (config.max_fov_evaluations_per_fill,)
    if config.screens_contacts and read_boundary is not None and len(pairs):
        read_boundary = _read_once(read_boundary, [
            _window(point, _radius(config.window_radius_fovs, model), volume_shape)
            for point in pairs.points
        ])  # fmt: skip
    return [
        pair_measures(
            read_image, read_segmentation, volume_shape, (int(ids[0]), int(ids[1])), point,
            predict, model, inference_config, config, budget, read_boundary,
        )[0]
        for ids, point in zip(pairs.ids, pairs.points, strict=True)
    ]  # fmt: skip


def _read_once(read: Reader, boxes: Sequence[Box]) -> Reader:
    """A reader of boxes within `boxes` that reads their bounding box once (the boundary map is
    a forest's prediction: once over a core costs less than once per pair)."""
    start = np.min([[s.start for s in box] for box in boxes], axis=0)
    stop = np.max([[s.stop for s in box] for box in boxes], axis=0)
    region = Roi(tuple(int(a) for a in start), tuple(int(b) for b in stop))
    whole = read(region.slices)

    def within(box: Box) -> np.ndarray:
        return whole[Roi.of(box).relative_to(region).slices]

    return within


# ---------------------------------------------------------------------------------------------
# Merging


def merge_lookup(pairs_to_merge: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids, targets): each id of a merged pair, sorted, and the id it becomes, the smallest of
    its connected component in the graph of merged pairs; ids not listed keep theirs.

    `stitching.join_ids` does the same over dense block-local ids; these ids are the volume's,
    sparse and possibly large, so they are compacted first."""
    pairs = np.asarray(pairs_to_merge, np.uint64).reshape(-1, 2)
    ids, compact = np.unique(pairs, return_inverse=True)
    compact = compact.reshape(-1, 2)
    graph = sparse.coo_array(
        (np.ones(len(pairs)), (compact[:, 0], compact[:, 1])), shape=(len(ids), len(ids))
    )
    _, component = connected_components(graph, directed=False)
    # ids are sorted: the first member of each component is its smallest id.
    _, first = np.unique(component, return_index=True)
    return ids, ids[first][component]


def relabel(segmentation: np.ndarray, ids: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """`segmentation` with every id in `ids` (sorted) replaced by its target (uint64)."""
    mapping = dict(zip(ids.tolist(), targets.tolist(), strict=True))
    return fastremap.remap(
        segmentation.astype(np.uint64), mapping, preserve_missing_labels=True, in_place=True
    )


def fill_unsegmented(segmentation: np.ndarray, boundary: np.ndarray) -> np.ndarray:
    """`segmentation` (uint64) with every 0 voxel given the id of the segment whose basin it lies
    in, a watershed of `boundary` (P(boundary) per voxel) flooded from the segments. All 0 stays
    all 0: no segment to flood from."""
    if segmentation.shape != boundary.shape:
        raise VolumeShapeError(
            f"segmentation {segmentation.shape} and boundary map {boundary.shape} differ in shape"
        )
    if segmentation.all() or not segmentation.any():
        return segmentation.astype(np.uint64)
    # scikit-image floods int32 markers: ids renumbered 1..N, then mapped back.
    markers, mapping = fastremap.renumber(segmentation, preserve_zero=True, in_place=False)
    flooded = watershed(boundary, markers.astype(np.int32))
    back = {new: old for old, new in mapping.items()}
    return fastremap.remap(flooded, back, preserve_missing_labels=True).astype(np.uint64)


def segment_sizes(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids, voxels): every non-0 id of `labels` (sorted, uint64) and how many voxels it has."""
    ids, counts = fastremap.unique(labels, return_counts=True)
    return ids[ids != 0].astype(np.uint64), counts[ids != 0].astype(np.int64)


def total_sizes(
    tables: Iterable[tuple[np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray]:
    """`segment_sizes` of parts of a volume summed into the whole volume's."""
    tables = list(tables)
    ids = np.concatenate([np.zeros(0, np.uint64), *(t[0] for t in tables)])
    counts = np.concatenate([np.zeros(0, np.int64), *(t[1] for t in tables)])
    unique, where = np.unique(ids, return_inverse=True)
    return unique, np.bincount(where, weights=counts, minlength=len(unique)).astype(np.int64)


def small_objects(
    sizes: tuple[np.ndarray, np.ndarray],
    merges: tuple[np.ndarray, np.ndarray],
    min_size: int,
) -> np.ndarray:
    """The ids, after `merges` (`merge_lookup`'s ids and targets), of the objects under
    `min_size` voxels in all; `sizes` is the whole volume's `total_sizes` before the merges."""
    ids, counts = sizes
    merged = relabel(ids.copy(), *merges) if len(merges[0]) else ids
    objects, totals = total_sizes([(merged, counts)])
    return objects[totals < min_size]


def members(objects: np.ndarray, merges: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """The segments, before `merges` (`merge_lookup`'s ids and targets), that make up `objects`
    (ids after them), sorted: an object's own id and those merged into it."""
    ids, targets = merges
    joined = ids[np.isin(targets, objects)]
    return np.union1d(np.asarray(objects, np.uint64), joined.astype(np.uint64))


def save_sizes(path: str | Path, ids: np.ndarray, counts: np.ndarray) -> None:
    _save_arrays(path, ids=ids, counts=counts)


def load_sizes(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    return _load_arrays(path, "ids", "counts")


def filled_part(
    part: Box,
    volume_shape: Sequence[int],
    margin: int,
    segmentation_of: Reader,
    boundary_of: Reader,
) -> np.ndarray:
    """`fill_unsegmented` of one part of a volume, flooded within the part and `margin` voxels
    of context around it (as far as the volume goes), the part's voxels returned."""
    grown, inner = with_context(part, margin, volume_shape)
    return fill_unsegmented(segmentation_of(grown), boundary_of(grown))[inner]


# ---------------------------------------------------------------------------------------------
# Split consensus


def split_consensus(
    first: np.ndarray, second: np.ndarray, min_size: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """(labels, pairs): two segmentations of one region cut by each other. A voxel's label stands
    for the pair (its id in `first`, its id in `second`); 0 where either is 0, or where the pair
    holds fewer than `min_size` voxels (the slivers where the two disagree on a border, as
    google/ffn's `split_segmentation_by_intersection` drops them). Labels are 1..N in the order
    of the sorted pairs, and `pairs[k - 1]` is label k's pair, (N, 2) uint64. Block by block:
    `id_pairs` per block, `join_id_pairs` of them all, then `consensus_labels` per block."""
    pairs = join_id_pairs([id_pairs(first, second)], min_size)
    return consensus_labels(first, second, pairs), pairs


def id_pairs(first: np.ndarray, second: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (id in `first`, id in `second`) pairs of a region's voxels where both are non-zero,
    (N, 2) uint64, sorted and unique, and the voxels of each, (N,) int64."""
    if first.shape != second.shape:
        raise VolumeShapeError(
            f"consensus of shapes {first.shape} and {second.shape}: must be equal"
        )
    both = (first > 0) & (second > 0)
    ids_first, in_first = np.unique(first[both], return_inverse=True)
    ids_second, in_second = np.unique(second[both], return_inverse=True)
    # One integer per pair (both compacted to < voxels): a 1-D unique, far faster than of rows.
    keys, counts = np.unique(
        in_first.astype(np.int64) * len(ids_second) + in_second, return_counts=True
    )
    pairs = np.stack([ids_first[keys // len(ids_second)], ids_second[keys % len(ids_second)]])
    return pairs.T.astype(np.uint64).reshape(-1, 2), counts.astype(np.int64)


def join_id_pairs(tables: Sequence[tuple[np.ndarray, np.ndarray]], min_size: int = 1) -> np.ndarray:
    """Several regions' `id_pairs` as one sorted, unique table of the pairs with at least
    `min_size` voxels in all."""
    pairs = np.concatenate([t[0].reshape(-1, 2) for t in tables]).astype(np.uint64)
    unique, group = np.unique(pairs, axis=0, return_inverse=True)
    counts = np.bincount(group.reshape(-1), np.concatenate([t[1] for t in tables]), len(unique))
    return unique[counts >= min_size].reshape(-1, 2)


def consensus_labels(first: np.ndarray, second: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """Each voxel's label: 1 + the row of its (first, second) pair in `pairs` (`join_id_pairs`:
    sorted, unique); 0 where either is 0 or the pair is not in the table (too small). Labels
    agree over blocks that share one table."""
    labels = np.zeros(first.shape, np.uint64)
    both = (first > 0) & (second > 0)
    if not both.any() or not len(pairs):
        return labels
    # Both ids compacted over the table's: one integer per pair, increasing with the sorted rows.
    ids_first, ids_second = np.unique(pairs[:, 0]), np.unique(pairs[:, 1])

    def keys(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        ia = np.minimum(np.searchsorted(ids_first, a), len(ids_first) - 1)
        ib = np.minimum(np.searchsorted(ids_second, b), len(ids_second) - 1)
        known = (ids_first[ia] == a) & (ids_second[ib] == b)
        return np.where(known, ia.astype(np.int64) * len(ids_second) + ib, -1)

    table = keys(pairs[:, 0], pairs[:, 1])
    voxels = keys(first[both].astype(np.uint64), second[both].astype(np.uint64))
    row = np.minimum(np.searchsorted(table, voxels), len(table) - 1)
    found = table[row] == voxels
    labels[both] = np.where(found, row.astype(np.uint64) + 1, 0)
    return labels


# ---------------------------------------------------------------------------------------------
# As tasks over the stitched volume's block cores (apps/agglomerate.py): pairs per core, one
# table, decisions per core, one merge table, a relabel task per core, a check. No task holds
# more than a core (and the pair windows it decides) or the tables of pairs and merges.


def core_contacts(
    k: int,
    blocks: BlockGrid,
    read_segmentation: Reader,
    volume_shape: Sequence[int],
    align: Sequence[int],
    max_gap: int,
) -> ContactTable:
    """The contacts whose low voxel lies in block k's core (`stitching.block_core` on the
    `align` grid): the cores part the volume, so each contact is counted by one task."""
    core = block_core(k, blocks, align)
    grown = tuple(
        slice(s.start, min(s.stop + max_gap + 1, int(n)))
        for s, n in zip(core, volume_shape, strict=True)
    )
    return candidate_pairs(
        read_segmentation(grown),
        offset_zyx=[s.start for s in core],
        max_gap=max_gap,
        own_shape_zyx=[s.stop - s.start for s in core],
    )


def save_contact_table(path: str | Path, table: ContactTable) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, ids=table.ids, contacts=table.contacts, points=table.points)


def load_contact_table(path: str | Path) -> ContactTable:
    with np.load(path) as f:
        return ContactTable(f["ids"].reshape(-1, 2), f["contacts"], f["points"].reshape(-1, 3))


def pairs_in(table: ContactTable, region: Box) -> ContactTable:
    """The pairs whose contact point lies in `region` (a block's core: each pair in one)."""
    start = np.array([s.start for s in region])
    stop = np.array([s.stop for s in region])
    return table.select(np.all((table.points >= start) & (table.points < stop), axis=1))


def save_decisions(path: str | Path, decisions: Sequence[PairDecision]) -> None:
    """The decisions as columns (one array per field of `PairDecision`)."""
    columns = {
        f.name: np.array([getattr(d, f.name) for d in decisions], _COLUMN_TYPES[f.type])
        for f in dataclasses.fields(PairDecision)
    }
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, **columns)


def load_decisions(path: str | Path) -> list[PairDecision]:
    names = [f.name for f in dataclasses.fields(PairDecision)]
    with np.load(path) as f:
        found = {name: f[name].tolist() for name in names if name in f}
    # Files from before a field was added hold none of it: its default.
    rows = [dict(zip(found, row, strict=True)) for row in zip(*found.values(), strict=True)]
    return [PairDecision(**row) for row in rows]


_COLUMN_TYPES = {int: np.uint64, float: np.float64, bool: bool}


def merged_pairs(decisions: Iterable[PairDecision], config: AgglomerationConfig) -> np.ndarray:
    """(M, 2) uint64: the pairs the thresholds of `config` take to be one object."""
    merged = [(d.a, d.b) for d in decisions if config.merges(d)]
    return np.array(merged, np.uint64).reshape(-1, 2)


def save_merges(path: str | Path, ids: np.ndarray, targets: np.ndarray) -> None:
    _save_arrays(path, ids=ids, targets=targets)


def load_merges(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    return _load_arrays(path, "ids", "targets")


def _save_arrays(path: str | Path, **arrays: np.ndarray) -> None:
    """Named arrays in one .npz, written whole or not at all."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, **arrays)


def _load_arrays(path: str | Path, *names: str) -> tuple[np.ndarray, ...]:
    with np.load(path) as f:
        return tuple(f[name] for name in names)
