"""Regions of interest: one file split into training, selection and evaluation parts.

An ROI is written as in the config, z, y, x, each `start:stop` in voxels (stop excluded, as a
Python slice): `"0:90, 0:250, 0:250"`. "" is the whole volume.
"""

import hashlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.core.errors import ConfigError, VolumeShapeError

ZYX = tuple[int, int, int]


@dataclass(frozen=True)
class Roi:
    """A box of voxels, [start, stop) along z, y, x."""

    start: ZYX
    stop: ZYX

    @classmethod
    def parse(cls, text: str, name: str = "roi") -> "Roi":
        parts = [p.strip() for p in text.split(",")]
        try:
            bounds = [tuple(int(v) for v in p.split(":")) for p in parts]
        except ValueError:
            bounds = []
        if len(bounds) != 3 or any(len(b) != 2 or not 0 <= b[0] < b[1] for b in bounds):
            raise ConfigError(
                f'{name} {text!r}: write it as "z0:z1, y0:y1, x0:x1" with 0 <= start < stop'
            )
        return cls(tuple(b[0] for b in bounds), tuple(b[1] for b in bounds))

    @classmethod
    def of(cls, box: tuple[slice, ...]) -> "Roi":
        """The ROI of a box of slices (starts and stops given)."""
        return cls(tuple(s.start for s in box), tuple(s.stop for s in box))

    @classmethod
    def whole(cls, shape: Sequence[int]) -> "Roi":
        return cls((0, 0, 0), tuple(int(s) for s in shape))

    @property
    def shape(self) -> ZYX:
        return tuple(b - a for a, b in zip(self.start, self.stop, strict=True))

    @property
    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in zip(self.start, self.stop, strict=True))

    def overlaps(self, other: "Roi") -> bool:
        return all(
            a0 < b1 and b0 < a1
            for a0, a1, b0, b1 in zip(self.start, self.stop, other.start, other.stop, strict=True)
        )

    def intersection(self, other: "Roi") -> "Roi | None":
        """The voxels in both, None when they do not overlap."""
        if not self.overlaps(other):
            return None
        return Roi(
            tuple(max(a, b) for a, b in zip(self.start, other.start, strict=True)),
            tuple(min(a, b) for a, b in zip(self.stop, other.stop, strict=True)),
        )

    def grown(self, margin: Sequence[int], shape: Sequence[int]) -> "Roi":
        """This ROI with `margin` voxels more on every side, as far as the volume goes."""
        start = tuple(max(0, a - m) for a, m in zip(self.start, margin, strict=True))
        stop = tuple(min(s, b + m) for b, m, s in zip(self.stop, margin, shape, strict=True))
        return Roi(start, stop)

    def scaled_down(self, factor: Sequence[int], shape: Sequence[int]) -> "Roi":
        """The voxels of a scale `factor` times coarser (of `shape`) that this ROI covers."""
        start = tuple(a // f for a, f in zip(self.start, factor, strict=True))
        stop = tuple(min(-(-b // f), n) for b, f, n in zip(self.stop, factor, shape, strict=True))
        return Roi(start, stop)

    def relative_to(self, outer: "Roi") -> "Roi":
        return self._shifted(outer.start, -1)

    def within(self, outer: "Roi") -> "Roi":
        """This ROI, given relative to `outer`, in `outer`'s own coordinates (`relative_to`'s
        inverse)."""
        return self._shifted(outer.start, 1)

    def _shifted(self, origin: Sequence[int], sign: int) -> "Roi":
        return Roi(
            *(
                tuple(p + sign * o for p, o in zip(ps, origin, strict=True))
                for ps in (self.start, self.stop)
            )
        )

    def __str__(self) -> str:
        return ", ".join(f"{a}:{b}" for a, b in zip(self.start, self.stop, strict=True))


def with_context(
    box: tuple[slice, ...], margin: int, shape: Sequence[int]
) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
    """`box` with `margin` voxels more on every side, as far as the volume of `shape` goes, and
    where `box` lies within that."""
    roi = Roi.of(box)
    grown = roi.grown((margin,) * len(box), shape)
    return grown.slices, roi.relative_to(grown).slices


def check_roi(roi: Roi, shape: Sequence[int], min_shape: Sequence[int], where: str) -> None:
    """The ROI lies inside a volume of `shape` and is at least `min_shape` (the FOV)."""
    if any(b > s for b, s in zip(roi.stop, shape, strict=True)):
        raise VolumeShapeError(
            f"{where} {roi} (z, y, x) reaches outside the volume of shape {tuple(shape)}"
        )
    if any(n < m for n, m in zip(roi.shape, min_shape, strict=True)):
        raise VolumeShapeError(
            f"{where} {roi} is {roi.shape} (z, y, x), smaller than the field of view {tuple(min_shape)}"
        )


def check_apart(parts: dict[str, Roi]) -> None:
    """Parts of one file must not share a voxel (a scored voxel seen in training flatters it)."""
    names = sorted(parts)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if parts[a].overlaps(parts[b]):
                raise ConfigError(
                    f"{a} {parts[a]} and {b} {parts[b]} overlap; parts of one file must not share voxels"
                )


def index_bounds(index: object, shape: Sequence[int]) -> list[tuple[int, int]]:
    """(start, stop) per axis of a numpy-style index made of slices with steps of 1 (or `...`),
    as a read-only array that is not numpy takes it; stop >= start."""
    if index is Ellipsis:
        index = ()
    if not isinstance(index, tuple):
        index = (index,)
    if len(index) > len(shape) or any(not isinstance(s, slice) for s in index):
        raise TypeError("this volume is read by slices (z, y, x)")
    index = index + (slice(None),) * (len(shape) - len(index))
    bounds = [s.indices(n) for s, n in zip(index, shape, strict=True)]
    if any(step != 1 for _, _, step in bounds):
        raise TypeError("this volume is read with steps of 1")
    return [(start, max(start, stop)) for start, stop, _ in bounds]


def grid_starts(shape: Sequence[int], step: int) -> list[ZYX]:
    """The starts of the grid of `step`^3 boxes from the origin over a volume of `shape` (the
    last boxes along an axis clipped at its end)."""
    return [box.start for box in tiles(Roi.whole(shape), (step,) * len(shape))]


def tiles(roi: Roi, edge: Sequence[int]) -> list[Roi]:
    """`roi` cut into boxes of `edge` voxels per axis from its start, z, y, x order (the last
    box along an axis clipped at the ROI's end)."""
    starts = itertools.product(
        *(range(a, b, e) for a, b, e in zip(roi.start, roi.stop, edge, strict=True))
    )
    return [
        Roi(
            tuple(start),
            tuple(min(a + e, b) for a, e, b in zip(start, edge, roi.stop, strict=True)),
        )
        for start in starts
    ]


def chunk_grid(
    bounds: Sequence[tuple[int, int]], chunks: Sequence[int]
) -> Iterator[tuple[int, ...]]:
    """The grid coordinates of every chunk that the box `bounds` ((start, stop) per axis) touches,
    in C order, generated (not held: a box of a 10^12-voxel volume touches millions)."""
    return itertools.product(
        *(range(a // c, -(-b // c)) for (a, b), c in zip(bounds, chunks, strict=True))
    )


def chunk_box(
    coords: Sequence[int], chunks: Sequence[int], shape: Sequence[int]
) -> list[tuple[int, int]]:
    """The (start, stop) per axis of the chunk at grid `coords`, clipped at the array's end."""
    return [(i * c, min((i + 1) * c, n)) for i, c, n in zip(coords, chunks, shape, strict=True)]


class ChunkStates:
    """Per chunk of an array that a box meets (on the array's chunk grid `chunks`, from its
    origin), a digest of the state of its file: a sha256 per chunk, XORed with that of any file
    that holds voxels of every chunk (a shard), so files may come in any order."""

    def __init__(self, bounds: Sequence[tuple[int, int]], chunks: Sequence[int]) -> None:
        self.cell = tuple(int(c) for c in chunks)
        # Where the first chunk starts, in the array's coordinates and relative to the box (what
        # a task's region, in the box's coordinates, is placed by).
        self.start = [a // c * c for (a, _), c in zip(bounds, self.cell, strict=True)]
        self.origin = tuple(s - a for s, (a, _) in zip(self.start, bounds, strict=True))
        extent = [
            -(-(b - s) // c) for (_, b), s, c in zip(bounds, self.start, self.cell, strict=True)
        ]
        self.grid = np.zeros([*extent, 32], np.uint8)

    def add(self, chunk: Sequence[tuple[int, int]] | None, state: str) -> None:
        """A chunk's box (array coordinates; a chunk outside the box is not counted), or None
        for a file that holds voxels of any chunk (a shard): then every chunk."""
        one = np.frombuffer(hashlib.sha256(state.encode()).digest(), np.uint8)
        if chunk is None:
            self.grid ^= one
            return
        met = tuple(
            slice(max(a - s, 0) // c, max(-(-(b - s) // c), 0))
            for (a, b), s, c in zip(chunk, self.start, self.cell, strict=True)
        )
        self.grid[met] ^= one
