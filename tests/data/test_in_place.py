"""A chunked volume to segment (zarr, precomputed) is read where it is, not copied: its stage
writes a record naming the box to read, and every later stage reads that box of the source.
The source is a 32 x 64 x 64 cut of the FlyEM medulla volume (tests/fixtures/README.md) as zarr."""

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from pipeline.core.errors import (
    DatasetMissing,
    EmptyLabelsError,
    VolumeDtypeError,
    VolumeError,
    VolumeShapeError,
)
from pipeline.core.roi import Roi
from pipeline.data.staging import (
    DataConfig,
    read_staged,
    reads_in_place,
    role_settings,
    source_files,
    stage_role,
)
from pipeline.data.volumes import VolumeSpec, new_chunked_volume, open_volume, read_raw

CUT = Path(__file__).parents[1] / "fixtures" / "flyem_medulla_cut.h5"
EVAL_ROI = "0:32, 32:64, 24:64"
CONTEXT = (4, 8, 8)


def cut_arrays() -> tuple[np.ndarray, np.ndarray, tuple[float, float, float]]:
    with h5py.File(CUT) as f:
        raw, labels = f["volumes/raw"][...], f["volumes/labels/neuron_ids"][...]
        voxel_size = tuple(float(v) for v in f["volumes/raw"].attrs["resolution"])
    return raw, labels, voxel_size


def as_zarr(folder: Path, arrays: dict[str, np.ndarray], voxel_size) -> dict[str, str]:
    """Each array as a zarr volume of its own (`folder/NAME.zarr:NAME`); their specs."""
    specs = {}
    for name, array in arrays.items():
        path = folder / f"{name}.zarr"
        new_chunked_volume(path, name, array.shape, array.dtype, voxel_size, (16, 32, 32))
        specs[name] = f"{path}:{name}"
        with open_volume(specs[name], writable=True) as target:
            target[...] = array
    return specs


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> dict:
    """The cut as zarr (raw, labels), and its arrays."""
    raw, labels, voxel_size = cut_arrays()
    specs = as_zarr(tmp_path_factory.mktemp("source"), {"raw": raw, "labels": labels}, voxel_size)
    return {
        "raw_spec": specs["raw"],
        "labels_spec": specs["labels"],
        "raw": raw,
        "labels": labels,
        "voxel_size": voxel_size,
    }


def eval_data(source: dict, **changes) -> DataConfig:
    files = {"eval_raw": source["raw_spec"], "eval_labels": source["labels_spec"]}
    return DataConfig(**(files | {"eval_roi": EVAL_ROI} | changes))


def test_a_box_of_a_volume_reads_as_a_volume_of_its_own(source):
    box = Roi.parse("2:10, 5:37, 20:64")
    spec = VolumeSpec.parse(f"{source['raw_spec']}[{box}]")
    assert spec.box == box and VolumeSpec.parse(str(spec)) == spec
    inner = spec.part(Roi.parse("1:2, 0:4, 4:8"))  # a box of a box
    assert inner.box == Roi.parse("3:4, 5:9, 24:28")
    with open_volume(spec) as window:
        assert window.shape == box.shape and window.dtype == np.uint8
        np.testing.assert_array_equal(window[...], source["raw"][box.slices])
        np.testing.assert_array_equal(window[1:3, :4, 40:], source["raw"][3:5, 5:9, 60:64])
    raw, voxel_size = read_raw(spec, region=(slice(0, 2), slice(0, 2), slice(0, 2)))
    assert raw.shape == (2, 2, 2) and voxel_size == source["voxel_size"]


def test_a_box_outside_its_volume_or_to_write_into_is_refused(source):
    with pytest.raises(
        VolumeShapeError, match=r"box reaches outside the volume of shape \(32, 64, 64\)"
    ):
        with open_volume(f"{source['raw_spec']}[0:33, 0:8, 0:8]"):
            pass
    with pytest.raises(VolumeError, match="a box of a volume is read, not written"):
        with open_volume(f"{source['raw_spec']}[0:8, 0:8, 0:8]", writable=True):
            pass
    with pytest.raises(DatasetMissing, match="a box of it"):
        VolumeSpec.parse("no-dataset[0:1, 0:1, 0:1]")


def test_a_chunked_volume_is_staged_as_a_record_and_read_in_place(source, tmp_path):
    data = eval_data(source)
    assert reads_in_place(data) and not reads_in_place(DataConfig())
    settings = role_settings(data, "eval", CONTEXT)
    assert settings["in_place"]
    token = stage_role(tmp_path / "eval.json", settings)
    # No voxel copied: the record, a digest of each chunk of raw and labels (`[data]
    # chunk_digests`, tests/data/test_damaged_chunks.py) and of each the cells a task reading a
    # part of it is keyed on (tests/inference/test_block_stamps.py).
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "eval.json",
        "eval.json.cells-labels.npy",
        "eval.json.cells-raw.npy",
        "eval.json.chunks-labels.npz",
        "eval.json.chunks-raw.npz",
    ]
    assert (tmp_path / "eval.json").stat().st_size < 4096

    staged = read_staged(tmp_path / "eval.json")
    context = Roi.parse(EVAL_ROI).grown(CONTEXT, (32, 64, 64))
    digests = tmp_path / "eval.json.chunks-raw.npz"
    assert staged.raw == f"{source['raw_spec']}[{context}]#chunk_digests={digests}"
    assert staged.voxel_size_nm == source["voxel_size"]
    assert staged.scored == Roi.parse(EVAL_ROI).relative_to(context)
    with open_volume(staged.raw) as raw, open_volume(staged.labels) as labels:
        np.testing.assert_array_equal(raw[...], source["raw"][context.slices])
        np.testing.assert_array_equal(labels[...], source["labels"][context.slices])

    # What a copy of the same part holds, and where it is scored, is what the record reads.
    copy = role_settings(
        DataConfig(eval_raw=f"{CUT}:volumes/raw", eval_labels=f"{CUT}:volumes/labels/neuron_ids",
                   eval_roi=EVAL_ROI), "eval", CONTEXT)  # fmt: skip
    stage_role(tmp_path / "copy.h5", copy)
    copied = read_staged(tmp_path / "copy.h5")
    assert copied.scored == staged.scored and copied.voxel_size_nm == staged.voxel_size_nm
    with open_volume(copied.raw) as a, open_volume(staged.raw) as b:
        np.testing.assert_array_equal(a[...], b[...])

    # The record carries a checksum of the source's metadata: a change there changes the token.
    record = json.loads((tmp_path / "eval.json").read_text())
    assert all(len(s["metadata_sha256"]) == 64 for s in record["sources"])
    zattrs = Path(source["raw_spec"].rpartition(":")[0]) / "raw" / ".zattrs"
    assert zattrs in source_files(data, "eval")  # a resume notices a change by these files
    before = zattrs.read_text()
    try:
        zattrs.write_text(json.dumps(json.loads(before) | {"note": "rewritten"}))
        assert stage_role(tmp_path / "changed.json", settings) != token
    finally:
        zattrs.write_text(before)
    assert stage_role(tmp_path / "again.json", settings) == token


def test_a_source_that_cannot_be_read_in_place_is_refused_and_nothing_is_staged(source, tmp_path):
    unlabeled = source["labels"].copy()
    unlabeled[Roi.parse(EVAL_ROI).slices] = 0  # the scored part has no ground truth
    specs = as_zarr(
        tmp_path,
        {"raw": source["raw"].astype(np.float32), "labels": unlabeled},
        source["voxel_size"],
    )
    cases = [
        (eval_data(source, eval_raw=specs["raw"]), VolumeDtypeError, "read in place must be uint8"),
        (eval_data(source, eval_labels=specs["labels"]), EmptyLabelsError, "no labeled voxel"),
    ]
    for data, error, message in cases:
        with pytest.raises(error, match=message):
            stage_role(tmp_path / "eval.json", role_settings(data, "eval", CONTEXT))
        assert not (tmp_path / "eval.json").exists()


def segmented_by_the_demo_model(folder: Path, name: str, raw: str, labels: str) -> Path:
    """A run of the workflow (inference only: the shipped demo model) on the cut's EVAL_ROI
    given as `raw` and `labels` specs; its run dir, `folder/name`."""
    from workflow_runs import ROOT, workflow

    config = folder / f"{name}.toml"
    config.write_text(
        f'name = "{name}"\npretrained_model = "{ROOT / "models" / "demo-synthetic"}"\n[data]\n'
        f'eval_raw = "{raw}"\neval_labels = "{labels}"\neval_roi = "{EVAL_ROI}"\n'
        "[blocks]\nblock_shape_zyx = [32, 40, 40]\noverlap_zyx = [8, 16, 16]\n"
        "[export]\nnum_scales = 2\n"
    )
    workflow("--config", str(config), "--run-dir", str(folder / name))
    return folder / name


@pytest.mark.slow
def test_the_workflow_segments_a_zarr_volume_in_place_as_it_does_a_copy(source, tmp_path):
    """Inference only (the shipped demo model), the same part from zarr (read in place) and
    from HDF5 (copied): the same segmentation and scores."""
    from workflow_runs import segmentation

    runs = {}
    for kind, raw, labels in [
        ("in_place", source["raw_spec"], source["labels_spec"]),
        ("copy", f"{CUT}:volumes/raw", f"{CUT}:volumes/labels/neuron_ids"),
    ]:
        runs[kind] = segmented_by_the_demo_model(tmp_path, kind, raw, labels)
    assert (runs["in_place"] / "staged" / "eval.json").is_file()
    assert not (runs["in_place"] / "staged" / "eval.h5").exists()
    assert (runs["copy"] / "staged" / "eval.h5").is_file()
    np.testing.assert_array_equal(segmentation(runs["in_place"]), segmentation(runs["copy"]))
    scores = [json.loads((runs[k] / "evaluation.json").read_text()) for k in ("in_place", "copy")]
    assert scores[0]["ffn"] == scores[1]["ffn"] and scores[0]["scored_roi"] == "0:32, 8:40, 8:48"
    assert (runs["in_place"] / "precomputed" / "export.json").is_file()
    # No task trains: Parsl started the "cpu" pool (its folder in runinfo) and not the "mpi" one.
    assert (runs["in_place"] / "runinfo" / "000" / "cpu").is_dir()
    assert not (runs["in_place"] / "runinfo" / "000" / "mpi").exists()
