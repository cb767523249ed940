"""Volume I/O and validation: the one array convention of the whole project.

Arrays are (z, y, x). Raw images are `uint8`; labels are `uint64` with 0 = unlabeled. The voxel
size in nm, also (z, y, x), is stored as the attribute `voxel_size_nm` on each dataset. FFN's own
literature and flags write sizes as (x, y, z); convert at the edge, never here.

Volumes are addressed by specs `path.h5:dataset`, `path.zarr:array` for chunked volumes that
many tasks write at once (`pipeline.data.zarr_volumes`), or `precomputed://URL` for Neuroglancer
precomputed inputs read in place, on this machine (`file:///layer`) or from a store by URL
(`https://`, `http://`, `s3://`, `gs://`; `pipeline.data.precomputed_volumes`), or
`folder:*.tif` for a folder of TIFF sections (`pipeline.data.tiff_volumes`). Reading
validates and fails with one line that names the file and the problem; writing is atomic
(temporary file, then rename).
"""

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import zarr

from pipeline.core.atomic import atomic_path
from pipeline.core.errors import (
    DatasetMissing,
    EmptyLabelsError,
    NonFiniteError,
    VolumeDtypeError,
    VolumeError,
    VolumeFileMissing,
    VolumeReadError,
    VolumeShapeError,
    VoxelSizeError,
    first_line,
)
from pipeline.core.roi import ZYX, Roi, grid_starts, index_bounds
from pipeline.data.precomputed_volumes import (
    FILE_SCHEME,
    PrecomputedArray,
    is_precomputed,
    is_remote,
    layer_url,
)
from pipeline.data.precomputed_volumes import PREFIX as PRECOMPUTED_PREFIX
from pipeline.data.tiff_volumes import TiffSections, is_tiff_sections
from pipeline.data.zarr_volumes import ChunkDigests, ZarrInput, create_zarr, is_zarr, open_zarr

VOXEL_SIZE_ATTR = "voxel_size_nm"
# Where real files keep the voxel size (z, y, x) in nm, in the order they are looked for: this
# project's attribute, then CREMI's (and many HDF5 stacks') `resolution`.
VOXEL_SIZE_ATTRS = (VOXEL_SIZE_ATTR, "resolution")
VoxelSize = tuple[float, float, float]
# A spec ending so reads chunks never written (or lost) as zeros, as `[data] fill_missing` asks.
FILL_MISSING = "#fill_missing"
# A zarr spec ending so (before any FILL_MISSING) checks each chunk read against the digests of
# that file (`zarr_volumes.ChunkDigests`), recorded when the run staged it (`[data] chunk_digests`).
CHUNK_DIGESTS = "#chunk_digests="


@dataclass(frozen=True)
class VolumeSpec:
    """Where one 3-D dataset lives: an HDF5 file (or zarr group) and a dataset path inside it,
    or a precomputed layer (`dataset` empty): its folder, or the `url` of one read from a store
    (https, http, s3, gs; `path` then empty); with `box`, only that box of it, read as
    a volume of its own (`path.zarr:raw[z0:z1, y0:y1, x0:x1]`): a part read in place. With
    `fill_missing` (written `...#fill_missing`), a chunk of a zarr or precomputed volume that
    does not exist reads as zeros; without, it is an error naming it (`MissingChunkError`).
    With `chunk_digests` (written `...#chunk_digests=FILE`), a zarr volume's chunks are checked
    against the digests kept in FILE (`ChunkDigestError`)."""

    path: Path
    dataset: str
    box: Roi | None = None
    fill_missing: bool = False
    chunk_digests: Path | None = None
    url: str = ""

    @classmethod
    def parse(cls, spec: "str | VolumeSpec") -> "VolumeSpec":
        if isinstance(spec, VolumeSpec):
            return spec
        text, box = str(spec), None
        if text.endswith(FILL_MISSING):
            return dataclasses.replace(cls.parse(text[: -len(FILL_MISSING)]), fill_missing=True)
        if CHUNK_DIGESTS in text:
            text, _, digests = text.rpartition(CHUNK_DIGESTS)
            return dataclasses.replace(cls.parse(text), chunk_digests=Path(digests))
        if text.endswith("]") and "[" in text:
            text, _, inner = text[:-1].rpartition("[")
            box = Roi.parse(inner, f"volume spec {spec!r}: box")
        if is_precomputed(text):
            url = layer_url(text)
            if is_remote(url):
                return cls(Path(), "", box, url=url)
            return cls(Path(url[len(FILE_SCHEME) :]), "", box)
        path, sep, dataset = text.rpartition(":")
        if not sep or not path or not dataset:
            raise DatasetMissing(
                f"volume spec {spec!r} must look like path.h5:dataset, path.zarr:array, "
                "precomputed://URL or folder:*.tif (a box of it: ...[z0:z1, y0:y1, x0:x1])"
            )
        return cls(Path(path), dataset, box)

    @property
    def precomputed(self) -> bool:
        return not self.dataset

    @property
    def layer_url(self) -> str:
        """A precomputed layer's URL, as cloud-volume takes it."""
        return self.url or f"{FILE_SCHEME}{self.path}"

    @property
    def name(self) -> str:
        """The volume's short name: its file's (or layer's folder's) without suffix."""
        return self.url.rstrip("/").rpartition("/")[2] if self.url else self.path.stem

    def part(self, box: Roi) -> "VolumeSpec":
        """The spec of `box` of this volume (of its box, where it names one already)."""
        return dataclasses.replace(self, box=box.within(self.box) if self.box else box)

    def __str__(self) -> str:
        where = (
            f"{PRECOMPUTED_PREFIX}{self.layer_url}"
            if self.precomputed
            else f"{self.path}:{self.dataset}"
        )
        where = f"{where}[{self.box}]" if self.box else where
        where = f"{where}{CHUNK_DIGESTS}{self.chunk_digests}" if self.chunk_digests else where
        return where + FILL_MISSING if self.fill_missing else where


class Window:
    """A box of a volume as a read-only volume of its own: `shape`, `dtype`, `attrs` (the
    volume's) and slicing from 0 with steps of 1, clipped to the box."""

    def __init__(
        self, dataset: "h5py.Dataset | ZarrInput | PrecomputedArray | TiffSections", box: Roi, spec
    ):
        if any(b > n for b, n in zip(box.stop, dataset.shape, strict=True)):
            raise VolumeShapeError(
                f"{spec}: the box reaches outside the volume of shape {tuple(dataset.shape)}"
            )
        self._dataset, self._box = dataset, box
        self.shape, self.dtype, self.attrs = box.shape, dataset.dtype, dataset.attrs

    def __getitem__(self, index: object) -> np.ndarray:
        bounds = index_bounds(index, self.shape)
        return self._dataset[
            tuple(slice(o + a, o + b) for o, (a, b) in zip(self._box.start, bounds, strict=True))
        ]


@dataclass(frozen=True, eq=False)
class LabeledVolume:
    """An image with its ground truth, already validated."""

    name: str
    raw: np.ndarray
    labels: np.ndarray
    voxel_size_nm: VoxelSize

    @property
    def shape(self) -> ZYX:
        return tuple(self.raw.shape)


@contextlib.contextmanager
def _checked_dataset(
    spec: VolumeSpec, writable: bool = False
) -> Iterator["h5py.Dataset | zarr.Array | PrecomputedArray | TiffSections | Window"]:
    """The 3-D dataset `spec` names, open (its box only, a `Window`, where the spec has one)."""
    if writable and spec.box:
        raise VolumeError(f"{spec}: a box of a volume is read, not written")
    with _whole_dataset(spec, writable) as dataset:
        yield Window(dataset, spec.box, spec) if spec.box else dataset


@contextlib.contextmanager
def _whole_dataset(
    spec: VolumeSpec, writable: bool = False
) -> Iterator["h5py.Dataset | zarr.Array | PrecomputedArray | TiffSections"]:
    """The 3-D dataset `spec` names, open; one-line errors for a missing or unreadable file, a
    missing dataset, a dataset that is not 3-D and, in the caller's block too, data or metadata
    that cannot be read. A `.zarr` path is a chunked volume (`pipeline.data.zarr_volumes`), a spec
    without a dataset a precomputed layer (`pipeline.data.precomputed_volumes`), one whose
    dataset is a glob of .tif files a folder of sections (`pipeline.data.tiff_volumes`)."""
    if writable and (spec.precomputed or not is_zarr(spec.path)):
        raise VolumeError(f"{spec}: only zarr volumes are written part by part in place")
    if spec.chunk_digests and (spec.precomputed or not is_zarr(spec.path) or writable):
        raise VolumeError(f"{spec}: chunk digests are checked on zarr volumes read, only")
    if spec.precomputed:
        yield PrecomputedArray(spec.layer_url, VOXEL_SIZE_ATTR, spec.fill_missing)
        return
    if is_zarr(spec.path):
        array = open_zarr(spec.path, spec.dataset, "r+" if writable else "r")
        _require_3d(array.shape, spec)
        with reading(spec):
            # Read, every chunk a read touches must exist (or `fill_missing`), agree in length
            # with its header (and its digest, with `chunk_digests`) and decode; a volume
            # opened to be written is the zarr array itself (its chunks begin unwritten).
            yield (
                array
                if writable
                else ZarrInput(
                    array, spec.path / spec.dataset, spec.fill_missing, spec.chunk_digests
                )
            )
        return
    if is_tiff_sections(spec.dataset):
        yield TiffSections(spec.path, spec.dataset)
        return
    if not spec.path.is_file():
        raise VolumeFileMissing(f"{spec.path}: file not found")
    try:
        f = h5py.File(spec.path, "r")
    except OSError as exc:
        raise VolumeFileMissing(
            f"{spec.path}: not a readable HDF5 file ({first_line(exc)})"
        ) from None
    with f, reading(spec):
        if spec.dataset not in f or not isinstance(f[spec.dataset], h5py.Dataset):
            found = []
            f.visititems(
                lambda name, obj: found.append(name) if isinstance(obj, h5py.Dataset) else None
            )
            raise DatasetMissing(
                f"{spec.path}: no dataset {spec.dataset!r} (datasets: {', '.join(found) or 'none'})"
            )
        dataset = f[spec.dataset]
        _require_3d(dataset.shape, spec)
        yield dataset


def _require_3d(shape: Sequence[int], spec: VolumeSpec) -> None:
    if len(shape) != 3:
        raise VolumeShapeError(f"{spec}: expected a 3-D (z, y, x) array, got shape {tuple(shape)}")


@contextlib.contextmanager
def reading(where: object) -> Iterator[None]:
    """h5py's read errors (a corrupted chunk, a truncated file: OSError without a file name) as
    one line that names the volume."""
    try:
        yield
    except OSError as exc:
        raise VolumeReadError(f"{where}: cannot read its data ({first_line(exc)})") from None


Region = tuple[slice, slice, slice]


def _open_dataset(
    spec: VolumeSpec, region: Region | None = None
) -> tuple[np.ndarray, VoxelSize | None]:
    """The voxels of `region` (default: all) and the stored voxel size."""
    with _checked_dataset(spec) as dataset:
        return dataset[region or ...], _stored_voxel_size(dataset, spec)


@dataclass(frozen=True)
class VolumeHeader:
    """What a volume's metadata says, read without its voxels."""

    spec: VolumeSpec
    shape: ZYX
    dtype: np.dtype
    voxel_size_nm: VoxelSize


def read_header(
    spec: "str | VolumeSpec", voxel_size_nm: Sequence[float] | None = None, labels: bool = False
) -> VolumeHeader:
    """Open a volume and check what can be checked without reading voxels: file, dataset, 3-D,
    dtype kind (raw uint8 or float, labels integer or float) and voxel size; the same one-line
    errors as reading it."""
    spec = VolumeSpec.parse(spec)
    with _checked_dataset(spec) as dataset:
        shape, dtype = tuple(int(n) for n in dataset.shape), dataset.dtype
        stored = _stored_voxel_size(dataset, spec)
    kinds = "iuf" if labels else "f"
    if dtype != np.uint8 and dtype.kind not in kinds:
        wanted = "an integer type" if labels else "uint8"
        raise VolumeDtypeError(
            f"{spec}: {'labels' if labels else 'raw image'} must be {wanted}, got {dtype}"
        )
    return VolumeHeader(spec, shape, dtype, _resolve_voxel_size(spec, stored, voxel_size_nm))


def chunk_state(spec: "str | VolumeSpec", cells: bool = False) -> dict | None:
    """What the chunk files a zarr or precomputed volume's box (its `box`, else all of it) is
    read from are now, read without their voxels (`ZarrInput.chunk_state`,
    `PrecomputedArray.chunk_state`: a stat per chunk file, of a layer read by URL a HEAD
    request per chunk file of the box; with `cells`, the state of each
    chunk of the box too, on the chunk grid); None for HDF5 (its file's own state says it)."""
    spec = VolumeSpec.parse(spec)
    if not spec.precomputed and not is_zarr(spec.path):
        return None
    with _whole_dataset(spec) as dataset:
        box = spec.box or Roi.whole(tuple(int(n) for n in dataset.shape))
        return dataset.chunk_state(list(zip(box.start, box.stop, strict=True)), cells)


def chunk_digests(spec: "str | VolumeSpec") -> ChunkDigests | None:
    """The digests of the chunk files a zarr volume's box (its `box`, else all of it) is read
    from, as they are now (`ZarrInput.chunk_digests`: each chunk file read once, its length
    checked); None for HDF5 and precomputed volumes."""
    spec = VolumeSpec.parse(spec)
    if spec.precomputed or not is_zarr(spec.path):
        return None
    with _whole_dataset(dataclasses.replace(spec, chunk_digests=None)) as dataset:
        box = spec.box or Roi.whole(tuple(int(n) for n in dataset.shape))
        return dataset.chunk_digests(list(zip(box.start, box.stop, strict=True)))


def volume_shape(spec: "str | VolumeSpec") -> ZYX:
    """The (z, y, x) shape of a volume, without reading its voxels; the same checks as reading."""
    with _checked_dataset(VolumeSpec.parse(spec)) as dataset:
        return tuple(int(n) for n in dataset.shape)


def _stored_voxel_size(dataset: "h5py.Dataset | zarr.Array", spec: VolumeSpec) -> VoxelSize | None:
    for name in VOXEL_SIZE_ATTRS:
        if name in dataset.attrs:
            return _check_voxel_size(dataset.attrs[name], f"{spec} (attribute {name!r})")
    return None


def _check_voxel_size(value: Sequence[float], where: object) -> VoxelSize:
    size = np.asarray(value, dtype=np.float64).ravel()
    if size.shape != (3,) or not np.all(np.isfinite(size)) or np.any(size <= 0):
        raise VoxelSizeError(
            f"{where}: voxel size must be 3 positive numbers (z, y, x) in nm, got {value!r}"
        )
    return tuple(float(s) for s in size)


def _require_finite(array: np.ndarray, spec: VolumeSpec) -> None:
    if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
        bad = int(np.count_nonzero(~np.isfinite(array)))
        raise NonFiniteError(f"{spec}: {bad} voxel(s) are NaN or infinite")


def _as_raw(array: np.ndarray, spec: VolumeSpec) -> np.ndarray:
    """uint8 as is; floats only when they are finite whole numbers in [0, 255] (no silent rescaling)."""
    if array.dtype == np.uint8:
        return array
    if array.dtype.kind != "f":
        raise VolumeDtypeError(f"{spec}: raw image must be uint8, got {array.dtype}")
    _require_finite(array, spec)
    if array.min() < 0 or array.max() > 255 or np.any(array != np.round(array)):
        raise VolumeDtypeError(
            f"{spec}: raw image is {array.dtype} but not whole numbers in [0, 255]; convert it to uint8"
        )
    return array.astype(np.uint8)


def _as_labels(array: np.ndarray, spec: VolumeSpec) -> np.ndarray:
    """Any non-negative integer type (or integral floats) becomes uint64; all zero is refused."""
    ids = label_ids(array, spec)
    if not np.any(ids):
        raise EmptyLabelsError(f"{spec}: labels are all zero (nothing labeled)")
    return ids


def label_ids(array: np.ndarray, spec: object) -> np.ndarray:
    """A part of a label volume as uint64 ids, checked as `_as_labels` does (all zero is fine:
    a part may hold nothing)."""
    if array.dtype.kind == "f":
        _require_finite(array, spec)
        if np.any(array != np.round(array)):
            raise VolumeDtypeError(f"{spec}: labels are {array.dtype} with fractional values")
    elif array.dtype.kind not in "iu":
        raise VolumeDtypeError(f"{spec}: labels must be an integer type, got {array.dtype}")
    if array.dtype.kind in "if" and array.size and array.min() < 0:
        raise VolumeDtypeError(f"{spec}: labels contain negative ids")
    return array.astype(np.uint64, copy=False)


@contextlib.contextmanager
def open_volume(
    spec: "str | VolumeSpec", writable: bool = False
) -> Iterator["h5py.Dataset | zarr.Array"]:
    """A volume open to be read part by part (file, dataset and 3-D checked; a read error names
    it in one line): for volumes that need not fit in memory. An h5py dataset, a zarr array read
    through `ZarrInput` (a missing or undecodable chunk is an error naming it) or a precomputed
    layer: all are sliced as numpy arrays are. `writable`: a zarr volume to write chunks into."""
    with _checked_dataset(VolumeSpec.parse(spec), writable) as dataset:
        yield dataset


def read_raw(
    spec: "str | VolumeSpec",
    voxel_size_nm: Sequence[float] | None = None,
    region: Region | None = None,
) -> tuple[np.ndarray, VoxelSize]:
    """Read and validate one raw image, or its `region` only; returns (uint8 zyx array, voxel
    size in nm)."""
    spec = VolumeSpec.parse(spec)
    array, stored_size = _open_dataset(spec, region)
    return _as_raw(array, spec), _resolve_voxel_size(spec, stored_size, voxel_size_nm)


def _resolve_voxel_size(
    spec: VolumeSpec, stored: VoxelSize | None, given: Sequence[float] | None
) -> VoxelSize:
    if given is not None:
        given = _check_voxel_size(given, "given voxel size")
        if stored is not None and not np.allclose(stored, given):
            raise VoxelSizeError(
                f"{spec}: stored voxel size {stored} nm differs from the given {given} nm"
            )
        return given
    if stored is None:
        raise VoxelSizeError(
            f"{spec}: no voxel size (looked for the attributes {', '.join(map(repr, VOXEL_SIZE_ATTRS))}); "
            "give the voxel size (z, y, x) in nm explicitly"
        )
    return stored


def read_labels(
    spec: "str | VolumeSpec",
    voxel_size_nm: Sequence[float] | None = None,
    region: Region | None = None,
) -> tuple[np.ndarray, VoxelSize]:
    """Read and validate one label volume, or its `region` only; returns (uint64 zyx array,
    voxel size in nm)."""
    spec = VolumeSpec.parse(spec)
    array, stored_size = _open_dataset(spec, region)
    return _as_labels(array, spec), _resolve_voxel_size(spec, stored_size, voxel_size_nm)


def read_volume_pair(
    raw_spec: "str | VolumeSpec",
    labels_spec: "str | VolumeSpec",
    *,
    name: str | None = None,
    min_shape_zyx: Sequence[int] | None = None,
    voxel_size_nm: Sequence[float] | None = None,
    region: Region | None = None,
) -> LabeledVolume:
    """Read an image and its ground truth (or their `region` only: a part of volumes too large
    to hold), check that they belong together, and return them.

    `min_shape_zyx` is the field of view: a volume smaller than it along any axis cannot train.
    `voxel_size_nm` is needed only when the files carry no `voxel_size_nm` attribute.
    """
    raw_spec, labels_spec = VolumeSpec.parse(raw_spec), VolumeSpec.parse(labels_spec)
    shapes = (volume_shape(raw_spec), volume_shape(labels_spec)) if region else None
    raw, raw_size = read_raw(raw_spec, voxel_size_nm, region)
    labels, labels_size = read_labels(labels_spec, voxel_size_nm or raw_size, region)
    raw_shape, labels_shape = shapes or (raw.shape, labels.shape)
    if labels_shape != raw_shape:
        raise VolumeShapeError(
            f"{labels_spec}: labels shape {labels_shape} differs from raw {raw_spec} shape {raw_shape}"
        )
    if min_shape_zyx is not None and any(
        s < m for s, m in zip(raw.shape, min_shape_zyx, strict=True)
    ):
        raise VolumeShapeError(
            f"{raw_spec}: shape {raw.shape} (z, y, x) is smaller than the field of view "
            f"{tuple(min_shape_zyx)}"
        )
    return LabeledVolume(name or raw_spec.name, raw, labels, raw_size)


def write_volumes(
    path: str | Path,
    arrays: dict[str, np.ndarray],
    voxel_size_nm: Sequence[float],
    attrs: dict[str, object] | None = None,
) -> Path:
    """Write named (z, y, x) arrays into one new HDF5 file, atomically, with the voxel size on each.

    `attrs` go on the file's root (provenance such as the generator's settings).
    """
    shapes = {name: a.shape for name, a in arrays.items()}
    if any(len(s) != 3 for s in shapes.values()) or len(set(shapes.values())) > 1:
        raise VolumeShapeError(f"{path}: arrays must be 3-D and of one shape, got {shapes}")
    layout = {name: (a.shape, a.dtype) for name, a in arrays.items()}
    with new_volumes(path, layout, voxel_size_nm, attrs) as datasets:
        for name, array in arrays.items():
            datasets[name][...] = array
    return Path(path)


def _create(
    f: h5py.File,
    name: str,
    shape: Sequence[int],
    dtype: np.dtype,
    voxel_size: VoxelSize,
) -> h5py.Dataset:
    chunks = tuple(min(64, s) for s in shape)
    dataset = f.create_dataset(
        name,
        shape=shape,
        dtype=dtype,
        chunks=chunks,
        compression="gzip",
        compression_opts=4,
    )
    dataset.attrs[VOXEL_SIZE_ATTR] = voxel_size
    return dataset


@contextlib.contextmanager
def new_volumes(
    path: str | Path,
    datasets: dict[str, tuple[Sequence[int], np.dtype]],
    voxel_size_nm: Sequence[float],
    attrs: dict[str, object] | None = None,
) -> Iterator[dict[str, h5py.Dataset]]:
    """A new HDF5 file of empty volumes {name: (shape, dtype)}, to be written part by part (what
    one process cannot hold whole): the file appears under `path` only when the block exits
    without an error. `attrs` go on the file's root."""
    voxel_size = _check_voxel_size(voxel_size_nm, path)
    for name, (shape, _) in datasets.items():
        if len(shape) != 3:
            raise VolumeShapeError(f"{path}: volume {name!r} must be 3-D, got shape {tuple(shape)}")
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        for key, value in (attrs or {}).items():
            f.attrs[key] = value
        yield {
            name: _create(f, name, tuple(shape), np.dtype(dtype), voxel_size)
            for name, (shape, dtype) in datasets.items()
        }


def read_bricks(
    spec: "str | VolumeSpec", region: Region, brick: int, labels: bool = False
) -> Iterator[tuple[tuple[int, int, int], np.ndarray]]:
    """The voxels of `region` in bricks of `brick`^3 on a grid from the region's start (clipped
    at its end), checked and converted as `read_raw` / `read_labels` do (uint8 image; uint64
    ids, where a brick may be all zero): (the brick's start within the region, its voxels).
    Bricks, not slabs of whole planes: the memory stays a brick's however wide the volume, and
    a chunked source aligned with the grid is decompressed once per chunk."""
    spec = VolumeSpec.parse(spec)
    origin = [r.start for r in region]
    shape = [r.stop - r.start for r in region]
    with _checked_dataset(spec) as dataset:
        for start in grid_starts(shape, brick):
            where = tuple(
                slice(o + a, o + min(a + brick, n))
                for o, a, n in zip(origin, start, shape, strict=True)
            )
            array = dataset[where]
            yield start, label_ids(array, spec) if labels else _as_raw(array, spec)


def new_chunked_volume(
    path: str | Path,
    name: str,
    shape: Sequence[int],
    dtype: np.dtype,
    voxel_size_nm: Sequence[float],
    chunks: Sequence[int],
) -> None:
    """A new zarr volume of zeros, to be written chunk by chunk by many tasks at once (each its
    own whole chunks); read it back with `open_volume("path.zarr:name")`."""
    voxel_size = _check_voxel_size(voxel_size_nm, path)
    if len(shape) != 3 or len(chunks) != 3:
        raise VolumeShapeError(
            f"{path}: a volume is 3-D, got shape {tuple(shape)}, chunks {tuple(chunks)}"
        )
    create_zarr(path, name, shape, dtype, chunks, {VOXEL_SIZE_ATTR: list(voxel_size)})
