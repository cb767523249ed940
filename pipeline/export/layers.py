"""Export an EM volume and its segmentation as Neuroglancer precomputed layers, with meshes and
skeletons.

The export folder (one atomic unit: built beside its destination, then renamed into place):

    image/                 raw EM, uint8, "raw" encoding, `num_scales` scales
    segmentation/          uint64, "compressed_segmentation" encoding (decoded by Neuroglancer)
        mesh/              meshes in nm: sharded multi-resolution (Draco) meshes by default,
                           else legacy meshes (a manifest `<id>:0` per segment, its fragments)
        skeletons/         skeletons in nm (`ExportConfig.skeletons`): sharded as the layers,
                           else a file per segment
        segment_properties/  every segment id with its voxel count (Neuroglancer lists and sorts them)
    records/               each task's record: the files it wrote, with size and mtime
    export.json            the summary, written last: how many records of each kind there are

Every scale of both layers is sharded (`neuroglancer_uint64_sharded_v1`, `pipeline.export.shards`:
one shard per task region at every scale) unless `ExportConfig.sharded` is off, when a file
holds a chunk. The segmentation's full resolution is the stitching's output itself
(pipeline.export.segmentation_layer): `new_segmentation` makes the layer, the stitching's relabel
tasks write their regions into it (`SegmentationWriter`: a shard each, or whole chunks) and
evaluation reads it there. The export
is then cut into tasks that the workflow spreads over its workers (apps/export.py), each holding
no more than a region of `task_voxels` per axis: `begin_export` writes both layers' `info` with
every scale and the mesh `info` (once: later tasks only read the files they share);
`region_step`, one per region of `export_regions`, writes the image at every scale and the
segmentation's coarser scales (`write_region`), downsampling them itself with tinybrain (what
igneous's downsampling tasks call), so no task reads what another export task wrote, and
sharded, meshes the region (its fragments, which `plan_meshes` then assigns to mesh shards and
`merge_part` tasks merge, pipeline.export.meshes); unsharded, `mesh_part`, one per igneous
meshing task, meshes the finished segmentation (legacy fragments); with skeletons,
`skeleton_part`, one per region, skeletonizes the region of the full resolution, then
`plan_skeletons` and `merge_skeleton_part` tasks make the skeleton shards
(pipeline.export.skeletons);
`finish_export` repairs what was lost since, adds legacy meshes' manifests, the segment
properties (from the regions' counts) and, last, the summary. The export is complete when every
record the summary counts is there and every file each lists is as recorded
(`export_complete`): no list of every file, no walk of the folder. `export_precomputed` runs the
same steps in turn on arrays in memory (the CLI, tests).

Axes: this project is (z, y, x) everywhere; cloud-volume and the precomputed format are (x, y, z).
Sizes are reversed only by `xyz`, arrays transposed (a view, no copy) only where they are written.

CLI: `python -m pipeline.cli.export --raw vol.h5:raw --segmentation seg.h5:segmentation --out DIR`.
"""

import contextlib
import itertools
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import fastremap
import numpy as np
import tinybrain
from tqdm import tqdm

from pipeline.core.atomic import atomic_dir, atomic_path
from pipeline.core.errors import (
    EmptyLabelsError,
    PrecomputedError,
    VolumeDtypeError,
    VolumeShapeError,
    VoxelSizeError,
)
from pipeline.core.memory import release_memory
from pipeline.core.roi import Roi, tiles
from pipeline.core.stamps import STAMPED_INSIDE_SUFFIX, kept_stamp
from pipeline.data.volumes import ZYX, VoxelSize
from pipeline.export.folder_layout import (
    IMAGE_LAYER,
    MESH_DIR,
    PROPERTIES_DIR,
    SEGMENTATION_LAYER,
    SKELETON_DIR,
    ExportConfig,
    Scale,
    file_record,
    layer_scales,
    layer_url,
    read_info,
    xyz,
)
from pipeline.export.fragment_shards import FRAGMENTS_SUFFIX, PLAN
from pipeline.export.meshes import (
    begin_legacy_meshing,
    begin_sharded_meshing,
    fragment_part,
    merge_part,
    mesh_part,
    mesh_shard_plan,
    mesh_task_count,
    write_mesh_manifests,
)
from pipeline.export.segmentation_layer import (
    MANIFEST,
    RECORDS_DIR,
    SegmentationLayout,
    SegmentationWriter,
    add_scales,
    check_replaceable,
    chunk_files,
    info_resolution,
    layer_info,
    new_segmentation,
    scale_factors,
    stitched_files,
    write_shard,
)
from pipeline.export.shards import ShardPlan, plan_shards
from pipeline.export.skeletons import (
    drop_skeletons,
    merge_skeleton_part,
    skeleton_dir,
    skeleton_part,
    skeleton_shard_plan,
)

# 1: it listed every file; 2: it counts the tasks' records; 3: records hold their stamps
# (`*.record`, JSON). A format 2 export is not complete: made again.
MANIFEST_FORMAT = 3
# Regions whose segments a mesh shard holds, about (murmurhash spreads them): its merge holds the
# shard's encoded meshes (and one segment's fragments), so a shard of about as many segments as
# a small export's one keeps that memory flat from 256^3 up.
REGIONS_PER_MESH_SHARD = 2
# The same for skeletons, a region's segments a shard, so that a merge holds what a 256^3
# export's one does: with 8 regions a shard (files as large as the meshes' and four times fewer)
# its memory rose 1.11x from 256^3 to 1024^3 (BENCHMARKS.md, "Skeleton tasks from 256³ to 1024³").
REGIONS_PER_SKELETON_SHARD = 1
# Shards a merge task makes, one after the other: fewer tasks (and records) than shards.
SHARDS_PER_MERGE = 4
# The export's tasks, in order; a record each (`task_record_path`). "plan" and "merge" are the
# sharded meshes' (pipeline.export.meshes), "skeleton*" the skeletons' (pipeline.export.skeletons).
TASK_KINDS = (
    "region", "mesh", "plan", "merge", "skeleton", "skeleton_plan", "skeleton_merge", "finish",
)  # fmt: skip
# What `begin_export` writes: the layers' and the meshes' info.
BEGUN_FILES = (
    f"{IMAGE_LAYER}/info",
    f"{SEGMENTATION_LAYER}/info",
    f"{SEGMENTATION_LAYER}/{MESH_DIR}/info",
)
# Files without which Neuroglancer cannot open the layers or find their meshes.
REQUIRED_FILES = (*BEGUN_FILES, f"{SEGMENTATION_LAYER}/{PROPERTIES_DIR}/info")


@dataclass(frozen=True)
class ExportResult:
    """What `export_precomputed` wrote: its folder, scales, segments and files (besides its
    record `export.json`), and how long it took."""

    path: Path
    scales: tuple[Scale, ...]
    segment_count: int
    file_count: int
    seconds: float


def _downsample_factor(voxel_size_nm: VoxelSize) -> ZYX:
    """Halve every axis finer than twice the finest one.

    Isotropic voxels give (2, 2, 2); 2:1 serial-section voxels give (1, 2, 2) (z, y, x) until x
    and y catch up with z, then (2, 2, 2): voxels never get more anisotropic than they were.
    """
    finest = min(voxel_size_nm)
    return tuple(2 if size < 2 * finest else 1 for size in voxel_size_nm)


def _chunk_zyx(voxel_size_nm: VoxelSize, chunk_voxels: int) -> ZYX:
    """`chunk_voxels` along the finest axis, a power-of-two fraction of it along coarser ones."""
    finest = min(voxel_size_nm)
    return tuple(max(1, chunk_voxels >> round(math.log2(size / finest))) for size in voxel_size_nm)


def plan_scales(shape_zyx: ZYX, voxel_size_nm: VoxelSize, config: ExportConfig) -> list[Scale]:
    """The export's scales, full resolution first.

    Fewer than `config.num_scales` when an axis to halve is down to one voxel: nothing to gain.
    """
    scales = [Scale(voxel_size_nm, shape_zyx, _chunk_zyx(voxel_size_nm, config.chunk_voxels))]
    while len(scales) < config.num_scales:
        last = scales[-1]
        factor = _downsample_factor(last.voxel_size_nm)
        if any(n < 2 for n, f in zip(last.shape_zyx, factor, strict=True) if f > 1):
            break
        size = tuple(s * f for s, f in zip(last.voxel_size_nm, factor, strict=True))
        shape = tuple(-(-n // f) for n, f in zip(last.shape_zyx, factor, strict=True))
        scales.append(Scale(size, shape, _chunk_zyx(size, config.chunk_voxels)))
    return scales


def shard_plan(shape_zyx: ZYX, voxel_size_nm: VoxelSize, config: ExportConfig) -> ShardPlan:
    """The export's shards: one region a task, a shard at every scale of both layers."""
    scales = plan_scales(shape_zyx, voxel_size_nm, config)
    return plan_shards(
        [s.shape_zyx for s in scales],
        [s.chunk_zyx for s in scales],
        scale_factors(scales),
        config.task_voxels,
    )


def segmentation_layout(
    shape_zyx: ZYX, voxel_size_nm: VoxelSize, config: ExportConfig, stitch_chunk_zyx: ZYX
) -> SegmentationLayout:
    """The segmentation's full resolution: sharded, the image's chunks and shards (its writers
    then write regions of the shard plan); unsharded, the stitching's chunks
    (`[blocks] chunk_zyx`), on which the block cores are split."""
    if not config.sharded:
        return SegmentationLayout(tuple(stitch_chunk_zyx), config.gzip)
    plan = shard_plan(shape_zyx, voxel_size_nm, config)
    chunk = plan_scales(shape_zyx, voxel_size_nm, config)[0].chunk_zyx
    return SegmentationLayout(chunk, config.gzip, plan.specs[0], plan.region_zyx)


def segmentation_spec(folder: str | Path) -> str:
    """The volume spec (`pipeline.data.volumes`) of the segmentation layer in an export folder: its
    full resolution, read in place."""
    return f"precomputed://file://{(Path(folder) / SEGMENTATION_LAYER).resolve()}"


def _check_inputs(
    raw: np.ndarray, segmentation: np.ndarray, voxel_size_nm: Sequence[float]
) -> tuple[np.ndarray, VoxelSize]:
    """Validate the pair; returns the segmentation as uint64 and the voxel size as floats."""
    if raw.ndim != 3:
        raise VolumeShapeError(f"export: raw must be a 3-D (z, y, x) array, got shape {raw.shape}")
    if segmentation.shape != raw.shape:
        raise VolumeShapeError(
            f"export: segmentation shape {segmentation.shape} differs from raw shape {raw.shape}"
        )
    if raw.dtype != np.uint8:
        raise VolumeDtypeError(f"export: raw must be uint8, got {raw.dtype}")
    if segmentation.dtype.kind != "u":
        raise VolumeDtypeError(
            f"export: segmentation must be an unsigned integer type (uint64), got {segmentation.dtype}"
        )
    try:
        size = tuple(float(s) for s in np.ravel(voxel_size_nm))
    except (TypeError, ValueError):
        size = ()
    if len(size) != 3 or not all(0 < s < math.inf for s in size):
        raise VoxelSizeError(
            f"export: voxel size must be 3 positive numbers (z, y, x) in nm, got {voxel_size_nm!r}"
        )
    # Nothing to mesh or show: the stage before failed, and a "successful" export would hide it.
    if not segmentation.any():
        raise EmptyLabelsError("export: segmentation is all zero (no segment to show or mesh)")
    return segmentation.astype(np.uint64, copy=False), size


def export_regions(
    shape_zyx: ZYX,
    voxel_size_nm: VoxelSize,
    config: ExportConfig,
    segmentation_chunk_zyx: ZYX | None = None,
) -> list[Roi]:
    """The regions that export tasks write, one each, at every scale. Sharded, the shard plan's:
    a shard at every scale of both layers. Unsharded, about `task_voxels` along each axis,
    rounded up to whole chunks of every scale of both layers (the segmentation's chunk:
    `segmentation_chunk_zyx`, else the image's). Either way a region's downsamplings are its own
    (tinybrain reduces whole 2 x 2 x 2 blocks) and no two tasks share a file."""
    if config.sharded:
        return shard_plan(shape_zyx, voxel_size_nm, config).regions(shape_zyx)
    scales = plan_scales(shape_zyx, voxel_size_nm, config)
    if segmentation_chunk_zyx is not None:
        full = Scale(scales[0].voxel_size_nm, shape_zyx, tuple(segmentation_chunk_zyx))
        scales += _segmentation_scales(scales, full)
    factors = scale_factors(scales)
    align = [
        math.lcm(*(s.chunk_zyx[a] * f[a] for s, f in zip(scales, factors, strict=True)))
        for a in range(3)
    ]
    return tiles(Roi.whole(shape_zyx), [-(-config.task_voxels // a) * a for a in align])


def export_tasks(
    shape_zyx: ZYX,
    voxel_size_nm: VoxelSize,
    config: ExportConfig,
    segmentation_chunk_zyx: ZYX | None = None,
) -> dict[str, int]:
    """How many tasks of each kind (`TASK_KINDS`, but the last) write the export: a region task
    per region (`export_regions`); sharded, the region tasks mesh their regions too, then one
    plan task and a merge task per `SHARDS_PER_MERGE` mesh shards (`mesh_shards`);
    unsharded, a meshing task per igneous meshing region. With skeletons, a skeleton task per
    region, one plan task and a merge task per `SHARDS_PER_MERGE` skeleton shards
    (`skeleton_shards`)."""
    regions = len(export_regions(shape_zyx, voxel_size_nm, config, segmentation_chunk_zyx))
    if config.sharded:
        meshes = {"mesh": 0, "plan": 1, "merge": -(-mesh_shards(regions) // SHARDS_PER_MERGE)}
    else:
        meshes = {"mesh": mesh_task_count(shape_zyx, config), "plan": 0, "merge": 0}
    merges = -(-skeleton_shards(regions) // SHARDS_PER_MERGE)
    skeletons = {"skeleton": regions, "skeleton_plan": 1, "skeleton_merge": merges}
    return {
        "region": regions,
        **meshes,
        **(skeletons if config.skeletons else dict.fromkeys(skeletons, 0)),
    }


def mesh_shards(regions: int) -> int:
    """About how many mesh shards an export of `regions` regions asks for (`hashed_sharding`)."""
    return -(-regions // REGIONS_PER_MESH_SHARD)


def skeleton_shards(regions: int) -> int:
    """About how many skeleton shards an export of `regions` regions asks for."""
    return -(-regions // REGIONS_PER_SKELETON_SHARD)


def full_resolution_key(voxel_size_nm: VoxelSize) -> str:
    """The folder of a layer's full-resolution chunks (cloud-volume's naming of a scale)."""
    return "_".join(map(str, info_resolution(voxel_size_nm)))


def _segmentation_scales(scales: Sequence[Scale], full: Scale) -> list[Scale]:
    """The segmentation layer's scales: the image's sizes, its own chunk at every one (the chunk
    its full resolution was written with)."""
    return [Scale(s.voxel_size_nm, s.shape_zyx, full.chunk_zyx) for s in scales]


def begin_export(
    folder: str | Path,
    shape_zyx: ZYX,
    voxel_size_nm: VoxelSize,
    config: ExportConfig,
    keep_records: bool = False,
) -> list[Scale]:
    """Over the full-resolution segmentation in `folder` (`new_segmentation`, written): empty
    everything else the export writes (the tasks' records too, unless `keep_records`: a repair
    rewrites each, keeping the workflow's stamp in it) and write both layers' `info` with every
    scale, what the region tasks write into. The record `export.json` goes first, so a folder
    being rewritten is never taken for a finished export."""
    folder = Path(folder)
    check_replaceable(folder)
    (folder / MANIFEST).unlink(missing_ok=True)
    info = read_info(folder, SEGMENTATION_LAYER)
    scales = plan_scales(shape_zyx, voxel_size_nm, config)
    full = layer_scales(info)[0]
    if (full.shape_zyx, full.voxel_size_nm) != (scales[0].shape_zyx, scales[0].voxel_size_nm):
        raise PrecomputedError(
            f"{folder / SEGMENTATION_LAYER}: its shape {full.shape_zyx} and voxel size "
            f"{full.voxel_size_nm} are not the exported volume's {shape_zyx}, {voxel_size_nm}"
        )
    shardings = shard_plan(shape_zyx, voxel_size_nm, config).specs if config.sharded else ()
    sharded_as_planned = info["scales"][0].get("sharding") == (shardings[0] if shardings else None)
    if not sharded_as_planned or (shardings and full.chunk_zyx != scales[0].chunk_zyx):
        raise PrecomputedError(
            f"{folder / SEGMENTATION_LAYER}: its full resolution is not stored as the export's "
            f"settings say (sharded = {config.sharded}, chunk_voxels = {config.chunk_voxels}, "
            f"task_voxels = {config.task_voxels}): stitch it again with these settings"
        )
    shutil.rmtree(folder / IMAGE_LAYER, ignore_errors=True)
    # The begin task's own record stays.
    for kind in TASK_KINDS if not keep_records else ():
        for record in (folder / RECORDS_DIR).glob(f"{kind}_*"):
            record.unlink()
    # The segmentation's full resolution is the stitching's; everything after it the export's.
    for name in [MESH_DIR, SKELETON_DIR, PROPERTIES_DIR, *(s["key"] for s in info["scales"][1:])]:
        shutil.rmtree(folder / SEGMENTATION_LAYER / name, ignore_errors=True)
    image = layer_info(IMAGE_LAYER, scales[0])
    add_scales(folder, IMAGE_LAYER, image, scales, shardings)
    info["scales"] = info["scales"][:1]
    # Named now: meshing and the properties then only add files. The skeletons' plan names
    # them once they are made (`skeleton_shard_plan`).
    info["mesh"], info["segment_properties"] = MESH_DIR, PROPERTIES_DIR
    info.pop("skeletons", None)
    # Sharded, the segmentation's chunks are the image's (a shard's region is the same).
    segmentation = scales if shardings else _segmentation_scales(scales, full)
    add_scales(folder, SEGMENTATION_LAYER, info, segmentation, shardings)
    (begin_sharded_meshing if config.sharded else begin_legacy_meshing)(folder, config)
    return scales


def write_region(
    folder: str | Path,
    region: Roi,
    raw: np.ndarray,
    segmentation: np.ndarray,
    config: ExportConfig,
) -> dict:
    """Write `region` (its voxels: `raw` uint8, `segmentation` uint64) into an export
    `begin_export` made: the image at every scale, the segmentation at every scale but its full
    resolution (the stitching's, which `segmentation` is read from). Returns what a region task
    records: the segment ids in it with their voxel counts, and every file it wrote, and the
    segmentation's full-resolution files it read, with size and mtime (`file_record`): the
    export is complete only while they are as they were."""
    from cloudvolume import CloudVolume

    folder = Path(folder)
    compress = "gzip" if config.gzip else False
    files: dict[str, list[int]] = {}
    for layer, array in ((IMAGE_LAYER, raw), (SEGMENTATION_LAYER, segmentation)):
        url = layer_url(folder, layer)
        volume = CloudVolume(url, progress=False)
        scales = layer_scales(volume.info)
        downsample = (
            tinybrain.downsample_segmentation
            if layer == SEGMENTATION_LAYER
            else tinybrain.downsample_with_averaging
        )
        # (z, y, x) in C order is (x, y, z) in Fortran order: a view, no copy.
        data, factors = array.T, scale_factors(scales)
        for mip, (scale, factor) in enumerate(zip(scales, factors, strict=True)):
            if mip:
                step = [a // b for a, b in zip(factor, factors[mip - 1], strict=True)]
                data = downsample(data, xyz(step))[0]
            box = region.scaled_down(factor, scale.shape_zyx)
            key = volume.info["scales"][mip]["key"]
            if layer == SEGMENTATION_LAYER and not mip:
                names = stitched_files(volume, box, scale, key, config.gzip)
            elif "sharding" in volume.info["scales"][mip]:
                names = [write_shard(folder / layer, mip, box, data)]
            else:
                cutout = tuple(
                    slice(a, b) for a, b in zip(xyz(box.start), xyz(box.stop), strict=True)
                )
                CloudVolume(url, mip=mip, compress=compress, progress=False)[cutout] = data
                names = chunk_files(box, scale, key, config.gzip)
            for name in names:
                files[f"{layer}/{name}"] = file_record(folder / layer / name)
    ids, counts = fastremap.unique(segmentation, return_counts=True)
    keep = ids != 0
    return {"ids": ids[keep], "counts": counts[keep], "files": files}


def damaged(folder: str | Path, files: dict[str, list[int]]) -> bool:
    """Whether any of `files` (a task's record: name relative to `folder`, `file_record`) is
    missing or not as recorded."""
    folder = Path(folder)
    try:
        # os.path, not pathlib: pathlib interns every name it parses.
        return any(file_record(os.path.join(folder, n)) != r for n, r in files.items())
    except OSError:
        return True


# Each task's record, in the export's own folder (`RECORDS_DIR`): a JSON object, the files it
# wrote ("files": with size and mtime, `file_record`); a region's also its segments' voxel
# counts. The export is complete when every task's record is there and each file is as recorded
# (`export_complete`): no list of every file, no walk of the folder. Named `*.record`, a record
# holds its task's stamp in a workflow run (pipeline.core.stamps, its "stamp" key): no stamp file
# beside it.
def task_record_path(folder: str | Path, kind: str, index: int) -> Path:
    """The record of task `index` of `kind` (one of `TASK_KINDS`)."""
    if kind not in TASK_KINDS:
        raise ValueError(f"task kind {kind!r} is not one of {TASK_KINDS}")
    return Path(folder) / RECORDS_DIR / f"{kind}_{index}{STAMPED_INSIDE_SUFFIX}"


def _save_record(path: str | Path, record: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(record))


def save_region_record(path: str | Path, region: Roi, record: dict) -> None:
    """A region task's record (`write_region`'s result), atomically."""
    ids, counts = np.asarray(record["ids"]), np.asarray(record["counts"])
    _save_record(
        path,
        {
            "region": str(region),
            "ids": ids.tolist(),
            "counts": counts.tolist(),
            "files": record["files"],
        },
    )


def load_region_record(path: str | Path) -> dict:
    record = json.loads(Path(path).read_text())
    return {
        "region": Roi.parse(record["region"]),
        "ids": np.array(record["ids"], np.uint64),
        "counts": np.array(record["counts"], np.int64),
        "files": record["files"],
    }


def _resave(save: Callable[..., None], path: Path, *record: object) -> None:
    """A repaired task's record saved again (`save(path, *record)`), its stamp (a workflow's)
    kept: the task stays up to date, having been put back as it was."""
    with kept_stamp(path):
        save(path, *record)


def save_files_record(path: str | Path, files: dict[str, list[int]]) -> None:
    """A task's record of the files it wrote (`file_record` each), atomically."""
    _save_record(path, {"files": files})


def recorded_files(path: str | Path) -> dict[str, list[int]]:
    """The files a task's record lists (`file_record` each)."""
    return json.loads(Path(path).read_text())["files"]


def region_step(
    folder: Path,
    index: int,
    region: Roi,
    read_region: Callable[[Roi], tuple[np.ndarray, np.ndarray]],
    config: ExportConfig,
) -> dict:
    """Region task `index`: `write_region` with the region's voxels (`read_region(region)` ->
    raw, segmentation), then for sharded meshes its meshes' fragments (`fragment_part`, once
    its voxels are let go and their memory handed back: the task holds one or the other).
    Returns its record."""
    record = write_region(folder, region, *read_region(region), config)
    if config.sharded:
        release_memory()
        record["files"] |= fragment_part(folder, config, index, region)
    return record


def _fragments(folder: Path, tasks: Iterable[dict[str, list[int]]]) -> dict[int, Path]:
    """{task index: its `.frags` file} of the tasks that wrote one (`tasks`: each one's files,
    in task order)."""
    return {
        k: folder / name
        for k, files in enumerate(tasks)
        for name in files
        if name.endswith(FRAGMENTS_SUFFIX)
    }


def _planned(folder: Path, where: Path) -> dict[str, list[int]]:
    """What a plan task wrote in `where` (the mesh or skeleton folder): its info and the plan."""
    return {
        p.relative_to(folder).as_posix(): file_record(p) for p in (where / "info", where / PLAN)
    }


def plan_meshes(
    folder: str | Path, regions: Iterable[dict[str, list[int]]], shards: int
) -> dict[str, list[int]]:
    """Sharded meshes' plan (`mesh_shard_plan`: about `shards` shards) from what every region
    task wrote (`regions`: each one's files, in task order, its `.frags` among them if any);
    returns the files it wrote."""
    folder = Path(folder)
    mesh_shard_plan(folder, _fragments(folder, regions), shards)
    return _planned(folder, folder / SEGMENTATION_LAYER / MESH_DIR)


def plan_skeletons(
    folder: str | Path, skeletons: Iterable[dict[str, list[int]]], shards: int, sharded: bool
) -> dict[str, list[int]]:
    """The skeletons' plan (`skeleton_shard_plan`: about `shards` shards, `sharded` or a file
    per segment) from what every skeleton task wrote (`skeletons`: each one's files, in task
    order); returns the files it wrote."""
    folder = Path(folder)
    skeleton_shard_plan(folder, _fragments(folder, skeletons), shards, sharded)
    return _planned(folder, skeleton_dir(folder))


def repair_export(
    folder: str | Path,
    tasks: dict[str, int],
    read_region: Callable[[Roi], tuple[np.ndarray, np.ndarray]],
    shape_zyx: ZYX,
    voxel_size_nm: VoxelSize,
    config: ExportConfig,
) -> tuple[list[str], list[dict]]:
    """Rewrite what changed after its task wrote it (a lost or truncated file; the whole folder),
    and its task's record: the damaged regions from `read_region(roi) -> (raw, segmentation)`,
    then, when a region was rewritten or a fragment is damaged, the meshing tasks, and for
    sharded meshes their plan and merges; the skeleton tasks whose pieces are damaged or that
    read a region rewritten, and then their plan and merges. `tasks`: how many of each kind
    (`TASK_KINDS`); the records are read once, a record at a time: a task's list of files is
    not kept. Returns what was repaired and every region's segment counts (ids, counts), for
    `finish_export`."""
    folder = Path(folder)
    (folder / MANIFEST).unlink(missing_ok=True)  # not complete while parts are rewritten
    repaired, counts = [], []
    layers = [folder / name for name in BEGUN_FILES]
    regions = None
    if not all(info.is_file() for info in layers):  # begun again: every task's record rewritten
        chunk = layer_scales(read_info(folder, SEGMENTATION_LAYER))[0].chunk_zyx
        regions = export_regions(shape_zyx, voxel_size_nm, config, chunk)
        begin_export(folder, shape_zyx, voxel_size_nm, config, keep_records=True)
        repaired.append("layers")
    placed, rewritten = [], set()  # every region, in task order; the starts of those rewritten
    for k in range(tasks.get("region", 0)):
        path = task_record_path(folder, "region", k)
        record = None if regions else load_region_record(path)
        region = regions[k] if regions else record["region"]
        if record is None or damaged(folder, record["files"]):
            record = region_step(folder, k, region, read_region, config)
            _resave(save_region_record, path, region, record)
            repaired.append(f"region {region}")
            rewritten.add(region.start)
        counts.append({"ids": record["ids"], "counts": record["counts"]})
        placed.append(region)
    for j in range(tasks.get("mesh", 0)):
        path = task_record_path(folder, "mesh", j)
        if repaired or damaged(folder, recorded_files(path)):
            _resave(save_files_record, path, mesh_part(folder, config, j))
            repaired.append(f"mesh {j}")
    if tasks.get("plan"):
        path = task_record_path(folder, "plan", 0)
        replan = bool(repaired) or damaged(folder, recorded_files(path))
        if replan:  # every shard is merged again: the plan's shards go
            written = (
                recorded_files(task_record_path(folder, "region", k))
                for k in range(tasks["region"])
            )
            planned = plan_meshes(folder, written, mesh_shards(tasks["region"]))
            _resave(save_files_record, path, planned)
            repaired.append("mesh plan")
        for j in range(tasks.get("merge", 0)):
            path = task_record_path(folder, "merge", j)
            if replan or damaged(folder, recorded_files(path)):
                _resave(save_files_record, path, merge_part(folder, config, j, tasks["merge"]))
                repaired.append(f"mesh merge {j}")
    _repair_skeletons(folder, tasks, placed, rewritten, config, repaired)
    return repaired, counts


def _repair_skeletons(
    folder: Path,
    tasks: dict[str, int],
    regions: Sequence[Roi],
    rewritten: set[ZYX],
    config: ExportConfig,
    repaired: list[str],
) -> None:
    """`repair_export`'s part for the skeletons (`regions`: every region; `rewritten`: the
    starts of those it wrote again), what it rewrites added to `repaired`: the skeleton tasks
    whose pieces are damaged or that read a region rewritten (the tiling's regions abut, so
    those a task reads past its high faces start at its own start or stop along each axis),
    then, if any was or the plan is damaged, the plan and every merge, else the damaged
    merges."""
    before = len(repaired)
    for k in range(tasks.get("skeleton", 0)):
        path, region = task_record_path(folder, "skeleton", k), regions[k]
        read = itertools.product(*zip(region.start, region.stop, strict=True))
        if not rewritten.isdisjoint(read) or damaged(folder, recorded_files(path)):
            _resave(save_files_record, path, skeleton_part(folder, k, region))
            repaired.append(f"skeleton {k}")
    if not tasks.get("skeleton_plan"):
        return
    path = task_record_path(folder, "skeleton_plan", 0)
    replan = len(repaired) > before or damaged(folder, recorded_files(path))
    if replan:  # every shard is merged again: the plan's shards go
        written = (
            recorded_files(task_record_path(folder, "skeleton", k))
            for k in range(tasks["skeleton"])
        )
        shards = skeleton_shards(tasks["skeleton"])
        _resave(save_files_record, path, plan_skeletons(folder, written, shards, config.sharded))
        repaired.append("skeleton plan")
    merges = tasks.get("skeleton_merge", 0)
    for j in range(merges):
        path = task_record_path(folder, "skeleton_merge", j)
        if replan or damaged(folder, recorded_files(path)):
            _resave(save_files_record, path, merge_skeleton_part(folder, j, merges))
            repaired.append(f"skeleton merge {j}")


def finish_export(
    folder: str | Path,
    regions: Sequence[dict],
    shape_zyx: ZYX,
    voxel_size_nm: VoxelSize,
    config: ExportConfig,
    tasks: dict[str, int],
    repaired: Sequence[str] = (),
) -> tuple[int, int]:
    """After every region, meshing and skeleton task: for legacy meshes the manifests
    Neuroglancer looks up, without skeletons none named (`drop_skeletons`), the segment
    properties from the regions' counts (`regions`: each one's `ids` and
    `counts`, as its record has them), this task's own record, then the summary `export.json`
    (how many records of each kind `tasks` says there are, what `repaired` says was rewritten),
    last. Returns (segments, files recorded)."""
    folder = Path(folder)
    (folder / MANIFEST).unlink(missing_ok=True)  # not complete again until written last
    mesh = folder / SEGMENTATION_LAYER / MESH_DIR
    manifests = [] if config.sharded else write_mesh_manifests(mesh)
    if not config.skeletons:  # made before they were turned off, or none: the info names none
        drop_skeletons(folder)
    ids = np.concatenate([r["ids"] for r in regions]) if regions else np.zeros(0, np.uint64)
    counts = np.concatenate([r["counts"] for r in regions]) if regions else np.zeros(0, np.int64)
    if not ids.size:
        # Nothing to show: the stage before failed, and a "successful" export would hide it.
        raise EmptyLabelsError("export: segmentation is all zero (no segment to show or mesh)")
    unique, where = np.unique(ids, return_inverse=True)
    _write_segment_properties(folder, unique, np.bincount(where, weights=counts).astype(np.int64))
    own = [*(folder / name for name in REQUIRED_FILES), *manifests]
    files = {path.relative_to(folder).as_posix(): file_record(path) for path in own}
    save_files_record(task_record_path(folder, "finish", 0), files)
    tasks = {**tasks, "finish": 1}
    scales = plan_scales(shape_zyx, voxel_size_nm, config)
    summary = {
        "format": MANIFEST_FORMAT,
        "shape_zyx": list(shape_zyx),
        "voxel_size_nm": list(voxel_size_nm),
        "scales_nm": [list(s.voxel_size_nm) for s in scales],
        "sharded": config.sharded,
        "segment_count": int(unique.size),
        "records": tasks,
        "repaired": list(repaired),
        "destination": config.destination,  # where `view` finds it (pipeline.export.destination)
    }
    with atomic_path(folder / MANIFEST) as tmp:
        tmp.write_text(json.dumps(summary, indent=1) + "\n")
    recorded = set().union(*(recorded_files(p) for p in _record_paths(folder, tasks)))
    return int(unique.size), len(recorded)


def _write_segment_properties(folder: Path, ids: np.ndarray, counts: np.ndarray) -> None:
    """Record every segment's voxel count (the segmentation's `info` names the folder)."""
    properties = {
        "@type": "neuroglancer_segment_properties",
        "inline": {
            "ids": [str(i) for i in ids],
            "properties": [
                {
                    "id": "voxels",
                    "type": "number",
                    "description": "size in voxels at full resolution",
                    # Neuroglancer's widest integer type is uint32.
                    "data_type": "uint32" if counts.max() < 2**32 else "float32",
                    "values": counts.tolist(),
                }
            ],
        },
    }
    properties_dir = folder / SEGMENTATION_LAYER / PROPERTIES_DIR
    properties_dir.mkdir(exist_ok=True)
    with atomic_path(properties_dir / "info") as tmp:
        tmp.write_text(json.dumps(properties))


@contextlib.contextmanager
def _naming(folder: Path) -> Iterator[None]:
    """An OS error that names no file (a full disk, seen by a library's write) names `folder`, so
    its one line says which disk."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror, str(folder)) from exc


def export_precomputed(
    raw: np.ndarray,
    segmentation: np.ndarray,
    voxel_size_nm: Sequence[float],
    out_dir: str | Path,
    config: ExportConfig = ExportConfig(),
    progress: bool = False,
) -> ExportResult:
    """Write `raw` (uint8) and `segmentation` (unsigned ints, 0 = background), both (z, y, x), as
    precomputed layers `image` and `segmentation` with meshes and skeletons under `out_dir`,
    atomically: the workflow's export tasks (`begin_export`, `write_region`, the meshing's, the
    skeletons', `finish_export`) run here one after the other, on arrays in memory. Publishing
    it to `config.destination` is the caller's (pipeline.export.destination.publish).

    An existing export at `out_dir` is replaced; any other non-empty folder there is an error.
    """
    started = time.perf_counter()
    segmentation, voxel_size = _check_inputs(raw, segmentation, voxel_size_nm)
    out_dir = Path(out_dir)
    check_replaceable(out_dir)
    shape = tuple(raw.shape)
    regions = export_regions(shape, voxel_size, config)
    tasks = export_tasks(shape, voxel_size, config)
    with (
        _naming(out_dir),
        atomic_dir(out_dir) as tmp,
        tqdm(
            total=sum(tasks.values()) + 1, desc="export", unit="task", disable=not progress
        ) as bar,
    ):
        chunk = plan_scales(shape, voxel_size, config)[0].chunk_zyx
        new_segmentation(
            tmp, shape, voxel_size, segmentation_layout(shape, voxel_size, config, chunk)
        )
        writer = SegmentationWriter(tmp, config.gzip)
        for region in regions:  # the stitching's part: a region, a shard, at a time
            writer.write(region.slices, segmentation[region.slices])
        scales = begin_export(tmp, shape, voxel_size, config)
        records = []
        for k, region in enumerate(regions):
            record = region_step(
                tmp, k, region, lambda r: (raw[r.slices], segmentation[r.slices]), config
            )
            save_region_record(task_record_path(tmp, "region", k), region, record)
            records.append(record)
            bar.update()
        for j in range(tasks["mesh"]):
            save_files_record(task_record_path(tmp, "mesh", j), mesh_part(tmp, config, j))
            bar.update()
        if tasks["plan"]:
            written = (r["files"] for r in records)
            planned = plan_meshes(tmp, written, mesh_shards(tasks["region"]))
            save_files_record(task_record_path(tmp, "plan", 0), planned)
            bar.update()
        for j in range(tasks["merge"]):
            merged = merge_part(tmp, config, j, tasks["merge"])
            save_files_record(task_record_path(tmp, "merge", j), merged)
            bar.update()
        skeletons = []
        for k in range(tasks["skeleton"]):
            skeletons.append(skeleton_part(tmp, k, regions[k]))
            save_files_record(task_record_path(tmp, "skeleton", k), skeletons[-1])
            bar.update()
        if tasks["skeleton_plan"]:
            shards = skeleton_shards(tasks["skeleton"])
            planned = plan_skeletons(tmp, skeletons, shards, config.sharded)
            save_files_record(task_record_path(tmp, "skeleton_plan", 0), planned)
            bar.update()
        for j in range(tasks["skeleton_merge"]):
            merged = merge_skeleton_part(tmp, j, tasks["skeleton_merge"])
            save_files_record(task_record_path(tmp, "skeleton_merge", j), merged)
            bar.update()
        segment_count, file_count = finish_export(tmp, records, shape, voxel_size, config, tasks)
        bar.update()
    return ExportResult(
        out_dir, tuple(scales), segment_count, file_count, time.perf_counter() - started
    )


def _record_paths(folder: Path, tasks: dict[str, int]) -> Iterator[Path]:
    for kind, count in tasks.items():
        for index in range(count):
            yield task_record_path(folder, kind, index)


def export_complete(folder: str | Path) -> bool:
    """True when `folder` holds a finished export: its summary `export.json` is there, and every
    task's record it counts, each written before it (not rewritten since), each file they list
    there with the size and mtime it had when its task wrote it (a later mtime is a file
    rewritten in place since, its size kept: a chunk partly zeroed). No other file is looked at:
    the records name them all. A copy that keeps mtimes (`cp -a`) stays complete; a rewrite
    that puts the mtime back (`os.utime`) is not seen, as no content is read. An export of the
    earlier format (`export.json` listing every file) is checked as it was."""
    folder = Path(folder)
    try:
        written = os.stat(folder / MANIFEST).st_mtime_ns
        summary = json.loads((folder / MANIFEST).read_text())
        if summary.get("format") == 1:
            return _complete_as_listed(folder, written)
        if summary.get("format") != MANIFEST_FORMAT:
            return False
        for path in _record_paths(folder, summary["records"]):
            if os.stat(path).st_mtime_ns > written or damaged(folder, recorded_files(path)):
                return False
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return False
    return all((folder / name).is_file() for name in REQUIRED_FILES)


_FILES_LINE = ' "files": {\n'  # format 1: the line before its list of files, one a line


def _complete_as_listed(folder: Path, written: int) -> bool:
    """An export of format 1: every file its `export.json` lists there with its size, not
    modified after it; the list read a line at a time, not held."""
    missing = set(REQUIRED_FILES)
    for name, size in _listed_files(folder / MANIFEST):
        # os.path, not pathlib: pathlib interns every name it parses.
        stat = os.stat(os.path.join(folder, name))
        if stat.st_size != size or stat.st_mtime_ns > written:
            return False
        missing.discard(name)
    return not missing


def _listed_files(record: Path) -> Iterator[tuple[str, int]]:
    """(name, size) of every file a format 1 `export.json` lists; ValueError if cut short."""
    with open(record) as lines:
        for line in itertools.dropwhile(lambda line: line != _FILES_LINE, lines):
            if line == _FILES_LINE:
                continue
            if line == " }\n":
                if lines.read() != "}":
                    raise ValueError(f"{record}: ends otherwise than its format")
                return
            ((name, size),) = json.loads("{" + line.rstrip().removesuffix(",") + "}").items()
            if not isinstance(size, int):
                raise ValueError(f"{record}: size of {name} is {size!r}")
            yield name, size
    raise ValueError(f"{record}: cut short")
