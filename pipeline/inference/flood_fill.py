"""Flood-filling inference: grow one object at a time from seed points, as google-research/ffn.

For every seed (peaks of the distance to the nearest image edge, innermost first; in later
passes, peaks of what the earlier passes left unsegmented) that is not yet part of an object, the
network runs on a FOV centred on the seed, with the object mask ("seed") initialised to
logit(0.95) at the seed and logit(0.05) where nothing was predicted yet. Its logits are written
back into a per-object canvas and the FOV moves by `deltas` toward every face of the central box
predicted above the move threshold (`pipeline.network.movement`), breadth first, until no move is left.
With `move_step_scale` above 1, a face that far out predicted above `long_move_threshold` takes
the FOV there instead (a long move; the cells it passes over count as visited).
Voxels with probability >= the segment threshold that no earlier object owns become the new
object, unless it is smaller than `min_segment_size`.

FFN's safeguards are kept: a voxel once predicted outside the object (p < 0.5) cannot be raised
again by a later FOV (a bias toward splits, which are cheaper to fix than merges; can be turned
off with `keep_background`); the FOV never centres on a voxel that an earlier object owns; an
object whose seed voxel drops below the move threshold is discarded. Added here: a move that would
take the FOV past the volume's border stops at the border, so objects are followed up to it; a cap
on FOV evaluations per object (a runaway merger stops growing) and an optional consistency check
that floods again from the object's innermost voxel.

Batching: with `batch_size` > 1, up to that many queued FOVs of the same object that do not
overlap are evaluated in one call, in queue order. Non-overlapping FOVs neither read nor write the
same voxels, so each sees what it would see on its own; only the breadth-first order is relaxed.
`batch_size` 1 is FFN's exact order. On a CPU the network's cost is per voxel, so batching gains
little there; it is meant for accelerators.

Checkpoints: given a `checkpoint_path`, `segment` saves its state between objects at an interval
and goes on from a saved state, so a volume that takes longer than a batch job may run survives
being stopped (google-research/ffn's `checkpoint_interval`).

Flood records (`segment_with_floods`): every flood, in order, with the object it made (0 if
none), its seed pass and seed, its FOV evaluations, its voxels and what became of it
(`FloodRecords`): each FOV evaluation is one flood's, so they tell where the cost went. They are
kept in the checkpoint's state too, so a resumed segmentation has the records of an
uninterrupted one.

The network is any `Predictor`: `predict(images, seeds) -> logits`, all (batch, z, y, x, 1)
float32. `make_model_predictor` wraps a Keras model; tests pass plain functions.

Command line: `python -m pipeline.cli.infer`.
"""

import dataclasses
import enum
import hashlib
import json
import time
import zipfile
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from scipy import ndimage
from skimage.feature import peak_local_max
from tqdm import tqdm

from pipeline.core import config_io
from pipeline.core.atomic import atomic_path
from pipeline.core.errors import (
    CheckpointError,
    ConfigError,
    InferenceError,
    VolumeDtypeError,
    VolumeShapeError,
)
from pipeline.network.model import INFERENCE_PRECISIONS, ModelConfig, logit, normalize_image
from pipeline.network.movement import face_moves

if TYPE_CHECKING:  # TensorFlow takes seconds to import: only where a network runs
    import tensorflow as tf

ZYX = tuple[int, int, int]
Predictor = Callable[[np.ndarray, np.ndarray], np.ndarray]
SEGMENTATION_DATASET = "segmentation"
# Fixed seed of the tiny noise that breaks ties between equal distances (FFN uses 42 as well).
PEAK_NOISE_SEED = 42
SEED_ORDERS = ("innermost", "raster")


@dataclass(frozen=True)
class InferenceConfig:
    """How objects are seeded, grown and accepted. Probabilities, not logits; sizes (z, y, x)."""

    # The FOV moves to a face where the object probability reaches this; a seed whose own
    # probability falls below it is dropped.
    move_threshold: float = 0.9
    # A long move: where the face `move_step_scale` times the model's `deltas` from the FOV's
    # centre is sure enough (below), the FOV moves there, else by `deltas` as FFN. 1 is FFN's own
    # search; more, fewer FOVs per object, each seeing less of its neighbours' predictions (at
    # most half the FOV).
    move_step_scale: float = 1.0
    # How probable the object must be on the face move_step_scale x deltas out for a long move.
    long_move_threshold: float = 0.99
    # A queued FOV is evaluated only if at least this share of its voxels is new to the flood;
    # one the flood has predicted (nearly) all of takes its moves from those predictions instead.
    # Inside a large object most FOVs see under 1 % new voxels and change a few voxels at their
    # edge. 0 evaluates every FOV (FFN).
    min_unseen_share: float = 0.0
    # Voxels at least this probable become part of the object.
    segment_threshold: float = 0.6
    seed_probability: float = 0.95  # the seed voxel's initial object probability
    pad_probability: float = 0.05  # where the object mask has no prediction yet
    min_segment_size: int = 100  # voxels; smaller objects are dropped
    # A seed with an object voxel this close (Chebyshev, per axis) is skipped, as FFN.
    min_boundary_distance_zyx: ZYX = (1, 1, 1)
    # A flood stops (keeping what it has) after this many FOV evaluations.
    max_fov_evaluations_per_object: int = 5000
    batch_size: int = 1  # non-overlapping FOVs of one object evaluated together
    consistency_check: bool = False  # flood again from the object's innermost voxel
    # FFN's bias toward splits: a voxel once predicted outside the object (p < 0.5) stays outside.
    # Off, later FOVs may fill holes that a FOV's unsure faces left, at the price of more merges
    # (BENCHMARKS.md compares both).
    keep_background: bool = True
    # Pad the volume's own faces by reflection, half a FOV wide, so objects there are seeded and
    # followed up to the face: FFN as published leaves that shell unsegmented (no FOV can be
    # centred in it). Faces inside the volume (a block's, a part's) take real context instead.
    reflect_faces: bool = False
    consistency_min_iou: float = 0.5  # ... keep the intersection if the masks agree this well
    # Seed policy (FFN's PolicyPeaks): edges where the gradient of the smoothed image beats its
    # neighbourhood's mean; seeds at local maxima of the distance to the nearest edge.
    seed_smoothing_sigma_zyx: tuple[float, float, float] = (0.5, 1.0, 1.0)
    # Width (voxels) of the Gaussian whose mean gradient an edge voxel must beat.
    seed_threshold_sigma: float = 49 / 6
    # Least distance (voxels) between two seeds.
    seed_min_distance: int = 3
    # Later passes seed the peaks of what earlier passes left unsegmented (segmented voxels count
    # as edges); a pass that adds no object ends the search.
    seed_passes: int = 3
    # The order seeds are tried in: "innermost" (farthest from any edge first) or "raster" (z,
    # then y, then x: FFN's own). A consensus's second pass takes the other one.
    seed_order: str = "innermost"
    # The network's arithmetic: "auto" (bf16 on a CPU with AVX512-BF16 or AMX, else float32;
    # an accelerator's as the weights were made), "model" (as the weights were made),
    # "float32" or "mixed_bfloat16" (pipeline.network.model.inference_precision).
    precision: str = "auto"

    def __post_init__(self) -> None:
        if self.seed_order not in SEED_ORDERS:
            raise ConfigError(f"seed_order must be one of {SEED_ORDERS}, got {self.seed_order!r}")
        if self.precision not in INFERENCE_PRECISIONS:
            raise ConfigError(
                f"precision must be one of {INFERENCE_PRECISIONS}, got {self.precision!r}"
            )
        if not 0 < self.pad_probability < self.seed_probability < 1:
            raise ConfigError("need 0 < pad_probability < seed_probability < 1")
        for name in (
            "move_threshold",
            "long_move_threshold",
            "segment_threshold",
            "consistency_min_iou",
        ):
            if not 0 < getattr(self, name) < 1:
                raise ConfigError(f"{name} must be in (0, 1), got {getattr(self, name)}")
        if not 0 <= self.min_unseen_share < 1:
            raise ConfigError(f"min_unseen_share must be in [0, 1), got {self.min_unseen_share}")
        if self.move_step_scale < 1:
            raise ConfigError(f"move_step_scale must be >= 1, got {self.move_step_scale}")
        if self.long_move_threshold < self.move_threshold:
            raise ConfigError("long_move_threshold below move_threshold: a long move needs more")
        if self.move_threshold > self.seed_probability:
            raise ConfigError("move_threshold above seed_probability: no seed could ever move")
        for name in (
            "min_segment_size",
            "max_fov_evaluations_per_object",
            "batch_size",
            "seed_passes",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seed_min_distance < 1 or self.seed_threshold_sigma <= 0:
            raise ConfigError("seed_min_distance must be >= 1 and seed_threshold_sigma > 0")
        if len(self.min_boundary_distance_zyx) != 3 or min(self.min_boundary_distance_zyx) < 0:
            raise ConfigError(
                f"min_boundary_distance_zyx must be 3 integers >= 0, got {self.min_boundary_distance_zyx}"
            )
        if len(self.seed_smoothing_sigma_zyx) != 3 or min(self.seed_smoothing_sigma_zyx) < 0:
            raise ConfigError(
                f"seed_smoothing_sigma_zyx must be 3 numbers >= 0, got {self.seed_smoothing_sigma_zyx}"
            )


@dataclass(frozen=True)
class InferenceStats:
    """What one segmentation run did; `to_dict` is JSON-ready."""

    voxels: int = 0
    seconds: float = 0.0
    seeds: int = 0  # peaks the seed policy found, over all passes
    seed_passes: int = 0  # passes of the seed policy run
    seeds_tried: int = 0  # ... that started a flood (the others were inside or next to an object)
    fov_evaluations: int = 0
    batches: int = 0  # predictor calls
    objects: int = 0
    objects_too_small: int = 0
    seeds_too_weak: int = 0  # floods discarded because the seed voxel fell below move_threshold
    objects_truncated: int = 0  # stopped at max_fov_evaluations_per_object (kept)
    fovs_seen_enough: int = 0  # queued FOVs not evaluated (`min_unseen_share`)
    objects_inconsistent: int = 0  # dropped by the consistency check
    segmented_voxels: int = 0

    @property
    def voxels_per_second(self) -> float:
        return self.voxels / self.seconds if self.seconds else 0.0

    def __add__(self, other: "InferenceStats") -> "InferenceStats":
        """Totals over blocks."""
        return InferenceStats(
            **{
                f.name: getattr(self, f.name) + getattr(other, f.name)
                for f in dataclasses.fields(self)
            }
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"voxels_per_second": self.voxels_per_second}


# ---------------------------------------------------------------------------------------------
# Seeds


def edge_map(raw: np.ndarray, config: InferenceConfig) -> np.ndarray:
    """Voxels on an edge of the image, bool.

    FFN's PolicyPeaks: an edge is a voxel whose Sobel gradient magnitude beats the Gaussian mean
    of the magnitude around it (an adaptive threshold). The image is smoothed first so that noise
    does not make edges everywhere.
    """
    image = ndimage.gaussian_filter(raw.astype(np.float32), config.seed_smoothing_sigma_zyx)
    gradient = ndimage.generic_gradient_magnitude(image, ndimage.sobel)
    return gradient > ndimage.gaussian_filter(gradient, config.seed_threshold_sigma)


def edge_distance(raw: np.ndarray, config: InferenceConfig) -> np.ndarray:
    """Distance (voxels) from every voxel to the nearest edge of the image, float32."""
    return ndimage.distance_transform_edt(~edge_map(raw, config)).astype(np.float32)


def _peaks(distance: np.ndarray, config: InferenceConfig, margin_zyx: Sequence[int]) -> np.ndarray:
    """Local maxima of `distance` at least `margin_zyx` from the border, innermost first (or
    in raster order: `seed_order`)."""
    # Plateaus of equal distance would give runs of peaks; tiny fixed noise picks one of each.
    noise = np.random.default_rng(PEAK_NOISE_SEED).random(distance.shape, dtype=np.float32)
    distance = distance + noise * np.float32(1e-3)
    interior = tuple(slice(m, s - m) for m, s in zip(margin_zyx, distance.shape, strict=True))
    peaks = peak_local_max(
        distance[interior],
        min_distance=config.seed_min_distance,
        threshold_abs=0.5,
        exclude_border=False,
    )
    peaks += np.array(margin_zyx)
    if config.seed_order == "raster":
        return peaks[np.lexsort(peaks.T[::-1])].astype(np.int64)
    order = np.argsort(-distance[tuple(peaks.T)], kind="stable")
    return peaks[order].astype(np.int64)


def seed_peaks(raw: np.ndarray, config: InferenceConfig, margin_zyx: Sequence[int]) -> np.ndarray:
    """Seed points, (N, 3) int64 zyx: local maxima of `edge_distance`, innermost first, at least
    `margin_zyx` (the FOV's radius) from the border so that a FOV fits around each.

    FFN visits its peaks in raster order; starting from the voxels farthest from any edge lets the
    most certain objects claim their voxels first, and the order does not depend on the volume's
    orientation.
    """
    return _peaks(edge_distance(raw, config), config, margin_zyx)


# ---------------------------------------------------------------------------------------------
# Flood filling


@dataclass(frozen=True, eq=False)
class _Object:
    """The mask of one flood, inside `box` (slices of the canvas)."""

    box: tuple[slice, ...]
    mask: np.ndarray

    def within(self, box: tuple[slice, ...]) -> np.ndarray:
        """The mask pasted into a larger `box`."""
        out = np.zeros(tuple(s.stop - s.start for s in box), bool)
        out[
            tuple(
                slice(a.start - b.start, a.stop - b.start)
                for a, b in zip(self.box, box, strict=True)
            )
        ] = self.mask
        return out


def _union_box(a: tuple[slice, ...], b: tuple[slice, ...]) -> tuple[slice, ...]:
    return tuple(
        slice(min(x.start, y.start), max(x.stop, y.stop)) for x, y in zip(a, b, strict=True)
    )


class FloodEnd(enum.IntEnum):
    """What became of a flood (`FloodRecords.end`)."""

    KEPT = 0  # its object was kept
    SEED_TOO_WEAK = 1  # its seed voxel fell below move_threshold
    TOO_SMALL = 2  # its object had fewer than min_segment_size voxels no earlier object owned
    INCONSISTENT = 3  # the consistency check's two floods disagreed
    # Kept, but wholly in the reflected padding around a block, which is cut off
    # (`pipeline.inference.blocks.segment_block`).
    CROPPED = 4


@dataclass
class Flood:
    """One `Canvas.flood`, as `FloodRecords` keeps it; `Canvas.try_seed` sets what its seed's
    attempt came to."""

    seed: tuple[int, ...]  # where the flood started
    fov_evaluations: int
    # Of the first flood of an attempt that reached the size test, the voxels tested (the
    # object's if kept); of any other, its own mask's voxels that no earlier object owned.
    voxels: int
    truncated: bool  # stopped at max_fov_evaluations_per_object
    end: FloodEnd
    object: int = 0  # the id of the object its attempt made; 0 if none
    seed_pass: int = 0  # 1, 2, ...; 0 for a flood from no seed pass (the second pass's fills)
    check: bool = False  # the consistency check's flood from the first one's innermost voxel


def _unsigned(values: np.ndarray) -> np.ndarray:
    """`values` (>= 0) in the smallest unsigned type that holds them."""
    return values.astype(np.min_scalar_type(int(values.max(initial=0))))


# `FloodRecords`' columns and their types in memory (`FloodRecords.arrays` stores them compactly).
FLOOD_COLUMNS = {
    "object": np.uint64,
    "seed_pass": np.int64,
    "seed": np.int64,
    "fov_evaluations": np.int64,
    "voxels": np.int64,
    "end": np.uint8,
    "truncated": bool,
    "check": bool,
}


@dataclass(frozen=True, eq=False)
class FloodRecords:
    """Every flood of a segmentation, in order, as columns of `Flood`'s fields (`seed` (N, 3),
    zyx; a block's in the volume). Each FOV evaluation is one flood's: `fov_evaluations` adds up
    to `InferenceStats.fov_evaluations`, and the stats' counts are the records' (seeds_tried: the
    floods that are not a check; objects, objects_too_small, objects_inconsistent: of those, the
    ends KEPT (and CROPPED), TOO_SMALL, INCONSISTENT; seeds_too_weak: every SEED_TOO_WEAK;
    objects_truncated: every truncated one)."""

    object: np.ndarray
    seed_pass: np.ndarray
    seed: np.ndarray
    fov_evaluations: np.ndarray
    voxels: np.ndarray
    end: np.ndarray
    truncated: np.ndarray
    check: np.ndarray

    PREFIX = "flood_"  # of the arrays' names in a file that holds others too

    def __len__(self) -> int:
        return len(self.object)

    @classmethod
    def of(cls, floods: Sequence[Flood]) -> "FloodRecords":
        columns = {
            name: np.array([getattr(f, name) for f in floods], kind)
            for name, kind in FLOOD_COLUMNS.items()
        }
        return cls(**columns | {"seed": columns["seed"].reshape(-1, 3)})

    def floods(self) -> list[Flood]:
        return [
            Flood(tuple(int(v) for v in self.seed[k]), int(self.fov_evaluations[k]),
                  int(self.voxels[k]), bool(self.truncated[k]), FloodEnd(int(self.end[k])),
                  int(self.object[k]), int(self.seed_pass[k]), bool(self.check[k]))
            for k in range(len(self))
        ]  # fmt: skip

    def arrays(self) -> dict[str, np.ndarray]:
        """The columns as compact arrays (`read` reads them back), named with `PREFIX`."""
        compact = {name: getattr(self, name) for name in FLOOD_COLUMNS}
        for name in ("object", "seed_pass", "fov_evaluations", "voxels"):
            compact[name] = _unsigned(compact[name])
        compact["seed"] = self.seed.astype(np.int32)  # < 0 in a block's padding at a face
        return {self.PREFIX + name: values for name, values in compact.items()}

    @classmethod
    def read(cls, found: Mapping[str, np.ndarray]) -> "FloodRecords | None":
        """The records `arrays` put among `found`'s arrays; None if it holds none (written
        before they were kept)."""
        if cls.PREFIX + "object" not in found:
            return None
        columns = {
            name: np.asarray(found[cls.PREFIX + name]).astype(kind)
            for name, kind in FLOOD_COLUMNS.items()
        }
        return cls(**columns | {"seed": columns["seed"].reshape(-1, 3)})

    def in_volume(self, offset_zyx: Sequence[int], ids: Mapping[int, int] | None) -> "FloodRecords":
        """The records of a segmentation of a region whose first voxel is `offset_zyx` in a
        volume, seeds in the volume's coordinates; with `ids` (old id: new id), its objects
        renumbered, a kept object missing from `ids` CROPPED."""
        seed = self.seed + np.asarray(offset_zyx, np.int64)
        if ids is None:
            return dataclasses.replace(self, seed=seed)
        objects = np.array([ids.get(int(o), 0) for o in self.object], np.uint64)
        cropped = (self.end == FloodEnd.KEPT) & (objects == 0)
        end = np.where(cropped, np.uint8(FloodEnd.CROPPED), self.end).astype(np.uint8)
        return dataclasses.replace(self, object=objects, seed=seed, end=end)


def long_step(model: ModelConfig, config: InferenceConfig) -> ZYX:
    """How far (z, y, x) a long move goes: the model's deltas scaled by `move_step_scale`, at
    most the FOV's radius (a face further out is not in the FOV)."""
    step = tuple(int(round(d * config.move_step_scale)) for d in model.deltas_zyx)
    radius = tuple(s // 2 for s in model.fov_shape_zyx)
    if any(s > r for s, r in zip(step, radius, strict=True)):
        raise ConfigError(
            f"move_step_scale {config.move_step_scale} moves the FOV by {step}, past its radius "
            f"{radius} (model deltas {model.deltas_zyx})"
        )
    return step  # type: ignore[return-value]


class Canvas:
    """One volume being segmented: the image, the segmentation so far and the current object's
    mask logits (NaN where the current flood has not predicted)."""

    def __init__(
        self, image: np.ndarray, predict: Predictor, model: ModelConfig, config: InferenceConfig
    ):
        self.image, self.predict, self.model, self.config = image, predict, model, config
        self.shape = np.array(image.shape)
        self.fov = np.array(model.fov_shape_zyx)
        self.radius = self.fov // 2
        self.last = self.shape - self.radius - 1  # the last valid FOV centre
        self.long_step = long_step(model, config)
        self.quantum = np.maximum(np.array(model.deltas_zyx), 1)  # as the training trajectories
        self.logits = np.full(image.shape, np.nan, np.float32)
        self.segmentation = np.zeros(image.shape, np.uint64)
        # float32 like the canvas, so a seed at move_threshold compares as equal, not below.
        self.move_logit = np.float32(logit(config.move_threshold))
        self.long_move_logit = np.float32(logit(config.long_move_threshold))
        self.segment_logit = np.float32(logit(config.segment_threshold))
        self.pad_logit = np.float32(logit(config.pad_probability))
        self.counts: Counter[str] = Counter()
        self.floods: list[Flood] = []  # every flood, in order (`FloodRecords`)
        self.after_batch: Callable[[], None] | None = None  # e.g. a progress report
        # Called with a flood's FOV evaluations so far before each step, where a flood with a
        # smaller budget would stop: the fills of every budget up to this one, from one flood.
        self.before_step: Callable[[int], None] | None = None

    # -- positions ---------------------------------------------------------------------------

    def is_valid(self, pos: tuple[int, ...]) -> bool:
        """The FOV fits in the volume and no earlier object owns its centre."""
        p = np.asarray(pos)
        inside = np.all(p >= self.radius) and np.all(p <= self.last)
        return bool(inside) and self.segmentation[tuple(pos)] == 0

    def _key(self, pos: tuple[int, ...]) -> tuple[int, ...]:
        """FFN visits one FOV per `deltas`-sized cell of positions; here positions against the
        border get cells of their own, or a FOV a voxel inside would stand in for them."""
        p = np.asarray(pos)
        key = np.where(p == self.radius, -1, p // self.quantum)
        return tuple(int(k) for k in np.where(p == self.last, -2, key))

    def _fov(self, pos: tuple[int, ...]) -> tuple[slice, ...]:
        return tuple(slice(p - r, p + r + 1) for p, r in zip(pos, self.radius, strict=True))

    def _take_batch(self, queue: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """Remove and return up to batch_size queued positions whose FOVs do not overlap."""
        batch: list[tuple[int, ...]] = []
        rest = []
        for pos in queue:
            free = len(batch) < self.config.batch_size and all(
                np.any(np.abs(np.subtract(pos, other)) >= self.fov) for other in batch
            )
            (batch if free else rest).append(pos)
        queue[:] = rest
        return batch

    # -- network -----------------------------------------------------------------------------

    def _evaluate(self, batch: list[tuple[int, ...]]) -> np.ndarray:
        boxes = [self._fov(pos) for pos in batch]
        images = np.stack([self.image[box] for box in boxes])[..., None]
        seeds = np.stack([self._known(pos) for pos in batch])[..., None]
        logits = np.asarray(self.predict(images, seeds))
        if logits.shape != images.shape:
            raise InferenceError(
                f"predictor returned shape {logits.shape} for inputs of shape {images.shape}"
            )
        if not np.all(np.isfinite(logits)):
            raise InferenceError("predictor returned NaN or infinite logits")
        self.counts["batches"] += 1
        self.counts["fov_evaluations"] += len(batch)
        if self.after_batch is not None:
            self.after_batch()
        return logits[..., 0].astype(np.float32, copy=False)

    def _moves(self, prediction: np.ndarray) -> list[tuple[ZYX, bool]]:
        """(offset, whether long) of FFN's moves by `deltas`, each replaced by the long move
        toward the same face where that is sure; best first."""
        near = face_moves(prediction, self.model.deltas_zyx, self.move_logit)
        moves = {face: (move, False) for face, move in near.items()}
        if self.long_step != tuple(self.model.deltas_zyx):
            long = face_moves(prediction, self.long_step, self.long_move_logit)
            moves |= {face: (move, True) for face, move in long.items()}
        return [(offset, is_long) for (_, offset), is_long in sorted(moves.values(), reverse=True)]

    def _passed_keys(self, pos: tuple[int, ...], target: tuple[int, ...]) -> set[tuple[int, ...]]:
        """The cells a long move passes over: visited as far as the flood goes (the network was
        sure of the object there), or a move back from the target would fill them in."""
        span = np.subtract(target, pos)
        steps = int(np.abs(span).max())
        return {self._key(tuple(np.add(pos, span * j // steps))) for j in range(1, steps)}

    def _queue_moves(
        self,
        pos: tuple[int, ...],
        prediction: np.ndarray,
        queue: list[tuple[int, ...]],
        seen: set[tuple[int, ...]],
    ) -> None:
        """Queue the moves from the FOV at `pos` that `prediction` (its logits) shows, to cells
        not visited yet."""
        for offset, is_long in self._moves(prediction):
            # A move past the border stops at it (FFN drops it, leaving up to `deltas` of an
            # object along the border unvisited).
            target = np.clip(np.add(pos, offset), self.radius, self.last)
            target = tuple(int(t) for t in target)
            key = self._key(target)
            if key not in seen and self.is_valid(target):
                seen.add(key)
                queue.append(target)
                if is_long:
                    seen |= self._passed_keys(pos, target)

    def _known(self, pos: tuple[int, ...]) -> np.ndarray:
        """The flood's logits in the FOV at `pos`, the pad where it has predicted nothing."""
        known = self.logits[self._fov(pos)]
        return np.where(np.isnan(known), self.pad_logit, known)

    def _seen_enough(
        self, batch: list[tuple[int, ...]], start: tuple[int, ...]
    ) -> list[tuple[int, ...]]:
        """Remove from `batch` and return the FOVs with less than `min_unseen_share` of their
        voxels new to the flood (never the seed's), in order."""
        share = self.config.min_unseen_share
        if not share:
            return []
        seen_enough = [
            pos
            for pos in batch
            if pos != start
            and np.count_nonzero(np.isnan(self.logits[self._fov(pos)])) < share * np.prod(self.fov)
        ]
        batch[:] = [pos for pos in batch if pos not in seen_enough]
        self.counts["fovs_seen_enough"] += len(seen_enough)
        return seen_enough

    # -- one object --------------------------------------------------------------------------

    def flood(self, start: tuple[int, ...]) -> _Object | None:
        """Grow one object from `start` (a valid position); None if its seed voxel got too weak.
        Recorded in `floods`, as kept until `try_seed` decides otherwise.

        The canvas's logits are reset afterwards, so floods do not see each other's predictions.
        """
        logits, config = self.logits, self.config
        queue, seen = [start], {self._key(start)}
        low = high = np.array(start)
        logits[start] = logit(config.seed_probability)
        evaluations, truncated = 0, False
        while queue and logits[start] >= self.move_logit:
            if self.before_step is not None:
                self.before_step(evaluations)
            if evaluations >= config.max_fov_evaluations_per_object:
                self.counts["objects_truncated"] += 1
                truncated = True
                break
            batch = self._take_batch(queue)
            for pos in self._seen_enough(batch, start):
                self._queue_moves(pos, self._known(pos), queue, seen)
            for pos, prediction in zip(batch, self._evaluate(batch) if batch else (), strict=True):
                evaluations += 1
                box = self._fov(pos)
                old = logits[box]
                if config.keep_background:  # NaN (not predicted yet) compares False
                    np.copyto(prediction, old, where=(old < 0) & (prediction > old))
                logits[box] = prediction
                low, high = np.minimum(low, pos), np.maximum(high, pos)
                self._queue_moves(pos, prediction, queue, seen)
                if logits[start] < self.move_logit:
                    break
        box = tuple(slice(a - r, b + r + 1) for a, b, r in zip(low, high, self.radius, strict=True))
        kept = logits[start] >= self.move_logit
        mask = logits[box] >= self.segment_logit
        logits[box] = np.nan
        voxels = int(np.count_nonzero(mask & (self.segmentation[box] == 0)))
        end = FloodEnd.KEPT if kept else FloodEnd.SEED_TOO_WEAK
        self.floods.append(Flood(tuple(start), evaluations, voxels, truncated, end))
        if not kept:
            self.counts["seeds_too_weak"] += 1
            return None
        return _Object(box, mask)

    def _consistent(self, first: _Object, start: tuple[int, ...]) -> _Object | None:
        """Flood again from the innermost voxel of `first`; their intersection if they agree."""
        padded = np.pad(first.mask, 1)  # the box's border counts as outside the object
        inner = np.unravel_index(
            int(np.argmax(ndimage.distance_transform_edt(padded))), padded.shape
        )
        centre = tuple(int(i - 1 + s.start) for i, s in zip(inner, first.box, strict=True))
        if centre == tuple(start) or not self.is_valid(centre):
            return first
        second = self.flood(centre)
        if second is None:
            return None
        box = _union_box(first.box, second.box)
        a, b = first.within(box), second.within(box)
        both = a & b
        if np.count_nonzero(both) < self.config.consistency_min_iou * np.count_nonzero(a | b):
            return None
        return _Object(box, both)

    def try_seed(self, seed: tuple[int, ...], seed_pass: int = 0) -> None:
        """Flood from `seed` unless it is taken or next to an object; keep what the flood (and
        the consistency check) makes if large enough. Its floods' records get the outcome."""
        if not self.is_valid(seed):
            return
        near = tuple(
            slice(max(s - d, 0), s + d + 1)
            for s, d in zip(seed, self.config.min_boundary_distance_zyx, strict=True)
        )
        if np.any(self.segmentation[near]):
            return
        self.counts["seeds_tried"] += 1
        attempt = len(self.floods)
        found = self.flood(seed)
        end, made = FloodEnd.SEED_TOO_WEAK, 0
        if found is not None and self.config.consistency_check:
            found = self._consistent(found, seed)
            if found is None:
                self.counts["objects_inconsistent"] += 1
                end = FloodEnd.INCONSISTENT
        if found is not None:
            owned = self.segmentation[found.box]
            mask = found.mask & (owned == 0)
            size = int(np.count_nonzero(mask))
            self.floods[attempt].voxels = size
            if size < self.config.min_segment_size:
                self.counts["objects_too_small"] += 1
                end = FloodEnd.TOO_SMALL
            else:
                self.counts["objects"] += 1
                self.counts["segmented_voxels"] += size
                end, made = FloodEnd.KEPT, self.counts["objects"]
                owned[mask] = made
        for k, flood in enumerate(self.floods[attempt:]):
            flood.seed_pass, flood.check, flood.object = seed_pass, k > 0, made
            if flood.end != FloodEnd.SEED_TOO_WEAK:  # a flood whose seed failed keeps that end
                flood.end = end


def _check_raw(raw: np.ndarray, model: ModelConfig) -> None:
    if raw.ndim != 3:
        raise VolumeShapeError(f"raw image must be 3-D (z, y, x), got shape {raw.shape}")
    if raw.dtype != np.uint8:
        raise VolumeDtypeError(f"raw image must be uint8, got {raw.dtype}")
    if any(s < f for s, f in zip(raw.shape, model.fov_shape_zyx, strict=True)):
        raise VolumeShapeError(
            f"raw image shape {raw.shape} (z, y, x) is smaller than the field of view "
            f"{model.fov_shape_zyx}"
        )


@dataclass
class _SeedLoop:
    """Where the seed loop stands between two objects: all a resumed run needs besides the
    segmentation (`pending` is the rest of the current pass's seeds; None: start a new pass)."""

    next_pass: int = 0
    pending: list[tuple[int, ...]] | None = None
    objects_before: int = 0  # objects when the current pass began
    tried: set[tuple[int, ...]] = dataclasses.field(default_factory=set)
    seconds: float = 0.0  # spent by earlier, interrupted runs
    # False once resumed from a state saved before floods were recorded: its records are lost.
    recorded: bool = True


def _fingerprint(raw: np.ndarray, model: ModelConfig, config: InferenceConfig, key: str) -> str:
    """What a checkpoint must have been made from: the same image, model shape, settings and
    caller's key (the weights: a predictor cannot tell which it runs)."""
    digest = hashlib.sha256(np.ascontiguousarray(raw).data).hexdigest()
    settings = {"model": config_io.to_dict(model), "inference": config_io.to_dict(config)}
    return f"{raw.shape} {digest} {json.dumps(settings, sort_keys=True)} {key}"


def _save_state(path: Path, canvas: "Canvas", loop: _SeedLoop, fingerprint: str) -> None:
    state = {
        "counts": dict(canvas.counts),
        "next_pass": loop.next_pass,
        "objects_before": loop.objects_before,
        "seconds": loop.seconds,
        "fingerprint": fingerprint,
        "floods_recorded": loop.recorded,
    }
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.savez(
            f,
            segmentation=canvas.segmentation,
            pending=np.array(loop.pending if loop.pending is not None else [], np.int64).reshape(
                -1, 3
            ),
            has_pending=loop.pending is not None,
            tried=np.array(sorted(loop.tried), np.int64).reshape(-1, 3),
            state=json.dumps(state),
            **FloodRecords.of(canvas.floods).arrays(),
        )


def _load_state(path: Path, canvas: "Canvas", fingerprint: str) -> _SeedLoop:
    try:
        with np.load(path) as saved:
            state = json.loads(str(saved["state"]))
            if state["fingerprint"] != fingerprint:
                raise CheckpointError(
                    f"{path}: an inference checkpoint of another volume or other settings; "
                    "delete it to start again"
                )
            canvas.segmentation[...] = saved["segmentation"]
            pending = [tuple(int(v) for v in s) for s in saved["pending"]]
            # A state saved before floods were recorded goes on without them.
            floods = FloodRecords.read(saved) if state.get("floods_recorded") else None
            loop = _SeedLoop(
                next_pass=state["next_pass"],
                pending=pending if bool(saved["has_pending"]) else None,
                objects_before=state["objects_before"],
                tried={tuple(int(v) for v in s) for s in saved["tried"]},
                seconds=state["seconds"],
                recorded=floods is not None,
            )
            canvas.floods = floods.floods() if floods is not None else []
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as exc:
        raise CheckpointError(f"{path}: unreadable inference checkpoint ({exc})") from None
    canvas.counts.update(state["counts"])
    return loop


ETA_MIN_SEEDS = 20  # seeds tried before a time left is estimated from the seeds


def progress_record(counts: Counter, loop: "_SeedLoop", seconds: float, voxels: int) -> dict:
    """Where a segmentation of `voxels` voxels stands: objects, FOV evaluations and their rate,
    the share of the voxels segmented and of this seed pass's seeds tried, and a rough time left
    for the pass (later passes may add seeds)."""
    pending = len(loop.pending or [])
    tried = len(loop.tried)
    share = tried / (tried + pending) if tried + pending else 0.0
    segmented = counts["segmented_voxels"] / voxels  # `segment` takes no volume under a FOV
    fovs = counts["fov_evaluations"]
    return {
        "objects": counts["objects"],
        "fov_evaluations": fovs,
        "fov_per_s": fovs / seconds if seconds > 0 else 0.0,
        "seeds_tried": tried,
        "seeds_pending": pending,
        "seed_share": share,
        "segmented_share": segmented,
        "seconds": seconds,
        "eta_s": _time_left(seconds, share if tried >= ETA_MIN_SEEDS else 0.0, segmented),
    }


def _time_left(seconds: float, seed_share: float, segmented_share: float) -> float | None:
    """The smaller of two extrapolations, each too long in its own phase: by seeds early (the
    first seeds lie deepest in the largest objects: on the whole FlyEM file's first block the
    first 28 of 4,143 seeds had segmented 39 % of it) and by segmented voxels late (what no fill
    reaches stays unsegmented however many seeds are left). None before either has a share."""
    left = [seconds * (1 - share) / share for share in (seed_share, segmented_share) if share > 0]
    return min(left) if left else None


def _progress_reporter(
    canvas: "Canvas",
    loop: _SeedLoop,
    started: float,
    voxels: int,
    on_progress: Callable[[dict], None] | None,
    every_s: float,
    now: float,
) -> Callable[[], None]:
    """What the canvas calls after every batch: `on_progress(progress_record)` when `every_s`
    seconds have passed since the last report (the first: since `now`)."""
    last_report = now

    def report_if_due() -> None:
        nonlocal last_report
        now = time.perf_counter()
        if on_progress is not None and now - last_report >= every_s:
            last_report = now
            on_progress(progress_record(canvas.counts, loop, loop.seconds + now - started, voxels))

    return report_if_due


def _state_saver(
    state_path: Path | None,
    canvas: "Canvas",
    loop: _SeedLoop,
    fingerprint: str,
    started: float,
    every_s: float,
    now: float,
) -> Callable[[], None]:
    """What the seed loop calls after every seed: the state written to `state_path` (if any) when
    `every_s` seconds have passed since the last save (the first: since `now`), with the seconds
    spent so far, earlier runs' included."""
    last_save = now

    def save_if_due() -> None:
        nonlocal last_save
        if state_path is not None and time.perf_counter() - last_save >= every_s:
            elapsed = loop.seconds
            loop.seconds += time.perf_counter() - started
            _save_state(state_path, canvas, loop, fingerprint)
            loop.seconds, last_save = elapsed, time.perf_counter()

    return save_if_due


def _begin_seed_pass(
    canvas: "Canvas",
    loop: _SeedLoop,
    edges: np.ndarray,
    config: InferenceConfig,
    margin: np.ndarray,
) -> None:
    """The seeds of a new pass, those not tried before, into `loop.pending`. The first pass is
    `seed_peaks`; later ones also take segmented voxels as edges."""
    blocked = edges | (canvas.segmentation > 0)
    distance = ndimage.distance_transform_edt(~blocked).astype(np.float32)
    seeds = [tuple(int(s) for s in seed) for seed in _peaks(distance, config, margin)]
    loop.pending = [seed for seed in seeds if seed not in loop.tried]
    loop.objects_before = canvas.counts["objects"]
    canvas.counts["seed_passes"] += 1
    canvas.counts["seeds"] += len(loop.pending)


def _try_pending_seeds(
    canvas: "Canvas", loop: _SeedLoop, bar: tqdm, save_if_due: Callable[[], None]
) -> None:
    """Flood from each seed left in the current pass, in order, saving the state when due."""
    while loop.pending:
        seed = loop.pending.pop(0)
        loop.tried.add(seed)
        canvas.try_seed(seed, loop.next_pass + 1)
        bar.update()
        bar.set_postfix(
            objects=canvas.counts["objects"],
            fovs=canvas.counts["fov_evaluations"],
            refresh=False,
        )
        save_if_due()


def _run_seed_passes(
    canvas: "Canvas",
    loop: _SeedLoop,
    edges: np.ndarray,
    config: InferenceConfig,
    margin: np.ndarray,
    save_if_due: Callable[[], None],
    progress: bool,
) -> None:
    """Seed passes from where `loop` stands until `config.seed_passes`, or a pass that adds no
    object."""
    with tqdm(desc="flood fill", unit="seed", disable=not progress) as bar:
        while loop.next_pass < config.seed_passes:
            if loop.pending is None:
                _begin_seed_pass(canvas, loop, edges, config, margin)
            bar.total = (bar.total or 0) + len(loop.pending)
            _try_pending_seeds(canvas, loop, bar, save_if_due)
            added = canvas.counts["objects"] > loop.objects_before
            loop.next_pass = loop.next_pass + 1 if added else config.seed_passes
            loop.pending = None


def segment(
    raw: np.ndarray,
    predict: Predictor,
    model: ModelConfig,
    config: InferenceConfig | None = None,
    **options: Any,
) -> tuple[np.ndarray, InferenceStats]:
    """`segment_with_floods` without the flood records."""
    segmentation, stats, _ = segment_with_floods(raw, predict, model, config, **options)
    return segmentation, stats


def segment_with_floods(
    raw: np.ndarray,
    predict: Predictor,
    model: ModelConfig,
    config: InferenceConfig | None = None,
    *,
    progress: bool = False,
    checkpoint_path: str | Path | None = None,
    checkpoint_every_s: float = 600.0,
    checkpoint_key: str = "",
    on_progress: Callable[[dict], None] | None = None,
    progress_every_s: float = 60.0,
) -> tuple[np.ndarray, InferenceStats, FloodRecords | None]:
    """Flood-fill segmentation of one (z, y, x) uint8 volume: (uint64 ids 1..N, 0 = none; stats;
    the records of its floods, None if it went on from a checkpoint saved without them).

    Deterministic: the same inputs and a deterministic predictor give the same segmentation.
    With `checkpoint_path`, the state between two objects is written there (atomically) every
    `checkpoint_every_s` seconds, and a run that finds it there goes on from it, giving the same
    result as one uninterrupted run (FFN's inference checkpoints, for jobs longer than a batch
    job's wall time); the file is removed when the segmentation is complete. A checkpoint of
    another image, model shape, settings or `checkpoint_key` (name the weights there) is refused.
    `on_progress(record)` is called every `progress_every_s` seconds, between two network calls
    (one object can take an hour), with `progress_record`'s fields.
    """
    _check_raw(raw, model)
    config = config or InferenceConfig()
    started = time.perf_counter()
    margin = np.array(model.fov_shape_zyx) // 2
    canvas = Canvas(normalize_image(raw, model), predict, model, config)
    state_path = Path(checkpoint_path) if checkpoint_path is not None else None
    fingerprint = _fingerprint(raw, model, config, checkpoint_key) if state_path is not None else ""
    loop = _SeedLoop()
    if state_path is not None and state_path.is_file():
        loop = _load_state(state_path, canvas, fingerprint)
    now = time.perf_counter()
    canvas.after_batch = _progress_reporter(
        canvas, loop, started, raw.size, on_progress, progress_every_s, now
    )
    save_if_due = _state_saver(
        state_path, canvas, loop, fingerprint, started, checkpoint_every_s, now
    )
    _run_seed_passes(canvas, loop, edge_map(raw, config), config, margin, save_if_due, progress)
    if state_path is not None:
        state_path.unlink(missing_ok=True)
    stats = InferenceStats(
        voxels=int(raw.size),
        seconds=loop.seconds + time.perf_counter() - started,
        **canvas.counts,
    )
    floods = FloodRecords.of(canvas.floods) if loop.recorded else None
    return canvas.segmentation, stats, floods


# ---------------------------------------------------------------------------------------------
# The network as a predictor


def make_model_predictor(model: "tf.keras.Model") -> Predictor:
    """Wrap a Keras FFN model (inference mode, one traced graph for every batch size)."""
    import tensorflow as tf

    spec = tf.TensorSpec((None, *model.inputs[0].shape[1:]), tf.float32)

    @tf.function(input_signature=[spec, spec], autograph=False)  # no Python control flow
    def run(images, seeds):
        return tf.cast(model([images, seeds], training=False), tf.float32)

    def predict(images: np.ndarray, seeds: np.ndarray) -> np.ndarray:
        return run(images, seeds).numpy()

    return predict


def checkpoint_model_config(checkpoint: str | Path) -> ModelConfig:
    """The model settings of a training checkpoint (`TRAIN_DIR/checkpoints/ckpt-N`), from the
    training run's `TRAIN_DIR/config.json`."""
    from pipeline.training.train_config import load_train_config

    config_path = Path(checkpoint).parent.parent / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{checkpoint}: no training config at {config_path}")
    return load_train_config(config_path).model


def inference_model(checkpoint: str | Path, config: InferenceConfig) -> ModelConfig:
    """The checkpoint's model settings, in the precision `config` asks of this machine."""
    import tensorflow as tf

    from pipeline.network.devices import visible_devices
    from pipeline.network.model import cpu_flags, inference_precision

    model = checkpoint_model_config(checkpoint)
    accelerator = bool(visible_devices(tf)[1])
    precision = inference_precision(config.precision, model.precision, cpu_flags(), accelerator)
    return dataclasses.replace(model, precision=precision)


def predictor_from_checkpoint(
    checkpoint: str | Path, model: ModelConfig | None = None
) -> Predictor:
    """Build the network of `model` (default: the checkpoint's own settings), restore its weights."""
    from pipeline.network.model import build_model, load_weights

    model = model or checkpoint_model_config(checkpoint)
    return make_model_predictor(load_weights(build_model(model), str(checkpoint)))
