"""Zarr volumes: arrays cut into chunk files that many tasks write side by side, each its own
chunks, and that any task reads part by part in place.

Addressed like HDF5 volumes, `path.zarr:name` (an array in the zarr group at `path.zarr`);
`pipeline.data.volumes` dispatches here on the `.zarr` suffix and does the validation. Chunks are
zstd-compressed; to zarr a chunk never written reads as the fill value 0 (unlabeled). An input
is read through `ZarrInput`, which refuses that (a chunk lost or never written is an error that
names it, unless the run's `[data] fill_missing` asks for zeros) and names a chunk that cannot be
decoded. Why zarr: README, "Chunked volumes".
"""

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import zarr
from numcodecs import Blosc

from pipeline.core.atomic import atomic_dir
from pipeline.core.errors import ChunkReadError, DatasetMissing, FFNError, MissingChunkError, VolumeFileMissing, VolumeReadError, first_line
from pipeline.core.roi import BrickStates, chunk_box, chunk_grid, index_bounds

SUFFIX = ".zarr"
COMPRESSOR = Blosc(cname="zstd", clevel=3, shuffle=Blosc.BITSHUFFLE)


def is_zarr(path: str | Path) -> bool:
    return Path(path).suffix == SUFFIX


def create_zarr(
    path: str | Path,
    name: str,
    shape: Sequence[int],
    dtype: np.dtype,
    chunks: Sequence[int],
    attrs: dict[str, object],
) -> None:
    """A new array of zeros (no chunk written yet) in a new group at `path`: the group appears
    whole or not at all, replacing an earlier one."""
    with atomic_dir(path) as tmp:
        group = zarr.open_group(str(tmp), mode="w")
        array = group.create_dataset(
            name,
            shape=tuple(shape),
            chunks=tuple(chunks),
            dtype=np.dtype(dtype),
            fill_value=0,
            compressor=COMPRESSOR,
        )
        array.attrs.update(attrs)


def open_zarr(path: Path, name: str, mode: str = "r") -> zarr.Array:
    """The array `name` of the group at `path`; one-line errors for a missing group or array."""
    if not (path / ".zgroup").is_file():
        raise VolumeFileMissing(f"{path}: not a zarr group (no .zgroup)")
    group = zarr.open_group(str(path), mode=mode)
    if name not in group.array_keys():
        found = ", ".join(group.array_keys()) or "none"
        raise DatasetMissing(f"{path}: no array {name!r} (arrays: {found})")
    return group[name]


FILL_MISSING_HINT = (
    "a chunk never written reads as zeros; set [data] fill_missing = true if that is what you want"
)


class ZarrInput:
    """A zarr array read as an input (read-only; `shape`, `dtype`, `attrs`, `chunks` and numpy-style
    slicing with steps of 1). Before a read, every chunk file it touches must exist: zarr reads a
    missing one as the fill value, which for a lost chunk of an image is a silent hole. With
    `fill_missing` that is allowed (cloud-volume's `fill_missing`). A chunk that exists but does
    not decode (truncated, overwritten) is named too. The check is one stat per chunk read, beside
    reading and decompressing that chunk."""

    def __init__(self, array: zarr.Array, folder: Path, fill_missing: bool = False) -> None:
        self._array, self.folder, self.fill_missing = array, Path(folder), fill_missing
        self.shape, self.dtype, self.attrs = tuple(array.shape), array.dtype, array.attrs
        self.chunks = tuple(int(c) for c in array.chunks)
        try:
            meta = json.loads((self.folder / ".zarray").read_text())
        except (OSError, ValueError):
            meta = {}
        # zarr v2 names a chunk by its grid coordinates joined by the array's separator ("." by
        # default: 0.1.2; "/" for nested folders: 0/1/2).
        self.separator = meta.get("dimension_separator") or "."

    def key(self, coords: Sequence[int]) -> str:
        return self.separator.join(map(str, coords))

    def missing(self, key: str) -> MissingChunkError:
        return MissingChunkError(f"{self.folder}: chunk {key} is missing ({FILL_MISSING_HINT})")

    def __getitem__(self, index: object) -> np.ndarray:
        bounds = index_bounds(index, self.shape)
        region = tuple(slice(a, b) for a, b in bounds)
        if not self.fill_missing and all(b > a for a, b in bounds):
            for coords in chunk_grid(bounds, self.chunks):
                key = self.key(coords)
                if not os.path.isfile(self.folder / key):
                    raise self.missing(key)
        try:
            return self._array[region]
        except FFNError:
            raise
        except Exception as exc:  # blosc's RuntimeError, a ValueError of a short buffer, EIO
            raise self._unreadable(bounds, exc) from None

    def _unreadable(self, bounds: Sequence[tuple[int, int]], exc: Exception) -> VolumeReadError:
        """The error naming the first chunk of the read that cannot be decoded on its own."""
        for coords in chunk_grid(bounds, self.chunks):
            box = tuple(slice(a, b) for a, b in chunk_box(coords, self.chunks, self.shape))
            try:
                self._array[box]
            except Exception as chunk_exc:
                return ChunkReadError(
                    f"{self.folder}: chunk {self.key(coords)} cannot be read "
                    f"({first_line(chunk_exc)})"
                )
        return VolumeReadError(f"{self.folder}: cannot read its data ({first_line(exc)})")

    def chunk_state(self, bounds: Sequence[tuple[int, int]], brick: int = 0) -> dict:
        """What the chunk files of the box `bounds` are now, without reading them: the number of
        chunks, how many are missing (the first one's key), their bytes, and a sha256 over
        every chunk's key, size, mtime_ns and ctime_ns (ctime: a restore that keeps size and
        mtime, `cp -p`, still changes it). Cost: one stat per chunk of the box, streamed (O(1)
        memory): 10^12 voxels in 64^3 chunks are 3.8 million stats, seconds on a local disk,
        minutes on a parallel file system (~10^4 stats/s). With `brick`, also "bricks": per
        brick of that edge on a grid from the box's start, the states of the chunks it meets
        (`BrickStates`), so that a task reading a part of the box is keyed on that part."""
        sha, chunks, missing, size, first = hashlib.sha256(), 0, 0, 0, ""
        bricks = BrickStates(bounds, brick) if brick else None
        for coords in chunk_grid(bounds, self.chunks):
            key = self.key(coords)
            try:
                stat = os.stat(self.folder / key)
            except FileNotFoundError:
                state, missing, first = "-", missing + 1, first or key
            else:
                state = f"{stat.st_size} {stat.st_mtime_ns} {stat.st_ctime_ns}"
                size += stat.st_size
            sha.update(f"{key} {state}\n".encode())
            chunks += 1
            if bricks is not None:
                bricks.add(chunk_box(coords, self.chunks, self.shape), f"{key} {state}")
        found = {
            "chunks": chunks,
            "missing": missing,
            "first_missing": first,
            "bytes": size,
            "state_sha256": sha.hexdigest(),
        }
        return found if bricks is None else found | {"bricks": bricks.grid}
