"""One real file split into training, selection and evaluation parts (ROIs): the CREMI layout as
it comes, parts checked before anything runs, and each part staged alone. The file is a 32 x 64 x 64
cut of the FlyEM medulla volume (tests/fixtures/README.md)."""

import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from pipeline.core.errors import ConfigError, VolumeShapeError, VoxelSizeError
from pipeline.core.roi import Roi
from pipeline.data.staging import DataConfig, check_sources, role_settings, stage_role

CUT = Path(__file__).parents[1] / "fixtures" / "flyem_medulla_cut.h5"
RAW, LABELS = f"{CUT}:volumes/raw", f"{CUT}:volumes/labels/neuron_ids"
FOV = (9, 17, 17)
PARTS = {
    "train_roi": "0:32, 0:64, 0:40",
    "select_roi": "0:32, 0:32, 40:64",
    "eval_roi": "0:32, 32:64, 40:64",
}


def one_file(**changes: str) -> DataConfig:
    files = {"train_raw": RAW, "train_labels": LABELS, "eval_raw": RAW, "eval_labels": LABELS}
    return DataConfig(**(files | PARTS | changes))


def test_an_roi_reads_as_python_slices_in_z_y_x():
    roi = Roi.parse("0:32, 32:64, 40:64")
    assert roi.shape == (32, 32, 24) and roi.slices == (slice(0, 32), slice(32, 64), slice(40, 64))
    assert roi.overlaps(Roi.parse("31:40, 0:33, 0:41")) and not roi.overlaps(
        Roi.parse("0:32, 0:32, 40:64")
    )
    assert roi.grown((8, 8, 8), (32, 64, 64)) == Roi.parse(
        "0:32, 24:64, 32:64"
    )  # as far as the volume goes


@pytest.mark.parametrize(
    "text", ["0:32, 0:64", "0:32, 0:64, 40", "5:5, 0:64, 0:64", "a:b, 0:1, 0:1"]
)
def test_a_malformed_roi_is_one_clear_error(text):
    with pytest.raises(ConfigError, match='write it as "z0:z1, y0:y1, x0:x1"'):
        one_file(eval_roi=text)


def test_the_parts_of_a_real_cremi_file_pass_the_checks_and_stage_alone(tmp_path):
    data = one_file()
    check_sources(data, FOV)
    with h5py.File(CUT) as f:
        raw, labels = f["volumes/raw"][...], f["volumes/labels/neuron_ids"][...]
    for role in ("train", "select", "eval"):
        stage_role(tmp_path / f"{role}.h5", role_settings(data, role))
        part = Roi.parse(PARTS[f"{role}_roi"])
        with h5py.File(tmp_path / f"{role}.h5") as f:
            np.testing.assert_array_equal(f["raw"][...], raw[part.slices])
            np.testing.assert_array_equal(f["labels"][...], labels[part.slices])
            assert tuple(f["raw"].attrs["voxel_size_nm"]) == (10.0, 10.0, 10.0)  # from `resolution`


def test_an_evaluated_part_is_staged_with_context_and_scored_inside(tmp_path):
    from pipeline.data.staging import read_staged

    stage_role(tmp_path / "eval.h5", role_settings(one_file(), "eval", context_zyx=(4, 8, 8)))
    with h5py.File(CUT) as f, h5py.File(tmp_path / "eval.h5") as staged:
        # 0:32, 32:64, 40:64 grown by (4, 8, 8) as far as the file goes: 0:32, 24:64, 32:64.
        np.testing.assert_array_equal(staged["raw"][...], f["volumes/raw"][0:32, 24:64, 32:64])
    assert read_staged(tmp_path / "eval.h5").scored == Roi.parse("0:32, 8:40, 8:32")
    stage_role(tmp_path / "train.h5", role_settings(one_file(), "train", context_zyx=(4, 8, 8)))
    assert read_staged(tmp_path / "train.h5").scored == Roi.parse(
        "0:32, 0:64, 0:40"
    )  # no context: not scored


def test_a_part_is_staged_brick_by_brick_with_the_digest_of_the_whole(tmp_path, monkeypatch):
    from pipeline.core import stamps
    from pipeline.data import volumes

    whole = stage_role(tmp_path / "whole.h5", role_settings(one_file(), "eval", (4, 8, 8)))
    reads = []
    monkeypatch.setattr(stamps, "BRICK", 16)  # the staged part, 32 x 40 x 32: 2 x 3 x 2 bricks
    monkeypatch.setattr(volumes, "_as_raw", lambda a, s: reads.append(a.shape) or a)
    bricked = stage_role(tmp_path / "bricks.h5", role_settings(one_file(), "eval", (4, 8, 8)))
    assert sorted(reads) == sorted([(16, 8, 16)] * 4 + [(16, 16, 16)] * 8)
    with h5py.File(tmp_path / "whole.h5") as a, h5py.File(tmp_path / "bricks.h5") as b:
        arrays = {name: b[name][...] for name in ("raw", "labels")}
        for name, array in arrays.items():
            np.testing.assert_array_equal(a[name][...], array)
    extra = [[10.0, 10.0, 10.0], "0:32, 8:40, 8:32"]
    assert bricked == stamps.digest_volumes(arrays, extra)  # fed brick by brick = held whole
    monkeypatch.undo()
    assert whole == stamps.digest_volumes(arrays, extra) != bricked  # the grid is part of it


def test_a_part_with_no_label_inside_its_roi_is_refused_and_nothing_is_staged(tmp_path):
    from pipeline.core.errors import EmptyLabelsError

    path = tmp_path / "file.h5"
    labels = np.zeros((32, 64, 64), np.uint64)
    labels[:, :, :8] = 7  # labeled only outside the evaluated part (and its context)
    with h5py.File(path, "w") as f:
        f["raw"] = np.zeros((32, 64, 64), np.uint8)
        f["labels"] = labels
        for name in ("raw", "labels"):
            f[name].attrs["resolution"] = (10, 10, 10)
    data = DataConfig(
        eval_raw=f"{path}:raw", eval_labels=f"{path}:labels", eval_roi="0:32, 0:64, 32:64"
    )
    with pytest.raises(EmptyLabelsError, match="no labeled voxel in the ROI"):
        stage_role(tmp_path / "eval.h5", role_settings(data, "eval"))
    assert not list(tmp_path.glob("eval*")) and not list(tmp_path.glob(".eval*"))


@pytest.mark.parametrize(
    "changes, error, message",
    [
        (
            {"select_roi": "0:32, 0:40, 30:64"},
            ConfigError,
            "overlap; parts of one file must not share voxels",
        ),
        (
            {"eval_roi": "0:32, 32:70, 40:64"},
            VolumeShapeError,
            "reaches outside the volume of shape (32, 64, 64)",
        ),
        (
            {"eval_roi": "0:8, 32:64, 40:64"},
            VolumeShapeError,
            "smaller than the field of view (9, 17, 17)",
        ),
    ],
)
def test_bad_parts_are_refused_before_anything_runs(changes, error, message):
    with pytest.raises(error) as caught:
        check_sources(one_file(**changes), FOV)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_raw_and_labels_that_disagree_on_the_voxel_size_are_refused(tmp_path):
    copy = tmp_path / "cut.h5"
    shutil.copyfile(CUT, copy)
    with h5py.File(copy, "a") as f:
        f["volumes/labels/neuron_ids"].attrs["resolution"] = (10.0, 8.0, 8.0)
    raw, labels = f"{copy}:volumes/raw", f"{copy}:volumes/labels/neuron_ids"
    with pytest.raises(VoxelSizeError, match="differ"):
        check_sources(
            one_file(train_raw=raw, train_labels=labels, eval_raw=raw, eval_labels=labels), FOV
        )


@pytest.mark.mpi
@pytest.mark.slow
def test_the_real_data_path_runs_end_to_end_on_the_parts_of_one_file(tmp_path):
    import json

    from workflow_runs import tiny_variant, workflow

    from pipeline.core.stamps import read_stamp

    parts = "".join(f'{name} = "{roi}"\n' for name, roi in PARTS.items())
    files = f'train_raw = "{RAW}"\ntrain_labels = "{LABELS}"\neval_raw = "{RAW}"\neval_labels = "{LABELS}"\n'
    config = tiny_variant(
        tmp_path,
        "flyem",
        {
            "synthetic_shape_zyx = [32, 64, 64]\n": files + parts,
            # The file's own faces padded, the part's inner faces given context instead.
            "min_segment_size = 20\n": "min_segment_size = 20\nreflect_faces = true\n",
        },
    )
    run_dir = tmp_path / "run"
    workflow("--config", str(config), "--run-dir", str(run_dir))

    for role in ("train", "select"):
        with h5py.File(run_dir / "staged" / f"{role}.h5") as f:
            assert f["raw"].shape == Roi.parse(PARTS[f"{role}_roi"]).shape
    with h5py.File(run_dir / "staged" / "eval.h5") as f:  # with a FOV radius (4, 8, 8) around it
        assert f["raw"].shape == (32, 40, 32)
    assert json.loads((run_dir / "config.json").read_text())["inference"]["reflect_faces"]
    selection = json.loads((run_dir / "selection.json").read_text())
    assert selection["held_out_volume"] == "select"  # never the scored part
    scores = json.loads((run_dir / "evaluation.json").read_text())
    # Segmented with context, scored inside the part only.
    assert scores["scored_roi"] == "0:32, 8:40, 8:32"
    # The baseline: a forest learned on the training part, tuned on the selection part.
    assert scores["ffn"]["voxels"] == scores["learned_watershed"]["voxels"] == 32 * 32 * 24
    record = json.loads((run_dir / "baseline" / "learned_watershed.json").read_text())
    assert len(record["tuning_trials"]) == 54 and set(record["seconds"]) == {"tune", "segment"}
    # The forest is a task of its own, timed in its stamp, and the report says so.
    assert read_stamp(run_dir / "baseline" / "boundary_forest.joblib")["measured"]["seconds"] > 0
    assert "s to learn the forest" in (run_dir / "report.md").read_text()
    assert (run_dir / "precomputed" / "export.json").is_file()
