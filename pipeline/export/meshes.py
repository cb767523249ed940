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
   (`PLAN`: each shard's segments, and for each segment the fragment tasks holding its
   meshes), written before `merge_shard` runs for each shard (igneous's
   MultiResShardedMeshMergeTask's steps, a segment at a time: its levels of detail, the shard
   file `<shard>.shard`). A merge task (`merge_part`) takes every shard whose number is its
   index modulo their count: about a shard a merge task, a fixed number of them (the
   workflow's tasks are known before it runs).

Files under `segmentation/mesh/`: `info`, a `.frags` per region holding a segment, the
plan and a `.shard` per shard holding a mesh. Neuroglancer reads only `info` and the shards; the
rest is what a merge re-run (a damaged shard) reads again. igneous's own way keeps a spatial
index file per task and a `.labels` file per shard besides, and every merge task reads the
whole spatial index.

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
from collections.abc import Iterator
from pathlib import Path
from time import strftime
from typing import TYPE_CHECKING

import numpy as np

from pipeline.core.atomic import atomic_path
from pipeline.core.errors import PrecomputedError
from pipeline.core.memory import release_memory
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

if TYPE_CHECKING:  # imported where used: cloud-volume and igneous take seconds to import
    from cloudvolume import Mesh
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


FRAGMENTS_SUFFIX = ".frags"


def _fragments_path(folder: Path, index: int) -> Path:
    """Where fragment task `index` keeps its region's meshes (a MapBuffer by segment id)."""
    return _mesh_dir(folder) / f"{index}{FRAGMENTS_SUFFIX}"


# The shards' plan (`mesh_shard_plan`), in the mesh folder: one file whatever the shard count.
PLAN = "plan.npy"


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
    in one MapBuffer file, as igneous writes it, but named after the task (`<index>.frags`, so
    the plan need not list names) and written atomically. Returns the file written
    (`file_record`), or nothing for a region without a segment."""
    from mapbuffer import MapBuffer

    folder = Path(folder)
    task = _igneous_mesh_task(folder, config, region, sharded=True)
    path = _fragments_path(folder, index)
    path.unlink(missing_ok=True)  # a stale one (its region since emptied) is not this run's

    def upload(meshes: dict, bbox: "Bbox") -> None:  # igneous's `_upload_batch`, atomically
        with atomic_path(path) as tmp:
            tmp.write_bytes(MapBuffer(meshes, compress="br").tobytes())

    task._upload_batch = upload
    task.execute()
    return {path.relative_to(folder).as_posix(): file_record(path)} if path.exists() else {}


def mesh_sharding(segment_count: int, shards: int) -> dict:
    """The meshes' `sharding` spec for `segment_count` segments in about `shards` shards, by
    igneous's rules (`compute_shard_params_for_hashed`, as `create_sharded_multires_mesh_tasks`
    calls it): 2^round(log2(`shards`)) shards, or more where the segments would overflow the
    indices sized for a 100 Mbit/s reader (8 KiB shard index, 32 KiB minishard indices);
    murmurhash spreads the segments (a shard's count varies by about its square root); draco
    meshes stored raw. The export asks for a shard per few regions (pipeline.export.layers's
    `REGIONS_PER_MESH_SHARD`), so a shard holds about as many segments whatever the volume's
    size (igneous's command asks for one per 1000 segments: at 256^3 one shard would hold every
    segment, at 1024^3 a thousand)."""
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


class _FileBytes:
    """A file's bytes, read where a MapBuffer slices them (its index, then one value at a time).
    Given the file itself, MapBuffer maps it whole, and every page it reads stays resident as
    the process's memory: a merge task reading its segments across every region's fragments
    would hold them all."""

    def __init__(self, file: "io.BufferedReader") -> None:
        self._file, self._size = file, os.fstat(file.fileno()).st_size

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, where: slice) -> bytes:
        start, stop, _ = where.indices(self._size)
        self._file.seek(start)
        return self._file.read(max(0, stop - start))


def _fragment_ids(path: Path) -> np.ndarray:
    """The segment ids a `.frags` file holds meshes of (its index only, not its meshes)."""
    from mapbuffer import MapBuffer

    with open(path, "rb") as f:
        return np.fromiter(MapBuffer(_FileBytes(f)).keys(), np.uint64)


def mesh_shard_plan(folder: Path, fragments: dict[int, Path], shards: int) -> int:
    """Once, after every fragment task (`fragments`: task index -> its `.frags` file, for the
    tasks that wrote one) and before any merge task: the mesh `info` Neuroglancer reads
    (igneous's `configure_multires_info`: multires type, vertex quantization, the mip's
    resolution as transform, lod scale 1; and the sharding of `mesh_sharding`, about `shards`
    shards), atomically, then the plan `PLAN` (what igneous keeps in a `.labels` file per shard
    and finds in the spatial index, `_write_plan`), and igneous's provenance entry for the
    merge. Shards of an earlier plan go first. Returns the number of shards
    (`mesh_shard_count`). Holds every (segment, task) pair of the volume: 16 bytes each, plus
    shardcomputer's lists (about 50 bytes a segment), once."""
    import shardcomputer
    from igneous.task_creation.common import operator_contact

    folder = Path(folder)
    segments = [_fragment_ids(path) for path in fragments.values()]
    owners = [
        np.full(ids.size, task, np.uint64) for task, ids in zip(fragments, segments, strict=True)
    ]
    pairs = np.concatenate([np.zeros(0, np.uint64), *segments])
    tasks = np.concatenate([np.zeros(0, np.uint64), *owners])
    ids = np.unique(pairs)
    spec = mesh_sharding(ids.size, shards)
    mesh = _mesh_dir(folder)
    for stale in mesh.glob("*.shard"):
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
    assigned = shardcomputer.assign_labels_to_shards(
        ids, spec["preshift_bits"], spec["shard_bits"], spec["minishard_bits"]
    )
    count = 2 ** spec["shard_bits"]
    shard_of = np.zeros(ids.size, np.uint64)
    for shard in range(count):
        members = np.asarray(assigned.get(_shard_name(spec, shard), []), np.uint64)
        shard_of[np.searchsorted(ids, members)] = shard
    _write_plan(mesh / PLAN, count, shard_of[np.searchsorted(ids, pairs)], pairs, tasks)
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


def _write_plan(
    path: Path, count: int, shards: np.ndarray, segments: np.ndarray, tasks: np.ndarray
) -> None:
    """The plan of `count` shards from (shard, segment, fragment task) triples, as one uint64
    array a merge task maps and slices (`_shard_segments`), reading only its shard's part:
    [count, segments n, pairs m, shard -> first segment (count + 1), segment ids (n, by shard
    then id), segment -> first pair (n + 1), the tasks holding each segment's fragments (m)]."""
    order = np.lexsort((tasks, segments, shards))
    segments, shards, tasks = segments[order], shards[order], tasks[order]
    firsts = np.flatnonzero(np.diff(segments, prepend=segments[:1] + 1) != 0)
    ids, owners = segments[firsts], shards[firsts]
    by_shard = np.searchsorted(owners, np.arange(count + 1))
    parts = [[count, ids.size, tasks.size], by_shard, ids, [*firsts, tasks.size], tasks]
    # Each as uint64 first: int64 and uint64 together would make floats (ids past 2^53 lost).
    plan = np.concatenate([np.asarray(part, np.uint64) for part in parts])
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, plan)


def _shard_segments(folder: Path, shard: int) -> Iterator[tuple[int, np.ndarray]]:
    """(segment id, the fragment tasks holding its meshes) of every segment of `shard`, from
    the plan (`_write_plan`); PrecomputedError when it is missing or cut short."""
    path = _mesh_dir(folder) / PLAN
    try:
        plan = np.load(path, mmap_mode="r")
        count, n, m = (int(v) for v in plan[:3])
        if plan.size != 3 + count + 1 + n + n + 1 + m or not 0 <= shard < count:
            raise ValueError(f"{plan.size} numbers, shard {shard} of {count}")
    except (OSError, ValueError) as exc:
        raise PrecomputedError(f"{path}: no whole plan of the mesh shards ({exc})") from None
    ids_at, pairs_at = 3 + count + 1, 3 + count + 1 + n
    tasks_at = pairs_at + n + 1
    first, last = int(plan[3 + shard]), int(plan[3 + shard + 1])
    starts = np.asarray(plan[pairs_at + first : pairs_at + last + 1], np.int64)
    for k, segment in enumerate(np.asarray(plan[ids_at + first : ids_at + last])):
        yield int(segment), np.asarray(plan[tasks_at + starts[k] : tasks_at + starts[k + 1]])


def _fragment(folder: Path, task: int, segment: int) -> "Mesh":
    """`segment`'s mesh in fragment task `task`'s file, read alone (`_FileBytes`): the file is
    opened and closed again, so a merge holds no file open between segments (a shard's segments
    come from regions all over the volume)."""
    from cloudvolume import Mesh
    from mapbuffer import MapBuffer

    with open(_fragments_path(folder, task), "rb") as f:
        return MapBuffer(_FileBytes(f), frombytesfn=Mesh.from_precomputed)[segment]


def _sharding(folder: Path) -> dict:
    info = _mesh_info(folder)
    if "sharding" not in info:
        raise PrecomputedError(f"{_mesh_dir(folder)}: no sharded meshes planned (mesh_shard_plan)")
    return info["sharding"]


def mesh_shard_count(folder: Path) -> int:
    """The number of shards (some maybe empty) of the plan `mesh_shard_plan` wrote in `folder`:
    read back, so a resumed run needs no segment ids."""
    return 2 ** _sharding(Path(folder))["shard_bits"]


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
    from cloudvolume.datasource.precomputed.sharding import synthesize_shard_files
    from igneous.tasks.mesh.multires import process_mesh

    folder = Path(folder)
    spec = _sharding(folder)
    count = 2 ** spec["shard_bits"]
    if not 0 <= shard_number < count:
        raise ValueError(f"mesh shard {shard_number} of {count}")
    path = _mesh_dir(folder) / f"{_shard_name(spec, shard_number)}.shard"
    path.unlink(missing_ok=True)
    volume = CloudVolume(layer_url(folder, SEGMENTATION_LAYER), progress=False)
    volume.mip = volume.mesh.meta.mip
    encoded, manifest_at = {}, {}
    for segment, tasks in _shard_segments(folder, shard_number):
        parts = [_fragment(folder, int(task), segment) for task in tasks]
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
    shards = synthesize_shard_files(volume.mesh.reader.spec, encoded, manifest_at)
    if list(shards) != [path.name]:
        raise PrecomputedError(f"mesh shard {path.name}: the plan's segments made {list(shards)}")
    with atomic_path(path) as tmp:
        tmp.write_bytes(shards[path.name])
    return {path.relative_to(folder).as_posix(): file_record(path)}


def merge_part(folder: Path, config: ExportConfig, index: int, count: int) -> dict[str, list[int]]:
    """Merge task `index` of `count`: every shard of the plan whose number is `index` modulo
    `count` (`merge_shard`), one after the other. Returns the shard files written."""
    if not 0 <= index < count:
        raise ValueError(f"merge task {index} of {count}")
    files = {}
    for shard in range(index, mesh_shard_count(folder), count):
        files |= merge_shard(folder, config, shard)
        # A shard's memory handed back before the next: held on, its fragmented heap grew a
        # merge task's peak by up to 20 MB after region tasks in the same worker.
        release_memory()
    return files
