"""Meshes of an export's segmentation: igneous's own meshing tasks, run here, one task at a
time in bounded memory.

Legacy meshes (unsharded exports): `begin_legacy_meshing` once, `mesh_part` per igneous meshing task
(a region of `task_voxels` per axis) writing a fragment per segment, `write_mesh_manifests` at
the end (a manifest per segment).

Sharded multi-resolution meshes (sharded exports): Neuroglancer's `neuroglancer_multilod_draco`
meshes in `neuroglancer_uint64_sharded_v1` shards, a few large files instead of a fragment per
segment per task and a manifest per segment. Three phases, each task holding a bounded part:

1. `begin_sharded_meshing`, once: the mesh `info` and igneous's provenance entry, which the
   fragment tasks then only read.
2. `fragment_part`, in each export region's task, once it has written the region's scales:
   igneous's MeshTask with `sharded=True` meshes the region into one `<task>.frags` file (a
   MapBuffer of its segments' meshes).
3. `mesh_shard_plan`, once, after every fragment task: the `sharding` spec and one plan file
   (pipeline.export.fragment_shards: each shard's segments, and for each segment the fragment
   tasks holding its meshes), written before `merge_shard` runs for each shard (igneous's
   MultiResShardedMeshMergeTask's steps, a segment at a time: its levels of detail, the shard
   file `<shard>.shard`). A merge task (`merge_part`) takes every shard whose number is its
   index modulo their count.

Files under `segmentation/mesh/`: `info`, a `.frags` per region holding a segment, the
plan and a `.shard` per shard holding a mesh. Neuroglancer reads only `info` and the shards; the
rest is what a merge re-run (a damaged shard) reads again.

Axes: the project is (z, y, x); igneous and cloud-volume are (x, y, z).
"""

import contextlib
import io
import json
import math
import os
import re
import shutil
from array import array as typed_array
from pathlib import Path
from time import strftime
from typing import TYPE_CHECKING

import numpy as np

from pipeline.core.atomic import atomic_path
from pipeline.core.errors import PrecomputedError
from pipeline.core.roi import Roi
from pipeline.data.volumes import ZYX
from pipeline.export.folder_layout import (
    MESH_DIR,
    SEGMENTATION_LAYER,
    ExportConfig,
    file_record,
    layer_scales,
    layer_url,
    read_info,
    xyz,
)
from pipeline.export.fragment_shards import (
    fragments_path,
    merge_in_turn,
    plan_shards,
    planned_shard_count,
    read_piece,
    shard_name,
    shard_segments,
    write_fragments,
    write_shard,
)

if TYPE_CHECKING:  # imported where used: cloud-volume and igneous take seconds to import
    from cloudvolume.lib import Bbox


def _meshing_options(config: ExportConfig) -> dict:
    """The options igneous's `create_meshing_tasks` takes and `_mesh_task` hands to each task."""
    return {
        "mip": 0,  # full resolution
        "simplification": config.mesh_max_error_nm > 0,
        "max_simplification_error": config.mesh_max_error_nm,
        "mesh_dir": MESH_DIR,
        # The spatial index serves cloud-volume's region queries; Neuroglancer ignores it.
        "spatial_index": False,
        "compress": "gzip" if config.gzip else False,
    }


def begin_legacy_meshing(folder: Path, config: ExportConfig) -> None:
    """igneous writes the mesh `info` and its provenance entry for the task set, once, before
    any meshing task runs: its `create_meshing_tasks` rewrites both in place (not atomically),
    so the meshing tasks, which run side by side and read them, must not call it."""
    # igneous imports its skeletonising dependencies too (about 2 s): only exporting pays for it.
    from igneous.task_creation import create_meshing_tasks

    # Its tasks are made (and dropped) only for its provenance, written after the last one;
    # it prints the task set's bounds to stdout.
    with contextlib.redirect_stdout(io.StringIO()):
        for _ in create_meshing_tasks(
            layer_url(folder, SEGMENTATION_LAYER),
            shape=(config.task_voxels,) * 3,
            **_meshing_options(config),
        ):
            pass


def _mesh_region(folder: Path, config: ExportConfig, index: int) -> Roi:
    """The region of igneous's meshing task `index` of `create_meshing_tasks`'s set (a region of
    `task_voxels` per axis, in its order: x fastest; the last ones reach past the volume, which
    igneous clamps)."""
    shape_zyx = layer_scales(read_info(folder, SEGMENTATION_LAYER))[0].shape_zyx
    grid_zyx = _mesh_grid_zyx(shape_zyx, config)
    count = math.prod(grid_zyx)
    if not 0 <= index < count:
        raise ValueError(f"meshing task {index} of {count}")
    corner_zyx = tuple(int(i) * config.task_voxels for i in np.unravel_index(index, grid_zyx))
    return Roi(corner_zyx, tuple(c + config.task_voxels for c in corner_zyx))


def _igneous_mesh_task(folder: Path, config: ExportConfig, region: Roi, sharded: bool):
    """igneous's meshing task of `region` (voxels, meshed at full resolution), made here as
    `create_meshing_tasks` makes each of its set, without the shared files that writes
    (`begin_legacy_meshing`, `begin_sharded_meshing`) and without making the other tasks:
    legacy fragments, or with `sharded` a `.frags` file of the region's meshes, which the merge
    tasks read."""
    from igneous.tasks import MeshTask

    options = _meshing_options(config)
    return MeshTask(
        shape=xyz(region.shape),
        offset=xyz(region.start),
        layer_path=layer_url(folder, SEGMENTATION_LAYER),
        mip=options["mip"],
        simplification_factor=100 if options["simplification"] else 0,
        max_simplification_error=options["max_simplification_error"],
        mesh_dir=options["mesh_dir"],
        cache_control="no-cache",
        dust_threshold=None,
        dust_global=False,
        progress=False,
        object_ids=None,
        exclude_object_ids=[],
        fill_missing=False,
        encoding="precomputed",  # what Neuroglancer and the merge task decode
        spatial_index=options["spatial_index"],
        frag_path=None,
        sharded=sharded,
        compress=options["compress"],
        closed_dataset_edges=True,
        fill_holes=0,
        dry_run=False,
    )


def _mesh_task(folder: Path, config: ExportConfig, index: int):
    """igneous's legacy meshing task `index` (`_igneous_mesh_task`). It remembers the ids it
    wrote fragments for (`fragment_ids`)."""
    task = _igneous_mesh_task(folder, config, _mesh_region(folder, config, index), sharded=False)
    task.fragment_ids, upload = [], task._upload_individuals

    def recorded_upload(mesh_binaries: dict, generate_manifests: bool) -> None:
        task.fragment_ids = list(mesh_binaries)
        upload(mesh_binaries, generate_manifests)

    task._upload_individuals = recorded_upload
    return task


def _mesh_grid_zyx(shape_zyx: ZYX, config: ExportConfig) -> list[int]:
    """igneous's meshing tasks per axis: regions of `task_voxels`, the last one cut short."""
    return [-(-n // config.task_voxels) for n in shape_zyx]


def mesh_task_count(shape_zyx: ZYX, config: ExportConfig) -> int:
    """How many meshing tasks igneous makes for a volume of this shape."""
    return math.prod(_mesh_grid_zyx(shape_zyx, config))


def mesh_part(folder: str | Path, config: ExportConfig, index: int) -> dict[str, list[int]]:
    """Run igneous's meshing task `index` (of `mesh_task_count`) on an export whose regions are
    all written; returns the mesh fragments it wrote (`file_record`)."""
    folder = Path(folder)
    task = _mesh_task(folder, config, index)
    task.execute()
    # Fragments are named `<id>:0:<the task's bounds>` (igneous MeshTask), `.gz` if compressed.
    mesh = folder / SEGMENTATION_LAYER / MESH_DIR
    suffix = f":0:{task._bounds.to_filename()}" + (".gz" if config.gzip else "")
    files = [mesh / f"{segment}{suffix}" for segment in task.fragment_ids]
    return {path.relative_to(folder).as_posix(): file_record(path) for path in files}


def write_mesh_manifests(mesh_dir: Path) -> list[Path]:
    """The legacy manifest `<id>:0` ({"fragments": [...]}) of every segment with fragments in
    `mesh_dir` (igneous's `<id>:0:<task bounds>[.gz]`), as igneous's manifest task writes them.
    Its task holds every fragment's name and a list per segment (about 2 KB a fragment); here a
    fragment is 12 bytes, (id, which task), however many the meshing tasks wrote. Returns the
    manifests written."""
    fragment = re.compile(r"(\d+):0:([^.]+)(?:\.gz)?")
    # Typed arrays, not lists of Python ints (about 36 bytes an entry).
    segments, tasks, bounds = typed_array("Q"), typed_array("i"), {}
    with os.scandir(mesh_dir) as listing:
        for entry in listing:
            if match := fragment.fullmatch(entry.name):
                segments.append(int(match[1]))
                tasks.append(bounds.setdefault(match[2], len(bounds)))
    names = list(bounds)
    segments, tasks = np.frombuffer(segments, np.uint64), np.frombuffer(tasks, np.int32)
    order = np.argsort(segments, kind="stable")
    starts = np.flatnonzero(np.diff(segments[order], prepend=np.uint64(0)) != 0)
    written = []
    for group in np.split(order, starts[1:]) if order.size else []:
        segment = int(segments[group[0]])
        fragments = [f"{segment}:0:{names[t]}" for t in tasks[group]]
        with atomic_path(mesh_dir / f"{segment}:0") as tmp:
            tmp.write_text(json.dumps({"fragments": fragments}))
        written.append(mesh_dir / f"{segment}:0")
    return written


# Sharded multi-resolution meshes

# igneous's defaults (`igneous mesh merge-sharded`): vertex positions quantized to 16 bits of
# their fragment's box, draco level 7, and the finest level of detail cut into boxes of at least
# 256 voxels an axis (a mesh smaller than that has one level of detail).
VERTEX_QUANTIZATION_BITS = 16
DRACO_COMPRESSION_LEVEL = 7
MIN_CHUNK_VOXELS = (256, 256, 256)


def _mesh_dir(folder: Path) -> Path:
    return folder / SEGMENTATION_LAYER / MESH_DIR


def begin_sharded_meshing(folder: Path, config: ExportConfig) -> None:
    """Before the fragment tasks run side by side: an empty mesh folder (an earlier run's
    fragments and shards go) with igneous's mesh `info` (legacy type: what `fragment_part`
    reads) and igneous's provenance entry, written by its `create_meshing_tasks(sharded=True)`,
    which rewrites both in place (not atomically), so the tasks must not call it. The
    segmentation's `info` names the mesh folder (atomically, here, if it does not yet) so
    igneous leaves that shared file alone."""
    from igneous.task_creation import create_meshing_tasks

    folder = Path(folder)
    info = read_info(folder, SEGMENTATION_LAYER)
    if info.get("mesh") != MESH_DIR:
        info["mesh"] = MESH_DIR
        with atomic_path(folder / SEGMENTATION_LAYER / "info") as tmp:
            tmp.write_text(json.dumps(info))
    shutil.rmtree(_mesh_dir(folder), ignore_errors=True)
    # Its tasks are made (and dropped) only for its provenance, written after the last one
    # (whose operator it asks `git config user.email` for, printing to stdout without one).
    with contextlib.redirect_stdout(io.StringIO()):
        for _ in create_meshing_tasks(
            layer_url(folder, SEGMENTATION_LAYER),
            shape=(config.task_voxels,) * 3,
            sharded=True,
            **_meshing_options(config),
        ):
            pass


def fragment_part(
    folder: Path, config: ExportConfig, index: int, region: Roi
) -> dict[str, list[int]]:
    """Run igneous's meshing task of `region` (export region `index`, whose region task calls
    this) with `sharded=True` on a begun export (`begin_sharded_meshing`): its region's meshes
    in one MapBuffer file, as igneous writes it, but named after the task
    (`fragment_shards.fragments_path`) and written atomically. Returns the file written
    (`file_record`), or nothing for a region without a segment."""
    folder = Path(folder)
    task = _igneous_mesh_task(folder, config, region, sharded=True)
    path = fragments_path(_mesh_dir(folder), index)
    path.unlink(missing_ok=True)  # a stale one (its region since emptied) is not this run's

    def upload(meshes: dict, bbox: "Bbox") -> None:  # igneous's `_upload_batch`, atomically
        write_fragments(path, meshes)

    task._upload_batch = upload
    task.execute()
    return {path.relative_to(folder).as_posix(): file_record(path)} if path.exists() else {}


def _mesh_info(folder: Path) -> dict:
    return json.loads((_mesh_dir(folder) / "info").read_text())


def mesh_shard_plan(folder: Path, fragments: dict[int, Path], shards: int) -> int:
    """Once, after every fragment task (`fragments`: task index -> its `.frags` file, for the
    tasks that wrote one) and before any merge task: the plan of about `shards` shards
    (`fragment_shards.plan_shards`; draco meshes stored raw), then the mesh `info` Neuroglancer
    reads (igneous's `configure_multires_info`: multires type, vertex quantization, the mip's
    resolution as transform, lod scale 1; and the plan's sharding), atomically, and igneous's
    provenance entry for the merge. Returns the number of shards (`mesh_shard_count`)."""
    from igneous.task_creation.common import operator_contact

    folder = Path(folder)
    mesh = _mesh_dir(folder)
    spec = plan_shards(mesh, fragments, shards, data_encoding="raw")
    info = _mesh_info(folder)
    resolution = read_info(folder, SEGMENTATION_LAYER)["scales"][info["mip"]]["resolution"]
    info.update(
        {
            "@type": "neuroglancer_multilod_draco",
            "vertex_quantization_bits": VERTEX_QUANTIZATION_BITS,
            "transform": [
                *(resolution[0], 0, 0, 0),
                *(0, resolution[1], 0, 0),
                *(0, 0, resolution[2], 0),
            ],
            "lod_scale_multiplier": 1.0,
            "sharding": spec,
        }
    )
    with atomic_path(mesh / "info") as tmp:
        tmp.write_text(json.dumps(info))
    provenance = folder / SEGMENTATION_LAYER / "provenance"
    record = json.loads(provenance.read_text())
    # igneous's operator: `git config user.email`, printed to stdout without one.
    with contextlib.redirect_stdout(io.StringIO()):
        by = operator_contact()
    record["processing"].append(
        {
            "method": {
                "task": "MultiResShardedMeshMergeTask",
                "cloudpath": layer_url(folder, SEGMENTATION_LAYER),
                "mip": info["mip"],
                "vertex_quantization_bits": VERTEX_QUANTIZATION_BITS,
                **{k: spec[k] for k in ("preshift_bits", "minishard_bits", "shard_bits")},
                "mesh_dir": MESH_DIR,
                "draco_compression_level": DRACO_COMPRESSION_LEVEL,
                "min_chunk_size": list(MIN_CHUNK_VOXELS),
            },
            "by": by,
            "date": strftime("%Y-%m-%d %H:%M %Z"),
        }
    )
    with atomic_path(provenance) as tmp:
        tmp.write_text(json.dumps(record))
    return 2 ** spec["shard_bits"]


def _sharding(folder: Path) -> dict:
    info = _mesh_info(folder)
    if "sharding" not in info:
        raise PrecomputedError(f"{_mesh_dir(folder)}: no sharded meshes planned (mesh_shard_plan)")
    return info["sharding"]


def mesh_shard_count(folder: Path) -> int:
    """The number of shards (some maybe empty) of the plan `mesh_shard_plan` wrote in `folder`."""
    return planned_shard_count(_mesh_dir(Path(folder)))


def merge_shard(folder: Path, config: ExportConfig, shard_number: int) -> dict[str, list[int]]:
    """Shard `shard_number` (of `mesh_shard_count`) of the multires meshes, as igneous's
    MultiResShardedMeshMergeTask makes it, from its own steps: a segment's fragments
    concatenated and consolidated, its levels of detail (`process_mesh`: `config.num_scales`
    at most, as many as the layers have scales; fewer for a mesh under `MIN_CHUNK_VOXELS`
    across) draco-encoded, the shard file synthesized by cloud-volume; written atomically, so a
    task cut short leaves no shard. Returns its `file_record`; nothing for a shard without a
    mesh. As igneous, a segment whose mesh is flat (under a voxel across on an axis: a sliver,
    simplified) gets no mesh.

    Unlike igneous's task, which decodes every fragment of all its segments at once and keeps
    every merged mesh until the shard is made, this takes one segment at a time: what it holds
    is the shard's encoded meshes and one segment's fragments. It reads its part of the plan
    (no `.labels` file, no spatial index) and only the `.frags` files holding its segments."""
    from cloudvolume import CloudVolume, Mesh
    from igneous.tasks.mesh.multires import process_mesh

    folder = Path(folder)
    mesh_dir = _mesh_dir(folder)
    spec = _sharding(folder)
    count = 2 ** spec["shard_bits"]
    if not 0 <= shard_number < count:
        raise ValueError(f"mesh shard {shard_number} of {count}")
    (mesh_dir / f"{shard_name(spec, shard_number)}.shard").unlink(missing_ok=True)
    volume = CloudVolume(layer_url(folder, SEGMENTATION_LAYER), progress=False)
    volume.mip = volume.mesh.meta.mip
    encoded, manifest_at = {}, {}
    for segment, tasks in shard_segments(mesh_dir, shard_number):
        parts = [read_piece(mesh_dir, int(t), segment, Mesh.from_precomputed) for t in tasks]
        mesh = Mesh.concatenate(*parts, segid=segment).consolidate()
        manifest, meshes = process_mesh(
            volume, segment, mesh, config.num_scales - 1, MIN_CHUNK_VOXELS,
            draco_compression_level=DRACO_COMPRESSION_LEVEL,
        )  # fmt: skip
        if manifest is not None and len(meshes) > 0:  # igneous's `create_mesh_shard`
            manifest_at[segment] = len(manifest)
            encoded[segment] = meshes + manifest.to_binary()
    if not encoded:
        return {}
    path = write_shard(mesh_dir, spec, shard_number, encoded, manifest_at)
    return {path.relative_to(folder).as_posix(): file_record(path)}


def merge_part(folder: Path, config: ExportConfig, index: int, count: int) -> dict[str, list[int]]:
    """Merge task `index` of `count`: every shard of the plan whose number is `index` modulo
    `count` (`merge_shard`), one after the other. Returns the shard files written."""
    shards = mesh_shard_count(folder)
    return merge_in_turn(lambda n: merge_shard(folder, config, n), index, count, shards)
