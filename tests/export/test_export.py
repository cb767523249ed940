"""Precomputed export: arrays read back unchanged in the right axis order, resolution and scales,
meshes where the objects are, the completeness record, atomic output and one test per input error.
"""

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np
import processes
import pytest
from cloudvolume import CloudVolume
from faults import killed_mid_write, zero_bytes
from igneous.tasks.mesh.mesh import MeshManifestFilesystemTask

from pipeline.cli import export as export_cli
from pipeline.core.errors import (
    ConfigError,
    EmptyLabelsError,
    MissingChunkError,
    PrecomputedError,
    VolumeDtypeError,
    VolumeShapeError,
    VoxelSizeError,
)
from pipeline.data.synthetic import SyntheticConfig, generate
from pipeline.data.volumes import open_volume, write_volumes
from pipeline.export import layers as export
from pipeline.export import meshes as export_meshes
from pipeline.export.layers import ExportConfig, export_complete, export_precomputed, plan_scales
from pipeline.export.segmentation_layer import SegmentationWriter, new_segmentation

ROOT = Path(__file__).resolve().parents[2]

# Every axis a different length, so any swap of axes changes the shape read back.
SHAPE = (24, 48, 64)
VOXEL = (20.0, 10.0, 10.0)
# Chunks (12, 24, 24) at full resolution: several along every axis, one cut through the middle.
CONFIG = ExportConfig(chunk_voxels=24)


@pytest.fixture(scope="module")
def volume():
    config = SyntheticConfig(seed=5).with_geometry(shape_zyx=SHAPE, voxel_size_nm=VOXEL)
    return generate(config)


@pytest.fixture(scope="module")
def exported(volume, tmp_path_factory):
    raw, segmentation = volume
    out = tmp_path_factory.mktemp("export") / "precomputed"
    result = export_precomputed(raw, segmentation, VOXEL, out, CONFIG)
    return out, result


def read_layer(folder, layer, mip=0):
    """A layer read back with cloud-volume, as (z, y, x)."""
    data = CloudVolume(f"file://{folder / layer}", mip=mip, progress=False)[:, :, :]
    return np.asarray(data)[..., 0].T


def mesh_vertices(meshes, segment: int) -> np.ndarray:
    """A segment's mesh's vertices (x, y, z, nm): legacy, or multi-resolution (finest level)."""
    mesh = meshes.get(segment)
    return (mesh[segment] if isinstance(mesh, dict) else mesh).vertices


def test_layers_read_back_unchanged_in_zyx(volume, exported):
    raw, segmentation = volume
    folder, _ = exported
    assert np.array_equal(read_layer(folder, "image"), raw)
    back = read_layer(folder, "segmentation")
    assert back.dtype == np.uint64
    assert np.array_equal(back, segmentation)


def test_info_has_the_voxel_size_in_xyz_and_three_scales(exported):
    folder, result = exported
    for layer in ("image", "segmentation"):
        info = json.loads((folder / layer / "info").read_text())
        scales = info["scales"]
        assert [s["resolution"] for s in scales] == [[10, 10, 20], [20, 20, 20], [40, 40, 40]]
        assert [s["size"] for s in scales] == [[64, 48, 24], [32, 24, 24], [16, 12, 12]]
        assert scales[0]["chunk_sizes"] == [[24, 24, 12]]
    assert json.loads((folder / "segmentation" / "info").read_text())["mesh"] == "mesh"
    assert len(result.scales) == 3


def test_downsampled_scales_keep_grey_levels_and_segment_ids(volume, exported):
    raw, segmentation = volume
    folder, _ = exported
    image = read_layer(folder, "image", mip=1)
    assert image.shape == (24, 24, 32)
    # Averaging 2 x 2 in y, x (z is already as coarse as the new y, x): near the mean of mip 0.
    assert abs(float(image.mean()) - float(raw.mean())) < 1.0
    labels = read_layer(folder, "segmentation", mip=2)
    assert labels.shape == (12, 12, 16)
    assert set(np.unique(labels)) <= set(np.unique(segmentation))


def test_every_segment_has_a_mesh_inside_the_volume_where_its_voxels_are(volume, exported):
    _, segmentation = volume
    folder, result = exported
    ids = [int(i) for i in np.unique(segmentation) if i]
    assert result.segment_count == len(ids)
    properties = json.loads((folder / "segmentation" / "segment_properties" / "info").read_text())
    assert properties["inline"]["ids"] == [str(i) for i in ids]
    source = CloudVolume(f"file://{folder / 'segmentation'}", progress=False)
    assert source.mesh.meta.is_sharded()  # multi-resolution, in shards
    extent_xyz = np.multiply(SHAPE, VOXEL)[::-1]
    for segment in ids:
        vertices = mesh_vertices(source.mesh, segment)  # (x, y, z) in nm
        assert len(vertices)
        # Inside the volume, up to the simplification's tolerance.
        slack = CONFIG.mesh_max_error_nm
        assert np.all(vertices >= -slack) and np.all(vertices <= extent_xyz + slack)
        # The mesh spans the segment's voxels (nm, x y z), within a voxel plus the simplification.
        where = np.argwhere(segmentation == segment)
        low = (where.min(0) * VOXEL)[::-1]
        high = ((where.max(0) + 1) * VOXEL)[::-1]
        tolerance = max(VOXEL) + slack
        assert np.allclose(vertices.min(0), low, atol=tolerance)
        assert np.allclose(vertices.max(0), high, atol=tolerance)


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "unsharded"])
def test_an_export_cut_into_many_tasks_writes_what_one_does(volume, tmp_path, sharded):
    raw, segmentation = volume
    one = ExportConfig(chunk_voxels=8, sharded=sharded)
    small = dataclasses.replace(one, task_voxels=16)
    regions = export.export_regions(SHAPE, VOXEL, small)
    assert len(regions) > 1 and export.mesh_task_count(SHAPE, small) == 2 * 3 * 4
    assert sum(np.prod(r.shape) for r in regions) == np.prod(SHAPE)
    assert len(export.export_regions(SHAPE, VOXEL, one)) == 1
    folder = tmp_path / "one"
    whole = export_precomputed(raw, segmentation, VOXEL, folder, one)
    cut = export_precomputed(raw, segmentation, VOXEL, tmp_path / "cut", small)
    assert cut.segment_count == whole.segment_count
    for layer in ("image", "segmentation"):
        files = sorted(p.relative_to(folder) for p in (folder / layer).glob("*_*_*/*"))
        cut_files = sorted(
            p.relative_to(tmp_path / "cut") for p in (tmp_path / "cut" / layer).glob("*_*_*/*")
        )
        if sharded:  # a shard a region and scale: the same voxels, cut otherwise
            assert len(files) == len(whole.scales)
            assert len(cut_files) == len(regions) * len(cut.scales)
            for mip in range(len(whole.scales)):
                np.testing.assert_array_equal(
                    read_layer(folder, layer, mip), read_layer(tmp_path / "cut", layer, mip)
                )
            continue
        assert files and files == cut_files  # unsharded, the same chunk files, byte for byte
        for chunk in files:
            assert (folder / chunk).read_bytes() == (tmp_path / "cut" / chunk).read_bytes()
    properties = "segmentation/segment_properties/info"
    assert (folder / properties).read_text() == (tmp_path / "cut" / properties).read_text()
    cut_mesh = CloudVolume(f"file://{tmp_path / 'cut' / 'segmentation'}", progress=False).mesh
    for segment in np.unique(segmentation)[1:]:
        assert len(mesh_vertices(cut_mesh, int(segment)))
    if sharded:
        return

    # The manifests, written without holding every fragment's name, are igneous's own.
    mesh_dir = tmp_path / "cut" / "segmentation" / "mesh"
    ours = {p.name: p.read_text() for p in mesh_dir.glob("*:0")}
    assert max(len(json.loads(m)["fragments"]) for m in ours.values()) > 1  # across tasks
    for name in ours:
        (mesh_dir / name).unlink()
    MeshManifestFilesystemTask(f"file://{tmp_path / 'cut' / 'segmentation'}")
    theirs = {p.name: json.loads(p.read_text()) for p in mesh_dir.glob("*:0")}
    assert theirs.keys() == ours.keys()
    for name, manifest in theirs.items():
        assert sorted(manifest["fragments"]) == sorted(json.loads(ours[name])["fragments"])


def test_meshing_tasks_are_igneous_own_and_write_no_shared_file(volume, tmp_path):
    """Meshing tasks run side by side: they must not rewrite the files the others read (igneous's
    task maker rewrites the mesh info and the layer's provenance in place, every call)."""
    from igneous.task_creation import create_meshing_tasks

    raw, segmentation = volume
    # Legacy meshes (sharded ones: tests/export/test_export_meshes.py).
    config = ExportConfig(chunk_voxels=8, task_voxels=16, sharded=False)
    folder = tmp_path / "out"
    export_precomputed(raw, segmentation, VOXEL, folder, config)
    layer = folder / "segmentation"
    shared = [layer / "info", layer / "provenance", layer / "mesh" / "info"]
    before = {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in shared}
    # One provenance entry for the task set, not one per task.
    processing = json.loads((layer / "provenance").read_text())["processing"]
    assert [p["method"]["task"] for p in processing] == ["MeshTask"]

    count = export.mesh_task_count(SHAPE, config)
    ours = [export_meshes._mesh_task(folder, config, j) for j in range(count)]
    recorded = {}
    for j in range(count):
        files = export.mesh_part(folder, config, j)
        assert files and all(export.file_record(folder / n) == r for n, r in files.items())
        recorded |= files
    # Each task names its own fragments (no listing of the folder): together, all of them.
    fragments = {p.relative_to(folder).as_posix() for p in (layer / "mesh").glob("*:0:*")}
    assert recorded.keys() == fragments
    assert {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in shared} == before

    # The same tasks, in the same order, as igneous makes (on a copy: it rewrites those files).
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    options = export_meshes._meshing_options(config)
    theirs = list(
        create_meshing_tasks(f"file://{copy / 'segmentation'}", shape=(16,) * 3, **options)
    )
    assert len(theirs) == count == 24
    for mine, igneous_task in zip(ours, theirs, strict=True):
        expected = igneous_task.payload()
        expected["layer_path"] = expected["layer_path"].replace(str(copy), str(folder))
        assert mine.payload() | {"class": expected["class"]} == expected
    with pytest.raises(ValueError, match="meshing task 24 of 24"):
        export_meshes._mesh_task(folder, config, count)


def test_complete_only_while_every_recorded_file_is_there(exported, tmp_path):
    folder, result = exported
    assert export_complete(folder)
    summary = json.loads((folder / "export.json").read_text())
    assert summary["format"] == 3 and summary["sharded"]
    records = list((folder / "records").iterdir())
    assert len(records) == sum(summary["records"].values())
    # Every file is in a task's record, but the records, the summary and igneous's provenance.
    recorded = set()
    for record in records:
        recorded |= set(export.recorded_files(record))
    assert len(recorded) == result.file_count
    files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    unrecorded = {f for f in files - recorded if not f.startswith("records/")}
    assert unrecorded == {"export.json", "segmentation/provenance"}

    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    assert export_complete(copy)  # copytree keeps mtimes
    next((copy / "image" / "10_10_20").iterdir()).unlink()
    assert not export_complete(copy)
    for damage in ("summary", "record", "rewritten record"):
        shutil.rmtree(copy)
        shutil.copytree(folder, copy)
        record = copy / "records" / "region_0.record"
        if damage == "summary":
            (copy / "export.json").unlink()
        elif damage == "record":
            record.unlink()
        else:  # written again after the summary: not what the summary vouched for
            later = (copy / "export.json").stat().st_mtime_ns + 10**9
            os.utime(record, ns=(record.stat().st_atime_ns, later))
        assert not export_complete(copy), damage
    assert not export_complete(tmp_path / "nowhere")


@pytest.mark.parametrize("damage", ["cut", "format"])
def test_a_cut_or_foreign_summary_is_not_complete(exported, tmp_path, damage):
    folder, _ = exported
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    summary = copy / "export.json"
    text = summary.read_text()
    if damage == "cut":
        summary.write_text(text[: len(text) // 2])
    else:
        summary.write_text(text.replace('"format": 3,', '"format": 4,'))
    assert not export_complete(copy)


def test_an_export_of_the_earlier_format_is_checked_by_its_list(exported, tmp_path):
    """Format 1 listed every file with its size in export.json: such an export stays complete
    while every listed file is there as listed."""
    folder, _ = exported
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    shutil.rmtree(copy / "records")
    listed = {
        p.relative_to(copy).as_posix(): p.stat().st_size
        for p in copy.rglob("*")
        if p.is_file() and p.name != "export.json"
    }
    lines = [f"  {json.dumps(name)}: {size}" for name, size in listed.items()]
    text = '{\n "format": 1,\n "files": {\n' + ",\n".join(lines) + "\n }\n}"
    (copy / "export.json").write_text(text)
    assert export_complete(copy)
    next((copy / "image" / "10_10_20").iterdir()).unlink()
    assert not export_complete(copy)


def test_failure_midway_leaves_no_destination_and_no_temporary(volume, tmp_path, monkeypatch):
    raw, segmentation = volume

    def broken_mesh(*args, **kwargs):
        raise RuntimeError("meshing failed")

    monkeypatch.setattr(export, "fragment_part", broken_mesh)
    with pytest.raises(RuntimeError, match="meshing failed"):
        export_precomputed(raw, segmentation, VOXEL, tmp_path / "out", CONFIG)
    assert os.listdir(tmp_path) == []


def test_failure_keeps_the_previous_export_and_success_replaces_it(volume, tmp_path, monkeypatch):
    raw, segmentation = volume
    out = tmp_path / "out"
    export_precomputed(raw, segmentation, VOXEL, out, ExportConfig(num_scales=1))
    monkeypatch.setattr(export, "_write_segment_properties", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        export_precomputed(raw, segmentation, VOXEL, out, CONFIG)
    assert export_complete(out)
    assert len(json.loads((out / "image" / "info").read_text())["scales"]) == 1
    monkeypatch.undo()
    export_precomputed(raw, segmentation, VOXEL, out, CONFIG)
    assert export_complete(out)
    assert len(json.loads((out / "image" / "info").read_text())["scales"]) == 3
    assert os.listdir(tmp_path) == ["out"]


def write_stitched(out, segmentation, config=CONFIG):
    """The segmentation's full resolution as the stitching writes it: the layer, then a region
    (a shard, sharded) at a time."""
    chunk = plan_scales(SHAPE, VOXEL, config)[0].chunk_zyx
    new_segmentation(out, SHAPE, VOXEL, export.segmentation_layout(SHAPE, VOXEL, config, chunk))
    writer = SegmentationWriter(out)
    for region in export.export_regions(SHAPE, VOXEL, config):
        writer.write(region.slices, segmentation[region.slices])


def test_refuses_to_replace_a_folder_that_is_not_an_export(volume, tmp_path):
    raw, segmentation = volume
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(PrecomputedError, match="not an export"):
        export_precomputed(raw, segmentation, VOXEL, tmp_path, CONFIG)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_an_export_cut_short_is_begun_again_but_a_foreign_folder_is_not(volume, tmp_path):
    raw, segmentation = volume
    out = tmp_path / "out"
    write_stitched(out, segmentation)  # the stitching's part
    export.begin_export(out, SHAPE, VOXEL, CONFIG)  # then the run stopped: no record
    region = export.export_regions(SHAPE, VOXEL, CONFIG)[0]
    export.write_region(out, region, raw[region.slices], segmentation[region.slices], CONFIG)
    assert not export_complete(out) and list((out / "image" / "10_10_20").glob("*"))
    export.begin_export(out, SHAPE, VOXEL, CONFIG)
    assert (out / "image" / "info").is_file() and not list(
        (out / "image" / "10_10_20").glob("*")
    )  # emptied, infos written again
    assert list((out / "segmentation" / "10_10_20").glob("*"))  # the stitching's: kept
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(PrecomputedError, match="not an export"):
        export.begin_export(out, SHAPE, VOXEL, CONFIG)
    assert (out / "notes.txt").read_text() == "keep me"


def test_a_file_rewritten_with_its_size_kept_is_repaired(volume, exported, tmp_path):
    """Issue 31: a region task's record held sizes only, so an image chunk partly zeroed was
    taken as intact and the repaired export still showed the damage. Sharded, the region's
    shard is written again, and its record; the meshes' are not (its segmentation is intact)."""
    raw, segmentation = volume
    folder, _ = exported
    out = tmp_path / "out"
    shutil.copytree(folder, out)
    tasks = json.loads((out / "export.json").read_text())["records"]
    image = sorted((out / "image" / "10_10_20").iterdir())[0]
    before = image.read_bytes()
    zero_bytes(image, 0, 100)
    assert image.stat().st_size == len(before) and image.read_bytes() != before
    assert not export_complete(out)

    def read_region(roi):
        return raw[roi.slices], segmentation[roi.slices]

    repaired, counts = export.repair_export(out, tasks, read_region, SHAPE, VOXEL, CONFIG)
    region = export.load_region_record(export.task_record_path(out, "region", 0))["region"]
    assert repaired[:1] == [f"region {region}"] and image.read_bytes() == before
    export.finish_export(
        out, counts, SHAPE, VOXEL, CONFIG, export.export_tasks(SHAPE, VOXEL, CONFIG), repaired
    )
    assert export_complete(out)
    again, _ = export.repair_export(out, tasks, read_region, SHAPE, VOXEL, CONFIG)
    assert again == []


def test_gzip_export_stores_gz_files_that_cloud_volume_reads(volume, tmp_path):
    raw, segmentation = volume
    out = tmp_path / "out"
    unsharded = ExportConfig(num_scales=2, gzip=True, sharded=False)  # shards gzip inside
    export_precomputed(raw, segmentation, VOXEL, out, unsharded)
    assert export_complete(out)
    chunks = list((out / "image" / "10_10_20").iterdir())
    assert chunks and all(c.suffix == ".gz" for c in chunks)
    assert np.array_equal(read_layer(out, "segmentation"), segmentation)


@pytest.mark.parametrize(
    ("voxel", "expected_nm", "chunks"),
    [
        # 2:1 serial sections: x, y first, then all three.
        ((20, 10, 10), [(20, 10, 10), (20, 20, 20), (40, 40, 40)], [(32, 64, 64), (64,) * 3]),
        ((8, 8, 8), [(8, 8, 8), (16, 16, 16), (32, 32, 32)], [(64,) * 3, (64,) * 3]),
        # 4:1: x, y twice before z.
        ((40, 10, 10), [(40, 10, 10), (40, 20, 20), (40, 40, 40)], [(16, 64, 64), (32, 64, 64)]),
    ],
)
def test_scales_downsample_the_finest_axes_first(voxel, expected_nm, chunks):
    scales = plan_scales((64, 256, 256), tuple(map(float, voxel)), ExportConfig(chunk_voxels=64))
    assert [s.voxel_size_nm for s in scales] == expected_nm
    assert [s.chunk_zyx for s in scales[:2]] == chunks


def test_scales_stop_when_an_axis_to_halve_is_one_voxel():
    scales = plan_scales((4, 4, 4), (10.0, 10.0, 10.0), ExportConfig(num_scales=5))
    assert [s.shape_zyx for s in scales] == [(4, 4, 4), (2, 2, 2), (1, 1, 1)]


@pytest.mark.parametrize(
    "change",
    [
        {"chunk_voxels": 4},
        {"chunk_voxels": 64.0},
        {"num_scales": 0},
        {"mesh_max_error_nm": -1.0},
        {"mesh_max_error_nm": float("nan")},
        {"gzip": "yes"},
        {"skeletons": 1},
    ],
)
def test_config_rejects_bad_values(change):
    with pytest.raises(ConfigError, match=next(iter(change))):
        ExportConfig(**change)


@pytest.mark.parametrize(
    ("case", "error", "message"),
    [
        ("shape", VolumeShapeError, "differs from raw shape"),
        ("two_d", VolumeShapeError, "3-D"),
        ("raw_float", VolumeDtypeError, "raw must be uint8"),
        ("signed_ids", VolumeDtypeError, "unsigned integer"),
        ("voxel", VoxelSizeError, "voxel size"),
        ("empty", EmptyLabelsError, "all zero"),
    ],
)
def test_bad_inputs_fail_with_one_line_before_writing(volume, tmp_path, case, error, message):
    raw, segmentation = volume
    voxel = VOXEL
    if case == "shape":
        segmentation = segmentation[:, :, :-1]
    elif case == "two_d":
        raw, segmentation = raw[0], segmentation[0]
    elif case == "raw_float":
        raw = raw.astype(np.float32)
    elif case == "signed_ids":
        segmentation = segmentation.astype(np.int64)
    elif case == "voxel":
        voxel = (20.0, 0.0, 10.0)
    elif case == "empty":
        segmentation = np.zeros_like(segmentation)
    with pytest.raises(error, match=message) as caught:
        export_precomputed(raw, segmentation, voxel, tmp_path / "out", CONFIG)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_cli_exports_from_hdf5(volume, tmp_path, capsys):
    raw, segmentation = volume
    h5 = write_volumes(
        tmp_path / "v.h5", {"raw": raw, "seg": segmentation.astype(np.uint32)}, VOXEL
    )
    out = tmp_path / "precomputed"
    argv = ["--raw", f"{h5}:raw", "--segmentation", f"{h5}:seg", "--out", str(out)]
    assert export_cli.main([*argv, "--scales", "2", "--chunk-voxels", "32"]) == 0
    assert export_complete(out)
    assert "2 scales" in capsys.readouterr().out
    assert np.array_equal(read_layer(out, "segmentation"), segmentation)
    assert list((out / "image" / "10_10_20").iterdir()) == [out / "image" / "10_10_20" / "0.shard"]
    assert export_cli.main([*argv, "--unsharded", "--chunk-voxels", "16"]) == 0
    assert export_complete(out) and len(list((out / "image" / "10_10_20").iterdir())) > 1
    assert np.array_equal(read_layer(out, "segmentation"), segmentation)
    assert export_cli.main([*argv[:2], "--segmentation", f"{h5}:nope", "--out", str(out)]) == 2
    assert "no dataset 'nope'" in capsys.readouterr().err


def _tmpfs_command(size: str, folder, command: str) -> list[str]:
    """`command` with a tmpfs of `size` mounted on `folder`, in a mount namespace of its own."""
    return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
            f"mount -t tmpfs -o size={size} tmpfs {folder} && {command}"]  # fmt: skip


def _can_mount_tmpfs(tmp_path) -> bool:
    import subprocess

    probe = tmp_path / "probe"
    probe.mkdir()
    done = subprocess.run(_tmpfs_command("16k", probe, "true"), capture_output=True)
    return done.returncode == 0


def test_cli_on_a_full_disk_fails_in_one_line_and_leaves_no_export(volume, tmp_path):
    import sys

    if not shutil.which("unshare") or not _can_mount_tmpfs(tmp_path):
        pytest.skip("cannot mount a small tmpfs here (needs unshare and user or mount namespaces)")
    raw, labels = volume
    write_volumes(tmp_path / "in.h5", {"raw": raw, "segmentation": labels}, VOXEL)
    disk = tmp_path / "disk"
    disk.mkdir()
    export_cli = (
        f"{sys.executable} -m pipeline.cli.export --raw {tmp_path}/in.h5:raw "
        f"--segmentation {tmp_path}/in.h5:segmentation --out {disk}/out"
    )
    # The tmpfs lives as long as the namespace: list what the failed export left, from inside.
    done = processes.run(
        _tmpfs_command("48k", disk, f"{export_cli}; echo exit=$?; ls -A {disk}"),
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))), timeout=900,
    )  # fmt: skip
    assert "exit=1" in done.stdout, done.stdout + done.stderr
    # Besides the progress bar's redrawn lines, one line: the error, naming where it wrote.
    *bar, error = [line for line in done.stderr.splitlines() if line.strip()]
    assert all(line.startswith("export:") for line in bar), done.stderr
    assert error.startswith(f"error: {disk}/") and error.endswith("No space left on device"), error
    assert done.stdout.strip().endswith("exit=1")  # the disk holds nothing: no export, no temporary


# A task killed while it writes a shard (tests/faults.py: half of it written, then SIGKILL).
# Every shard (image, segmentation, meshes) is written whole to a temporary name, then renamed.
_WRITE_SHARD = r"""
import numpy as np
from pipeline.export import layers as export

folder, what = pathlib.Path(sys.argv[1]), sys.argv[2]
if what == "region":
    with np.load(folder.parent / "volume.npz") as v:
        region = export.export_regions(v["seg"].shape, (20.0, 10.0, 10.0), export.ExportConfig(chunk_voxels=24))[0]
        export.write_region(folder, region, v["raw"], v["seg"], export.ExportConfig(chunk_voxels=24))
else:
    export.merge_part(folder, export.ExportConfig(chunk_voxels=24), 0, 1)
"""


def _kill_mid_shard(folder, what: str, tmp_path) -> Path:
    """Run `what` ("region" 0, or mesh "merge" 0) in a child process that is SIGKILLed once
    half of a shard is on disk; returns the file it was writing."""
    return killed_mid_write(_WRITE_SHARD, ".shard", tmp_path / f"{what}.writing", str(folder), what)


@pytest.mark.parametrize("what", ["region", "merge"])
def test_a_task_killed_mid_shard_leaves_no_complete_export_and_its_rerun_completes_it(
    volume, exported, tmp_path, what
):
    raw, segmentation = volume
    folder, _ = exported
    out = tmp_path / "out"
    shutil.copytree(folder, out)
    np.savez(tmp_path / "volume.npz", raw=raw, seg=segmentation)
    tasks = json.loads((out / "export.json").read_text())["records"]
    record = export.task_record_path(out, what, 0)
    shard = {"region": sorted((out / "image" / "10_10_20").glob("*.shard"))[0],
             "merge": next((out / "segmentation" / "mesh").glob("*.shard"))}[what]  # fmt: skip
    (out / "export.json").unlink()  # as a rerun of the task would find it: not yet complete
    record.unlink()
    shard.unlink()

    half = _kill_mid_shard(out, what, tmp_path)
    assert half.stat().st_size > 0
    assert not record.exists() and not export_complete(out)
    # Written beside it, never renamed into place: nothing to misread.
    assert half != shard and half.parent == shard.parent and not shard.exists()
    if what == "region":
        with pytest.raises(MissingChunkError, match=r"shard .*\.shard"):
            with open_volume(f"precomputed://file://{out / 'image'}") as array:
                array[...]

    def read_region(roi):
        return raw[roi.slices], segmentation[roi.slices]

    if what == "region":  # the workflow's rerun of the task (its record is missing)
        region = export.export_regions(SHAPE, VOXEL, CONFIG)[0]
        written = export.region_step(out, 0, region, read_region, CONFIG)
        export.save_region_record(record, region, written)
    else:
        export.save_files_record(record, export.merge_part(out, CONFIG, 0, tasks["merge"]))
    repaired, counts = export.repair_export(out, tasks, read_region, SHAPE, VOXEL, CONFIG)
    export.finish_export(
        out, counts, SHAPE, VOXEL, CONFIG, export.export_tasks(SHAPE, VOXEL, CONFIG), repaired
    )
    assert export_complete(out) and shard.is_file()
    assert (read_layer(out, "image") == raw).all()
    assert len(mesh_vertices(CloudVolume(f"file://{out / 'segmentation'}", progress=False).mesh,
                             int(segmentation.max())))  # fmt: skip


def test_an_export_over_a_full_resolution_stored_otherwise_is_refused(volume, tmp_path):
    """The stitching wrote the layer unsharded; an export begun with sharded settings would
    write shards over chunk files: it stops, saying to stitch again."""
    _, segmentation = volume
    out = tmp_path / "out"
    unsharded = dataclasses.replace(CONFIG, sharded=False)
    write_stitched(out, segmentation, unsharded)
    with pytest.raises(PrecomputedError, match="not stored as the export's settings say"):
        export.begin_export(out, SHAPE, VOXEL, CONFIG)
    export.begin_export(out, SHAPE, VOXEL, unsharded)  # as it was written: fine


def test_a_lost_layer_begins_the_export_again_and_rewrites_every_task(volume, exported, tmp_path):
    raw, segmentation = volume
    folder, _ = exported
    out = tmp_path / "out"
    shutil.copytree(folder, out)
    (out / "records" / "begun.record").write_text("{}")  # the begin task's record (a workflow's)
    shutil.rmtree(out / "image")
    tasks = json.loads((out / "export.json").read_text())["records"]

    def read_region(roi):
        return raw[roi.slices], segmentation[roi.slices]

    repaired, counts = export.repair_export(out, tasks, read_region, SHAPE, VOXEL, CONFIG)
    # "layers", then every task but the last (this one), which the summary counts too
    assert repaired[0] == "layers" and len(repaired) == 1 + sum(tasks.values()) - 1
    assert (out / "records" / "begun.record").read_text() == "{}"  # the begin task's record kept
    export.finish_export(
        out, counts, SHAPE, VOXEL, CONFIG, export.export_tasks(SHAPE, VOXEL, CONFIG), repaired
    )
    assert export_complete(out) and (read_layer(out, "image") == raw).all()
