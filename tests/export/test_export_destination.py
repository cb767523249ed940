"""An export published to a destination URL (`[export] destination`,
pipeline.export.destination), tested against the S3 stand-in on 127.0.0.1 (tests/conftest.py's
`s3_bucket`): it reads back as the export written here, its completeness is checked in the store,
`view` prints a link to it and serves nothing, and a scheme it cannot write is refused."""

import dataclasses
import urllib.parse
from pathlib import Path

import numpy as np
import pytest
from cloudfiles import CloudFiles
from cloudvolume import CloudVolume

from pipeline.core.errors import ConfigError
from pipeline.data.synthetic import SyntheticConfig, generate
from pipeline.export.destination import destination_complete, publish, published_to
from pipeline.export.layers import ExportConfig, export_complete, export_precomputed, recorded_files
from pipeline.export.viewer import serve_forever
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


def test_an_export_to_s3_reads_back_as_the_one_written_here(volume, s3_bucket, tmp_path):
    here = export_to(volume, tmp_path / "here", "file://")
    destination = f"s3://{s3_bucket}/exports/run"
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
        assert names and all(store.exists(names).values())


def test_a_recorded_file_deleted_from_the_store_makes_it_incomplete(volume, s3_bucket, tmp_path):
    destination = f"s3://{s3_bucket}/run"
    folder = export_to(volume, tmp_path / "run", destination)
    name = next(iter(recorded_files(folder / "records" / "region_1.record")))
    CloudFiles(destination).delete(name)
    assert not destination_complete(destination)
    assert export_complete(folder)  # the run dir's copy is not the store
    CloudFiles(destination).put(name, (folder / name).read_bytes(), compress=None)
    assert destination_complete(destination)
    CloudFiles(destination).put(name, b"cut short", compress=None)
    assert not destination_complete(destination)


def test_view_prints_a_link_to_the_remote_export_and_serves_nothing(
    volume, s3_bucket, tmp_path, capsys
):
    destination = f"s3://{s3_bucket}/run"
    folder = export_to(volume, tmp_path / "run", destination)
    serve_forever(folder)  # returns at once: no server to keep
    link = next(line for line in capsys.readouterr().out.splitlines() if "Neuroglancer" in line)
    state = urllib.parse.unquote(link)
    assert "https://neuroglancer-demo.appspot.com" in state
    assert f"precomputed://{destination}/segmentation" in state
    assert f"precomputed://{destination}/image" in state and '"skeletons":true' in state


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
