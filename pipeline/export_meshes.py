"""Meshes of an export's segmentation: igneous's own meshing tasks, run here, one task at a
time in bounded memory.

Legacy meshes (unsharded exports): `begin_legacy_meshing` once, `mesh_part` per igneous meshing task
(a region of `task_voxels` per axis) writing a fragment per segment, `write_mesh_manifests` at
the end (a manifest per segment).

Sharded multi-resolution meshes (sharded exports): Neuroglancer's `neuroglancer_multilod_draco`
meshes in `neuroglancer_uint64_sharded_v1` shards, a few large files instead of a fragment per
segment per task and a manifest per segment. Three phases, each task holding a bounded part:

1. `begin_sharded_meshing`, once: the mesh `info` (with its spatial index) and igneous's
   provenance entry, which the fragment tasks then only read.
2. `fragment_part`, one per igneous meshing task (the regions of `mesh_part`): igneous's
   MeshTask with `sharded=True` meshes its region into one `.frags` file (a MapBuffer of its
   segments' meshes) and the region's spatial index (`.spatial`: segment -> box, nm).
3. `mesh_shard_plan`, once, with every segment id: the `sharding` spec and the segment ids of
   each shard (`<shard>.labels`), written before `merge_shards`, one task per meshing task,
   each merging every shard whose number is its index modulo their count (`merge_shard`:
   igneous's MultiResShardedMeshMergeTask gathers a shard's segments' fragments, makes their
   levels of detail and writes the shard file `<shard>.shard`). A fixed number of merge tasks
   however many shards the segments need: the workflow's tasks are known before it runs.

Files under `segmentation/mesh/`: `info`, a `.frags` per task whose region holds a segment, a
`.spatial` (`.spatial.gz` with `gzip`) per task, a `.labels` per shard and a `.shard` per shard
holding a mesh. Neuroglancer reads only `info` and the shards; the rest is what a merge re-run
(a damaged shard) reads again.

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
from collections.abc import Iterable
from pathlib import Path
from time import strftime
from typing import TYPE_CHECKING

import numpy as np

from pipeline.atomic import atomic_path
from pipeline.errors import PrecomputedError
from pipeline.export_layout import (
    MESH_DIR,
    SEGMENTATION_LAYER,
    ExportConfig,
    file_record,
    layer_scales,
    layer_url,
    read_info,
    xyz,
)
from pipeline.volumes import ZYX

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


def _igneous_mesh_task(folder: Path, config: ExportConfig, index: int, sharded: bool):
    """igneous's meshing task `index` of `create_meshing_tasks`'s set (a region of
    `task_voxels` per axis, meshed at full resolution, in its order: x fastest), made here
    without the shared files that writes (`begin_legacy_meshing`, `begin_sharded_meshing`) and
    without making the other tasks: legacy fragments, or with `sharded` a `.frags` file of the
    region's meshes and its spatial index, which the merge tasks read."""
    from igneous.tasks import MeshTask

    shape_zyx = layer_scales(read_info(folder, SEGMENTATION_LAYER))[0].shape_zyx
    grid_zyx = _mesh_grid_zyx(shape_zyx, config)
    count = math.prod(grid_zyx)
    if not 0 <= index < count:
        raise ValueError(f"meshing task {index} of {count}")
    corner_zyx = np.array(np.unravel_index(index, grid_zyx)) * config.task_voxels
    options = _fragment_options(config) if sharded else _meshing_options(config)
    return MeshTask(
        shape=(config.task_voxels,) * 3,
        offset=xyz(corner_zyx.tolist()),
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
    task = _igneous_mesh_task(folder, config, index, sharded=False)
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


def _fragment_options(config: ExportConfig) -> dict:
    """The legacy meshing's options, with the spatial index: a merge task finds which `.frags`
    files hold its segments from it (igneous's `locations_for_labels`)."""
    return {**_meshing_options(config), "spatial_index": True}


def begin_sharded_meshing(folder: Path, config: ExportConfig) -> None:
    """Before the fragment tasks run side by side: an empty mesh folder (an earlier run's
    fragments and shards go) with igneous's mesh `info` (legacy type, its spatial index's
    resolution and chunk: what `fragment_part` reads) and igneous's provenance entry, written by
    its `create_meshing_tasks(sharded=True)`, which rewrites both in place (not atomically), so
    the tasks must not call it. The segmentation's `info` names the mesh folder (atomically,
    here, if it does not yet) so igneous leaves that shared file alone."""
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
            **_fragment_options(config),
        ):
            pass


def fragment_part(folder: Path, config: ExportConfig, index: int) -> dict[str, list[int]]:
    """Run igneous's meshing task `index` (of `pipeline.export.mesh_task_count`: a region of
    `task_voxels` per axis, x fastest, as `create_meshing_tasks` orders them) with
    `sharded=True` on a begun export (`begin_sharded_meshing`). Returns the files it wrote
    (`file_record`): its `.frags` (none when its region is empty) and its `.spatial`."""
    folder = Path(folder)
    task = _igneous_mesh_task(folder, config, index, sharded=True)
    # Named as igneous names them (`_upload_batch`, `_upload_spatial_index`); the `.frags` only
    # when written, so a stale one (its region since emptied, its index now `{}`) is not taken
    # for this run's.
    written, upload = [], task._upload_batch

    def recorded_upload(meshes: dict, bbox: "Bbox") -> None:
        upload(meshes, bbox)
        written.append(f"{bbox.to_filename()}.frags")

    task._upload_batch = recorded_upload
    task.execute()
    resolution = task._volume.resolution
    physical = task._bounds.astype(resolution.dtype) * resolution
    precision = task._volume.mesh.spatial_index.precision
    written.append(f"{physical.to_filename(precision)}.spatial" + (".gz" if config.gzip else ""))
    mesh = _mesh_dir(folder)
    return {
        (mesh / name).relative_to(folder).as_posix(): file_record(mesh / name) for name in written
    }


def mesh_sharding(segment_count: int, shards: int) -> dict:
    """The meshes' `sharding` spec for `segment_count` segments in about `shards` shards, by
    igneous's rules (`compute_shard_params_for_hashed`, as `create_sharded_multires_mesh_tasks`
    calls it): 2^round(log2(`shards`)) shards, or more where the segments would overflow the
    indices sized for a 100 Mbit/s reader (8 KiB shard index, 32 KiB minishard indices);
    murmurhash spreads the segments (a shard's count varies by about its square root); draco
    meshes stored raw. The export asks for as many shards as merge tasks, one each, so a merge
    task holds about the segments of a meshing region whatever the volume's size (igneous's
    command asks for one per 1000 segments: at 256^3 one shard would hold every segment, at
    1024^3 a thousand)."""
    from cloudvolume.datasource.precomputed.sharding import ShardingSpecification
    from igneous.task_creation.common import compute_shard_params_for_hashed

    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    shard_bits, minishard_bits, preshift_bits = compute_shard_params_for_hashed(
        num_labels=segment_count,
        shard_index_bytes=2**13,
        minishard_index_bytes=2**15,
        min_shards=shards,
    )
    spec = ShardingSpecification(
        type="neuroglancer_uint64_sharded_v1",
        preshift_bits=preshift_bits,
        hash="murmurhash3_x86_128",
        minishard_bits=minishard_bits,
        shard_bits=shard_bits,
        minishard_index_encoding="gzip",
        data_encoding="raw",
    )
    return json.loads(spec.to_json())  # its numbers as ints (it holds numpy's)


def _shard_name(spec: dict, shard_number: int) -> str:
    """A shard's name (hex, as wide as its bits need): cloud-volume's and shardcomputer's."""
    return format(shard_number, "x").zfill(math.ceil(spec["shard_bits"] / 4))


def _mesh_info(folder: Path) -> dict:
    return json.loads((_mesh_dir(folder) / "info").read_text())


def mesh_shard_plan(folder: Path, segment_ids: np.ndarray | Iterable[int], shards: int) -> int:
    """Once, after `begin_sharded_meshing` and before any merge task (fragment tasks may still
    run: they read only the spatial index of the `info` this replaces): the mesh `info`
    Neuroglancer reads (igneous's `configure_multires_info`: multires type, vertex quantization,
    the mip's resolution as transform, lod scale 1; and the sharding of `mesh_sharding`),
    atomically and in one write, then each shard's segment ids (`<shard>.labels`, an empty list
    for a shard none hashes to) and igneous's provenance entry for the merge. Shards of an
    earlier plan go first. `segment_ids`: every segment of the volume (the export regions' ids;
    0 is ignored); `shards`: about how many shards (`mesh_sharding`). Returns the number of
    shards (`mesh_shard_count`).

    igneous's `create_sharded_multires_mesh_tasks` does this from the spatial index: it reads
    every `.spatial` file, 10,000 at a time, and holds every id as a Python int; here the ids
    are given (8 bytes each, plus shardcomputer's lists: about 50 bytes an id, once)."""
    import shardcomputer
    from igneous.task_creation.common import operator_contact

    folder = Path(folder)
    ids = np.unique(np.asarray(segment_ids, dtype=np.uint64))
    ids = ids[ids != 0]
    spec = mesh_sharding(ids.size, shards)
    mesh = _mesh_dir(folder)
    for stale in [*mesh.glob("*.shard"), *mesh.glob("*.labels")]:
        stale.unlink()
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
    shards = shardcomputer.assign_labels_to_shards(
        ids, spec["preshift_bits"], spec["shard_bits"], spec["minishard_bits"]
    )
    count = 2 ** spec["shard_bits"]
    for shard in range(count):
        name = _shard_name(spec, shard)
        with atomic_path(mesh / f"{name}.labels") as tmp:
            tmp.write_text(json.dumps(shards.get(name, [])))
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
    return count


def _sharding(folder: Path) -> dict:
    info = _mesh_info(folder)
    if "sharding" not in info:
        raise PrecomputedError(f"{_mesh_dir(folder)}: no sharded meshes planned (mesh_shard_plan)")
    return info["sharding"]


def mesh_shard_count(folder: Path) -> int:
    """The number of merge tasks (shards, some maybe empty) of the plan `mesh_shard_plan` wrote
    in `folder`: read back, so a resumed run needs no segment ids."""
    return 2 ** _sharding(Path(folder))["shard_bits"]


def merge_shard(folder: Path, config: ExportConfig, shard_number: int) -> dict[str, list[int]]:
    """Run igneous's MultiResShardedMeshMergeTask for shard `shard_number` (of
    `mesh_shard_count`): its segments' multires meshes, with `config.num_scales` levels of detail
    at most (as many as the layers have scales; fewer for a mesh under `MIN_CHUNK_VOXELS`
    across), in its shard file. Returns that file's `file_record`; nothing for a shard without a
    mesh. A shard file left by an earlier run goes first; igneous writes it in place, not
    atomically: a run cut short leaves it truncated, and a re-run rewrites it. igneous drops a
    segment whose mesh is flat (under a voxel across on an axis: a sliver, simplified) without a
    word: it gets no mesh.

    Memory and reads, from igneous's source: it reads its `.labels` (its segments), then every
    `.spatial` file (one per fragment task: the whole spatial index, in batches of up to 500
    files held at once) keeping the names of the `.frags` holding its segments, which it maps
    (mmap) to decode its segments' fragments; it holds every fragment of all its segments at
    once, then their levels of detail, draco encodings and the whole shard. So its memory is
    its segments' meshes (about a meshing region's segments: bounded by the plan, not by the
    volume, except that one segment spanning the volume has a mesh growing with it) plus a batch
    of index files (each as large as a task's segment count); its reads grow with the number of
    fragment tasks, as every merge task reads the whole spatial index."""
    from igneous.tasks import MultiResShardedMeshMergeTask

    folder = Path(folder)
    spec = _sharding(folder)
    count = 2 ** spec["shard_bits"]
    if not 0 <= shard_number < count:
        raise ValueError(f"mesh shard {shard_number} of {count}")
    name = _shard_name(spec, shard_number)
    labels = _mesh_dir(folder) / f"{name}.labels"
    if not labels.is_file():
        # igneous would list every segment of the volume from the spatial index instead.
        raise PrecomputedError(f"{labels}: missing (written by mesh_shard_plan)")
    path = _mesh_dir(folder) / f"{name}.shard"
    path.unlink(missing_ok=True)
    MultiResShardedMeshMergeTask(
        layer_url(folder, SEGMENTATION_LAYER),
        name,
        draco_compression_level=DRACO_COMPRESSION_LEVEL,
        mesh_dir=MESH_DIR,
        num_lod=config.num_scales - 1,
        min_chunk_size=MIN_CHUNK_VOXELS,
        progress=False,
    )
    return {path.relative_to(folder).as_posix(): file_record(path)} if path.exists() else {}


def merge_part(folder: Path, config: ExportConfig, index: int, count: int) -> dict[str, list[int]]:
    """Merge task `index` of `count`: every shard of the plan whose number is `index` modulo
    `count` (`merge_shard`), one after the other. Returns the shard files written."""
    if not 0 <= index < count:
        raise ValueError(f"merge task {index} of {count}")
    files = {}
    for shard in range(index, mesh_shard_count(folder), count):
        files |= merge_shard(folder, config, shard)
    return files
