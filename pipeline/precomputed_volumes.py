"""Neuroglancer precomputed volumes as inputs, read part by part in place through cloud-volume.

Addressed as `precomputed://file:///abs/path/to/layer` (the layer folder holding `info`); its
scale 0 is the volume. cloud-volume indexes (x, y, z, channel) from the layer's voxel offset; the
adapter here shows the project's convention instead, a (z, y, x) array from 0 with the voxel size
(z, y, x) in nm as the attribute `voxel_size_nm`, so `pipeline.volumes` validates and slices it as
it does HDF5 and zarr. A chunk that is missing is an error, never zeros.
"""

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pipeline.errors import VolumeFileMissing, VolumeReadError, VolumeShapeError, first_line
from pipeline.roi import index_bounds

PREFIX = "precomputed://"
FILE_SCHEME = "file://"


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

    def __init__(self, path: Path, voxel_size_attr: str) -> None:
        from cloudvolume import CloudVolume
        from cloudvolume.exceptions import InfoUnavailableError

        if not (path / "info").is_file():
            raise VolumeFileMissing(
                f"{PREFIX}{FILE_SCHEME}{path}: no precomputed layer (no info file)"
            )
        try:
            self._volume = CloudVolume(
                f"{FILE_SCHEME}{path}", mip=0, fill_missing=False, progress=False
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

    def __getitem__(self, index: "slice | Sequence[slice] | type(Ellipsis)") -> np.ndarray:
        bounds = index_bounds(index, self.shape)
        if any(stop == start for start, stop in bounds):
            return np.zeros([stop - start for start, stop in bounds], self.dtype)
        (z0, z1), (y0, y1), (x0, x1) = bounds
        ox, oy, oz = self._offset_xyz
        try:
            cutout = self._volume[ox + x0 : ox + x1, oy + y0 : oy + y1, oz + z0 : oz + z1]
        except Exception as exc:  # cloud-volume's missing chunk, a corrupt or truncated file
            raise VolumeReadError(
                f"{self._where}: cannot read its data ({first_line(exc)})"
            ) from None
        return np.ascontiguousarray(np.asarray(cutout)[..., 0].transpose(2, 1, 0))
