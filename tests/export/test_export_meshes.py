"""Sharded multi-resolution meshes: igneous's tasks on a real small segmentation, read back with
cloud-volume as Neuroglancer would; few files; shared files written once; a damaged shard
rewritten."""

import dataclasses
import json
import os
import shutil
from unittest.mock import ANY

import numpy as np
import pytest
from cloudvolume import CloudVolume
from cloudvolume.exceptions import MeshMissingError

from pipeline.core.errors import PrecomputedError
from pipeline.export import fragment_shards
from pipeline.export import layers as export
from pipeline.export import meshes as sharded
from pipeline.export.layers import ExportConfig, damaged, file_record
from pipeline.export.segmentation_layer import SegmentationWriter, new_segmentation

SHAPE = (64, 96, 80)  # (z, y, x): every axis a different length
VOXEL = (20.0, 10.0, 10.0)
# Regions of 16 x 32 x 64 voxels (4 x 3 x 2, each a fragment task); legacy meshing 2 x 3 x 3 tasks.
CONFIG = ExportConfig(task_voxels=32, chunk_voxels=8)
REGIONS = export.export_regions(SHAPE, VOXEL, CONFIG)
SPHERE, BOX, TUBE = 1, 2**40 + 3, 7  # one id beyond 32 bits
CUBES = 1000  # the first of many small cubes: what makes legacy meshes many files
SHARDS = 4  # a few shards, so a few merge tasks
ABSENT = 999


def segmentation() -> np.ndarray:
    """A sphere, a box and a tube that cross task borders (the tube the whole volume along x,
    its ends on the volume's faces), and small cubes on a lattice where there is room."""
    seg = np.zeros(SHAPE, np.uint64)
    z, y, x = ((np.ogrid[: SHAPE[0], : SHAPE[1], : SHAPE[2]][a] + 0.5) * VOXEL[a] for a in range(3))
    seg[(z - 600) ** 2 + (y - 500) ** 2 + (x - 420) ** 2 < 250**2] = SPHERE
    seg[44:60, 70:94, 4:40] = BOX
    seg[np.broadcast_to((z - 210) ** 2 + (y - 155) ** 2 < 60**2, SHAPE)] = TUBE
    corners = np.stack(np.meshgrid(*(range(2, n, 12) for n in SHAPE), indexing="ij"), -1)
    for k, corner in enumerate(corners.reshape(-1, 3)):
        # Whole cubes only: igneous's merge drops a mesh under a voxel across (a sliver).
        if not seg[tuple(slice(c - 1, c + 4) for c in corner)].any():
            seg[tuple(slice(c, c + 3) for c in corner)] = CUBES + k
    return seg


def snapshot(folder, names):
    return {name: ((folder / name).read_bytes(), file_record(folder / name)) for name in names}


MESH = "segmentation/mesh"
SHARED = ["segmentation/info", "segmentation/provenance", f"{MESH}/info"]
PLAN = f"{MESH}/{fragment_shards.PLAN}"


def fragment_files(folder, fragments) -> dict:
    """{task: its `.frags`} from what the fragment tasks returned, as the plan takes them."""
    return {task: folder / name for task, files in enumerate(fragments) for name in files}


def shard_segments(folder, count) -> dict[int, list[int]]:
    """Each shard's segments, as the plan lists them."""
    return {
        n: [s for s, _ in fragment_shards.shard_segments(folder / MESH, n)] for n in range(count)
    }


@pytest.fixture(scope="module")
def meshed(tmp_path_factory):
    """A segmentation layer meshed by every task in turn, with the shared files seen between."""
    seg = segmentation()
    folder = tmp_path_factory.mktemp("sharded") / "export"
    # As the stitching writes it for an export: its layout, a region (a shard) at a time.
    chunk = export.plan_scales(SHAPE, VOXEL, CONFIG)[0].chunk_zyx
    layout = export.segmentation_layout(SHAPE, VOXEL, CONFIG, chunk)
    new_segmentation(folder, SHAPE, VOXEL, layout)
    writer = SegmentationWriter(folder)
    for region in REGIONS:
        writer.write(region.slices, seg[region.slices])
    sharded.begin_sharded_meshing(folder, CONFIG)
    begun = snapshot(folder, SHARED)
    # As each region task meshes its region, once it has written its scales.
    fragments = [sharded.fragment_part(folder, CONFIG, k, r) for k, r in enumerate(REGIONS)]
    fragmented = snapshot(folder, SHARED)
    count = sharded.mesh_shard_plan(folder, fragment_files(folder, fragments), SHARDS)
    planned = snapshot(folder, SHARED + [PLAN])
    shards = [sharded.merge_shard(folder, CONFIG, n) for n in range(count)]
    merged = snapshot(folder, SHARED + [PLAN])
    return {
        "folder": folder,
        "seg": seg,
        "fragments": fragments,
        "shards": shards,
        "snapshots": (begun, fragmented, planned, merged),
    }


def segment_ids(seg) -> list[int]:
    return [int(i) for i in np.unique(seg) if i]


def source(folder):
    return CloudVolume(f"file://{folder / 'segmentation'}", progress=False).mesh


def test_info_is_a_sharded_multires_mesh_for_neuroglancer(meshed):
    folder = meshed["folder"]
    assert json.loads((folder / "segmentation" / "info").read_text())["mesh"] == "mesh"
    info = json.loads((folder / MESH / "info").read_text())
    assert info["@type"] == "neuroglancer_multilod_draco"
    assert info["vertex_quantization_bits"] == 16 and info["lod_scale_multiplier"] == 1.0
    assert info["transform"] == [10, 0, 0, 0, 0, 10, 0, 0, 0, 0, 20, 0]  # x, y, z
    spec = info["sharding"]
    assert spec["@type"] == "neuroglancer_uint64_sharded_v1"
    assert spec["hash"] == "murmurhash3_x86_128" and spec["data_encoding"] == "raw"
    assert sharded.mesh_shard_count(folder) == 2 ** spec["shard_bits"] == len(meshed["shards"])
    assert len(meshed["shards"]) == 4  # 303 segments, 64 a shard asked for: 2^round(log2 5)
    assert source(folder).meta.is_sharded()


def test_every_segment_has_a_mesh_spanning_its_voxels(meshed):
    folder, seg = meshed["folder"], meshed["seg"]
    ids = segment_ids(seg)
    assert {SPHERE, BOX, TUBE} <= set(ids) and len(ids) == 303
    meshes = source(folder).get(ids)
    assert sorted(meshes) == ids
    # Within a voxel plus the simplification's tolerance of the segment's voxels (nm, x y z).
    tolerance = max(VOXEL) + CONFIG.mesh_max_error_nm
    for segment in ids:
        vertices = meshes[segment].vertices
        where = np.argwhere(seg == segment)
        low = (where.min(0) * VOXEL)[::-1]
        high = ((where.max(0) + 1) * VOXEL)[::-1]
        assert len(vertices)
        assert np.all(vertices >= low - tolerance) and np.all(vertices <= high + tolerance)
        assert np.allclose(vertices.min(0), low, atol=tolerance), segment
        assert np.allclose(vertices.max(0), high, atol=tolerance), segment


def test_a_segment_absent_from_the_volume_has_no_mesh(meshed):
    mesh = source(meshed["folder"])
    assert ABSENT not in segment_ids(meshed["seg"])
    with pytest.raises(MeshMissingError):
        mesh.get(ABSENT)
    assert set(mesh.get([ABSENT, SPHERE], allow_missing=True)) == {SPHERE}


def test_few_files_each_written_by_one_task_and_far_fewer_than_legacy(meshed, tmp_path):
    folder, seg = meshed["folder"], meshed["seg"]
    tasks = len(REGIONS)
    shards = len(meshed["shards"])
    recorded = {}
    for files in meshed["fragments"] + meshed["shards"]:
        assert not recorded.keys() & files.keys()  # no file written by two tasks
        recorded |= files
    assert not any(damaged(folder, files) for files in meshed["fragments"] + meshed["shards"])
    written = {p.relative_to(folder).as_posix() for p in (folder / MESH).iterdir()}
    # What the tasks wrote, the plan and the info: all there is (no spatial index, no lists of
    # a shard's segments).
    assert written == recorded.keys() | {PLAN, f"{MESH}/info"}
    frags = [n for n in recorded if n.endswith(".frags")]
    assert len(frags) == tasks == 24  # every region holds a segment
    assert sum(n.endswith(".shard") for n in recorded) == shards
    assert len(written) == tasks + shards + 2 == 30

    # Legacy meshes of the same segmentation: a fragment per segment per task, a manifest each.
    legacy = tmp_path / "legacy"
    shutil.copytree(folder, legacy)
    export.begin_export(legacy, SHAPE, VOXEL, CONFIG)
    legacy_tasks = export.mesh_task_count(SHAPE, CONFIG)
    fragments = sum(len(export.mesh_part(legacy, CONFIG, i)) for i in range(legacy_tasks))
    legacy_files = fragments + len(segment_ids(seg)) + 1  # + manifests + info
    assert legacy_files > 10 * len(written)  # 707 files here, 30 sharded


def test_tasks_write_no_shared_file_and_the_info_once_before_merging(meshed):
    begun, fragmented, planned, merged = meshed["snapshots"]
    assert fragmented == begun  # the fragment tasks only read the mesh info and provenance
    assert merged == planned  # nor do the merge tasks rewrite the plan
    info = json.loads(begun[f"{MESH}/info"][0])
    assert info["@type"] == "neuroglancer_legacy_mesh" and "spatial_index" not in info
    assert planned["segmentation/info"] == begun["segmentation/info"]
    processing = json.loads(planned["segmentation/provenance"][0])["processing"]
    assert [p["method"]["task"] for p in processing] == ["MeshTask", "MultiResShardedMeshMergeTask"]
    assert processing[0]["method"]["sharded"] and not processing[0]["method"]["spatial_index"]


def test_fragment_tasks_are_igneous_own(meshed, tmp_path):
    """igneous's own task set over regions of the same shape holds each region task's meshing
    task (at the volume's end igneous clamps a task's box; the regions are clipped)."""
    from igneous.task_creation import create_meshing_tasks

    folder = meshed["folder"]
    copy = tmp_path / "copy"  # igneous's task maker rewrites the shared files
    shutil.copytree(folder, copy)
    theirs = create_meshing_tasks(
        f"file://{copy / 'segmentation'}",
        shape=export.xyz(REGIONS[0].shape),
        sharded=True,
        **sharded._meshing_options(CONFIG),
    )
    expected = {}
    for task in theirs:
        payload = task.payload()
        payload["layer_path"] = payload["layer_path"].replace(str(copy), str(folder))
        offset, shape = list(payload["offset"]), list(payload["shape"])
        end = [min(o + n, s) for o, n, s in zip(offset, shape, export.xyz(SHAPE), strict=True)]
        payload["shape"] = [e - o for e, o in zip(end, offset, strict=True)]
        expected[tuple(offset)] = payload
    mine = [sharded._igneous_mesh_task(folder, CONFIG, r, sharded=True).payload() for r in REGIONS]
    assert len(mine) == len(expected) == 24
    for payload in mine:
        payload["shape"] = list(payload["shape"])
        assert payload | {"class": ANY} == expected[tuple(payload["offset"])]


def test_a_merge_rerun_rewrites_its_truncated_shard(meshed, tmp_path):
    folder = tmp_path / "export"
    shutil.copytree(meshed["folder"], folder)
    number, files = next((n, f) for n, f in enumerate(meshed["shards"]) if f)
    ((name, record),) = files.items()
    original = (meshed["folder"] / name).read_bytes()
    with open(folder / name, "r+b") as f:
        f.truncate(len(original) // 2)
    assert damaged(folder, files)
    again = sharded.merge_shard(folder, CONFIG, number)
    assert again.keys() == files.keys() and again[name][0] == record[0]
    assert (folder / name).read_bytes() == original
    ids = segment_ids(meshed["seg"])
    mesh = source(folder)
    assert sorted(mesh.get(ids)) == ids
    with pytest.raises(ValueError, match="mesh shard 4 of 4"):
        sharded.merge_shard(folder, CONFIG, 4)
    plan = folder / PLAN
    with open(plan, "r+b") as f:
        f.truncate(plan.stat().st_size - 8)
    with pytest.raises(PrecomputedError, match="plan.npy: no whole plan"):
        sharded.merge_shard(folder, CONFIG, 0)
    plan.unlink()
    with pytest.raises(PrecomputedError, match="plan.npy: no whole plan"):
        sharded.merge_shard(folder, CONFIG, 0)


def test_a_merge_maps_no_fragment_file(meshed, tmp_path, monkeypatch):
    """MapBuffer maps a file it is given whole, and the pages read stay the process's memory: a
    merge reading its segments from every region's fragments would hold them all. It reads a
    segment's bytes alone."""
    import mmap

    folder = tmp_path / "export"
    shutil.copytree(meshed["folder"], folder)
    mapped = []

    class Recorded(mmap.mmap):  # a type still: MapBuffer asks isinstance(buffer, mmap.mmap)
        def __new__(cls, fileno, *args, **kwargs):
            mapped.append(os.readlink(f"/proc/self/fd/{fileno}"))
            return super().__new__(cls, fileno, *args, **kwargs)

    monkeypatch.setattr(mmap, "mmap", Recorded)
    number, files = next((n, f) for n, f in enumerate(meshed["shards"]) if f)
    ((name, _),) = files.items()
    assert sharded.merge_shard(folder, CONFIG, number).keys() == files.keys()
    assert (folder / name).read_bytes() == (meshed["folder"] / name).read_bytes()
    assert mapped and not [m for m in mapped if m.endswith(".frags")]  # the plan is mapped


def test_a_shard_is_what_igneous_makes_of_the_same_fragments(meshed):
    """The merge takes a segment at a time; igneous's own shard maker, given every segment's
    fragments at once (concatenated and consolidated as its merge task does), makes the same
    bytes."""
    from cloudvolume import Mesh
    from igneous.tasks.mesh.multires import create_mesh_shard
    from mapbuffer import MapBuffer

    folder = meshed["folder"]
    volume = CloudVolume(f"file://{folder / 'segmentation'}", progress=False)
    volume.mip = volume.mesh.meta.mip
    number, files = next((n, f) for n, f in enumerate(meshed["shards"]) if f)
    meshes = {}
    for segment, tasks in fragment_shards.shard_segments(folder / MESH, number):
        parts = []
        for task in tasks:
            content = (folder / MESH / f"{task}.frags").read_bytes()
            parts.append(MapBuffer(content, frombytesfn=Mesh.from_precomputed)[segment])
        meshes[segment] = Mesh.concatenate(*parts, segid=segment).consolidate()
    assert len(meshes) > 10 and any(
        len(tasks) > 1 for _, tasks in fragment_shards.shard_segments(folder / MESH, number)
    )
    name, content = create_mesh_shard(
        volume, meshes, CONFIG.num_scales - 1, sharded.DRACO_COMPRESSION_LEVEL, False,
        format(number, "x"), sharded.MIN_CHUNK_VOXELS,
    )  # fmt: skip
    ((ours,),) = [files]
    assert ours == f"{MESH}/{name}" and (folder / ours).read_bytes() == content


def test_a_large_mesh_gets_a_level_of_detail_per_scale(meshed, tmp_path, monkeypatch):
    """igneous makes coarser levels only for meshes `MIN_CHUNK_VOXELS` across (none here): with
    smaller boxes the sphere gets one per scale, each with fewer triangles."""
    folder = tmp_path / "export"
    shutil.copytree(meshed["folder"], folder)
    monkeypatch.setattr(sharded, "MIN_CHUNK_VOXELS", (4, 4, 4))
    assert source(folder).get_manifest(SPHERE).num_lods == 1
    shard = source(folder).reader.get_filename(SPHERE)
    sharded.merge_shard(folder, CONFIG, int(shard.removesuffix(".shard"), 16))
    mesh = source(folder)
    assert mesh.get_manifest(SPHERE).num_lods == CONFIG.num_scales
    faces = [len(mesh.get(SPHERE, lod=lod)[SPHERE].faces) for lod in range(CONFIG.num_scales)]
    assert faces == sorted(faces, reverse=True) and faces[-1] < faces[0] / 2


def test_a_fragment_task_rerun_on_a_planned_export_writes_what_it_records(meshed, tmp_path):
    folder = tmp_path / "export"  # planned: a fragment task runs on its sharded `info` too
    shutil.copytree(meshed["folder"], folder)
    config = dataclasses.replace(CONFIG, gzip=True)  # fragments are never gzipped
    before = (folder / MESH / "0.frags").read_bytes()
    files = sharded.fragment_part(folder, config, 0, REGIONS[0])
    assert list(files) == [f"{MESH}/0.frags"] and not damaged(folder, files)
    assert (folder / MESH / "0.frags").read_bytes() == before


def test_a_shard_no_segment_hashes_to_has_no_file(meshed, tmp_path):
    folder = tmp_path / "export"
    shutil.copytree(meshed["folder"], folder)
    ids = segment_ids(meshed["seg"])
    count = sharded.mesh_shard_plan(folder, fragment_files(folder, meshed["fragments"]), 303)
    assert count == 256  # 2^round(log2(303)): shards no segment hashes to
    assert not list((folder / MESH).glob("*.shard"))  # the earlier plan's shards went
    spec = json.loads((folder / MESH / "info").read_text())["sharding"]
    labels = shard_segments(folder, count)
    assert sorted(sum(labels.values(), [])) == ids
    empty = next(n for n, segments in labels.items() if not segments)
    assert sharded.merge_shard(folder, CONFIG, empty) == {}
    full = next(n for n, segments in labels.items() if segments)
    assert sharded.merge_shard(folder, CONFIG, full)
    assert sorted(source(folder).get(labels[full])) == sorted(labels[full])
    assert spec["shard_bits"] == 8


def test_shard_count_follows_the_merge_tasks_unless_the_indices_overflow():
    def bits(segments: int, shards: int) -> int:
        return fragment_shards.hashed_sharding(segments, shards, "raw")["shard_bits"]

    assert bits(0, 1) == 0
    assert bits(1500, 2) == 1
    assert bits(123, 5) == 2  # 2^round(log2(5))
    assert bits(10**6, 64) == 6
    assert bits(10**7, 1) == 4  # 8 KiB and 32 KiB indices
    with pytest.raises(ValueError, match="shards must be >= 1"):
        fragment_shards.hashed_sharding(10, 0, "raw")
