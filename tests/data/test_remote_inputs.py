"""Inputs read by URL, without the internet: a Neuroglancer precomputed layer served over HTTP
(the export's own data server, `viewer.start_data_server`) and from an S3 stand-in (moto's
server) and from a GCS stand-in (gcp-storage-emulator), all on 127.0.0.1, started and stopped here. Read by URL a layer is the local one,
voxel for voxel; a chunk the store does not have is an error naming it (zeros only with
`fill_missing`); a chunk changed in the store changes what the work that read it is keyed on,
and an unchanged store keeps it (`pipeline.data.precomputed_volumes`)."""

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from pipeline.core.errors import MissingChunkError, VolumeFileMissing
from pipeline.core.roi import Roi
from pipeline.core.stamps import read_stamp, region_token, run_once
from pipeline.data.staging import (
    DataConfig,
    read_staged,
    role_settings,
    source_files,
    stage_files,
    stage_in_place,
    stage_role,
)
from pipeline.data.volumes import open_volume, read_labels, read_raw, read_volume_pair

SHAPE = (8, 24, 32)  # z, y, x
CHUNK_XYZ = (16, 16, 4)  # 2 x 2 x 2 chunks
VOXEL = (20.0, 8.0, 8.0)
OFFSET_XYZ = (7, 5, 3)
# The chunk at z 0:4, y 0:16, x 0:16 as cloud-volume names it: scale 0's key (its resolution),
# x0-x1_y0-y1_z0-z1 from the offset.
FIRST_CHUNK = "8.0_8.0_20.0/7-23_5-21_3-7"

pytestmark = pytest.mark.usefixtures("no_proxy")


def arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(59)
    labels = np.repeat(np.arange(1, 5, dtype=np.uint64), SHAPE[2] // 4)
    return {
        "raw": rng.integers(0, 256, SHAPE, dtype=np.uint8),
        "seg": np.broadcast_to(labels, SHAPE).copy(),
    }


def write_layer(
    url: str,
    array: np.ndarray,
    voxel_zyx: tuple = VOXEL,
    offset_xyz: tuple = OFFSET_XYZ,
    chunk_xyz: tuple = CHUNK_XYZ,
) -> None:
    """A precomputed layer of a (z, y, x) array at `url` (file://, s3://), as other tools write
    them: (x, y, z) order, a voxel offset, gzip-compressed chunks."""
    from cloudvolume import CloudVolume

    info = CloudVolume.create_new_info(
        num_channels=1,
        layer_type="segmentation" if array.dtype == np.uint64 else "image",
        data_type=str(array.dtype),
        encoding="raw",
        resolution=list(voxel_zyx[::-1]),
        voxel_offset=list(offset_xyz),
        volume_size=list(array.shape[::-1]),
        chunk_size=list(chunk_xyz),
    )
    volume = CloudVolume(url, info=info, progress=False)
    volume.commit_info()
    volume[:, :, :] = array.T


def rewrite_first_chunk(url: str) -> None:
    """Voxel (1, 2, 3) changed in the layer at `url`: its chunk (FIRST_CHUNK) written again."""
    from cloudvolume import CloudVolume

    volume = CloudVolume(url, progress=False)
    (ox, oy, oz), (cx, cy, cz) = OFFSET_XYZ, CHUNK_XYZ
    chunk = volume[ox : ox + cx, oy : oy + cy, oz : oz + cz]
    chunk[3, 2, 1] ^= 1  # x, y, z
    volume[ox : ox + cx, oy : oy + cy, oz : oz + cz] = chunk


@pytest.fixture
def local(tmp_path) -> dict[str, str]:
    """The layers on this machine: what a read by URL must equal."""
    for name, array in arrays().items():
        write_layer(f"file://{tmp_path / 'local' / name}", array)
    return {name: f"precomputed://file://{tmp_path / 'local' / name}" for name in arrays()}


@pytest.fixture
def http_store(tmp_path, monkeypatch) -> dict:
    """The layers served over HTTP from a folder, as a lab serves them: {"raw", "seg": spec,
    "folder": the served folder, "url": the layers' base URL, "write": where more layers go,
    "read": their specs' start}."""
    from pipeline.export.viewer import PrecomputedServer, start_data_server

    # cloud-files opens 20 connections at once; with socketserver's listen backlog of 5 the
    # kernel drops the others' SYNs, and each waits its 1 s retransmit (a web server's backlog
    # is hundreds).
    monkeypatch.setattr(PrecomputedServer, "request_queue_size", 64)
    folder = tmp_path / "served"
    for name, array in arrays().items():
        write_layer(f"file://{folder / name}", array)
    server = start_data_server(folder)
    try:
        yield {name: f"precomputed://{server.url}/{name}" for name in arrays()} | {
            "folder": folder,
            "url": server.url,
            "write": f"file://{folder}",
            "read": f"precomputed://{server.url}",
        }
    finally:
        server.shutdown()
        server.server_close()


def bucket_store(scheme: str, bucket: str) -> dict:
    """The layers written to a new `bucket` of a store (`s3`, `gs`), named `scheme://bucket/layer`
    as on the cloud: {"raw", "seg": spec, "bucket", "write", "read"}."""
    for name, array in arrays().items():
        write_layer(f"{scheme}://{bucket}/{name}", array)
    return {name: f"precomputed://{scheme}://{bucket}/{name}" for name in arrays()} | {
        "bucket": bucket,
        "write": f"{scheme}://{bucket}",
        "read": f"precomputed://{scheme}://{bucket}",
    }


@pytest.fixture
def s3_store(s3_bucket) -> dict:
    """The layers in the S3 stand-in (`s3_bucket`)."""
    return bucket_store("s3", s3_bucket)


@pytest.fixture
def gs_store(gs_bucket) -> dict:
    """The layers in the GCS stand-in (`gs_bucket`)."""
    return bucket_store("gs", gs_bucket)


def test_a_layer_read_over_http_is_the_local_one_voxel_for_voxel(local, http_store):
    for name in ("raw", "seg"):
        with open_volume(http_store[name]) as remote, open_volume(local[name]) as here:
            assert remote.shape == here.shape == SHAPE
            np.testing.assert_array_equal(remote[...], here[...])
            np.testing.assert_array_equal(remote[1:7, 3:20, 5:31], here[1:7, 3:20, 5:31])
    volume = read_volume_pair(http_store["raw"], http_store["seg"])
    assert volume.voxel_size_nm == VOXEL and volume.name == "raw"
    np.testing.assert_array_equal(volume.raw, arrays()["raw"])


@pytest.mark.parametrize("store", ["s3_store", "gs_store"])
def test_a_layer_read_from_a_bucket_is_the_local_one_voxel_for_voxel(local, store, request):
    layers = request.getfixturevalue(store)
    for name, read in (("raw", read_raw), ("seg", read_labels)):
        remote, voxel_size = read(layers[name])
        np.testing.assert_array_equal(remote, read(local[name])[0])
        assert voxel_size == VOXEL
    region = (slice(2, 8), slice(0, 17), slice(9, 32))
    np.testing.assert_array_equal(
        read_raw(layers["raw"], region=region)[0], arrays()["raw"][region]
    )


def test_a_chunk_the_web_server_lacks_is_an_error_naming_it_never_zeros(http_store):
    spec = http_store["raw"]
    (lost,) = (http_store["folder"] / "raw").glob(f"{FIRST_CHUNK}*")
    lost.unlink()
    with pytest.raises(
        MissingChunkError, match=f"^{re.escape(spec)}: chunk {FIRST_CHUNK} is missing"
    ):
        read_raw(spec)
    filled = read_raw(f"{spec}#fill_missing")[0]
    assert not filled[:4, :16, :16].any()
    np.testing.assert_array_equal(filled[4:], arrays()["raw"][4:])
    # A part away from it reads; staging in place refuses the box that holds it.
    np.testing.assert_array_equal(read_raw(f"{spec}[4:8, 0:24, 0:32]")[0], arrays()["raw"][4:])
    with pytest.raises(MissingChunkError, match=f"chunk {FIRST_CHUNK} is missing"):
        stage_in_place(http_store["folder"].parent / "eval.json", spec)


@pytest.mark.parametrize("store", ["s3_store", "gs_store"])
def test_a_chunk_deleted_from_a_bucket_is_an_error_naming_it_never_zeros(store, request, tmp_path):
    from cloudfiles import CloudFiles

    layers = request.getfixturevalue(store)
    spec = layers["raw"]
    bucket = CloudFiles(layers["write"])
    assert bucket.get(f"raw/{FIRST_CHUNK}") is not None
    bucket.delete(f"raw/{FIRST_CHUNK}")
    assert bucket.get(f"raw/{FIRST_CHUNK}") is None
    with pytest.raises(
        MissingChunkError, match=f"^{re.escape(spec)}: chunk {FIRST_CHUNK} is missing"
    ):
        read_raw(spec)
    assert not read_raw(f"{spec}#fill_missing")[0][:4, :16, :16].any()
    # Staging in place asks the store for each chunk's state (a HEAD): refused too.
    with pytest.raises(MissingChunkError, match=f"chunk {FIRST_CHUNK} is missing"):
        stage_in_place(tmp_path / "eval.json", spec)


def test_a_layer_the_store_does_not_have_fails_with_one_line(http_store):
    spec = f"precomputed://{http_store['url']}/nothing"
    with pytest.raises(VolumeFileMissing, match=f"^{re.escape(spec)}: no precomputed layer"):
        read_raw(spec)


def stage(spec: str, staged: Path, roi: str = "0:8, 0:24, 0:32") -> tuple[str, str]:
    """The volume to segment staged in place from `spec` as the workflow's stage task runs it
    (`run_once` with `role_settings` and `source_files`): (what run_once did, its token)."""
    data = DataConfig(eval_raw=spec, eval_roi=roi)
    settings = role_settings(data, "eval")
    inputs = source_files(data, "eval")
    done = run_once(settings, inputs, [staged], lambda: stage_role(staged, settings))
    return done, read_stamp(staged)["token"]


@pytest.mark.parametrize("store", ["http_store", "s3_store", "gs_store"])
def test_a_changed_remote_chunk_restages_and_keys_only_the_work_over_it(store, request, tmp_path):
    """The stage's settings hold the store's state of the box (a HEAD per chunk file), so a
    resume re-stages when a chunk changed there; its record's cells re-key only the parts
    that read that chunk. Unchanged, nothing runs again."""
    layers = request.getfixturevalue(store)
    spec, staged = layers["raw"], tmp_path / "staged" / "eval.json"
    staged.parent.mkdir()
    assert source_files(DataConfig(eval_raw=spec), "eval") == []  # no file here to watch
    done, token = stage(spec, staged)
    over, away = Roi.parse("0:4, 0:16, 0:16"), Roi.parse("4:8, 16:24, 16:32")
    keys = {roi: region_token(staged, roi) for roi in (over, away)}
    assert done == "ran" and stage(spec, staged) == ("up to date", token)
    np.testing.assert_array_equal(read_raw(read_staged(staged).raw)[0], arrays()["raw"])

    if store == "http_store":  # a web server's state is size and Last-Modified, to the second
        rewrite_first_chunk(f"file://{layers['folder'] / 'raw'}")
        (chunk,) = (layers["folder"] / "raw").glob(f"{FIRST_CHUNK}*")
        os.utime(chunk, (chunk.stat().st_atime, chunk.stat().st_mtime + 5))
    else:  # a bucket's ETag changes with the object
        rewrite_first_chunk(spec.removeprefix("precomputed://"))
    done, changed = stage(spec, staged)
    assert done == "ran" and changed != token
    assert region_token(staged, over) != keys[over] and region_token(staged, away) == keys[away]
    changed_raw = read_raw(read_staged(staged).raw)[0]
    assert changed_raw[1, 2, 3] == arrays()["raw"][1, 2, 3] ^ 1


def test_a_volume_copied_from_http_is_the_copy_of_the_local_one(local, http_store, tmp_path):
    """Staged as a copy (a training volume), the same voxels give the same token."""
    tokens = [
        stage_files(tmp_path / f"{where}.h5", layers["raw"], layers["seg"], roi="2:8, 0:24, 4:30")
        for where, layers in (("local", local), ("http", http_store))
    ]
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("store", ["http_store", "s3_store", "gs_store"])
def test_a_volume_in_a_store_is_segmented_as_the_same_volume_on_this_machine(
    store, request, tmp_path
):
    """Staged in place and segmented block by block (the stand-in network of
    tests/inference/test_inference.py, which sees only the image): from the store the same
    segmentation, voxel for voxel, as from the local layer."""
    from test_inference import (
        CONFIG,
        MODEL,
        assert_same_segmentation,
        hand_made_volume,
        stand_in_predictor,
    )

    from pipeline.inference.blocks import BlockConfig
    from pipeline.inference.stitching import segment_blockwise

    layers, (image, labels) = request.getfixturevalue(store), hand_made_volume()
    write_layer(f"{layers['write']}/hand", image)
    write_layer(f"file://{tmp_path / 'local' / 'hand'}", image)
    segmentations = []
    for where, spec in [
        ("local", f"precomputed://file://{tmp_path / 'local' / 'hand'}"),
        ("store", f"{layers['read']}/hand"),
    ]:
        (tmp_path / where / "staged").mkdir(parents=True)
        staged = tmp_path / where / "staged" / "eval.json"
        stage(spec, staged, roi="")
        with open_volume(read_staged(staged).raw) as raw:
            blocks = BlockConfig(block_shape_zyx=(16, 24, 24), overlap_zyx=(0, 8, 8))
            blocks_dir = tmp_path / where / "blocks"
            segmentations.append(
                segment_blockwise(raw, stand_in_predictor, MODEL, CONFIG, blocks, blocks_dir)[0]
            )
    np.testing.assert_array_equal(segmentations[1], segmentations[0])
    assert_same_segmentation(segmentations[0], labels)


@pytest.mark.slow
def test_the_workflow_segments_a_volume_in_a_store_as_the_same_volume_on_this_machine(
    http_store, s3_store, tmp_path
):
    """The whole workflow (the shipped demo model, no training) on a cut of real EM whose image
    and labels are precomputed layers on this machine, served over HTTP, and in the S3
    stand-in: the same segmentation, voxel for voxel, and the same scores from all three."""
    from test_in_place import cut_arrays, segmented_by_the_demo_model
    from workflow_runs import segmentation

    raw, labels, voxel_zyx = cut_arrays()
    local = f"file://{tmp_path / 'local'}"
    for base in (local, http_store["write"], s3_store["write"]):
        for name, array in (("cut_raw", raw), ("cut_labels", labels.astype(np.uint64))):
            write_layer(f"{base}/{name}", array, voxel_zyx, (0, 0, 0), (32, 32, 16))
    runs = {
        where: segmented_by_the_demo_model(
            tmp_path, where, f"{layers}/cut_raw", f"{layers}/cut_labels"
        )
        for where, layers in [
            ("local", f"precomputed://{local}"),
            ("http", http_store["read"]),
            ("s3", s3_store["read"]),
        ]
    }
    stages = {w: json.loads((r / "staged" / "eval.json").read_text()) for w, r in runs.items()}
    assert stages["http"]["raw"].startswith("precomputed://http://127.0.0.1:")
    assert stages["s3"]["raw"].startswith(f"precomputed://s3://{s3_store['bucket']}/cut_raw")
    scores = {w: json.loads((r / "evaluation.json").read_text())["ffn"] for w, r in runs.items()}
    for where in ("http", "s3"):
        np.testing.assert_array_equal(segmentation(runs[where]), segmentation(runs["local"]))
        assert scores[where] == scores["local"]
    assert len(np.unique(segmentation(runs["local"]))) > 2  # objects, not one background
