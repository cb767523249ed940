"""Zarr volumes: arrays cut into chunk files that many tasks write side by side, each its own
chunks, and that any task reads part by part in place.

Addressed like HDF5 volumes, `path.zarr:name` (an array in the zarr group at `path.zarr`);
`pipeline.volumes` dispatches here on the `.zarr` suffix and does the validation. Chunks are
zstd-compressed; a chunk never written reads as the fill value 0 (unlabeled), which is why a
writer must say when it is done (the stitch stage's record) before the volume is trusted.
Why zarr: README, "Chunked volumes".
"""

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import zarr
from numcodecs import Blosc

from pipeline.atomic import atomic_dir
from pipeline.errors import DatasetMissing, VolumeFileMissing

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
