"""Neuroglancer precomputed volumes as inputs, read part by part in place through cloud-volume.

Addressed as `precomputed://file:///abs/path/to/layer` (the layer folder holding `info`); its
scale 0 is the volume. cloud-volume indexes (x, y, z, channel) from the layer's voxel offset; the
adapter here shows the project's convention instead, a (z, y, x) array from 0 with the voxel size
(z, y, x) in nm as the attribute `voxel_size_nm`, so `pipeline.data.volumes` validates and slices it as
it does HDF5 and zarr. A chunk that is missing is an error naming it, never zeros, unless the
run's `[data] fill_missing` asks for zeros (cloud-volume's `fill_missing`); a chunk that cannot
be decoded is named too. A sharded layer (`neuroglancer_uint64_sharded_v1`, many chunks to a
file) is read the same way; its errors name the shard file that holds the chunk.
"""

import hashlib
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pipeline.core.errors import (
    ChunkReadError,
    MissingChunkError,
    VolumeFileMissing,
    VolumeReadError,
    VolumeShapeError,
    first_line,
)
from pipeline.core.roi import ChunkStates, chunk_box, chunk_grid, index_bounds

PREFIX = "precomputed://"
FILE_SCHEME = "file://"
# An unsharded chunk file's name: its voxels x0-x1_y0-y1_z0-z1 (cloud-volume, gzip or not).
CHUNK_NAME = re.compile(r"(-?\d+)-(-?\d+)_(-?\d+)-(-?\d+)_(-?\d+)-(-?\d+)(?:\.gz|\.br|\.zstd)?")


def is_precomputed(spec: str) -> bool:
    return str(spec).startswith(PREFIX)


def local_path(spec: str) -> Path:
    """The layer folder of a `precomputed://file:///...` spec. Only local layers: a run stamps
    its inputs by their files (and this machine reaches no bucket), so gs:// and s3:// layers
    are copied in first (e.g. with `cloudfiles cp`)."""
    url = str(spec)[len(PREFIX) :]
    if not url.startswith(FILE_SCHEME):
        raise VolumeFileMissing(
            f"{spec}: only local precomputed layers (precomputed://file:///path) are read; "
            "copy a remote layer in first"
        )
    return Path(url[len(FILE_SCHEME) :])


class PrecomputedArray:
    """Scale 0 of a precomputed layer as a read-only (z, y, x) array: `shape`, `dtype`, `attrs`
    and numpy-style slicing with steps of 1."""

    def __init__(self, path: Path, voxel_size_attr: str, fill_missing: bool = False) -> None:
        from cloudvolume import CloudVolume
        from cloudvolume.exceptions import InfoUnavailableError

        if not (path / "info").is_file():
            raise VolumeFileMissing(
                f"{PREFIX}{FILE_SCHEME}{path}: no precomputed layer (no info file)"
            )
        try:
            self._volume = CloudVolume(
                f"{FILE_SCHEME}{path}", mip=0, fill_missing=fill_missing, progress=False
            )
        except (InfoUnavailableError, ValueError, KeyError) as exc:
            raise VolumeReadError(
                f"{path}/info: not a precomputed layer ({first_line(exc)})"
            ) from None
        x, y, z, channels = (int(n) for n in self._volume.shape)
        if channels != 1:
            raise VolumeShapeError(f"{path}: {channels} channels; one is read (a 3-D volume)")
        self.shape = (z, y, x)
        self.dtype = np.dtype(self._volume.dtype)
        self.attrs = {voxel_size_attr: [float(r) for r in self._volume.resolution[::-1]]}
        self._offset_xyz = [int(o) for o in self._volume.voxel_offset]
        self._where = f"{PREFIX}{FILE_SCHEME}{path}"
        self.folder = path / self._volume.key  # scale 0's chunk files
        self.chunks = tuple(int(c) for c in self._volume.chunk_size[::-1])  # z, y, x
        self.fill_missing = fill_missing

    def __getitem__(self, index: "slice | Sequence[slice] | type(Ellipsis)") -> np.ndarray:
        bounds = index_bounds(index, self.shape)
        if any(stop == start for start, stop in bounds):
            return np.zeros([stop - start for start, stop in bounds], self.dtype)
        (z0, z1), (y0, y1), (x0, x1) = bounds
        ox, oy, oz = self._offset_xyz
        from cloudvolume.exceptions import EmptyVolumeException

        try:
            cutout = self._volume[ox + x0 : ox + x1, oy + y0 : oy + y1, oz + z0 : oz + z1]
        except EmptyVolumeException as exc:
            from pipeline.data.zarr_volumes import FILL_MISSING_HINT

            raise MissingChunkError(
                f"{self._where}: {self._missing(exc)} is missing ({FILL_MISSING_HINT})"
            ) from None
        except Exception as exc:  # a corrupt or truncated chunk file (deflate, raw size)
            raise self._unreadable(bounds, exc) from None
        return np.ascontiguousarray(np.asarray(cutout)[..., 0].transpose(2, 1, 0))

    def _unreadable(self, bounds: Sequence[tuple[int, int]], exc: Exception) -> VolumeReadError:
        """The error naming the first chunk of the read that cannot be decoded on its own."""
        # The chunk grid starts at the voxel offset: chunk i spans offset + i * chunk, clipped.
        offset = self._offset_xyz[::-1]  # z, y, x
        for coords in chunk_grid(bounds, self.chunks):
            box = chunk_box(coords, self.chunks, self.shape)
            (z0, z1), (y0, y1), (x0, x1) = (
                (a + o, b + o) for (a, b), o in zip(box, offset, strict=True)
            )
            try:
                self._volume[x0:x1, y0:y1, z0:z1]
            except Exception as chunk_exc:
                return ChunkReadError(
                    f"{self._where}: {self._file_of((x0, y0, z0), (x1, y1, z1))} "
                    f"cannot be read ({first_line(chunk_exc)})"
                )
        return VolumeReadError(f"{self._where}: cannot read its data ({first_line(exc)})")

    def _missing(self, exc: Exception) -> str:
        """What an EmptyVolumeException says is missing: an unsharded chunk's file name (its
        message), or the box of a sharded layer's chunk, whose shard file is named here."""
        from cloudvolume import Bbox

        box = exc.args[0] if exc.args else None
        if not isinstance(box, Bbox):
            return f"chunk {first_line(exc)}"
        return self._file_of(tuple(box.minpt), tuple(box.maxpt))

    def _file_of(self, start_xyz: Sequence[int], stop_xyz: Sequence[int]) -> str:
        """The file holding the chunk from `start_xyz` to `stop_xyz` (layer coordinates): its own,
        or in a sharded layer the shard its compressed Morton code falls in."""
        start, stop = (tuple(int(v) for v in point) for point in (start_xyz, stop_xyz))
        chunk = "_".join(f"{a}-{b}" for a, b in zip(start, stop, strict=True))
        if not self._volume.image.is_sharded(0):
            return f"chunk {self._volume.key}/{chunk}"
        from cloudvolume.datasource.precomputed.common import compressed_morton_code
        from cloudvolume.datasource.precomputed.sharding import ShardingSpecification

        size = np.asarray(self._volume.chunk_size, int)
        grid = -(-np.asarray(self._volume.volume_size, int) // size)
        point = (np.asarray(start) - np.asarray(self._offset_xyz)) // size
        spec = ShardingSpecification.from_dict(self._volume.scale["sharding"])
        shard = spec.compute_shard_location(compressed_morton_code(point, grid)).shard_number
        return f"shard {self._volume.key}/{shard}.shard (chunk {chunk})"

    def chunk_state(self, bounds: Sequence[tuple[int, int]], cells: bool = False) -> dict:
        """What scale 0's chunk files are now, without reading them: their number, bytes and a
        digest of every file's name, size, mtime_ns and ctime_ns. The whole scale's folder is
        listed (one scandir, a stat per file; a sharded layer's shard files alike), not only the
        files of `bounds`; the digest is a sum of one sha256 per file, so neither order nor
        memory grows with the millions of files a large layer holds. With `cells`, also
        "cells": per chunk of `bounds` on scale 0's chunk grid (`ChunkStates`) the state of its
        file, placed by its name (x0-x1_y0-y1_z0-z1); a shard file, whose chunks its name does
        not tell, counts in every chunk."""
        files = size = total = 0
        states = ChunkStates(bounds, self.chunks) if cells else None
        found = {"files": 0, "bytes": 0, "state_sha256": f"{total:064x}"}
        if not self.folder.is_dir():  # no chunk written yet
            return found if states is None else found | {"cells": states}
        with os.scandir(self.folder) as listing:
            for entry in listing:
                if not entry.is_file():
                    continue
                stat = entry.stat()
                one = f"{entry.name} {stat.st_size} {stat.st_mtime_ns} {stat.st_ctime_ns}"
                total = (total + int.from_bytes(hashlib.sha256(one.encode()).digest(), "big")) % (
                    1 << 256
                )
                files, size = files + 1, size + stat.st_size
                if states is not None:
                    states.add(self._chunk_bounds(entry.name), one)
        found = {"files": files, "bytes": size, "state_sha256": f"{total:064x}"}
        return found if states is None else found | {"cells": states}

    def _chunk_bounds(self, name: str) -> list[tuple[int, int]] | None:
        """The (z, y, x) box in array coordinates of an unsharded chunk file's name, None for
        any other file (a shard)."""
        match = CHUNK_NAME.fullmatch(name)
        if match is None:
            return None
        x0, x1, y0, y1, z0, z1 = (int(n) for n in match.groups())
        ox, oy, oz = self._offset_xyz
        return [(z0 - oz, z1 - oz), (y0 - oy, y1 - oy), (x0 - ox, x1 - ox)]
