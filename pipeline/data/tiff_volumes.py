"""A folder of TIFF sections as an input volume, read section by section.

Many EM volumes arrive as a folder of 2-D sections, one TIFF file each. Addressed as
`FOLDER:PATTERN`, PATTERN a glob of the section files ending in .tif or .tiff
(`/data/em/sections:*.tif`): the files in FOLDER it matches are the volume's z sections, in the
order of their names with numbers compared as numbers (`s2.tif` before `s10.tif`). Opening
reads every file's header only and checks that each holds one 2-D greyscale image of the first
one's shape and dtype (an error names the file); a read decodes only the sections it needs,
one at a time: an uncompressed section is memory-mapped (only the window's bytes are read), a
compressed one decoded whole (memory: one section). TIFF keeps no voxel size in nm: give
`[data] voxel_size_nm`. The volume is copied into the run when staged, as HDF5 is, and a resume
watches every file of the folder (`staging.source_files`).
"""

import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pipeline.core.errors import (
    ChunkReadError,
    VolumeDtypeError,
    VolumeFileMissing,
    VolumeReadError,
    VolumeShapeError,
    first_line,
)
from pipeline.core.roi import index_bounds

SUFFIXES = (".tif", ".tiff")


def is_tiff_sections(pattern: str) -> bool:
    """Whether a spec's part after the folder names TIFF section files (a glob)."""
    return pattern.lower().endswith(SUFFIXES)


def _in_order(name: str) -> list:
    """A file name's sort key: its runs of digits as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


class TiffSections:
    """The sections of `folder` matching `pattern` as a read-only (z, y, x) array: `shape`,
    `dtype`, `attrs` (none: TIFF keeps no voxel size in nm) and numpy-style slicing with steps
    of 1."""

    def __init__(self, folder: Path, pattern: str) -> None:
        import tifffile

        if not folder.is_dir():
            raise VolumeFileMissing(f"{folder}: no folder of TIFF sections")
        self.files = sorted(
            (p for p in folder.glob(pattern) if p.is_file()), key=lambda p: _in_order(p.name)
        )
        if not self.files:
            raise VolumeFileMissing(f"{folder}: no section file matches {pattern!r}")
        first = None
        for file in self.files:
            try:
                with tifffile.TiffFile(file) as tif:
                    page = tif.pages[0]
                    pages, shape, dtype = len(tif.pages), tuple(page.shape), np.dtype(page.dtype)
            except Exception as exc:  # not a TIFF, or its header cut short
                raise VolumeReadError(
                    f"{file}: not a readable TIFF file ({first_line(exc)})"
                ) from None
            if pages != 1 or len(shape) != 2:
                raise VolumeShapeError(
                    f"{file}: a section is one 2-D greyscale image; this file holds {pages} "
                    f"image(s) of shape {shape}"
                )
            first = first or (file, shape, dtype)
            if shape != first[1]:
                raise VolumeShapeError(
                    f"{file}: section of shape {shape} (y, x), the first ({first[0].name}) "
                    f"{first[1]}"
                )
            if dtype != first[2]:
                raise VolumeDtypeError(
                    f"{file}: section of dtype {dtype}, the first ({first[0].name}) {first[2]}"
                )
        self.shape = (len(self.files), *first[1])
        self.dtype = first[2]
        self.attrs: dict = {}

    def __getitem__(self, index: "slice | Sequence[slice] | type(Ellipsis)") -> np.ndarray:
        (z0, z1), rows, cols = index_bounds(index, self.shape)
        out = np.empty((z1 - z0, rows[1] - rows[0], cols[1] - cols[0]), self.dtype)
        for z in range(z0, z1):
            out[z - z0] = self._section(z, slice(*rows), slice(*cols))
        return out

    def _section(self, z: int, rows: slice, cols: slice) -> np.ndarray:
        """The window (`rows`, `cols`) of section `z`, read from its file now."""
        import tifffile

        file = self.files[z]
        try:
            try:
                section = tifffile.memmap(file, page=0, mode="r")
            except ValueError:  # compressed, or not contiguous: decoded whole
                section = tifffile.imread(file, key=0)
            return np.array(section[rows, cols])
        except Exception as exc:  # its data cut short or damaged since the volume was opened
            raise ChunkReadError(
                f"{file}: section {z} cannot be read ({first_line(exc)})"
            ) from None
