"""One chunk of a volume read in place, edited on disk, re-runs only what reads it (issue 60,
point 4): the inference blocks whose boxes (with their context, the overlaps) hold a voxel of
the chunk, the stitching's pairs of those blocks, the parts of the layer that read them, and
the export and evaluation regions over those parts; every other task of the resume is found up
to date, and the result is a fresh run's over the edited volume.

The volume: a synthetic 64 x 80 x 80 (z, y, x) image and its labels as zarr in 16^3 chunks,
segmented with the shipped demo model (no training) in 3 x 3 x 3 blocks; a box of it is staged
(its ROI with the model's context, 3:59, 5:69, 5:69), so the box starts off the chunk grid.
Which tasks ran: each task's stamp file, made anew when it runs (a new inode), and the
workflow's own "finished" / "finished (found up to date)" lines."""

import json
import re

import numpy as np
import pytest
from workflow_runs import ROOT, segmentation, stamp_files, tasks_of, workflow

from pipeline.core.roi import Roi
from pipeline.data.synthetic import SyntheticConfig, generate
from pipeline.data.volumes import new_chunked_volume, open_volume
from pipeline.inference.blocks import plan_blocks
from pipeline.inference.stitching import later_neighbours, part_neighbours

pytestmark = [pytest.mark.slow]

SHAPE = (64, 80, 80)
CHUNK = (16, 16, 16)
ROI = "7:55, 13:61, 13:61"
BOX = Roi.parse("3:59, 5:69, 5:69")  # the ROI with the demo model's context (4, 8, 8)
# The chunk edited, in the source: in the box z 45:56, y 59:64, x 11:27, which the blocks
# z 32:56, y 32:64 and x 0:32 and 16:48 hold (2 of the 27).
EDITED = Roi((48, 64, 16), (64, 80, 32))
CONFIG = """name = "in-place"
pretrained_model = "{model}"
[data]
eval_raw = "{raw}"
eval_labels = "{labels}"
eval_roi = "{roi}"
[blocks]
block_shape_zyx = [24, 32, 32]
overlap_zyx = [8, 16, 16]
[export]
num_scales = 2
chunk_voxels = 16
task_voxels = 32
[evaluation]
task_voxels = 32
"""


def write_source(folder) -> dict[str, str]:
    """The synthetic image and labels, each a zarr volume of its own; their specs."""
    config = SyntheticConfig(seed=5).with_geometry(shape_zyx=SHAPE)
    raw, labels = generate(config)
    specs = {}
    for name, array in {"raw": raw, "labels": labels}.items():
        path = folder / f"{name}.zarr"
        new_chunked_volume(path, name, SHAPE, array.dtype, config.voxel_size_nm, CHUNK)
        with open_volume(f"{path}:{name}", writable=True) as target:
            target[...] = array
        specs[name] = f"{path}:{name}"
    return specs


def edit_chunk(raw_spec: str) -> None:
    """The image's chunk EDITED inverted: its one file written again, in the user's store."""
    with open_volume(raw_spec, writable=True) as target:
        target[EDITED.slices] = 255 - target[EDITED.slices]


def finished(out: str) -> dict[str, bool]:
    """Per task the workflow ran, whether its app did the work (False: found up to date)."""
    lines = r"^\[workflow [\d:]+\]\s+\d+ s (.+?) finished( \(found up to date\))?$"
    return {name: not up_to_date for name, up_to_date in re.findall(lines, out, re.MULTILINE)}


def indices(names, stage: str) -> set[int]:
    """The k of the tasks `stage[k]` (or `stage[kind k]`) among `names`."""
    return {int(re.search(r"(\d+)\]$", n).group(1)) for n in names if n.startswith(stage)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("in_place")
    specs = write_source(folder)
    config = folder / "in_place.toml"
    model = ROOT / "models" / "demo-synthetic"
    config.write_text(CONFIG.format(model=model, roi=ROI, **specs))
    run_dir, fresh = folder / "run", folder / "fresh"
    workflow("--config", str(config), "--run-dir", str(run_dir))
    before = {"stamps": stamp_files(tasks_of(run_dir)), "segmentation": segmentation(run_dir)}
    unchanged = workflow("--config", str(config), "--run-dir", str(run_dir), "--resume").stdout
    edit_chunk(specs["raw"])
    resumed = workflow("--config", str(config), "--run-dir", str(run_dir), "--resume").stdout
    workflow("--config", str(config), "--run-dir", str(fresh))  # the edited volume, from nothing
    tasks = tasks_of(run_dir)
    after = stamp_files(tasks)
    ran = {name for name, state in after.items() if state != before["stamps"][name]}
    return {
        "run_dir": run_dir,
        "fresh": fresh,
        "tasks": {task.name: task for task in tasks},
        "unchanged": unchanged,
        "resumed": resumed,
        "ran": ran,
        "before": before["segmentation"],
    }


def test_an_unchanged_input_runs_nothing(runs):
    assert "nothing to do: every task is up to date" in runs["unchanged"]


def test_the_stamps_and_the_workflow_agree_on_what_ran(runs):
    said = finished(runs["resumed"])
    assert {name for name, worked in said.items() if worked} == runs["ran"]


def test_one_chunk_reruns_only_the_blocks_that_read_it(runs):
    blocks = plan_blocks(BOX.shape, _block_config(runs))
    edited = EDITED.relative_to(BOX).intersection(Roi.whole(BOX.shape))
    reading = {k for k, b in enumerate(blocks) if Roi(b.start, b.stop).overlaps(edited)}
    assert indices(runs["ran"], "infer[") == reading == {24, 25}
    assert len(blocks) == 27


def test_the_stitching_runs_only_where_the_blocks_that_ran_are_read(runs):
    blocks = plan_blocks(BOX.shape, _block_config(runs))
    infer = indices(runs["ran"], "infer[")
    pairs = {k for k in range(len(blocks)) if {k, *later_neighbours(k, blocks)} & infer}
    assert indices(runs["ran"], "stitch[pairs") <= pairs < set(range(len(blocks)))
    # A part of the layer runs when it reads a block that ran, or holds an object whose
    # stitched id changed (an object the edit split or joined): never where nothing changed.
    parts = _parts(runs)
    reading = {k for k, part in enumerate(parts) if set(part_neighbours(part, blocks)) & infer}
    changed = {k for k, part in enumerate(parts) if _differs(runs, part)}
    relabelled = indices(runs["ran"], "stitch[relabel")
    assert changed <= relabelled <= reading | changed
    assert len(relabelled) < len(parts) == 8


def test_the_export_and_the_evaluation_run_only_over_what_changed(runs):
    """Their regions over a part of the layer written again, or over the edited chunk; the
    export's begin, which would empty it, not at all."""
    parts = _parts(runs)
    changed = [_roi(parts[k]) for k in indices(runs["ran"], "stitch[relabel")]
    changed.append(EDITED.relative_to(BOX))
    for stage in ("export[region", "evaluate[count"):
        names = [n for n in runs["tasks"] if n.startswith(stage)]
        regions = {n: Roi.parse(runs["tasks"][n].settings["region"]) for n in names}
        over = {n for n in names if any(regions[n].overlaps(c) for c in changed)}
        assert {n for n in names if n in runs["ran"]} <= over < set(names)
    assert "export[begin]" not in runs["ran"]


def test_the_result_is_a_fresh_runs_over_the_edited_volume(runs):
    np.testing.assert_array_equal(segmentation(runs["run_dir"]), segmentation(runs["fresh"]))
    scores = [json.loads((runs[k] / "evaluation.json").read_text()) for k in ("run_dir", "fresh")]
    assert scores[0]["ffn"] == scores[1]["ffn"]
    assert not np.array_equal(runs["before"], segmentation(runs["fresh"]))


def _block_config(runs):
    from pipeline.core.config_io import from_dict
    from pipeline.inference.blocks import BlockConfig

    return from_dict(BlockConfig, runs["tasks"]["stitch"].settings["blocks"])


def _parts(runs) -> list[tuple[slice, ...]]:
    """The parts of the layer, in the order of the relabel tasks."""
    from pipeline.core.config_io import from_dict
    from pipeline.export.segmentation_layer import SegmentationLayout
    from pipeline.inference.stitching import layer_parts

    layout = from_dict(SegmentationLayout, runs["tasks"]["stitch"].settings["layout"])
    return layer_parts(plan_blocks(BOX.shape, _block_config(runs)), layout)


def _roi(part: tuple[slice, ...]) -> Roi:
    return Roi(tuple(s.start for s in part), tuple(s.stop for s in part))


def _differs(runs, part: tuple[slice, ...]) -> bool:
    return not np.array_equal(runs["before"][part], segmentation(runs["run_dir"])[part])
