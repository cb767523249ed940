"""Skeletons of an export: igneous's skeleton tasks on a real small segmentation, a region each,
merged into a sharded skeleton source that cloud-volume reads back as Neuroglancer would; each
skeleton inside its object and one piece across the regions; a task killed or lost is redone on
resume and a finished one is not; the viewer names the skeletons."""

import json
import shutil
import time
import urllib.request
from pathlib import Path
from unittest.mock import ANY

import numpy as np
import pytest
from cloudvolume import CloudVolume
from faults import killed_mid_write
from scipy import ndimage

from apps.contracts import ExportSkeletons, MergeSkeletons, PlanSkeletons
from apps.export import export_skeletons, merge_skeletons, plan_skeletons
from pipeline.core.config_io import to_dict
from pipeline.export import layers as export
from pipeline.export import skeletons, viewer
from pipeline.export.fragment_shards import shard_segments
from pipeline.export.layers import ExportConfig, export_complete, export_precomputed
from pipeline.export.segmentation_layer import SegmentationWriter, new_segmentation

SHAPE = (32, 64, 96)  # (z, y, x)
VOXEL = (20.0, 10.0, 10.0)
# Regions of 16 x 32 x 64 voxels: 2 along every axis, a skeleton task each.
CONFIG = ExportConfig(task_voxels=32, chunk_voxels=8)
REGIONS = export.export_regions(SHAPE, VOXEL, CONFIG)
TUBE, TEE, BALL, PAIR, DUST = 2**40 + 3, 5, 9, 10, 12  # one id beyond 32 bits
OBJECTS = (TUBE, TEE, BALL, PAIR)
SKELETONS = "segmentation/skeletons"
ROOT = Path(__file__).resolve().parents[2]


def segmentation() -> np.ndarray:
    """A tube the whole volume along x, across every region's faces (its axis near the corner
    where four regions meet); a T of two thinner tubes, the bar along y, the stem along x; a
    ball across a region's face; two balls apart with one id; a cube too small to skeletonize."""
    seg = np.zeros(SHAPE, np.uint64)
    z, y, x = ((np.ogrid[: SHAPE[0], : SHAPE[1], : SHAPE[2]][a] + 0.5) * VOXEL[a] for a in range(3))
    seg[np.broadcast_to((z - 310) ** 2 + (y - 315) ** 2 < 70**2, SHAPE)] = TUBE
    bar = ((z - 500) ** 2 + (x - 250) ** 2 < 45**2) & (y > 40) & (y < 620)
    stem = ((z - 500) ** 2 + (y - 430) ** 2 < 45**2) & (x > 250) & (x < 880)
    seg[bar | stem] = TEE
    seg[(z - 160) ** 2 + (y - 520) ** 2 + (x - 640) ** 2 < 110**2] = BALL
    for x0 in (100, 400):  # a segment of two pieces, which stay apart
        seg[(z - 560) ** 2 + (y - 80) ** 2 + (x - x0) ** 2 < 70**2] = PAIR
    seg[:2, :3, 90:93] = DUST
    return seg


def layer(folder, seg) -> None:
    """The segmentation's full resolution as the stitching writes it for an export."""
    chunk = export.plan_scales(SHAPE, VOXEL, CONFIG)[0].chunk_zyx
    new_segmentation(folder, SHAPE, VOXEL, export.segmentation_layout(SHAPE, VOXEL, CONFIG, chunk))
    writer = SegmentationWriter(folder)
    for region in REGIONS:
        writer.write(region.slices, seg[region.slices])


def fragments(folder, pieces) -> dict:
    return {k: folder / name for k, files in enumerate(pieces) for name in files}


@pytest.fixture(scope="module")
def skeletonized(tmp_path_factory):
    """Every skeleton task, the plan and the merges, in turn, on the segmentation layer."""
    seg = segmentation()
    folder = tmp_path_factory.mktemp("skeletons") / "export"
    layer(folder, seg)
    started = time.perf_counter()
    pieces = [skeletons.skeleton_part(folder, k, region) for k, region in enumerate(REGIONS)]
    seconds = time.perf_counter() - started
    shards = skeletons.skeleton_shard_plan(folder, fragments(folder, pieces), 2, sharded=True)
    merged = [skeletons.merge_skeleton_shard(folder, n) for n in range(shards)]
    return {"folder": folder, "seg": seg, "pieces": pieces, "merged": merged, "seconds": seconds}


def planned(skeletonized) -> dict[int, set[int]]:
    """Each segment the plan lists, with the skeleton tasks holding its pieces."""
    where = skeletonized["folder"] / SKELETONS
    return {
        segment: set(map(int, tasks))
        for n in range(len(skeletonized["merged"]))
        for segment, tasks in shard_segments(where, n)
    }


def source(folder):
    return CloudVolume(f"file://{folder / 'segmentation'}", progress=False).skeleton


def in_voxels(vertices: np.ndarray) -> np.ndarray:
    """(z, y, x) voxel indices of skeleton vertices (x, y, z, nm; at voxel centres)."""
    return np.floor(vertices / np.array(VOXEL[::-1])).astype(int)[:, ::-1]


def test_the_segmentation_names_a_sharded_skeleton_source(skeletonized):
    folder = skeletonized["folder"]
    assert len(REGIONS) == 8 and skeletonized["seconds"] < 60
    assert json.loads((folder / "segmentation" / "info").read_text())["skeletons"] == "skeletons"
    info = json.loads((folder / SKELETONS / "info").read_text())
    assert info["@type"] == "neuroglancer_skeletons" and info["mip"] == 0
    assert info["transform"] == [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0]  # vertices in nm
    assert info["vertex_attributes"] == [
        {"id": "radius", "data_type": "float32", "num_components": 1}
    ]
    spec = info["sharding"]
    assert spec["@type"] == "neuroglancer_uint64_sharded_v1" and spec["data_encoding"] == "gzip"
    assert source(folder).meta.is_sharded()
    shards = [name for files in skeletonized["merged"] for name in files]
    assert shards and all(name.endswith(".shard") for name in shards)


def test_every_object_has_a_skeleton_inside_it(skeletonized):
    folder, seg = skeletonized["folder"], skeletonized["seg"]
    for segment in OBJECTS:
        skeleton = source(folder).get(segment)
        assert len(skeleton.vertices) > 1 and len(skeleton.edges), segment
        assert np.all(skeleton.radius > 0), segment
        voxels = in_voxels(skeleton.vertices)
        assert np.all(voxels >= 0) and np.all(voxels < SHAPE), segment
        inside = seg[tuple(voxels.T)] == segment
        # Every vertex on a voxel of its object, or (a loop of two regions' pieces collapsed
        # to its centre by the merge) next to one.
        near = ndimage.binary_dilation(seg == segment)[tuple(voxels.T)]
        assert inside.mean() > 0.9 and near.all(), (segment, inside.mean())


def test_a_skeleton_across_regions_is_one_tree_the_length_of_its_object(skeletonized):
    folder = skeletonized["folder"]
    tube = source(folder).get(TUBE)
    # Pieces from all 8 regions, joined at the faces: one piece, end to end along x.
    assert planned(skeletonized)[TUBE] == set(range(8))
    assert len(tube.components()) == 1
    x = tube.vertices[:, 0]
    assert x.min() < 2 * VOXEL[2] and x.max() > SHAPE[2] * VOXEL[2] - 2 * VOXEL[2]
    tee = source(folder).get(TEE)
    assert len(tee.components()) == 1
    degrees = np.bincount(tee.edges.ravel(), minlength=len(tee.vertices))
    assert (degrees >= 3).sum() >= 1 and (degrees == 1).sum() == 3  # a fork, three ends
    assert len(source(folder).get(PAIR).components()) == 2


def test_an_object_too_small_gets_no_skeleton(skeletonized):
    assert planned(skeletonized).keys() == set(OBJECTS)  # DUST: under the dust threshold


def test_unsharded_skeletons_are_a_file_per_segment_read_back_alike(skeletonized, tmp_path):
    folder = tmp_path / "export"
    shutil.copytree(skeletonized["folder"], folder)
    pieces = fragments(folder, skeletonized["pieces"])
    shards = skeletons.skeleton_shard_plan(folder, pieces, 2, sharded=False)
    assert not list((folder / SKELETONS).glob("*.shard"))  # the sharded plan's went
    files = skeletons.merge_skeleton_part(folder, 0, 1)
    assert shards >= 1 and sorted(files) == sorted(f"{SKELETONS}/{i}" for i in OBJECTS)
    assert "sharding" not in json.loads((folder / SKELETONS / "info").read_text())
    unsharded, sharded = source(folder), source(skeletonized["folder"])
    assert not unsharded.meta.is_sharded()
    for segment in OBJECTS:
        np.testing.assert_array_equal(
            unsharded.get(segment).vertices, sharded.get(segment).vertices
        )


def test_skeleton_tasks_are_igneous_own_and_read_their_region_and_a_voxel_past_it(
    skeletonized, tmp_path
):
    """igneous's own task set over regions of the same shape holds each of our tasks (at the
    volume's end igneous's boxes reach past it and the task clamps them to it; the regions are
    clipped), each reading its region and a voxel past its high faces (the contract's part)."""
    from igneous.task_creation import create_skeletonizing_tasks

    folder = skeletonized["folder"]
    copy = tmp_path / "copy"  # igneous's task maker rewrites the shared files
    shutil.copytree(folder, copy)
    theirs = create_skeletonizing_tasks(
        f"file://{copy / 'segmentation'}",
        shape=export.xyz(REGIONS[0].shape),
        **skeletons.skeletonizing_options(),
    )

    def clipped(payload: dict) -> dict:
        offset, extent = payload["offset"], export.xyz(SHAPE)
        for key in ("shape", "spatial_grid_shape"):
            ends = [min(o + n, s) for o, n, s in zip(offset, payload[key], extent, strict=True)]
            payload[key] = [e - o for e, o in zip(ends, offset, strict=True)]
        return payload | {"class": ANY}

    expected = {}
    for task in theirs:
        payload = task.payload()
        payload["cloudpath"] = payload["cloudpath"].replace(str(copy), str(folder))
        expected[tuple(payload["offset"])] = clipped(payload)
    mine = [skeletons._igneous_skeleton_task(folder, r).payload() for r in REGIONS]
    assert len(mine) == len(expected) == 8
    for payload, region in zip(mine, REGIONS, strict=True):
        assert clipped(payload) == expected[tuple(payload["offset"])]
        read = skeletons.skeleton_read(region, SHAPE)
        assert export.xyz(read.start) == payload["offset"]
        assert export.xyz(read.shape) == clipped(payload)["shape"]


# The workflow's skeleton apps, in the order it runs them, each on what it reads and writes.
def app_steps(folder) -> list:
    base = {"export": to_dict(CONFIG), "shape": list(SHAPE)}
    begun = folder / "records" / "begun.record"
    full = folder / "segmentation" / export.full_resolution_key(VOXEL)
    record = lambda kind, k: export.task_record_path(folder, kind, k)  # noqa: E731
    tasks = export.export_tasks(SHAPE, VOXEL, CONFIG)
    steps = [
        (export_skeletons, {**base, "region": str(r), "index": k},
         ExportSkeletons(begun=begun, segmentation=full, record=record("skeleton", k)))
        for k, r in enumerate(REGIONS)
    ]  # fmt: skip
    pieces = tuple(record("skeleton", k) for k in range(len(REGIONS)))
    plan = record("skeleton_plan", 0)
    shards = export.skeleton_shards(len(REGIONS))
    steps.append(
        (plan_skeletons, {**base, "shards": shards}, PlanSkeletons(skeletons=pieces, plan=plan))
    )
    merges = tasks["skeleton_merge"]
    steps += [
        (merge_skeletons, {**base, "merge": j, "merges": merges},
         MergeSkeletons(plan=(plan,), record=record("skeleton_merge", j)))
        for j in range(merges)
    ]  # fmt: skip
    return steps


def resume(folder) -> list[str]:
    """Every skeleton app as a resumed workflow's worker runs it (`run_once`: up to date or
    run; the app's own function: Parsl's wrapper would return an error, not raise it); what
    each did."""
    return [
        app.func.__wrapped__(settings, str(folder), io=io)
        for app, settings, io in app_steps(folder)
    ]


# A skeleton task killed while it writes its pieces (tests/faults.py: half of its file written,
# then SIGKILL, as a lost node or an out-of-memory kill would stop it).
_RUN_A_SKELETON_TASK = r"""
here = pathlib.Path(sys.argv[2])
sys.path[:0] = [str(here), str(here.parent)]  # this module and the tests' helpers
from test_export_skeletons import app_steps

folder = pathlib.Path(sys.argv[1])
app, settings, io = app_steps(folder)[1]
app.func.__wrapped__(settings, str(folder), io=io)
"""


def kill_mid_write(folder, tmp_path) -> None:
    here = str(Path(__file__).parent)
    killed_mid_write(
        _RUN_A_SKELETON_TASK, ".frags", tmp_path / "writing", str(folder), here, cwd=ROOT
    )


def pieces(folder) -> dict[str, int]:
    """The skeleton tasks' files, with their mtimes (not the temporary of one killed)."""
    return {p.name: p.stat().st_mtime_ns for p in (folder / SKELETONS).glob("[0-9]*.frags")}


def test_a_skeleton_task_killed_or_lost_is_redone_on_resume_and_a_finished_one_is_not(
    skeletonized, tmp_path
):
    """A task's files are its own (no other task writes them): a resume runs the task whose
    record is missing (killed before it wrote it), then the plan and merges that read it, and
    no other. A file lost after its task finished is the last task's to repair (below)."""
    folder = tmp_path / "export"
    shutil.copytree(skeletonized["folder"], folder)
    (folder / "records").mkdir()
    (folder / "records" / "begun.record").write_text("{}")  # the begin task's (no voxels)
    steps = len(app_steps(folder))
    assert set(resume(folder)) == {"ran"}  # a first run: every task, each stamps its record
    assert resume(folder) == ["up to date"] * steps
    before = pieces(folder)
    expected = {s: source(folder).get(s).vertices for s in OBJECTS}

    # Task 1 killed halfway through writing its pieces: its record and its file gone, half a
    # file beside where it would be.
    record = export.task_record_path(folder, "skeleton", 1)
    record.unlink()
    (folder / SKELETONS / "1.frags").unlink()
    kill_mid_write(folder, tmp_path)
    assert not record.exists() and not (folder / SKELETONS / "1.frags").exists()
    done = resume(folder)
    assert done[:8] == ["up to date", "ran", *["up to date"] * 6]
    assert set(done[8:]) == {"ran"}  # the plan and the merges, whose input changed
    after = pieces(folder)
    assert after.keys() == before.keys() and after["1.frags"] != before["1.frags"]
    assert {k: v for k, v in after.items() if k != "1.frags"} == {
        k: v for k, v in before.items() if k != "1.frags"
    }
    assert len(list((folder / SKELETONS).glob(".1.tmp-*"))) == 1  # the half, never read
    for segment, vertices in expected.items():
        np.testing.assert_array_equal(source(folder).get(segment).vertices, vertices)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A whole export of the small segmentation (its image: the labels' shades), one region."""
    seg = segmentation()
    raw = (seg % 200 + 30).astype(np.uint8)
    out = tmp_path_factory.mktemp("whole") / "precomputed"
    export_precomputed(raw, seg, VOXEL, out, ExportConfig(chunk_voxels=8))
    return out, raw, seg


def test_an_export_has_skeletons_its_records_vouch_for_and_can_go_without(exported, tmp_path):
    out, raw, seg = exported
    assert export_complete(out)
    summary = json.loads((out / "export.json").read_text())["records"]
    assert summary["skeleton"] == 1 and summary["skeleton_plan"] == 1
    recorded = set()
    for kind in ("skeleton", "skeleton_plan", "skeleton_merge"):
        for k in range(summary[kind]):
            recorded |= set(export.recorded_files(export.task_record_path(out, kind, k)))
    written = {p.relative_to(out).as_posix() for p in (out / SKELETONS).iterdir()}
    assert written == recorded
    assert {s.id for s in source(out).get(list(OBJECTS))} == set(OBJECTS)

    # Damaged, then repaired by the last task: only the skeletons' tasks run again.
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / SKELETONS / "0.frags").unlink()
    assert not export_complete(copy)
    tasks = json.loads((copy / "export.json").read_text())["records"]
    read = lambda roi: (raw[roi.slices], seg[roi.slices])  # noqa: E731
    repaired, counts = export.repair_export(copy, tasks, read, SHAPE, VOXEL, CONFIG)
    assert repaired == ["skeleton 0", "skeleton plan", "skeleton merge 0"]
    export.finish_export(copy, counts, SHAPE, VOXEL, CONFIG, tasks, repaired)
    assert export_complete(copy)

    # Without skeletons: none named, none kept.
    without = ExportConfig(chunk_voxels=8, skeletons=False)
    bare = tmp_path / "bare"
    export_precomputed(raw, seg, VOXEL, bare, without)
    assert export_complete(bare) and not (bare / SKELETONS).exists()
    assert "skeletons" not in json.loads((bare / "segmentation" / "info").read_text())
    assert json.loads((bare / "export.json").read_text())["records"]["skeleton"] == 0


def test_the_viewer_names_the_skeleton_source(exported, tmp_path):
    out, _, _ = exported
    with viewer.start_viewer(out) as handle:
        source_state = handle.viewer.state.layers["segmentation"].source[0]
        assert source_state.url == f"precomputed://{handle.data_url}/segmentation"
        assert source_state.subsources["skeletons"].enabled
        with urllib.request.urlopen(f"{handle.data_url}/{SKELETONS}/info", timeout=10) as response:
            assert json.loads(response.read())["@type"] == "neuroglancer_skeletons"
