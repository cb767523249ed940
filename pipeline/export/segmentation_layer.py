"""The full resolution of an export's segmentation layer, written by tasks side by side before
the export begins: the stitching's relabel tasks and the second pass write their regions into it
(`SegmentationWriter`: a shard each, or whole chunks), evaluation reads it there, and the export
(pipeline.export.layers) then adds its coarser scales, meshes and properties.

`new_segmentation` makes the layer, empty, stored as a `SegmentationLayout` says. The helpers the
export shares with it (the layers' `info`, their scales' factors, the chunk and shard files a
region's writing makes, the check that a folder may be replaced) are here too.
"""

import hashlib
import itertools
import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.core.atomic import atomic_path
from pipeline.core.errors import PrecomputedError
from pipeline.core.roi import Roi
from pipeline.data.volumes import ZYX, VoxelSize
from pipeline.export.folder_layout import (
    IMAGE_LAYER,
    SEGMENTATION_LAYER,
    Scale,
    layer_scales,
    layer_url,
    read_info,
    xyz,
)
from pipeline.export.shards import shard_zyx

MANIFEST = "export.json"  # the export's summary, written last
RECORDS_DIR = "records"  # the export tasks' records


@dataclass(frozen=True)
class SegmentationLayout:
    """How the segmentation's full resolution is stored, which its writers (the stitching and
    the second pass, before the export begins) must know: its chunks, and when sharded the
    shard spec and the region (voxels from the origin) each shard file covers, which one task
    writes whole. Unsharded, each writer's region is whole chunks of its own."""

    chunk_zyx: ZYX
    gzip: bool = False
    sharding: dict | None = None
    region_zyx: ZYX | None = None


def scale_factors(scales: Sequence[Scale]) -> list[ZYX]:
    """Each scale's voxel size in full-resolution voxels (z, y, x)."""
    first = scales[0].voxel_size_nm
    return [
        tuple(round(s / f) for s, f in zip(scale.voxel_size_nm, first, strict=True))
        for scale in scales
    ]


def info_resolution(voxel_size_nm: VoxelSize) -> list:
    """A voxel size as an `info`'s resolution (x, y, z); whole numbers as ints, since a scale's
    folder is named after them (10_10_20, not 10.0_10.0_20.0)."""
    return [int(v) if float(v).is_integer() else float(v) for v in xyz(voxel_size_nm)]


def layer_info(layer: str, scale: Scale) -> dict:
    """A layer's `info` with its full-resolution scale only."""
    from cloudvolume import CloudVolume

    segmentation = layer == SEGMENTATION_LAYER
    return CloudVolume.create_new_info(
        num_channels=1,
        layer_type="segmentation" if segmentation else "image",
        data_type="uint64" if segmentation else "uint8",
        encoding="compressed_segmentation" if segmentation else "raw",
        resolution=info_resolution(scale.voxel_size_nm),
        voxel_offset=[0, 0, 0],
        volume_size=xyz(scale.shape_zyx),
        chunk_size=xyz(scale.chunk_zyx),
    )


def add_scales(
    folder: Path, layer: str, info: dict, scales: Sequence[Scale], shardings: Sequence = ()
) -> None:
    """Write `info` with `scales[1:]` added after its own full resolution, each scale sharded
    as `shardings` says (a spec, or None: unsharded)."""
    from cloudvolume import CloudVolume

    volume = CloudVolume(layer_url(folder, layer), info=info, progress=False)
    for scale, factor in zip(scales[1:], scale_factors(scales)[1:], strict=True):
        volume.add_scale(xyz(factor), chunk_size=xyz(scale.chunk_zyx))
    for entry, spec in zip(volume.info["scales"], shardings, strict=False):
        entry.pop("sharding", None)
        if spec is not None:
            entry["sharding"] = spec
    volume.commit_info()


def new_segmentation(
    folder: str | Path, shape_zyx: ZYX, voxel_size_nm: VoxelSize, layout: SegmentationLayout
) -> None:
    """The export folder's segmentation layer, empty, with its full resolution only (stored as
    `layout` says): what the stitching's relabel tasks write into, each its own chunks or
    shards (`SegmentationWriter`), before the export begins. What was there before goes, and
    the record `export.json` first: the export is complete again only once begun and finished
    over the new segmentation."""
    folder = Path(folder)
    check_replaceable(folder)
    (folder / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(folder / SEGMENTATION_LAYER, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    scale = Scale(tuple(map(float, voxel_size_nm)), tuple(shape_zyx), tuple(layout.chunk_zyx))
    info = layer_info(SEGMENTATION_LAYER, scale)
    add_scales(folder, SEGMENTATION_LAYER, info, [scale], [layout.sharding])


def _segmentation_info(
    shape_zyx: ZYX, voxel_size_nm: VoxelSize, layout: SegmentationLayout
) -> dict:
    """The `info` `new_segmentation` writes, as read back from its file."""
    scale = Scale(tuple(map(float, voxel_size_nm)), tuple(shape_zyx), tuple(layout.chunk_zyx))
    info = layer_info(SEGMENTATION_LAYER, scale)
    if layout.sharding is not None:
        info["scales"][0]["sharding"] = layout.sharding
    return json.loads(json.dumps(info))


def _full_resolution(info: dict) -> dict:
    """What of a segmentation layer's `info` says how its full resolution is stored: the
    export adds coarser scales, meshes and properties to it."""
    kept = {k: info.get(k) for k in ("type", "data_type", "num_channels")}
    return kept | {"scale": info["scales"][0]}


def holds_segmentation(
    folder: str | Path, shape_zyx: ZYX, voxel_size_nm: VoxelSize, layout: SegmentationLayout
) -> bool:
    """Whether `folder` holds a segmentation layer whose full resolution is stored as
    `new_segmentation` would make it (what its writers wrote may be kept)."""
    try:
        info = read_info(Path(folder), SEGMENTATION_LAYER)
        stored = _full_resolution(info)
    except (PrecomputedError, KeyError, IndexError, TypeError, AttributeError):
        return False
    return stored == _full_resolution(_segmentation_info(shape_zyx, voxel_size_nm, layout))


def check_replaceable(final: Path) -> None:
    """Only an earlier export, finished or cut short (nothing but its layers), or nothing, or an
    empty folder may be replaced."""
    own = {IMAGE_LAYER, SEGMENTATION_LAYER, MANIFEST, RECORDS_DIR}
    replaceable = (
        not final.exists()
        or (final / MANIFEST).is_file()
        or (final.is_dir() and {p.name for p in final.iterdir()} <= own)
    )
    if not replaceable:
        raise PrecomputedError(f"{final}: exists and is not an export; refusing to replace it")


def chunk_files(box: Roi, scale: Scale, key: str, gzip: bool) -> list[str]:
    """The chunk files (relative to the layer) that writing `box` (voxels of `scale`) makes."""
    ranges = [
        [(c, min(c + size, h)) for c in range(low, h, size)]
        for low, h, size in zip(box.start, box.stop, scale.chunk_zyx, strict=True)
    ]
    return [
        f"{key}/{x[0]}-{x[1]}_{y[0]}-{y[1]}_{z[0]}-{z[1]}" + (".gz" if gzip else "")
        for z, y, x in itertools.product(*ranges)
    ]


def stitched_files(volume, box: Roi, scale: Scale, key: str, gzip: bool) -> list[str]:
    """The files of the full resolution of segmentation layer `volume` (a CloudVolume at it) that
    hold `box`: its shard, or its chunks."""
    if volume.image.is_sharded(0):
        from cloudvolume import Bbox

        return [f"{key}/{volume.image.shard_filename(Bbox(xyz(box.start), xyz(box.stop)), 0)}"]
    return chunk_files(box, scale, key, gzip)


def write_shard(layer_dir: Path, mip: int, box: Roi, data_xyz: np.ndarray) -> str:
    """Write the shard of scale `mip` that covers `box` (its voxels, z, y, x; `data_xyz` them in
    cloud-volume's order) whole, with cloud-volume's `make_shard`, atomically: a task killed
    mid-write leaves no shard to be read as complete. A shard there with these bytes is kept,
    and with it its mtime, which the export's records hold of what they read (a part of the
    stitching run again with the same labels leaves the export complete). Returns its name in
    the layer."""
    from cloudvolume import Bbox, CloudVolume

    volume = CloudVolume(f"file://{layer_dir.resolve()}", mip=mip, progress=False)
    data = data_xyz if data_xyz.ndim == 4 else data_xyz[..., None]
    name, content = volume.image.make_shard(data, Bbox(xyz(box.start), xyz(box.stop)), mip)
    path = layer_dir / volume.key / name
    if not _holds(path, content):
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_bytes(content)
    return f"{volume.key}/{name}"


def _holds(path: Path, content: bytes) -> bool:
    """Whether the file `path` holds `content` (read only when its size is that)."""
    try:
        return path.stat().st_size == len(content) and path.read_bytes() == content
    except OSError:
        return False


class SegmentationWriter:
    """The full resolution of an export's segmentation layer (`new_segmentation`), written by
    tasks side by side, each a region of its own: unsharded, whole chunks (or up to the
    volume's end); sharded, a region of the shard plan (`region_zyx`, one shard file). No two
    share a file; a region's files can be named and digested, so a later check finds one lost
    or changed."""

    def __init__(self, folder: str | Path, gzip: bool = False) -> None:
        from cloudvolume import CloudVolume

        folder = Path(folder)
        self._layer = folder / SEGMENTATION_LAYER
        info = read_info(folder, SEGMENTATION_LAYER)
        self._scale, self._key, self._gzip = layer_scales(info)[0], info["scales"][0]["key"], gzip
        self._volume = CloudVolume(
            layer_url(folder, SEGMENTATION_LAYER),
            mip=0,
            compress="gzip" if gzip else False,
            progress=False,
        )
        self.chunks, self.where = self._scale.chunk_zyx, str(self._layer)
        spec = info["scales"][0].get("sharding")
        # The box one shard covers: what a writer's region must be (None: unsharded).
        self.region_zyx = spec and shard_zyx(spec, self._scale.shape_zyx, self.chunks)
        self.layout = SegmentationLayout(self.chunks, gzip, spec, self.region_zyx)

    def write(self, region: tuple[slice, ...], ids: np.ndarray) -> None:
        """Store `ids` (uint64, the region's shape) as the region's voxels."""
        # (z, y, x) in C order is (x, y, z) in Fortran order: a view, no copy.
        data = np.asarray(ids, np.uint64).T
        if self.region_zyx:
            write_shard(self._layer, 0, Roi.of(region), data)
        else:
            self._volume[tuple(region[::-1])] = data

    def chunk_names(self, region: tuple[slice, ...]) -> list[str]:
        """The files (relative to the layer) that writing `region` makes."""
        return stitched_files(self._volume, Roi.of(region), self._scale, self._key, self._gzip)

    def digest(self, name: str) -> str | None:
        """sha256 of chunk file `name` (`chunk_names`), None when it is missing."""
        try:
            return hashlib.sha256((self._layer / name).read_bytes()).hexdigest()
        except FileNotFoundError:
            return None
