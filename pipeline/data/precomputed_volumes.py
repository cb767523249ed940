"""Neuroglancer precomputed volumes as inputs, read part by part in place through cloud-volume.

Addressed as `precomputed://URL`, URL the layer folder holding `info`: `file:///abs/path` on
this machine, or a layer read where it lives, chunk by chunk as reads need them, never copied
in first: `https://` and `http://` (any web server of static files, as the public FlyEM, H01
and MICrONS layers are served), `s3://bucket/path` and `gs://bucket/path` (credentials as
cloud-files takes them: its secrets folder, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY; an
S3-compatible store by its endpoint, `s3://https://host/bucket/path`, or AWS_ENDPOINT_URL_S3).
Its scale 0 is the volume. cloud-volume indexes (x, y, z, channel) from the layer's voxel
offset; the adapter here shows the project's convention instead, a (z, y, x) array from 0 with
the voxel size (z, y, x) in nm as the attribute `voxel_size_nm`, so `pipeline.data.volumes`
validates and slices it as it does HDF5 and zarr. A chunk that is missing is an error naming
it, never zeros, unless the run's `[data] fill_missing` asks for zeros (cloud-volume's
`fill_missing`); a chunk that cannot be decoded is named too; a layer read by URL alike (a
store that cannot be reached is `RemoteReadError`). A sharded layer
(`neuroglancer_uint64_sharded_v1`, many chunks to a file) is read the same way; its errors name
the shard file that holds the chunk.

What a run keys a layer on, read without its voxels (`PrecomputedArray.chunk_state`): a local
layer's chunk files' stats; of a layer read by URL, what its store says about each chunk file
of the box read (its size, content encoding and ETag, else Last-Modified: one HEAD request per
file), so a chunk changed in the store makes the work that read it stale, as a local one does.
"""

import contextlib
import hashlib
import itertools
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline.core.errors import (
    ChunkReadError,
    MissingChunkError,
    RemoteReadError,
    VolumeError,
    VolumeFileMissing,
    VolumeReadError,
    VolumeShapeError,
    first_line,
)
from pipeline.core.roi import ChunkStates, chunk_box, chunk_grid, index_bounds

if TYPE_CHECKING:  # imported where used: cloud-files takes a while to import
    from cloudfiles import CloudFiles

PREFIX = "precomputed://"
FILE_SCHEME = "file://"
# The stores a layer is read from by URL, through cloud-files.
REMOTE_SCHEMES = ("https://", "http://", "s3://", "gs://")
# An unsharded chunk file's name: its voxels x0-x1_y0-y1_z0-z1 (cloud-volume, gzip or not).
CHUNK_NAME = re.compile(r"(-?\d+)-(-?\d+)_(-?\d+)-(-?\d+)_(-?\d+)-(-?\d+)(?:\.gz|\.br|\.zstd)?")
# Files asked about per round of HEAD requests (sent in parallel): the answers for a box of
# millions of chunks are not held at once.
HEAD_BATCH = 10_000


def is_precomputed(spec: str) -> bool:
    return str(spec).startswith(PREFIX)


def layer_url(spec: str) -> str:
    """The layer's URL in a `precomputed://URL` spec, as cloud-volume takes it."""
    url = str(spec)[len(PREFIX) :]
    if not url.startswith((FILE_SCHEME, *REMOTE_SCHEMES)):
        raise VolumeError(
            f"{spec}: a precomputed layer is read from file://, https://, http://, s3:// or gs://"
        )
    return url


def is_remote(url: str) -> bool:
    """Whether a layer's URL is read from a store, not from this machine's files."""
    return not url.startswith(FILE_SCHEME)


def info_sha256(url: str) -> str:
    """The sha256 of the bytes of the `info` of a layer read by URL."""
    from cloudfiles import CloudFiles

    try:
        content = CloudFiles(url).get("info")
    except Exception as exc:  # any failure of the request: no host, refused, no credentials
        raise RemoteReadError(f"{PREFIX}{url}: cannot read its info ({first_line(exc)})") from None
    if content is None:
        raise VolumeFileMissing(f"{PREFIX}{url}: no precomputed layer (no info file)")
    return hashlib.sha256(content).hexdigest()


def _version(head: Mapping) -> str:
    """A remote file's version as its store states it: its size, content encoding and ETag
    (S3, GCS: a digest of its bytes, so a chunk written again with the same bytes is the
    same), or without an ETag its Last-Modified (a web server's, to the second)."""
    tag = head.get("ETag") or f"modified {head.get('Last-Modified')}"
    return f"{head.get('Content-Length')} {head.get('Content-Encoding') or ''} {tag}"


class PrecomputedArray:
    """Scale 0 of a precomputed layer (`url`, as `layer_url` gives it) as a read-only (z, y, x)
    array: `shape`, `dtype`, `attrs` and numpy-style slicing with steps of 1."""

    def __init__(self, url: str, voxel_size_attr: str, fill_missing: bool = False) -> None:
        from cloudvolume import CloudVolume
        from cloudvolume.exceptions import InfoUnavailableError

        self.remote = is_remote(url)
        self._url, self._where = url, f"{PREFIX}{url}"
        info = f"{url if self.remote else url[len(FILE_SCHEME) :]}/info"
        if not self.remote and not Path(info).is_file():
            raise VolumeFileMissing(f"{self._where}: no precomputed layer (no info file)")
        try:
            self._volume = CloudVolume(url, mip=0, fill_missing=fill_missing, progress=False)
        except InfoUnavailableError as exc:
            if self.remote:  # the store has no info there (a web server's 404)
                raise VolumeFileMissing(
                    f"{self._where}: no precomputed layer (no info file)"
                ) from None
            raise VolumeReadError(f"{info}: not a precomputed layer ({first_line(exc)})") from None
        except (ValueError, KeyError) as exc:
            raise VolumeReadError(f"{info}: not a precomputed layer ({first_line(exc)})") from None
        except Exception as exc:  # a store that cannot be reached: no host, refused, no rights
            if not self.remote:
                raise
            raise RemoteReadError(f"{self._where}: cannot be read ({first_line(exc)})") from None
        x, y, z, channels = (int(n) for n in self._volume.shape)
        if channels != 1:
            raise VolumeShapeError(
                f"{self._where}: {channels} channels; one is read (a 3-D volume)"
            )
        self.shape = (z, y, x)
        self.dtype = np.dtype(self._volume.dtype)
        self.attrs = {voxel_size_attr: [float(r) for r in self._volume.resolution[::-1]]}
        self._offset_xyz = [int(o) for o in self._volume.voxel_offset]
        # Scale 0's chunk files, on this machine; a store's are asked about (`chunk_state`).
        self.folder = None if self.remote else Path(url[len(FILE_SCHEME) :]) / self._volume.key
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
        """The error naming the first chunk of the read that cannot be decoded (or, read by
        URL, fetched) on its own."""
        for _, start, stop in self._chunks_of(bounds):
            try:
                self._volume[start[0] : stop[0], start[1] : stop[1], start[2] : stop[2]]
            except Exception as chunk_exc:
                return ChunkReadError(
                    f"{self._where}: {self._file_of(start, stop)} "
                    f"cannot be read ({first_line(chunk_exc)})"
                )
        return VolumeReadError(f"{self._where}: cannot read its data ({first_line(exc)})")

    def _chunks_of(
        self, bounds: Sequence[tuple[int, int]]
    ) -> Iterator[tuple[list[tuple[int, int]], tuple[int, ...], tuple[int, ...]]]:
        """Each chunk `bounds` meets: its (z, y, x) box in array coordinates, and its start and
        stop (x, y, z) in the layer's, as cloud-volume names it."""
        # The chunk grid starts at the voxel offset: chunk i spans offset + i * chunk, clipped.
        for coords in chunk_grid(bounds, self.chunks):
            box = chunk_box(coords, self.chunks, self.shape)
            start, stop = (
                tuple(p[i] + o for p, o in zip(box[::-1], self._offset_xyz, strict=True))
                for i in (0, 1)
            )
            yield box, start, stop

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
        chunk = _chunk_name(start_xyz, stop_xyz)
        if not self._volume.image.is_sharded(0):
            return f"chunk {self._volume.key}/{chunk}"
        return f"shard {self._shard_file(start_xyz)} (chunk {chunk})"

    def _shard_file(self, start_xyz: Sequence[int]) -> str:
        """The shard file (its path in the layer) of the chunk starting at `start_xyz`."""
        from cloudvolume.datasource.precomputed.common import compressed_morton_code
        from cloudvolume.datasource.precomputed.sharding import ShardingSpecification

        size = np.asarray(self._volume.chunk_size, int)
        grid = -(-np.asarray(self._volume.volume_size, int) // size)
        point = (np.asarray(start_xyz, int) - np.asarray(self._offset_xyz)) // size
        spec = ShardingSpecification.from_dict(self._volume.scale["sharding"])
        shard = spec.compute_shard_location(compressed_morton_code(point, grid)).shard_number
        return f"{self._volume.key}/{shard}.shard"

    def chunk_state(self, bounds: Sequence[tuple[int, int]], cells: bool = False) -> dict:
        """What scale 0's chunk files are now, without reading them (`_local_state` of a layer
        on this machine, `_remote_state` of one read by URL). With `cells`, also "cells": per
        chunk of `bounds` on scale 0's chunk grid (`ChunkStates`) the state of its file; a
        shard file, whose chunks its name does not tell, counts in every chunk."""
        states = ChunkStates(bounds, self.chunks) if cells else None
        found = self._remote_state(bounds, states) if self.remote else self._local_state(states)
        return found if states is None else found | {"cells": states}

    def _local_state(self, states: ChunkStates | None) -> dict:
        """Their number, bytes and a digest of every file's name, size, mtime_ns and ctime_ns.
        The whole scale's folder is listed (one scandir, a stat per file; a sharded layer's
        shard files alike), not only the files of the box; the digest is a sum of one sha256
        per file, so neither order nor memory grows with the millions of files a large layer
        holds. A file is placed in `states` by its name (x0-x1_y0-y1_z0-z1)."""
        files = size = total = 0
        if not self.folder.is_dir():  # no chunk written yet
            return {"files": 0, "bytes": 0, "state_sha256": f"{total:064x}"}
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
        return {"files": files, "bytes": size, "state_sha256": f"{total:064x}"}

    def _remote_state(self, bounds: Sequence[tuple[int, int]], states: ChunkStates | None) -> dict:
        """What the store says now about each file the chunks of `bounds` are read from (each
        shard file once), as zarr's `chunk_state` says it of a box: the number of files, how
        many the store does not have (the first one's name), their bytes and a sha256 over
        every file's name and version (`_version`). One HEAD request per file, in parallel
        (cloud-files' threads), in rounds of HEAD_BATCH: a store need not list (a web server
        does not), and only the box's files are asked about. 10^12 voxels in 64^3 chunks are
        3.8 million requests, tens of minutes at a few thousand a second."""
        from cloudfiles import CloudFiles

        store = CloudFiles(self._url, progress=False)
        sha, files, missing, size, first = hashlib.sha256(), 0, 0, 0, ""
        found = self._files_of(bounds)
        while batch := list(itertools.islice(found, HEAD_BATCH)):
            heads = self._heads(store, [name for name, _ in batch])
            for name, box in batch:
                head = heads.get(name)
                if head is None:
                    state, missing, first = "-", missing + 1, first or name
                else:
                    state, size = _version(head), size + int(head.get("Content-Length") or 0)
                sha.update(f"{name} {state}\n".encode())
                files += 1
                if states is not None:
                    states.add(box, f"{name} {state}")
        return {
            "chunks": files,
            "missing": missing,
            "first_missing": first,
            "bytes": size,
            "state_sha256": sha.hexdigest(),
        }

    def _heads(self, store: "CloudFiles", names: list[str]) -> dict[str, dict | None]:
        """The store's HEAD of each file of `names` (None: it has no such file). cloud-files'
        GCS head of a missing object fails the whole request (it reads the properties of the
        None its client returns), so after a failure each file is asked alone, and one whose
        HEAD fails is missing only if the store says it has no size for it."""
        with contextlib.suppress(Exception):  # refused, no answer, or a missing file (GCS)
            return store.head(names)
        heads: dict[str, dict | None] = {}
        for name in names:
            try:
                heads[name] = store.head(name)
            except Exception as exc:
                with contextlib.suppress(Exception):
                    if store.size(name) is None:
                        heads[name] = None
                        continue
                raise RemoteReadError(
                    f"{self._where}: cannot ask its store about {name} ({first_line(exc)})"
                ) from None
        return heads

    def _files_of(
        self, bounds: Sequence[tuple[int, int]]
    ) -> Iterator[tuple[str, list[tuple[int, int]] | None]]:
        """Each file (its path in the layer) the chunks of `bounds` are read from, once: a
        chunk's with its (z, y, x) box in array coordinates, a shard file with None (it holds
        voxels of chunks its name does not tell)."""
        sharded, shards = self._volume.image.is_sharded(0), set()
        for box, start, stop in self._chunks_of(bounds):
            if not sharded:
                yield f"{self._volume.key}/{_chunk_name(start, stop)}", box
            elif (shard := self._shard_file(start)) not in shards:
                shards.add(shard)
                yield shard, None

    def _chunk_bounds(self, name: str) -> list[tuple[int, int]] | None:
        """The (z, y, x) box in array coordinates of an unsharded chunk file's name, None for
        any other file (a shard)."""
        match = CHUNK_NAME.fullmatch(name)
        if match is None:
            return None
        x0, x1, y0, y1, z0, z1 = (int(n) for n in match.groups())
        ox, oy, oz = self._offset_xyz
        return [(z0 - oz, z1 - oz), (y0 - oy, y1 - oy), (x0 - ox, x1 - ox)]


def _chunk_name(start_xyz: Sequence[int], stop_xyz: Sequence[int]) -> str:
    """cloud-volume's name of an unsharded chunk's file: x0-x1_y0-y1_z0-z1."""
    return "_".join(f"{int(a)}-{int(b)}" for a, b in zip(start_xyz, stop_xyz, strict=True))
