"""Synthetic EM-like volumes with ground truth: the workflow's built-in data set.

The tissue is neuropil-like: many tubes (neurites) whose centrelines are smooth random walks in
physical (nm) space that bend and branch, plus a few larger blobs (cell bodies). Objects are packed
densely: every voxel belongs to the object whose surface is nearest, so thick tubes own wide
cells, and a thin unlabeled membrane (label 0) separates neighbours. The image adds what makes EM
hard to segment by thresholding: membranes that fade in places, dark organelles inside objects,
per-object and per-section brightness changes, anisotropic blur and noise.

All randomness comes from one generator seeded by the config, so a config always gives the same
bytes. Command line: `python -m pipeline.cli.synthetic OUT.h5 [--preset NAME] [--seed N] ...`.
"""

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import cc3d
import fastremap
import numpy as np
from scipy import ndimage

from pipeline.core.errors import ConfigError

# Grey levels of the clean image (before blur and noise); membranes and organelles are subtracted.
CYTOPLASM_GREY = 160.0
MEMBRANE_DEPTH = 105.0
ORGANELLE_DEPTH = 80.0
TEXTURE_SD = 6.0
# Correlation lengths of the smooth random fields.
TEXTURE_SCALE_NM = 60.0
MEMBRANE_CONTRAST_SCALE_NM = 250.0
# Contrast left on the faintest membrane stretches (1 = full contrast).
FAINT_MEMBRANE_CONTRAST = 0.12
# Branches of branches, but not deeper: enough for tree-like neurites.
MAX_BRANCH_DEPTH = 2
# Neurites that leave each cell body.
PROCESSES_PER_BLOB = (1, 3)


@dataclass(frozen=True)
class SyntheticConfig:
    """Everything that shapes a synthetic volume; lengths are in nm unless the name says voxels."""

    shape_zyx: tuple[int, int, int] = (64, 128, 128)
    # 2:1 anisotropic like serial-section EM, matching FFN's default FOV of 33, 33, 17 (x, y, z).
    voxel_size_nm: tuple[float, float, float] = (20.0, 10.0, 10.0)
    seed: int = 0
    tube_count: int = 40
    tube_radius_nm: tuple[float, float] = (40.0, 120.0)
    # How far a tube's direction strays from its mean (0 = straight) and over what length it bends.
    tube_bend: float = 0.7
    tube_persistence_nm: float = 250.0
    # Chance that a tube (or a branch) sprouts a branch sharing its id.
    branch_probability: float = 0.5
    blob_count: int = 3
    blob_radius_nm: tuple[float, float] = (200.0, 350.0)
    membrane_width_vox: int = 1
    # Share of the membrane area that fades to almost no contrast.
    faint_membrane_fraction: float = 0.1
    blur_sigma_nm: float = 8.0
    # Image variation in grey levels (0-255): per voxel, per object and per z-section.
    noise_sd: float = 12.0
    object_brightness_sd: float = 10.0
    section_brightness_sd: float = 4.0
    # Dark organelles per um^3 (a few fewer where crowded objects leave no room).
    organelle_density_per_um3: float = 60.0
    organelle_radius_nm: tuple[float, float] = (18.0, 50.0)
    # Smaller pieces (slivers cut off by membranes) become unlabeled.
    min_object_voxels: int = 100

    def __post_init__(self) -> None:
        _set(self, "shape_zyx", _positive_triple(self, "shape_zyx", int))
        _set(self, "voxel_size_nm", _positive_triple(self, "voxel_size_nm", float))
        for name in ("tube_radius_nm", "blob_radius_nm", "organelle_radius_nm"):
            _set(self, name, _range(self, name))
        for name in ("seed", "tube_count", "blob_count", "min_object_voxels"):
            _require(self, name, lambda v: isinstance(v, int) and v >= 0, "an integer >= 0")
        _require(
            self, "membrane_width_vox", lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"
        )
        if self.tube_count + self.blob_count == 0:
            raise ConfigError("synthetic config: tube_count and blob_count are both 0 (no objects)")
        for name in ("branch_probability", "faint_membrane_fraction"):
            _require(self, name, lambda v: 0 <= v < 1, "in [0, 1)")
        _require(self, "tube_persistence_nm", lambda v: 0 < v < math.inf, "> 0")
        for name in (
            "tube_bend",
            "blur_sigma_nm",
            "noise_sd",
            "object_brightness_sd",
            "section_brightness_sd",
            "organelle_density_per_um3",
        ):
            _require(self, name, lambda v: 0 <= v < math.inf, ">= 0")

    @property
    def extent_nm(self) -> np.ndarray:
        """Size of the box in nm, (z, y, x)."""
        return np.multiply(self.shape_zyx, self.voxel_size_nm)

    def with_geometry(
        self,
        shape_zyx: Sequence[int] | None = None,
        voxel_size_nm: Sequence[float] | None = None,
    ) -> "SyntheticConfig":
        """The same tissue in another box: object counts follow the physical volume.

        Tubes cross the box, so their count grows with its cross-section (volume ** 2/3); blobs
        with its volume. Object sizes and densities stay as they are.
        """
        resized = dataclasses.replace(
            self,
            shape_zyx=tuple(shape_zyx or self.shape_zyx),
            voxel_size_nm=tuple(voxel_size_nm or self.voxel_size_nm),
        )
        ratio = float(np.prod(resized.extent_nm) / np.prod(self.extent_nm))
        tubes = round(self.tube_count * ratio ** (2 / 3))
        blobs = round(self.blob_count * ratio)
        if tubes + blobs == 0:  # a box too small for the tissue's density still gets one object
            tubes = 1
        return dataclasses.replace(resized, tube_count=tubes, blob_count=blobs)


def _set(config: SyntheticConfig, name: str, value: object) -> None:
    object.__setattr__(config, name, value)  # normalising a frozen dataclass's own field


def _require(
    config: SyntheticConfig, name: str, ok: Callable[[Any], bool], requirement: str
) -> None:
    value = getattr(config, name)
    try:
        valid = bool(ok(value))
    except (TypeError, ValueError):
        valid = False
    if not valid:
        raise ConfigError(f"synthetic config: {name} must be {requirement}, got {value!r}")


def _positive_triple(config: SyntheticConfig, name: str, kind: type) -> tuple:
    """The value as a tuple of 3 positive `kind`s (lists from JSON or argparse are welcome)."""
    requirement = f"3 positive {'integers' if kind is int else 'numbers'} (z, y, x)"
    _require(
        config,
        name,
        lambda v: len(v) == 3 and all(kind(x) == x and 0 < x < math.inf for x in v),
        requirement,
    )
    return tuple(kind(x) for x in getattr(config, name))


def _range(config: SyntheticConfig, name: str) -> tuple[float, float]:
    requirement = "(low, high) with 0 < low <= high"
    _require(config, name, lambda v: len(v) == 2 and 0 < v[0] <= v[1] < math.inf, requirement)
    return tuple(float(x) for x in getattr(config, name))


PRESETS: dict[str, SyntheticConfig] = {
    # Trains and segments in minutes on 2 cores.
    "default": SyntheticConfig(),
    # Twice the edge length (8x the voxels), same tissue density: for throughput measurements.
    "benchmark": SyntheticConfig(shape_zyx=(128, 256, 256), tube_count=160, blob_count=24),
}


# --- geometry ---------------------------------------------------------------------------------


class _Path(NamedTuple):
    """A centreline sampled every step: points (k, 3) nm, unit tangents (k, 3), radii (k,) nm."""

    object_id: int
    points: np.ndarray
    tangents: np.ndarray
    radii: np.ndarray


class _Blob(NamedTuple):
    object_id: int
    centre: np.ndarray
    radius: float


def _unit(vectors: np.ndarray) -> np.ndarray:
    return vectors / np.linalg.norm(vectors, axis=-1, keepdims=True)


def _walk(
    rng: np.random.Generator,
    config: SyntheticConfig,
    blobs: list[_Blob],
    ids: Sequence[int],
    starts: np.ndarray,
    directions: np.ndarray,
    radii: np.ndarray,
    two_sided: bool,
) -> list[_Path]:
    """Smooth random walks from `starts` along `directions`, cut where they first leave the box
    or enter another object's blob. A two-sided walk also runs backwards, to cross the whole box.
    """
    # One voxel: finer than any tube's radius, so the drawn tube has no gaps.
    step = min(config.voxel_size_nm)
    half = math.ceil(1.5 * np.linalg.norm(config.extent_nm) / step)
    sigma = config.tube_persistence_nm / step
    # Channels 0-2 bend the tangent, channel 3 swells and thins the radius (varicosities).
    noise = rng.standard_normal((len(starts), 2 * half + 1, 4))
    noise = ndimage.gaussian_filter1d(noise, sigma, axis=1, truncate=3.0)
    noise *= math.sqrt(2 * math.sqrt(math.pi) * sigma)  # back to unit variance after smoothing
    tangents = _unit(directions[:, None, :] + config.tube_bend * noise[..., :3])
    travelled = np.cumsum(step * tangents, axis=1)
    points = starts[:, None, :] + travelled - travelled[:, half : half + 1]
    free = np.all((points >= 0) & (points < config.extent_nm), axis=2)
    for blob in blobs:
        in_blob = np.sum((points - blob.centre) ** 2, axis=2) < blob.radius**2
        free &= ~in_blob | (np.asarray(ids) == blob.object_id)[:, None]
    keep = np.zeros_like(free)
    keep[:, half:] = np.logical_and.accumulate(free[:, half:], axis=1)
    if two_sided:
        keep[:, : half + 1] = np.logical_and.accumulate(free[:, half::-1], axis=1)[:, ::-1]
    radii = radii[:, None] * np.exp(0.25 * noise[..., 3])
    return [
        _Path(int(i), points[k, keep[k]], tangents[k, keep[k]], radii[k, keep[k]])
        for k, i in enumerate(ids)
    ]


def _random_directions(rng: np.random.Generator, count: int) -> np.ndarray:
    return _unit(rng.standard_normal((count, 3)))


def _branch_directions(rng: np.random.Generator, tangents: np.ndarray) -> np.ndarray:
    """Directions 30-70 degrees off the parent's tangent, to a random side."""
    side = rng.standard_normal(tangents.shape)
    side = _unit(side - np.sum(side * tangents, axis=1, keepdims=True) * tangents)
    angle = np.radians(rng.uniform(30, 70, (len(tangents), 1)))
    return np.cos(angle) * tangents + np.sin(angle) * side


def _place_blobs(rng: np.random.Generator, config: SyntheticConfig) -> list[_Blob]:
    """Non-overlapping spheres (a blob that finds no room in a few tries is left out)."""
    blobs: list[_Blob] = []
    for _ in range(config.blob_count * 10):
        if len(blobs) == config.blob_count:
            break
        centre, radius = rng.uniform(0, config.extent_nm), rng.uniform(*config.blob_radius_nm)
        if all(np.linalg.norm(centre - b.centre) > radius + b.radius for b in blobs):
            blobs.append(_Blob(len(blobs) + 1, centre, radius))
    return blobs


def _outside_blobs(
    rng: np.random.Generator, config: SyntheticConfig, blobs: list[_Blob], count: int
) -> np.ndarray:
    """Up to `count` uniform random points (nm) in no blob (fewer only if blobs fill the box)."""
    points = rng.uniform(0, config.extent_nm, (10 * count, 3))
    for blob in blobs:
        points = points[np.linalg.norm(points - blob.centre, axis=1) > blob.radius]
    return points[:count]


def _skeleton(rng: np.random.Generator, config: SyntheticConfig) -> tuple[list[_Blob], list[_Path]]:
    """Blobs get ids 1..B, tubes B+1..; processes and branches share the id they grow from.

    Tubes run between blobs, never through them; each blob sends out a few processes.
    """
    low, high = config.tube_radius_nm
    blobs = _place_blobs(rng, config)
    starts = _outside_blobs(rng, config, blobs, config.tube_count)
    tube_ids = range(len(blobs) + 1, len(blobs) + len(starts) + 1)
    radii = rng.uniform(low, high, len(starts))
    directions = _random_directions(rng, len(starts))
    paths = _walk(rng, config, blobs, tube_ids, starts, directions, radii, two_sided=True)

    counts = rng.integers(*PROCESSES_PER_BLOB, len(blobs), endpoint=True)
    owners = [b for b, n in zip(blobs, counts, strict=True) for _ in range(n)]
    if owners:
        ids = [b.object_id for b in owners]
        centres = np.array([b.centre for b in owners])
        radii = rng.uniform((low + high) / 2, high, len(owners))
        directions = _random_directions(rng, len(owners))
        paths += _walk(rng, config, blobs, ids, centres, directions, radii, two_sided=False)

    parents = paths
    for _ in range(MAX_BRANCH_DEPTH):
        parents = [
            p for p in parents if len(p.points) > 1 and rng.random() < config.branch_probability
        ]
        if not parents:
            break
        at = [rng.integers(len(p.points)) for p in parents]
        starts = np.array([p.points[k] for p, k in zip(parents, at, strict=True)])
        tangents = np.array([p.tangents[k] for p, k in zip(parents, at, strict=True)])
        radii = np.array([p.radii[k] for p, k in zip(parents, at, strict=True)])
        radii = np.maximum(low, radii * rng.uniform(0.6, 0.9, len(parents)))
        directions = _branch_directions(rng, tangents)
        ids = [p.object_id for p in parents]
        parents = _walk(rng, config, blobs, ids, starts, directions, radii, two_sided=False)
        paths += parents
    return blobs, paths


# --- label map --------------------------------------------------------------------------------


def _voxel_index(config: SyntheticConfig, points_nm: np.ndarray) -> np.ndarray:
    """Flat voxel indices of points (n, 3) in nm."""
    index = np.floor(points_nm / np.asarray(config.voxel_size_nm)).astype(np.int64)
    index = np.clip(index, 0, np.asarray(config.shape_zyx) - 1)
    return np.ravel_multi_index(tuple(index.T), config.shape_zyx)


def _draw_thick(
    config: SyntheticConfig, points_nm: np.ndarray, ids: np.ndarray, radii: np.ndarray
) -> np.ndarray:
    """Voxels within its radius of a centreline point take that point's id (nearest point wins)."""
    flat = _voxel_index(config, points_nm)
    flat, first = np.unique(
        flat, return_index=True
    )  # one seed per voxel, independent of write order
    seed_id = np.zeros(config.shape_zyx, np.uint32)
    seed_radius = np.zeros(config.shape_zyx, np.float32)
    seed_id.flat[flat] = ids[first]
    seed_radius.flat[flat] = radii[first]
    distance, nearest = ndimage.distance_transform_edt(
        seed_id == 0, sampling=config.voxel_size_nm, return_indices=True
    )
    nearest = tuple(nearest)
    return np.where(distance <= seed_radius[nearest], seed_id[nearest], 0).astype(np.uint32)


def _capsule(
    config: SyntheticConfig, start: np.ndarray, end: np.ndarray, reach: float
) -> tuple[tuple[slice, ...], np.ndarray]:
    """Squared distances (nm^2) from the segment start-end to the voxel centres of its bounding box.

    Returns the box (slices into the volume) and the distances; a sphere is a segment of length 0.
    Local boxes keep blobs and organelles cheap: no pass over the whole volume per object.
    """
    voxel = np.asarray(config.voxel_size_nm)
    low = np.maximum(0, np.floor((np.minimum(start, end) - reach) / voxel)).astype(int)
    high = np.minimum(
        config.shape_zyx, np.ceil((np.maximum(start, end) + reach) / voxel) + 1
    ).astype(int)
    centres = [(np.arange(a, b) + 0.5) * v for a, b, v in zip(low, high, voxel, strict=True)]
    grid = np.stack(np.meshgrid(*centres, indexing="ij"), axis=-1)
    axis = end - start
    along = np.sum((grid - start) * axis, axis=-1) / max(float(np.sum(axis * axis)), 1e-12)
    along = np.clip(along, 0.0, 1.0)
    squared = np.sum((grid - start - along[..., None] * axis) ** 2, axis=-1)
    return tuple(slice(a, b) for a, b in zip(low, high, strict=True)), squared


def _draw_blobs(config: SyntheticConfig, cores: np.ndarray, blobs: list[_Blob]) -> None:
    """Blobs are drawn last: a thick tube passing close by must not dent them."""
    for blob in blobs:
        box, squared = _capsule(config, blob.centre, blob.centre, blob.radius)
        region = cores[box]
        region[squared <= blob.radius**2] = blob.object_id


def _fill_space(config: SyntheticConfig, cores: np.ndarray) -> np.ndarray:
    """Every voxel takes the id of the nearest core: an additively weighted Voronoi diagram."""
    nearest = ndimage.distance_transform_edt(
        cores == 0, sampling=config.voxel_size_nm, return_distances=False, return_indices=True
    )
    return cores[tuple(nearest)]


def _membranes(labels: np.ndarray, width: int) -> np.ndarray:
    """Mask `width` voxels thick where 6-neighbours differ (width 1: on the lower-index side)."""
    mask = np.zeros(labels.shape, bool)
    offsets = range(-((width - 1) // 2), width // 2 + 1)
    for axis, size in enumerate(labels.shape):

        def along(start: int, stop: int, axis: int = axis) -> tuple[slice, ...]:
            return tuple(slice(start, stop) if a == axis else slice(None) for a in range(3))

        edge = labels[along(0, size - 1)] != labels[along(1, size)]  # edge[i]: voxel i vs i + 1
        for offset in offsets:
            first, last = max(0, -offset), min(size - 1, size - offset)  # edge indices that fit
            mask[along(first + offset, last + offset)] |= edge[along(first, last)]
    return mask


def _one_component_per_id(labels: np.ndarray, min_voxels: int) -> np.ndarray:
    """Each 6-connected piece becomes its own object; dust becomes unlabeled; ids become 1..N."""
    pieces = cc3d.connected_components(labels, connectivity=6)
    pieces = cc3d.dust(pieces, min_voxels, connectivity=6, in_place=True, precomputed_ccl=True)
    pieces, _ = fastremap.renumber(pieces, preserve_zero=True, in_place=True)
    return pieces.astype(np.uint64, copy=False)


def _labels(rng: np.random.Generator, config: SyntheticConfig) -> np.ndarray:
    blobs, paths = _skeleton(rng, config)
    points = np.concatenate([p.points for p in paths])
    ids = np.concatenate([np.full(len(p.points), p.object_id, np.uint32) for p in paths])
    radii = np.concatenate([p.radii for p in paths])
    cores = _draw_thick(config, points, ids, radii)
    _draw_blobs(config, cores, blobs)
    dense = _fill_space(config, cores)
    dense[_membranes(dense, config.membrane_width_vox)] = 0
    return _one_component_per_id(dense, config.min_object_voxels)


# --- image ------------------------------------------------------------------------------------


def _smooth_field(rng: np.random.Generator, config: SyntheticConfig, scale_nm: float) -> np.ndarray:
    """Random field (float32, mean 0, SD 1) that varies over about `scale_nm`.

    Gaussian bumps on a grid with random weights. The Gaussian is separable, so the field is built
    axis by axis with small matrix products, far cheaper than a 3-D filter over the volume. The
    products run in float64: BLAS may sum in another order on another machine, and float32 would
    then change some voxels' rounded grey level.
    """
    spacing = scale_nm / 2
    knot_counts = [math.ceil(e / spacing) + 5 for e in config.extent_nm]
    field = rng.standard_normal(knot_counts)
    for axis, (size, voxel, knots) in enumerate(
        zip(config.shape_zyx, config.voxel_size_nm, knot_counts, strict=True)
    ):
        offsets = (np.arange(size)[:, None] + 0.5) * voxel - (np.arange(knots) - 2) * spacing
        basis = np.exp(-0.5 * (offsets / scale_nm) ** 2)
        field = np.moveaxis(np.tensordot(basis, field, axes=(1, axis)), 0, axis)
    return ((field - field.mean()) / max(float(field.std()), 1e-6)).astype(np.float32)


def _membrane_contrast(rng: np.random.Generator, config: SyntheticConfig) -> np.ndarray:
    """1 on most of the membrane, fading to FAINT_MEMBRANE_CONTRAST on a share of it."""
    field = _smooth_field(rng, config, MEMBRANE_CONTRAST_SCALE_NM)
    faint_below = statistics.NormalDist().inv_cdf(max(config.faint_membrane_fraction, 1e-9))
    ramp = np.clip(2 * (field - faint_below), 0.0, 1.0)
    return FAINT_MEMBRANE_CONTRAST + (1 - FAINT_MEMBRANE_CONTRAST) * ramp


def _organelles(
    rng: np.random.Generator, config: SyntheticConfig, labels: np.ndarray
) -> np.ndarray:
    """Darkness in [0, 1] of round (vesicle-like) and elongated (mitochondria-like) organelles.

    Each is a capsule that must lie, with a margin, inside one object: an organelle touching a
    membrane would read as a thick membrane.
    """
    count = round(config.organelle_density_per_um3 * float(np.prod(config.extent_nm)) * 1e-9)
    darkness = np.zeros(config.shape_zyx, np.float32)
    # Draw extra candidates: those that do not fit are skipped.
    tries = 8 * count
    centres = rng.uniform(0, config.extent_nm, (tries, 3))
    radii = rng.uniform(*config.organelle_radius_nm, tries)
    lengths = radii * rng.uniform(0, 4, tries) * (rng.random(tries) < 0.5)
    halves = 0.5 * lengths[:, None] * _random_directions(rng, tries)
    strengths = rng.uniform(0.6, 1.0, tries)
    hosts = labels.flat[_voxel_index(config, centres)]
    # Cheap first test: centre and both ends in the same object.
    for end in (centres - halves, centres + halves):
        hosts[labels.flat[_voxel_index(config, end)] != hosts] = 0
    margin = max(config.voxel_size_nm)
    placed = 0
    for centre, half, radius, strength, host in zip(
        centres, halves, radii, strengths, hosts, strict=True
    ):
        if placed == count:
            break
        if host == 0:
            continue
        box, squared = _capsule(config, centre - half, centre + half, radius + margin)
        if np.any(labels[box][squared <= (radius + margin) ** 2] != host):
            continue
        darkness[box][squared <= radius**2] = strength
        placed += 1
    return darkness


def _render(rng: np.random.Generator, config: SyntheticConfig, labels: np.ndarray) -> np.ndarray:
    brightness = rng.normal(CYTOPLASM_GREY, config.object_brightness_sd, int(labels.max()) + 1)
    brightness[0] = CYTOPLASM_GREY
    image = brightness.astype(np.float32)[labels]
    image += TEXTURE_SD * _smooth_field(rng, config, TEXTURE_SCALE_NM)
    membrane = labels == 0
    image[membrane] -= MEMBRANE_DEPTH * _membrane_contrast(rng, config)[membrane]
    image -= ORGANELLE_DEPTH * _organelles(rng, config, labels)
    sections = rng.normal(0, config.section_brightness_sd, config.shape_zyx[0])
    image += sections.astype(np.float32)[:, None, None]
    sigma = [config.blur_sigma_nm / v for v in config.voxel_size_nm]
    image = ndimage.gaussian_filter(image, sigma, mode="nearest")
    image += config.noise_sd * rng.standard_normal(config.shape_zyx, dtype=np.float32)
    return np.clip(np.rint(image), 0, 255).astype(np.uint8)


def generate(config: SyntheticConfig) -> tuple[np.ndarray, np.ndarray]:
    """(raw uint8, labels uint64), both (z, y, x); labels are 1..N, 0 on membranes."""
    rng = np.random.default_rng(config.seed)
    labels = _labels(rng, config)
    if not labels.any():
        raise ConfigError(
            f"synthetic config: no object of min_object_voxels={config.min_object_voxels} fits in "
            f"shape_zyx={config.shape_zyx}"
        )
    return _render(rng, config, labels), labels
