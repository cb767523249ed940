"""An export published to a destination URL (`[export] destination`,
pipeline.export.destination), tested against the S3 and GCS stand-ins on 127.0.0.1
(tests/conftest.py's `s3_bucket`, `gs_bucket`): it reads back as the export written here, its completeness is checked in the store,
`view` prints a link to it (the stand-in by its endpoint) and serves nothing, Neuroglancer in
headless Chromium draws it from there once the bucket's CORS rule lets it, and a scheme it cannot
write is refused."""

import contextlib
import dataclasses
import json
import logging
import re
import urllib.parse
from pathlib import Path

import boto3
import neuroglancer
import numpy as np
import pytest
from browser import chromium, coloured, wait_for
from cloudfiles import CloudFiles
from cloudvolume import CloudVolume

from pipeline.core.errors import ConfigError
from pipeline.data.synthetic import SyntheticConfig, generate
from pipeline.export.destination import destination_complete, publish, published_to
from pipeline.export.layers import ExportConfig, export_complete, export_precomputed, recorded_files
from pipeline.export.viewer import browser_url, serve_forever
from pipeline.run.run_config import load_run_config

SHAPE = (16, 32, 48)
VOXEL = (20.0, 10.0, 10.0)
# Several regions and so several tasks' records, with meshes and skeletons.
CONFIG = ExportConfig(chunk_voxels=16, task_voxels=16, num_scales=2)


@pytest.fixture(scope="module")
def volume() -> tuple[np.ndarray, np.ndarray]:
    return generate(SyntheticConfig(seed=7).with_geometry(shape_zyx=SHAPE, voxel_size_nm=VOXEL))


def export_to(volume, folder: Path, destination: str) -> Path:
    raw, segmentation = volume
    config = dataclasses.replace(CONFIG, destination=destination)
    export_precomputed(raw, segmentation, VOXEL, folder, config)
    if destination != "file://":
        publish(folder, destination)
    return folder


def read_back(url: str) -> np.ndarray:
    return np.asarray(CloudVolume(url, progress=False)[:, :, :])[..., 0].T


@pytest.mark.parametrize(("scheme", "bucket"), [("s3", "s3_bucket"), ("gs", "gs_bucket")])
def test_an_export_to_a_bucket_reads_back_as_the_one_written_here(
    volume, scheme, bucket, request, tmp_path
):
    here = export_to(volume, tmp_path / "here", "file://")
    destination = f"{scheme}://{request.getfixturevalue(bucket)}/exports/run"
    export_to(volume, tmp_path / "run", destination)
    for layer in ("segmentation", "image"):
        remote = read_back(f"{destination}/{layer}")
        assert np.array_equal(remote, read_back(f"file://{here / layer}"))
    assert np.array_equal(read_back(f"{destination}/segmentation"), volume[1])
    assert destination_complete(destination) and published_to(tmp_path / "run") == destination
    # The meshes and skeletons went too: every file the tasks recorded is in the bucket.
    store = CloudFiles(destination)
    for kind in ("merge", "skeleton_merge"):
        names = list(recorded_files(tmp_path / "run" / "records" / f"{kind}_0.record"))
        assert names and None not in store.size(names).values()


@pytest.mark.parametrize(("scheme", "bucket"), [("s3", "s3_bucket"), ("gs", "gs_bucket")])
def test_a_recorded_file_deleted_from_the_store_makes_it_incomplete(
    volume, scheme, bucket, request, tmp_path
):
    destination = f"{scheme}://{request.getfixturevalue(bucket)}/run"
    folder = export_to(volume, tmp_path / "run", destination)
    name = next(iter(recorded_files(folder / "records" / "region_1.record")))
    CloudFiles(destination).delete(name)
    assert not destination_complete(destination)
    assert export_complete(folder)  # the run dir's copy is not the store
    CloudFiles(destination).put(name, (folder / name).read_bytes(), compress=None)
    assert destination_complete(destination)
    CloudFiles(destination).put(name, b"cut short", compress=None)
    assert not destination_complete(destination)


def printed_link(capsys: pytest.CaptureFixture) -> str:
    """The Neuroglancer link `view` printed."""
    line = next(line for line in capsys.readouterr().out.splitlines() if "Neuroglancer" in line)
    return line.split("Neuroglancer: ", 1)[1]


@pytest.mark.parametrize("named", ["by the environment", "by its endpoint"])
def test_view_prints_a_link_to_the_remote_export_and_serves_nothing(
    volume, s3_bucket, moto_endpoint, named, tmp_path, capsys, monkeypatch
):
    destination = f"s3://{s3_bucket}/run"
    if named == "by its endpoint":  # cloud-files' form: the store's endpoint in the URL
        destination = f"s3://{moto_endpoint}/{s3_bucket}/run"
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # nothing there
    folder = export_to(volume, tmp_path / "run", destination)
    serve_forever(folder)  # returns at once: no server to keep
    state = urllib.parse.unquote(printed_link(capsys))
    assert state.startswith("https://neuroglancer-demo.appspot.com")
    # The stand-in by its endpoint, over HTTP: to Neuroglancer `s3://` is AWS.
    url = f"{moto_endpoint}/{s3_bucket}/run"
    assert f"precomputed://{url}/segmentation" in state
    assert f"precomputed://{url}/image" in state and '"skeletons":true' in state


@pytest.mark.parametrize(
    ("destination", "environment", "url"),
    [
        ("s3://b/run", {}, "s3://b/run"),
        ("gs://b/run", {"AWS_ENDPOINT_URL_S3": "http://h:9"}, "gs://b/run"),
        ("s3://b/run", {"AWS_ENDPOINT_URL_S3": "http://h:9/"}, "http://h:9/b/run"),
        ("s3://b/run", {"AWS_ENDPOINT_URL": "https://h"}, "https://h/b/run"),
        ("s3://b/run", {"AWS_ENDPOINT_URL": "https://h", "AWS_ENDPOINT_URL_S3": "http://s"},
         "http://s/b/run"),
        ("s3://http://h:9/b/run", {"AWS_ENDPOINT_URL_S3": "http://s"}, "http://h:9/b/run"),
        ("s3://https://h/b/run", {}, "https://h/b/run"),
    ],
)  # fmt: skip
def test_a_bucket_is_linked_by_its_endpoint_only_outside_aws(
    destination, environment, url, monkeypatch
):
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert browser_url(destination) == url


def asked(caplog: pytest.LogCaptureFixture, request: re.Pattern) -> bool:
    """Whether the S3 stand-in answered `request`: its log lines, `"GET /path HTTP/1.1" 206`
    (colour codes inside the quotes but for a 200)."""
    return any(request.search(r.getMessage()) for r in caplog.records if r.name == "werkzeug")


def public_read(bucket: str) -> str:
    """A policy letting anyone read `bucket`'s objects, as a browser reads them: unsigned."""
    return json.dumps(
        {"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Principal": "*", "Action": "s3:GetObject",
             "Resource": f"arn:aws:s3:::{bucket}/*"}
        ]}
    )  # fmt: skip


@pytest.mark.browser
def test_headless_chromium_renders_the_export_from_the_s3_stand_in_once_cors_allows_it(
    volume, s3_bucket, moto_endpoint, tmp_path, capsys, caplog
):
    """The printed link's state, opened in Neuroglancer's own client served here (its public
    page needs the internet): a page of another origin than the bucket's, so it reads the
    layers only once the bucket's CORS rule allows it, and then draws the segmentation."""
    destination = f"s3://{s3_bucket}/run"
    folder = export_to(volume, tmp_path / "run", destination)
    serve_forever(folder)
    state = neuroglancer.parse_url(printed_link(capsys))
    key = json.loads((folder / "segmentation" / "info").read_text())["scales"][0]["key"]
    chunks = re.compile(rf'GET /{s3_bucket}/run/segmentation/{re.escape(key)}/\S+ HTTP\S*" 20[06]')
    refused = f"{moto_endpoint}/{s3_bucket}/run/segmentation/info' from origin"
    s3 = boto3.client("s3")
    s3.put_bucket_policy(Bucket=s3_bucket, Policy=public_read(s3_bucket))
    caplog.set_level(logging.INFO, logger="werkzeug")
    neuroglancer.set_server_bind_address("127.0.0.1")
    viewer = neuroglancer.Viewer()
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(neuroglancer.stop)
        viewer.set_state(state)
        driver = chromium(tmp_path / "chromium-profile")
        cleanup.callback(driver.quit)

        def shows_segments() -> bool:
            return coloured(driver.get_screenshot_as_png(), "left")

        caplog.clear()
        driver.get(viewer.get_viewer_url())
        # Readable, but not across origins: the browser refuses the page the bucket's answers.
        blocked = wait_for(
            lambda: [m for m in driver.get_log("browser") if refused in m["message"]], 60
        )
        assert blocked and "CORS policy" in blocked[0]["message"], "not refused the stand-in"
        assert not asked(caplog, chunks) and not shows_segments()
        s3.put_bucket_cors(
            Bucket=s3_bucket,
            CORSConfiguration={"CORSRules": [
                {"AllowedOrigins": ["*"], "AllowedMethods": ["GET", "HEAD"],
                 "AllowedHeaders": ["*"]}
            ]},
        )  # fmt: skip
        driver.refresh()
        rendered = wait_for(shows_segments, 180)
        screenshot = tmp_path / "viewer.png"
        screenshot.write_bytes(driver.get_screenshot_as_png())
        assert rendered, f"no segmentation in the 2-D panel after 180 s (see {screenshot})"
        assert asked(caplog, chunks)  # its chunks, from the stand-in


def test_a_folder_elsewhere_is_a_complete_export_served_from_there(volume, tmp_path):
    elsewhere = tmp_path / "lab" / "run"
    export_to(volume, tmp_path / "run", f"file://{elsewhere}")
    assert export_complete(elsewhere) and destination_complete(f"file://{elsewhere}")
    assert np.array_equal(read_back(f"file://{elsewhere / 'segmentation'}"), volume[1])


@pytest.mark.parametrize(
    "destination", ["https://example.org/run", "ftp://host/run", "s3:/bucket", "bucket/run"]
)
def test_a_destination_it_cannot_write_is_refused_when_the_config_is_built(destination, tmp_path):
    with pytest.raises(ConfigError, match="destination"):
        ExportConfig(destination=destination)
    config = tmp_path / "run.toml"
    config.write_text(f'[export]\ndestination = "{destination}"\n')
    with pytest.raises(ConfigError, match="destination"):
        load_run_config(config)
