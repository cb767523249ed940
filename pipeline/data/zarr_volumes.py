"""Zarr volumes: arrays cut into chunk files that many tasks write side by side, each its own
chunks, and that any task reads part by part in place.

Addressed like HDF5 volumes, `path.zarr:name` (an array in the zarr group at `path.zarr`);
`pipeline.data.volumes` dispatches here on the `.zarr` suffix and does the validation. Chunks are
zstd-compressed; to zarr a chunk never written reads as the fill value 0 (unlabeled). An input
is read through `ZarrInput`, which refuses that (a chunk lost or never written is an error that
names it, unless the run's `[data] fill_missing` asks for zeros), names a chunk that cannot be
decoded, and checks each chunk's bytes before zarr decodes them: their length against the
chunk's header (`chunk_size_problem`), and, for a volume the run staged with `[data]
chunk_digests`, their crc32 against the one recorded then (`ChunkDigests`). Why zarr: README,
"Chunked volumes".
"""

import hashlib
import json
import os
import struct
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zarr
from numcodecs import Blosc
from zarr.storage import BaseStore

from pipeline.core.atomic import atomic_dir, atomic_path
from pipeline.core.errors import (
    ChunkDigestError,
    ChunkReadError,
    ChunkSizeError,
    DatasetMissing,
    FFNError,
    MissingChunkError,
    VolumeFileMissing,
    VolumeReadError,
    first_line,
)
from pipeline.core.roi import ChunkStates, chunk_box, chunk_grid, index_bounds

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


# Blosc's chunk header (c-blosc 1.x, what numcodecs writes): version, its codec's version,
# flags and type size (a byte each), then nbytes (the decoded size), blocksize and cbytes (the
# whole chunk's size, this header included), little-endian uint32s.
BLOSC_HEADER = struct.Struct("<BBBBIII")
BLOSC_MEMCPYED = 0x02  # flag: stored as a plain copy (data that do not compress, as EM images)


def chunk_size_problem(data: bytes, array: zarr.Array) -> str:
    """What is wrong with the length of a chunk's bytes `data` of `array`, "" if nothing. Blosc
    (this project's compressor, and zarr's default): the length must be the header's cbytes
    (a chunk cut short or with bytes appended is not, while c-blosc, handed no length, decodes a
    plain copy from its header alone, from whatever memory follows a short one), and the
    header's nbytes a chunk's size (its shape times the item size: zarr stores edge chunks
    whole), unless filters, which may change that size, come first. Without a compressor or
    filters the length must be a chunk's size. Another compressor's frames are checked only by
    decoding them (zlib, zstd and lz4 fail on a cut frame; bytes overwritten in place are for
    `ChunkDigests`). Cost: a few comparisons on the bytes zarr reads anyway."""
    expected = int(np.prod(array.chunks)) * array.dtype.itemsize
    compressor, filtered = array.compressor, bool(array.filters) or array.dtype.hasobject
    if compressor is None:
        if filtered or len(data) == expected:
            return ""
        return (
            f"it holds {len(data)} bytes where an uncompressed chunk of {tuple(array.chunks)} "
            f"{array.dtype} holds {expected}: {'cut short' if len(data) < expected else 'bytes appended'}"
        )
    if compressor.codec_id != "blosc":
        return ""
    if len(data) < BLOSC_HEADER.size:
        return f"it holds {len(data)} bytes, less than Blosc's {BLOSC_HEADER.size}-byte header: cut short"
    _, _, flags, _, nbytes, _, cbytes = BLOSC_HEADER.unpack_from(data)
    if len(data) != cbytes:
        how = "cut short" if len(data) < cbytes else "bytes appended"
        return f"it holds {len(data)} bytes where its Blosc header says {cbytes}: {how}"
    if flags & BLOSC_MEMCPYED and cbytes != nbytes + BLOSC_HEADER.size:
        return (
            f"its Blosc header says a plain copy, yet of {cbytes} bytes for {nbytes}: its header "
            "is damaged"
        )
    if not filtered and nbytes != expected:
        return (
            f"its Blosc header says {nbytes} bytes decoded where a chunk of "
            f"{tuple(array.chunks)} {array.dtype} is {expected}: its header is damaged, or it is "
            "another array's"
        )
    return ""


# The digest of a chunk's bytes: zlib's crc32, 3-4 GB/s on this project's machine against 0.7
# for blake2b (BENCHMARKS.md, "Chunk digests"); a CRC detects every burst of errors up to 32
# bits and misses other damage with a chance of 2^-32. Stored as uint64 so that NOT_WRITTEN,
# out of crc32's range, marks a chunk missing when recorded (read as zeros, `fill_missing`).
DIGEST = "crc32"
NOT_WRITTEN = np.uint64(2**64 - 1)


def chunk_digest(data: bytes) -> int:
    return zlib.crc32(data)


@dataclass(frozen=True, eq=False)
class ChunkDigests:
    """The digest of each chunk of a box of a zarr array, as its bytes were when recorded: the
    chunk grid from `origin` (the grid coordinates of the box's first chunk), `chunks` the
    array's chunk shape when recorded. Kept in a `.npz` file (`save`, `load`) beside a run's
    staging record, never in the user's store."""

    origin: tuple[int, ...]
    chunks: tuple[int, ...]
    digests: np.ndarray  # uint64, one per chunk of the grid; NOT_WRITTEN: missing then

    def recorded(self, coords: Sequence[int]) -> int | None:
        """The digest recorded for the chunk at grid `coords` (NOT_WRITTEN: it was missing);
        None for a chunk outside the recorded box."""
        at = tuple(c - o for c, o in zip(coords, self.origin, strict=True))
        if any(a < 0 or a >= n for a, n in zip(at, self.digests.shape, strict=True)):
            return None
        return int(self.digests[at])

    def save(self, path: str | Path) -> str:
        """Write the file `path` atomically; returns the sha256 of what it holds (not of the
        file, whose zip entries carry the time they were written)."""
        with atomic_path(path) as tmp, open(tmp, "wb") as out:
            np.savez(out, origin=self.origin, chunks=self.chunks, digests=self.digests)
        held = json.dumps([self.origin, self.chunks, list(self.digests.shape)]).encode()
        return hashlib.sha256(held + self.digests.tobytes()).hexdigest()

    @classmethod
    def load(cls, path: str | Path) -> "ChunkDigests":
        try:
            with np.load(path) as found:
                origin, chunks, digests = (found[k] for k in ("origin", "chunks", "digests"))
        except (OSError, ValueError, KeyError) as exc:
            raise VolumeReadError(
                f"{path}: the chunk digests recorded at staging cannot be read "
                f"({first_line(exc)}); remove the staging record beside it and --resume, to "
                "stage the volume again"
            ) from None
        return cls(tuple(map(int, origin)), tuple(map(int, chunks)), digests)


class _CheckedChunks(BaseStore):
    """The chunk store a `ZarrInput` reads through: each chunk's bytes as zarr gets them, before
    it decodes them, must exist (unless `fill_missing`), have a length that agrees with their
    header (`chunk_size_problem`) and, where digests were recorded, the recorded digest. The
    checks run on the bytes read anyway: no extra read, and what is checked is what is decoded."""

    _writeable = _erasable = False

    def __init__(self, owner: "ZarrInput", inner: BaseStore, prefix: str) -> None:
        self._owner, self._inner, self.prefix = owner, inner, prefix

    def read(self, key: str) -> bytes | None:
        """The checked bytes of the chunk under store key `key`; None if it does not exist and
        may read as the fill value."""
        owner = self._owner
        name = key[len(self.prefix) :]
        coords = tuple(int(c) for c in name.split(owner.separator))
        recorded = owner.digests.recorded(coords) if owner.digests else None
        try:
            data = self._inner[key]
        except KeyError:
            if not owner.fill_missing:
                raise owner.missing(name) from None
            if recorded is not None and recorded != NOT_WRITTEN:
                raise MissingChunkError(
                    f"{owner.folder}: chunk {name} is missing (it was there when the run staged "
                    "the volume, which recorded its digest)"
                ) from None
            return None
        data = bytes(data) if not isinstance(data, bytes) else data
        problem = chunk_size_problem(data, owner.source)
        if problem:
            raise ChunkSizeError(f"{owner.folder}: chunk {name} cannot be read ({problem})")
        if recorded is not None:
            found = chunk_digest(data)
            if recorded == NOT_WRITTEN:
                raise ChunkDigestError(
                    f"{owner.folder}: chunk {name} was missing when the run staged the volume "
                    "and has been written since"
                )
            if found != recorded:
                raise ChunkDigestError(
                    f"{owner.folder}: chunk {name} differs from the digest recorded when the run "
                    f"staged the volume ({DIGEST} {found:08x}, recorded {recorded:08x}): its bytes "
                    "were changed in place since (damaged, or rewritten during the run)"
                )
        return data

    def getitems(self, keys: Sequence[str], *, contexts: Mapping) -> Mapping[str, bytes]:
        found = {key: self.read(key) for key in keys}
        return {key: data for key, data in found.items() if data is not None}

    def __getitem__(self, key: str) -> bytes:
        data = self.read(key)
        if data is None:
            raise KeyError(key)
        return data

    def __contains__(self, key: object) -> bool:
        return key in self._inner

    def __iter__(self) -> Iterator[str]:
        return iter(self._inner)

    def __len__(self) -> int:
        return len(self._inner)

    def __setitem__(self, key: str, value: object) -> None:
        raise PermissionError(f"{self._owner.folder}: an input volume is read, not written")

    __delitem__ = __setitem__


class ZarrInput:
    """A zarr array read as an input (read-only; `shape`, `dtype`, `attrs`, `chunks` and numpy-style
    slicing with steps of 1). Each chunk file a read touches must exist: zarr reads a missing one
    as the fill value, which for a lost chunk of an image is a silent hole. With `fill_missing`
    that is allowed (cloud-volume's `fill_missing`). A chunk whose length disagrees with its
    header is named before it is decoded (`chunk_size_problem`: Blosc decodes a plain copy cut
    short without an error), and one that exists but does not decode too. With `digests` (the
    file of a `ChunkDigests` recorded at staging) each chunk read must have the recorded digest.
    Cost: the checks run on the bytes zarr reads (no extra read), a crc32 of each with digests."""

    def __init__(
        self,
        array: zarr.Array,
        folder: Path,
        fill_missing: bool = False,
        digests: Path | None = None,
    ) -> None:
        self.source, self.folder, self.fill_missing = array, Path(folder), fill_missing
        self.shape, self.dtype, self.attrs = tuple(array.shape), array.dtype, array.attrs
        self.chunks = tuple(int(c) for c in array.chunks)
        try:
            meta = json.loads((self.folder / ".zarray").read_text())
        except (OSError, ValueError):
            meta = {}
        # zarr v2 names a chunk by its grid coordinates joined by the array's separator ("." by
        # default: 0.1.2; "/" for nested folders: 0/1/2).
        self.separator = meta.get("dimension_separator") or "."
        self.digests = ChunkDigests.load(digests) if digests else None
        if self.digests and self.digests.chunks != self.chunks:
            raise ChunkDigestError(
                f"{self.folder}: its chunks are {self.chunks} now, {self.digests.chunks} when the "
                f"run staged the volume ({digests})"
            )
        prefix = f"{array.path}/" if array.path else ""
        self._checked = _CheckedChunks(self, array.chunk_store, prefix)
        self._array = zarr.Array(
            array.store, path=array.path, read_only=True, chunk_store=self._checked
        )

    def key(self, coords: Sequence[int]) -> str:
        return self.separator.join(map(str, coords))

    def missing(self, key: str) -> MissingChunkError:
        return MissingChunkError(f"{self.folder}: chunk {key} is missing ({FILL_MISSING_HINT})")

    def __getitem__(self, index: object) -> np.ndarray:
        bounds = index_bounds(index, self.shape)
        region = tuple(slice(a, b) for a, b in bounds)
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

    def chunk_digests(self, bounds: Sequence[tuple[int, int]]) -> ChunkDigests:
        """The digests of the chunks of the box `bounds` as they are now (each read whole, its
        length checked, not decoded; a missing one NOT_WRITTEN, or an error unless
        `fill_missing`). Cost: reading the box's chunk files once and a crc32 of each
        (BENCHMARKS.md, "Chunk digests"); the memory of one chunk and 8 bytes per chunk."""
        origin = tuple(a // c for (a, _), c in zip(bounds, self.chunks, strict=True))
        extent = tuple(
            -(-b // c) - o for (_, b), c, o in zip(bounds, self.chunks, origin, strict=True)
        )
        digests = np.full(extent, NOT_WRITTEN, dtype=np.uint64)
        for coords in chunk_grid(bounds, self.chunks):
            data = self._checked.read(self._checked.prefix + self.key(coords))
            if data is not None:
                digests[tuple(c - o for c, o in zip(coords, origin, strict=True))] = chunk_digest(
                    data
                )
        return ChunkDigests(origin, self.chunks, digests)

    def chunk_state(self, bounds: Sequence[tuple[int, int]], cells: bool = False) -> dict:
        """What the chunk files of the box `bounds` are now, without reading them: the number of
        chunks, how many are missing (the first one's key), their bytes, and a sha256 over
        every chunk's key, size, mtime_ns and ctime_ns (ctime: a restore that keeps size and
        mtime, `cp -p`, still changes it). Cost: one stat per chunk of the box, streamed (O(1)
        memory): 10^12 voxels in 64^3 chunks are 3.8 million stats, seconds on a local disk,
        minutes on a parallel file system (~10^4 stats/s). With `cells`, also "cells": the
        state of each chunk of the box on the chunk grid (`ChunkStates`), so that a task
        reading a part of the box is keyed on the chunks it reads."""
        sha, chunks, missing, size, first = hashlib.sha256(), 0, 0, 0, ""
        states = ChunkStates(bounds, self.chunks) if cells else None
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
            if states is not None:
                states.add(chunk_box(coords, self.chunks, self.shape), f"{key} {state}")
        found = {
            "chunks": chunks,
            "missing": missing,
            "first_missing": first,
            "bytes": size,
            "state_sha256": sha.hexdigest(),
        }
        return found if states is None else found | {"cells": states}
