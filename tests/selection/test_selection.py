"""Checkpoint selection: the better of two networks wins, the choice is written atomically and
read back, and bad inputs are named."""

import dataclasses
import json
import shutil

import numpy as np
import pytest
from test_inference import MODEL, bright_weights, hand_made_volume, make_checkpoint

from pipeline.cli.selection import main
from pipeline.core.errors import CheckpointError, ConfigError
from pipeline.data.volumes import LabeledVolume, write_volumes
from pipeline.inference.flood_fill import InferenceConfig
from pipeline.selection.checkpoints import (
    SelectionConfig,
    chosen_checkpoint,
    held_out_coordinates,
    list_checkpoints,
    select_checkpoint,
    selection_done,
    selection_token,
)

FAST = SelectionConfig(last_checkpoints=2, held_out_fovs=24)


def held_out() -> LabeledVolume:
    raw, labels = hand_made_volume()
    return LabeledVolume("hand_made", raw, labels, (20.0, 10.0, 10.0))


@pytest.fixture
def train_dir(tmp_path):
    """Checkpoints 5 and 10 mark bright voxels as object (the true mask where a FOV shows one
    object); checkpoint 20 is untrained (it predicts the seed voxel alone)."""
    run = tmp_path / "run"
    make_checkpoint(run, 5, bright_weights)
    make_checkpoint(run, 10, bright_weights)
    make_checkpoint(run, 20)
    return run


def test_the_better_of_the_last_checkpoints_is_selected(train_dir):
    path = train_dir / "selection.json"
    assert not selection_done(path)
    record = select_checkpoint(train_dir, held_out(), FAST)
    assert [row["step"] for row in record["candidates"]] == [10, 20]  # the last two
    scores = {row["step"]: row["fov_f1"] for row in record["candidates"]}
    assert scores[10] > 0.6 and scores[20] < 0.1, scores
    assert record["step"] == 10 and record["checkpoint"].endswith("ckpt-10")
    assert selection_done(path) and json.loads(path.read_text()) == record
    assert chosen_checkpoint(path) == train_dir / "checkpoints" / "ckpt-10"
    # Named relative to the folder of selection.json (the run dir): see the moved run below.
    assert record["checkpoint"] == "checkpoints/ckpt-10" and record["train_dir"] == "."
    assert (
        chosen_checkpoint(train_dir / record["checkpoint"]) == train_dir / "checkpoints" / "ckpt-10"
    )
    assert selection_done(path, train_dir, FAST)


def test_a_selection_goes_stale_when_training_goes_on(train_dir):
    path = train_dir / "selection.json"
    select_checkpoint(train_dir, held_out(), FAST)
    assert selection_done(path, train_dir, FAST)
    make_checkpoint(train_dir, 30)  # training resumed and saved a newer checkpoint
    assert selection_done(path)  # still a whole file ...
    assert not selection_done(path, train_dir, FAST)  # ... but not of the last two checkpoints
    record = select_checkpoint(train_dir, held_out(), FAST)
    assert [row["step"] for row in record["candidates"]] == [20, 30]
    assert selection_done(path, train_dir, FAST)
    assert not selection_done(path, train_dir, dataclasses.replace(FAST, held_out_fovs=9))


def test_a_fine_tune_worse_than_its_starting_weights_is_not_taken(tmp_path):
    run = tmp_path / "tuned"
    make_checkpoint(
        run, 0, bright_weights
    )  # the starting weights (pipeline.training.trainer writes ckpt-0)
    for step in (10, 20, 30):
        make_checkpoint(run, step)  # fine-tuning lost what the weights knew
    unless_worse = dataclasses.replace(FAST, start_as_candidate=True)
    record = select_checkpoint(run, held_out(), unless_worse)
    assert [row["step"] for row in record["candidates"]] == [0, 20, 30]
    assert record["step"] == 0 and record["checkpoint"].endswith("ckpt-0")
    assert selection_done(run / "selection.json", run, unless_worse)
    # By default only the newest checkpoints compete.
    assert [row["step"] for row in select_checkpoint(run, held_out(), FAST)["candidates"]] == [
        20,
        30,
    ]


def test_selection_can_also_segment_a_crop(train_dir, tmp_path):
    config = SelectionConfig(
        last_checkpoints=1,
        held_out_fovs=8,
        vi_crop_zyx=(12, 24, 24),
        inference=InferenceConfig(min_segment_size=10),
    )
    record = select_checkpoint(train_dir, held_out(), config, tmp_path / "choice.json")
    (row,) = record["candidates"]
    assert row["step"] == 20 and {"vi", "vi_split", "vi_merge", "adapted_rand_error"} <= set(row)
    assert selection_done(tmp_path / "choice.json") and not selection_done(train_dir / "x.json")


def test_held_out_coordinates_leave_room_for_a_fov():
    _, labels = hand_made_volume()
    coords = held_out_coordinates(labels, MODEL, 50, seed=0)
    assert coords.shape == (50, 3) and labels[tuple(coords.T)].all()
    assert (coords >= (2, 4, 4)).all() and (coords < (14, 36, 36)).all()


def test_held_out_coordinates_leave_out_small_objects_as_training_does():
    _, labels = hand_made_volume()
    ids, sizes = np.unique(labels[labels > 0], return_counts=True)
    smallest = ids[np.argmin(sizes)]
    assert smallest in labels[tuple(held_out_coordinates(labels, MODEL, 400, seed=0).T)]

    coords = held_out_coordinates(labels, MODEL, 400, seed=0, min_object_voxels=sizes.min() + 1)

    assert smallest not in labels[tuple(coords.T)] and labels[tuple(coords.T)].all()


def test_a_run_without_checkpoints_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoints"):
        select_checkpoint(tmp_path, held_out(), FAST)
    assert list_checkpoints(tmp_path) == []


def test_an_incomplete_selection_file_is_not_a_choice(tmp_path):
    path = tmp_path / "selection.json"
    path.write_text('{"checkpoint": ')
    assert not selection_done(path)
    with pytest.raises(CheckpointError, match="not a complete selection"):
        chosen_checkpoint(path)


def test_command_line_selects_and_reports(train_dir, tmp_path, capsys):
    raw, labels = hand_made_volume()
    volume = write_volumes(tmp_path / "v.h5", {"raw": raw, "labels": labels}, (20, 10, 10))
    args = ["--train-dir", str(train_dir), "--raw", f"{volume}:raw", "--labels", f"{volume}:labels"]
    assert main([*args, "--held-out-fovs", "8", "--last-checkpoints", "3"]) == 0
    assert "selected" in capsys.readouterr().out and selection_done(train_dir / "selection.json")
    assert main([*args, "--criterion", "vi"]) == 2
    assert capsys.readouterr().err.startswith("error: criterion 'vi' needs vi_crop_zyx")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"last_checkpoints": 0}, "last_checkpoints must be >= 1"),
        ({"criterion": "loss"}, "criterion must be one of"),
        ({"vi_crop_zyx": (8, 0, 8)}, "vi_crop_zyx must be"),
    ],
)
def test_bad_selection_settings_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SelectionConfig(**kwargs)


def nan_weights(model) -> None:
    bright_weights(model)
    lom = model.get_layer("conv_lom")
    kernel, bias = lom.get_weights()
    lom.set_weights([kernel * np.nan, bias])


def test_a_checkpoint_with_non_finite_weights_or_loss_is_never_selected(train_dir, capsys):
    make_checkpoint(train_dir, 30, nan_weights)  # the newest, and NaN
    (train_dir / "metrics.csv").write_text(  # training logged a NaN loss at step 20
        "step,wall_s,loss,accuracy,precision,recall,f1,object_fraction,learning_rate,fov_per_s\n"
        "20,1,nan,0,0,0,0,0,0.001,1\n"
    )
    record = select_checkpoint(train_dir, held_out(), dataclasses.replace(FAST, last_checkpoints=3))
    assert record["step"] == 10 and [row["step"] for row in record["candidates"]] == [10]
    reasons = {s["checkpoint"].rpartition("-")[2]: s["reason"] for s in record["skipped"]}
    assert reasons == {
        "20": "its recorded training loss is nan",
        "30": "its weights are not all finite",
    }
    assert "skipping" in capsys.readouterr().out


def test_no_usable_checkpoint_is_one_clear_error(tmp_path):
    run = tmp_path / "run"
    make_checkpoint(run, 5, nan_weights)
    with pytest.raises(
        CheckpointError, match="none of the last 1 checkpoints can be used .*ckpt-5: its weights"
    ):
        select_checkpoint(run, held_out(), FAST)


def test_a_moved_or_copied_run_dir_chooses_its_own_checkpoint(train_dir, tmp_path):
    """Issue 31: selection.json named the checkpoint by its absolute path, so a copied run dir
    segmented with the original's weights, and a moved one (the original gone) with none."""
    record = select_checkpoint(train_dir, held_out(), FAST)
    token = selection_token(train_dir / "selection.json")
    copy = shutil.copytree(train_dir, tmp_path / "copy")
    assert chosen_checkpoint(copy / "selection.json") == copy / "checkpoints" / "ckpt-10"
    moved = shutil.move(train_dir, tmp_path / "elsewhere" / "moved")
    assert not train_dir.exists()
    assert chosen_checkpoint(moved / "selection.json") == moved / "checkpoints" / "ckpt-10"
    assert selection_token(moved / "selection.json") == token  # the same weights: nothing re-runs
    # A checkpoint outside the selection file's folder (a pretrained model) stays absolute.
    outside = tmp_path / "choices" / "choice.json"
    outside.parent.mkdir()
    chosen = select_checkpoint(moved, held_out(), FAST, outside)
    assert (
        chosen["checkpoint"]
        == str(moved / "checkpoints" / "ckpt-10")
        == str(chosen_checkpoint(outside))
    )
    assert chosen["candidates"] == [
        row | {"checkpoint": str(moved / row["checkpoint"])} for row in record["candidates"]
    ]


def test_a_selection_file_from_before_with_an_absolute_path_still_works(train_dir, tmp_path):
    select_checkpoint(train_dir, held_out(), FAST)
    path = train_dir / "selection.json"
    record = json.loads(path.read_text())
    absolute = train_dir / "checkpoints" / "ckpt-10"
    path.write_text(json.dumps(record | {"checkpoint": str(absolute)}))  # as written before
    assert chosen_checkpoint(path) == absolute  # there: taken as it is
    moved = shutil.move(train_dir, tmp_path / "moved")
    # Gone: the same path's tail under the folder the file is in now.
    assert chosen_checkpoint(moved / "selection.json") == moved / "checkpoints" / "ckpt-10"
    (moved / "checkpoints").rename(moved / "lost")
    assert chosen_checkpoint(moved / "selection.json") == absolute  # named missing by its reader
