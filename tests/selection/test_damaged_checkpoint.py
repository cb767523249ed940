"""Issue 56, item 2: a chosen checkpoint cut short after the selection. Before, `status` and
`--resume` said "select up to date" and every inference block failed with "Read less bytes than
requested", naming no file. Now the selection's stamp holds the chosen checkpoint's files (size,
mtime): a damaged one runs the selection again, which sets it aside in `checkpoints/unreadable/`
(as training does) and chooses among the readable ones; a load that fails names the files."""

import json
import os
import shutil

import numpy as np
import pytest
from test_inference import bright_weights, hand_made_volume, make_checkpoint
from workflow_runs import copy_run, segmentation, workflow

from pipeline.core.errors import CheckpointError
from pipeline.core.stamps import read_stamp, run_once, stamp_path, why_stale
from pipeline.data.volumes import LabeledVolume
from pipeline.inference.flood_fill import checkpoint_model_config, predictor_from_checkpoint
from pipeline.network.model import UnreadableCheckpoint
from pipeline.selection.checkpoints import (
    SelectionConfig,
    checkpoint_files,
    chosen_checkpoint,
    chosen_predictor,
    select_checkpoint,
    selection_done,
)

FAST = SelectionConfig(last_checkpoints=2, held_out_fovs=24)
DATA = ".data-00000-of-00001"


def held_out() -> LabeledVolume:
    raw, labels = hand_made_volume()
    return LabeledVolume("hand_made", raw, labels, (20.0, 10.0, 10.0))


def cut_short(path) -> None:
    """Truncate `path` to half its size, as a full disk or a killed copy leaves it."""
    os.truncate(path, path.stat().st_size // 2)


@pytest.fixture
def train_dir(tmp_path):
    """Checkpoints 5 and 10 mark bright voxels as object; 20 is untrained."""
    run = tmp_path / "run"
    for step, weights in ((5, bright_weights), (10, bright_weights), (20, None)):
        make_checkpoint(run, step, weights)
    return run


def test_an_unreadable_candidate_is_set_aside_and_the_one_before_takes_its_place(train_dir, capsys):
    checkpoints = train_dir / "checkpoints"
    cut_short(checkpoints / f"ckpt-10{DATA}")  # the better of the last two
    record = select_checkpoint(train_dir, held_out(), FAST)
    assert [row["step"] for row in record["candidates"]] == [5, 20]
    assert record["step"] == 5 and record["skipped"] == []
    (aside,) = record["set_aside"]
    assert aside["checkpoint"] == "checkpoints/unreadable/ckpt-10"
    assert f"ckpt-10{DATA}" in aside["reason"] and "Read less bytes" in aside["reason"]
    assert sorted(p.name for p in (checkpoints / "unreadable").iterdir()) == [
        f"ckpt-10{DATA}",
        "ckpt-10.index",
    ]
    assert not list(checkpoints.glob("ckpt-10.*"))
    # Training's own list of its checkpoints no longer has it (a training that goes on).
    assert "ckpt-10" not in (checkpoints / "checkpoint").read_text()
    assert selection_done(train_dir / "selection.json", train_dir, FAST)
    assert "set aside in" in capsys.readouterr().out


def test_no_readable_checkpoint_is_one_line_naming_the_files(tmp_path):
    run = tmp_path / "run"
    make_checkpoint(run, 5, bright_weights)
    cut_short(run / "checkpoints" / f"ckpt-5{DATA}")
    with pytest.raises(CheckpointError) as error:
        select_checkpoint(run, held_out(), FAST)
    message = str(error.value)
    assert len(message.splitlines()) == 1 and f"ckpt-5{DATA}" in message
    assert (run / "checkpoints" / f"ckpt-5{DATA}").is_file()  # nothing to choose: left in place


def test_loading_a_cut_short_checkpoint_names_its_files(train_dir):
    checkpoint = train_dir / "checkpoints" / "ckpt-10"
    cut_short(checkpoint.with_name(f"ckpt-10{DATA}"))
    with pytest.raises(UnreadableCheckpoint) as error:
        predictor_from_checkpoint(checkpoint)
    message = str(error.value)
    assert isinstance(error.value, CheckpointError) and len(message.splitlines()) == 1
    assert message.startswith(f"{checkpoint}: cannot be read") and f"ckpt-10{DATA}" in message


def test_weights_cut_short_under_an_older_selection_take_its_stamp_with_them(train_dir):
    """A run selected before its stamp recorded the chosen files does not notice them cut
    short until a task loads them: that task names the files, and the selection no longer
    counts as done, so the next --resume chooses again (no file deleted by hand)."""
    selection = train_dir / "selection.json"

    def work() -> str:
        selection.write_text(json.dumps({"checkpoint": "checkpoints/ckpt-10"}))
        return "token"

    run_once({}, [], [selection], work)  # no `checked`: as such a run's stamp
    model = checkpoint_model_config(chosen_checkpoint(selection))
    chosen_predictor(selection, model)  # readable: the selection stays done
    assert why_stale({}, [], [selection]) is None
    cut_short(train_dir / "checkpoints" / f"ckpt-10{DATA}")
    assert why_stale({}, [], [selection]) is None  # nothing to notice it by
    with pytest.raises(UnreadableCheckpoint) as error:
        chosen_predictor(selection, model)
    message = str(error.value)
    assert len(message.splitlines()) == 1 and f"ckpt-10{DATA}" in message
    assert message.endswith("selection.json no longer counts as done: --resume chooses again")
    assert why_stale({}, [], [selection]) is not None


def test_a_stamp_keys_on_the_files_its_output_names_not_its_identity(train_dir, tmp_path):
    """The checked files make the task run again when they change, but key nothing: the
    identity and token are as without them, and a stamp without them stays up to date."""
    output = train_dir / "selection.json"
    chosen = train_dir / "checkpoints" / "ckpt-10"

    def work() -> str:
        output.write_text(json.dumps({"checkpoint": "checkpoints/ckpt-10"}))
        return "token"

    assert run_once({"a": 1}, [], [output], work, checked=lambda: checkpoint_files(chosen)) == "ran"
    stamp = read_stamp(output)
    assert sorted(stamp["checked"]) == [f"checkpoints/ckpt-10{DATA}", "checkpoints/ckpt-10.index"]
    assert why_stale({"a": 1}, [], [output]) is None
    # As a stamp made before the files were recorded: up to date, same identity.
    older = {k: v for k, v in stamp.items() if k != "checked"}
    stamp_path(output).write_text(json.dumps(older))
    assert why_stale({"a": 1}, [], [output]) is None
    stamp_path(output).write_text(json.dumps(stamp))
    chosen.with_name("ckpt-10.index").unlink()
    reason = why_stale({"a": 1}, [], [output])
    assert reason == "checkpoints/ckpt-10.index, which selection.json names, is missing"
    cut_short(chosen.with_name(f"ckpt-10{DATA}"))
    assert why_stale({"a": 1}, [], [output]) == (
        f"checkpoints/ckpt-10{DATA}, which selection.json names, changed since it was made"
    )


@pytest.mark.mpi
@pytest.mark.slow
def test_a_chosen_checkpoint_cut_short_is_set_aside_by_the_resume(tiny_run, tmp_path):
    """The real fault on a finished run: its chosen checkpoint's data file cut to half. The plan
    (status, dry run) names it and runs the selection again; the resume sets it aside, chooses a
    readable checkpoint and ends with exit 0."""
    run_dir = copy_run(tiny_run, tmp_path / "run")
    before = segmentation(run_dir)
    selection = run_dir / "selection.json"
    chosen = chosen_checkpoint(selection)
    # The tiny training's other checkpoints segment nothing (the export refuses an all-zero
    # segmentation): as a longer training keeps several good ones, an earlier readable copy of
    # the chosen weights, with their mtimes.
    earlier = chosen.with_name(f"ckpt-{int(chosen.name.rpartition('-')[2]) - 5}")
    for file in checkpoint_files(chosen):
        shutil.copy2(file, earlier.with_name(earlier.name + file.name.removeprefix(chosen.name)))
    data = chosen.with_name(chosen.name + DATA)
    cut_short(data)
    stale = (
        f"select     0/1 up to date; runs: checkpoints/{data.name}, which selection.json names, "
        "changed since it was made"
    )
    assert stale in workflow("status", "--run-dir", str(run_dir)).stdout
    planned = workflow("--run-dir", str(run_dir), "--resume", "--dry-run").stdout
    assert stale in planned and "infer[0], infer[1], infer[2], infer[3]: after select" in planned

    workflow("--run-dir", str(run_dir), "--resume")
    record = json.loads(selection.read_text())
    assert chosen_checkpoint(selection) == earlier
    aside = [s["checkpoint"] for s in record["set_aside"]]
    assert aside == [f"train/checkpoints/unreadable/{chosen.name}"]
    assert (data.parent / "unreadable" / data.name).is_file() and not data.exists()
    assert sorted(read_stamp(selection)["checked"]) == [
        f"train/checkpoints/{earlier.name}{DATA}",
        f"train/checkpoints/{earlier.name}.index",
    ]
    # The same weights: the blocks found up to date, the same segmentation.
    np.testing.assert_array_equal(segmentation(run_dir), before)
    again = workflow("--run-dir", str(run_dir), "--resume", "--dry-run").stdout
    assert "select     1/1 up to date" in again and "infer      4/4 up to date" in again
