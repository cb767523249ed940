"""FFN's training preprocessing: partition the ground truth, then sample balanced coordinates.

As google-research/ffn's `compute_partitions.py` and `build_coordinates.py`: every labeled voxel
gets a class from the fraction of its local window (the "local object mask", radius
`lom_radius_zyx`) that belongs to its own object, and training centres are drawn equally from every
class, so thin neurites and object borders are seen as often as the insides of large cells.

Differences from FFN, on purpose:
  * the partition map keeps the volume's shape (FFN crops the margin), so coordinates index the
    volume directly; voxels within `margin_zyx` of the border are class 255 (excluded);
  * unlabeled voxels are class 0 and, like 255, are never sampled; so are the voxels of objects
    smaller than `min_object_voxels` (FFN's `--min_size`, which clears such "dust" before
    partitioning and would still sample it as class 0, training the network to fill specks of
    a few voxels that a ground truth's annotation leaves behind);
  * coordinates are an `.npz` file (zyx, with the volume name and each coordinate's class), not a
    TFRecord, and each training rank reads only its own shard.

CLI: `python -m pipeline.cli.partitions --labels vol.h5:labels --partitions-out parts.h5
--coordinates-out coords.npz`.
"""

import time
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import fastremap
import numpy as np
from tqdm import tqdm

from pipeline.core.atomic import atomic_path
from pipeline.core.errors import ConfigError, CoordinatesError, VolumeDtypeError, VolumeShapeError
from pipeline.data.volumes import ZYX, VolumeSpec, read_labels, write_volumes

# FFN's README thresholds: 12 thresholds, so labeled classes 1..13.
DEFAULT_THRESHOLDS = (0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
# Half of FFN's default training FOV (x, y, z) = (33, 33, 17).
DEFAULT_LOM_RADIUS_ZYX = (8, 16, 16)
UNLABELED = 0
EXCLUDED = 255
# Objects whose voxels, cut into blocks this size, fit in smaller boxes are processed per block.
PIECE_ZYX = (64, 64, 64)
# Voxels of one object handled at once: bounds the memory that huge objects take.
CHUNK_VOXELS = 1 << 22
PARTITIONS_DATASET = "partitions"
COORDINATES_FORMAT = 1


def _check_zyx(value: Sequence[int], name: str) -> ZYX:
    values = tuple(value)
    if len(values) != 3 or not all(isinstance(v, int | np.integer) and v >= 0 for v in values):
        raise ConfigError(f"{name} must be 3 non-negative integers (z, y, x), got {value!r}")
    return tuple(int(v) for v in values)


def _check_thresholds(thresholds: Sequence[float]) -> tuple[float, ...]:
    try:
        values = tuple(float(t) for t in thresholds)
    except (TypeError, ValueError):
        raise ConfigError(f"thresholds must be numbers, got {thresholds!r}") from None
    # Classes 1..len+1 must stay below EXCLUDED in a uint8.
    if not 0 < len(values) < EXCLUDED - 1:
        raise ConfigError(f"thresholds: need 1 to {EXCLUDED - 2} values, got {len(values)}")
    if not all(0 < t <= 1 for t in values) or any(
        a >= b for a, b in zip(values, values[1:], strict=False)
    ):
        raise ConfigError(f"thresholds must be strictly increasing in (0, 1], got {list(values)}")
    return values


def _check_int(value: object, name: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_margin(margin_zyx: Sequence[int] | None, lom_radius_zyx: ZYX) -> ZYX:
    if margin_zyx is None:
        return lom_radius_zyx
    margin = _check_zyx(margin_zyx, "margin_zyx")
    # A smaller margin would put windows outside the volume, where the count is undefined.
    if any(m < r for m, r in zip(margin, lom_radius_zyx, strict=True)):
        raise ConfigError(f"margin_zyx {margin} must be at least lom_radius_zyx {lom_radius_zyx}")
    return margin


@dataclass(frozen=True)
class PartitionConfig:
    """Settings of the partitioning and of the coordinate sampling, validated on creation."""

    thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS
    lom_radius_zyx: ZYX = DEFAULT_LOM_RADIUS_ZYX
    margin_zyx: ZYX | None = None  # None: the LOM radius
    samples_per_class: int = 5000
    seed: int = 0
    # Objects with fewer voxels (in the whole label volume) are never sampled; 0 samples every
    # object. FFN's own default is 10,000 (compute_partitions.py's --min_size).
    min_object_voxels: int = 0

    def __post_init__(self) -> None:
        radius = _check_zyx(self.lom_radius_zyx, "lom_radius_zyx")
        object.__setattr__(self, "thresholds", _check_thresholds(self.thresholds))
        object.__setattr__(self, "lom_radius_zyx", radius)
        if self.margin_zyx is not None:
            object.__setattr__(self, "margin_zyx", _check_margin(self.margin_zyx, radius))
        _check_int(self.samples_per_class, "samples_per_class", minimum=1)
        _check_int(self.seed, "seed", minimum=0)
        _check_int(self.min_object_voxels, "min_object_voxels", minimum=0)

    @property
    def margin(self) -> ZYX:
        """The margin actually used: `margin_zyx`, or the LOM radius when that is None."""
        return self.lom_radius_zyx if self.margin_zyx is None else self.margin_zyx


# ---------------------------------------------------------------------------------------------
# Partitions


def _interior(shape: Sequence[int], margin: ZYX) -> tuple[slice, ...]:
    if any(s <= 2 * m for s, m in zip(shape, margin, strict=True)):
        raise ConfigError(
            f"volume shape {tuple(shape)} (z, y, x) has no voxel farther than margin {margin} "
            "from the border"
        )
    return tuple(slice(m, s - m) for s, m in zip(shape, margin, strict=True))


def _window_counts(mask: np.ndarray, points: np.ndarray, radius: np.ndarray) -> np.ndarray:
    """Number of True voxels of `mask` in the (2r+1) window around each of the (3, N) points.

    Integer summed-volume table (exact), queried only at the points: 8 corner lookups each. Every
    window must lie inside `mask`.
    """
    # int32 is faster; int64 only when a box could hold 2**31 voxels.
    dtype = np.int32 if mask.size < 2**31 else np.int64
    table = np.zeros(tuple(s + 1 for s in mask.shape), dtype=dtype)
    inner = table[1:, 1:, 1:]
    inner[...] = mask  # casting first, then cumsums in place: much faster than cumsum(dtype=)
    for axis in range(3):
        np.cumsum(inner, axis=axis, out=inner)
    # table[i, j, k] = mask[:i, :j, :k].sum(); window [p - r, p + r] -> corners p - r and p + r + 1.
    low = np.ravel_multi_index(tuple(points - radius[:, None]), table.shape)
    # Flat offset from the low corner to the high one along each axis (table is C-contiguous).
    step = np.array(table.strides) // table.itemsize * (2 * radius + 1)
    flat = table.ravel()
    counts = np.zeros(points.shape[1], dtype=np.int64)
    for corner in np.ndindex(2, 2, 2):  # 1 = high index; inclusion-exclusion over the 8 corners
        sign = 1 if (3 - sum(corner)) % 2 == 0 else -1
        counts += sign * flat[low + int(np.dot(corner, step))].astype(np.int64)
    return counts


def _voxels_by_object(ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(id, flat indices into `ids` of its voxels) for every non-zero id present, from one sort."""
    flat = ids.ravel()
    order = np.argsort(flat, kind="stable")
    ends = np.cumsum(np.bincount(flat))
    return [(k, order[ends[k - 1] : ends[k]]) for k in range(1, len(ends)) if ends[k] > ends[k - 1]]


def _box(points: np.ndarray, radius: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Low and high (exclusive) corners of the (3, N) points' bounding box grown by the radius."""
    return points.min(axis=1) - radius, points.max(axis=1) + 1 + radius


def _box_volume(points: np.ndarray, radius: np.ndarray) -> int:
    low, high = _box(points, radius)
    return int(np.prod(high - low))


def _pieces(points: np.ndarray, radius: np.ndarray) -> list[np.ndarray]:
    """An object's (3, N) voxels whole, or split by PIECE_ZYX blocks when their grown bounding
    boxes hold fewer voxels in all: a long diagonal neurite's box is mostly empty.
    """
    block = points // np.array(PIECE_ZYX)[:, None]
    block -= block.min(axis=1, keepdims=True)
    key = np.ravel_multi_index(tuple(block), tuple(block.max(axis=1) + 1))
    # Small keys (few blocks per object) sort by radix, in linear time.
    order = np.argsort(key.astype(np.min_scalar_type(key.max())), kind="stable")
    split = np.split(points[:, order], np.flatnonzero(np.diff(key[order])) + 1, axis=1)
    whole = [points]
    return min(whole, split, key=lambda pieces: sum(_box_volume(p, radius) for p in pieces))


def compute_partitions(
    labels: np.ndarray,
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    lom_radius_zyx: Sequence[int] = DEFAULT_LOM_RADIUS_ZYX,
    margin_zyx: Sequence[int] | None = None,
    *,
    min_object_voxels: int = 0,
    progress: bool = False,
) -> np.ndarray:
    """FFN's partition map of a (z, y, x) label volume, same shape, uint8.

    For each labeled voxel, the fraction f of its (2r+1)-voxel window (r = `lom_radius_zyx`) that
    has its own label gives class 1 + (index of the first threshold with f < threshold), or
    len(thresholds) + 1 when f >= every threshold. Unlabeled voxels, and those of objects with
    fewer than `min_object_voxels` voxels in `labels`, are 0; voxels within
    `margin_zyx` (default: the radius) of the border are 255, whatever their label.
    """
    if labels.ndim != 3:
        raise VolumeShapeError(f"labels must be 3-D (z, y, x), got shape {labels.shape}")
    if labels.dtype.kind not in "iu":
        raise VolumeDtypeError(f"labels must be an integer type, got {labels.dtype}")
    thresholds = np.asarray(_check_thresholds(thresholds))
    radius_zyx = _check_zyx(lom_radius_zyx, "lom_radius_zyx")
    margin = _check_margin(margin_zyx, radius_zyx)
    radius = np.array(radius_zyx)
    interior = _interior(labels.shape, margin)
    window = int(np.prod(2 * radius + 1))

    # Consecutive ids: small dtype, so the sort below is a fast radix sort.
    ids, _ = fastremap.renumber(labels, preserve_zero=True, in_place=False)
    output = np.full(labels.shape, EXCLUDED, dtype=np.uint8)
    output[interior] = UNLABELED
    core = ids[interior]  # only these voxels get a class; their windows lie inside the volume
    sizes = np.bincount(ids.ravel())
    objects = [(k, v) for k, v in _voxels_by_object(core) if sizes[k] >= min_object_voxels]
    for k, voxels in tqdm(objects, desc="partitions", unit="object", disable=not progress):
        # Voxels are in (z, y, x) order, so a chunk of them is a slab of the object.
        chunks = (voxels[i : i + CHUNK_VOXELS] for i in range(0, len(voxels), CHUNK_VOXELS))
        for chunk in chunks:
            points = np.stack(np.unravel_index(chunk, core.shape)) + np.array(margin)[:, None]
            for piece in _pieces(points, radius):
                low, high = _box(piece, radius)  # holds all of the piece's windows
                mask = ids[tuple(slice(a, b) for a, b in zip(low, high, strict=True))] == k
                fraction = _window_counts(mask, piece - low[:, None], radius) / window
                output[tuple(piece)] = np.digitize(fraction, thresholds) + 1
    return output


# ---------------------------------------------------------------------------------------------
# Coordinates


def build_coordinates(partitions: np.ndarray, samples_per_class: int, seed: int) -> np.ndarray:
    """Training centres, (N, 3) int32 zyx, balanced across the partition classes, shuffled.

    Every class present (other than 0 = unlabeled and 255 = excluded) gives exactly
    `samples_per_class` voxels: drawn without replacement when it has that many, otherwise all of
    its voxels repeated in a random order (FFN's `np.resize`). Deterministic for a given `seed`.
    """
    _check_int(samples_per_class, "samples_per_class", minimum=1)
    if partitions.ndim != 3 or partitions.dtype != np.uint8:
        raise VolumeShapeError(
            f"partitions must be a 3-D uint8 array, got {partitions.dtype} {partitions.shape}"
        )
    counts = np.bincount(partitions.ravel(), minlength=EXCLUDED + 1)
    classes = [c for c in np.flatnonzero(counts) if c not in (UNLABELED, EXCLUDED)]
    if not classes:
        raise CoordinatesError(
            "partitions have no labeled voxel outside the margin: nothing to sample"
        )
    rng = np.random.default_rng(seed)
    picks = []
    for c in classes:
        voxels = np.flatnonzero(partitions == c)
        if len(voxels) >= samples_per_class:
            picks.append(rng.choice(voxels, samples_per_class, replace=False))
        else:
            picks.append(np.resize(rng.permutation(voxels), samples_per_class))
    flat = rng.permutation(np.concatenate(picks))
    return np.stack(np.unravel_index(flat, partitions.shape), axis=1).astype(np.int32)


@dataclass(frozen=True, eq=False)
class Coordinates:
    """Training centres of one volume: `coords` (N, 3) int32 zyx and each one's partition class."""

    coords: np.ndarray
    volume_name: str
    classes: np.ndarray

    def __len__(self) -> int:
        return len(self.coords)

    def shard(self, rank: int, size: int, where: object = "coordinates") -> "Coordinates":
        """This rank's share (see `shard`), classes kept aligned; `where` names it in errors."""
        coords, classes = (_shard(a, rank, size, where) for a in (self.coords, self.classes))
        return Coordinates(coords, self.volume_name, classes)


def shard(coords: np.ndarray, rank: int, size: int) -> np.ndarray:
    """Rank `rank` of `size` gets every size-th row from `rank` on: shards are disjoint, cover every
    row exactly once, differ in length by at most one, and none is empty."""
    return _shard(coords, rank, size, "coordinates")


def _shard(rows: np.ndarray, rank: int, size: int, where: object) -> np.ndarray:
    ints = all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in (rank, size))
    if not ints or not 0 <= rank < size:
        raise ConfigError(
            f"shard rank {rank!r} of size {size!r}: need integers with 0 <= rank < size"
        )
    if len(rows) < size:
        raise CoordinatesError(
            f"{where}: {len(rows)} coordinate(s) cannot give each of {size} ranks one"
        )
    return rows[rank::size]


def save_coordinates(
    path: str | Path,
    coords: np.ndarray,
    volume_name: str,
    *,
    classes: np.ndarray,
    config: PartitionConfig | None = None,
) -> Path:
    """Write coordinates, their volume's name and classes (and any settings) atomically."""
    path = Path(path)
    coords, classes = np.asarray(coords), np.asarray(classes)
    _check_coordinates(coords, classes, volume_name, path)
    arrays = {
        "format_version": np.int64(COORDINATES_FORMAT),
        "coords": coords.astype(np.int32),
        "classes": classes.astype(np.uint8),
        "volume_name": np.str_(volume_name),
    }
    if config is not None:
        arrays |= {
            "thresholds": np.array(config.thresholds),
            "lom_radius_zyx": np.array(config.lom_radius_zyx),
            "margin_zyx": np.array(config.margin),
            "samples_per_class": np.int64(config.samples_per_class),
            "seed": np.int64(config.seed),
            "min_object_voxels": np.int64(config.min_object_voxels),
        }
    # A file object, because np.savez would append ".npz" to a temporary name without it.
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.savez_compressed(f, **arrays)
    return path


def _check_coordinates(
    coords: np.ndarray, classes: np.ndarray, volume_name: object, where: object
) -> None:
    if (
        coords.ndim != 2
        or coords.shape[1:] != (3,)
        or coords.dtype.kind not in "iu"
        or not len(coords)
    ):
        raise CoordinatesError(
            f"{where}: coords must be a non-empty (N, 3) integer array, "
            f"got {coords.dtype} {coords.shape}"
        )
    if coords.min() < 0 or coords.max() > np.iinfo(np.int32).max:
        raise CoordinatesError(f"{where}: coords must be non-negative int32 voxel indices")
    if classes.shape != coords.shape[:1] or classes.dtype.kind not in "iu":
        raise CoordinatesError(
            f"{where}: classes must be {len(coords)} integers, got {classes.dtype} {classes.shape}"
        )
    if classes.min() <= UNLABELED or classes.max() >= EXCLUDED:
        raise CoordinatesError(
            f"{where}: classes must be in 1..{EXCLUDED - 1} (labeled, not excluded)"
        )
    if not isinstance(volume_name, str) or not volume_name:
        raise CoordinatesError(
            f"{where}: volume name must be a non-empty string, got {volume_name!r}"
        )


def load_coordinates(path: str | Path, *, rank: int = 0, size: int = 1) -> Coordinates:
    """Read and validate a coordinates file; with `size` > 1, only shard `rank` of it."""
    path = Path(path)
    if not path.is_file():
        raise CoordinatesError(f"{path}: file not found")
    required = ("format_version", "coords", "classes", "volume_name")
    try:
        with np.load(path, allow_pickle=False) as data:
            found = {k: data[k][()] for k in required if k in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise CoordinatesError(f"{path}: not a readable .npz coordinates file ({exc})") from None
    if missing := [k for k in required if k not in found]:
        raise CoordinatesError(f"{path}: not a coordinates file (missing {', '.join(missing)})")
    version, coords, classes, name = (found[k] for k in required)
    if version != COORDINATES_FORMAT:
        raise CoordinatesError(
            f"{path}: coordinates format {version}, this code reads {COORDINATES_FORMAT}"
        )
    name = str(name) if isinstance(name, str) else name  # np.str_ -> str
    _check_coordinates(coords, classes, name, path)
    return Coordinates(coords.astype(np.int32), name, classes.astype(np.uint8)).shard(
        rank, size, path
    )


# ---------------------------------------------------------------------------------------------
# The preprocessing stage (the workflow's app and pipeline.cli.partitions call it)


def _class_table(partitions: np.ndarray, sampled: np.ndarray, thresholds: Sequence[float]) -> str:
    voxels = np.bincount(partitions.ravel(), minlength=EXCLUDED + 1)
    samples = np.bincount(sampled, minlength=EXCLUDED + 1)
    bounds = [0.0, *thresholds]
    ranges = {UNLABELED: "unlabeled/small", EXCLUDED: "margin (excluded)"}
    for c in range(1, len(thresholds) + 2):
        low = bounds[c - 1]
        ranges[c] = f"[{low:g}, {thresholds[c - 1]:g})" if c <= len(thresholds) else f"[{low:g}, 1]"
    lines = [f"{'class':>5}  {'own fraction':<18} {'voxels':>12} {'samples':>9}"]
    for c in sorted(ranges):
        lines.append(f"{c:>5}  {ranges[c]:<18} {voxels[c]:>12} {samples[c]:>9}")
    return "\n".join(lines)


def preprocess(
    labels_spec: "str | VolumeSpec",
    partitions_out: str | Path,
    coordinates_out: str | Path,
    config: PartitionConfig = PartitionConfig(),
    *,
    name: str | None = None,
    voxel_size_nm: Sequence[float] | None = None,
    progress: bool = True,
) -> Path:
    """The preprocessing stage: partition a label volume, write it, sample and write coordinates
    (named `name`, default the labels file's stem). Returns the coordinates path."""
    spec = VolumeSpec.parse(labels_spec)
    labels, voxel_size = read_labels(spec, voxel_size_nm)
    start = time.perf_counter()
    partitions = compute_partitions(
        labels,
        config.thresholds,
        config.lom_radius_zyx,
        config.margin_zyx,
        min_object_voxels=config.min_object_voxels,
        progress=progress,
    )
    partition_seconds = time.perf_counter() - start
    attrs = {
        "labels": str(spec),
        "thresholds": config.thresholds,
        "lom_radius_zyx": config.lom_radius_zyx,
        "margin_zyx": config.margin,
        "min_object_voxels": config.min_object_voxels,
    }
    write_volumes(partitions_out, {PARTITIONS_DATASET: partitions}, voxel_size, attrs)
    start = time.perf_counter()
    coords = build_coordinates(partitions, config.samples_per_class, config.seed)
    classes = partitions[tuple(coords.T)]
    save_coordinates(
        coordinates_out, coords, name or spec.path.stem, classes=classes, config=config
    )
    if progress:
        print(_class_table(partitions, classes, config.thresholds))
        print(
            f"partitions: {partitions_out} ({partition_seconds:.1f} s); coordinates: "
            f"{len(coords)} in {coordinates_out} ({time.perf_counter() - start:.1f} s)"
        )
    return Path(coordinates_out)


def coordinates_complete(path: str | Path) -> bool:
    """The preprocessing stage's check: a readable, valid coordinates file exists."""
    try:
        load_coordinates(path)
    except CoordinatesError:
        return False
    return True
