"""Inference blocks are keyed on the part of the staged volume they read (issue 31): a voxel
changed in the volume to segment re-runs only the blocks that read its brick
(`stamps.region_token`), the real staging (`staging.stage_files`) and stamps (`run_once` with
`blocks.infer_regions`, as apps/infer.py and the workflow's plan use them)."""

import h5py
import numpy as np
import pytest

from pipeline.blocks import Block, BlockConfig, block_path, infer_regions, plan_blocks
from pipeline.roi import Roi
from pipeline.staging import stage_files
from pipeline.stamps import (
    BRICK,
    BRICK_DIGESTS,
    Task,
    input_token,
    plan,
    read_stamp,
    run_once,
    why_stale,
)
from pipeline.volumes import VOXEL_SIZE_ATTR, write_volumes

SHAPE = (64, 256, 256)  # 1 x 2 x 2 bricks
# 1 x 3 x 3 blocks, overlapping by 32 voxels in y and x (starts 0, 64, 128).
GRID = BlockConfig((64, 128, 128), (16, 32, 32))
BLOCKS = plan_blocks(SHAPE, GRID)


@pytest.fixture
def run(tmp_path):
    """A source volume, its stage and a selection: what the blocks of a run read."""
    source = tmp_path / "user" / "em.h5"
    source.parent.mkdir()
    image = np.random.default_rng(0).integers(0, 256, SHAPE, dtype=np.uint8)
    write_volumes(source, {"raw": image}, (30.0, 8.0, 8.0))
    (tmp_path / "staged").mkdir()
    selection = tmp_path / "selection.json"
    selection.write_text('{"checkpoint": "ckpt-1"}')
    return {"source": source, "staged": tmp_path / "staged" / "eval.h5", "selection": selection}


def stage_task(run: dict, roi: str = "") -> Task:
    settings = {"raw": f"{run['source']}:raw", "roi": roi}
    return Task("stage[eval]", "stage", settings, (run["source"],), (run["staged"],))


def stage(run: dict, roi: str = "") -> str:
    """The stage task of the volume to segment, as apps/stage.py runs it."""
    task = stage_task(run, roi)
    staged = task.outputs[0]
    return run_once(
        task.settings,
        task.inputs,
        task.outputs,
        lambda: stage_files(staged, task.settings["raw"], roi=roi),
    )


def infer_task(run: dict, block: Block, k: int) -> Task:
    """Block k's task as workflow.dag_steps plans it."""
    settings = {"start": list(block.start), "stop": list(block.stop)}
    output = block_path(run["staged"].parent.parent / "blocks", block)
    inputs = (run["staged"], run["selection"])
    return Task(f"infer[{k}]", "infer", settings, inputs, (output,), infer_regions(block))


def infer_tasks(run: dict, blocks=BLOCKS) -> list[Task]:
    return [infer_task(run, block, k) for k, block in enumerate(blocks)]


def infer_all(run: dict, blocks=BLOCKS) -> set[int]:
    """Every block's task as apps/infer.py runs it (its result: the sum of the block's voxels);
    the blocks that ran."""
    ran = set()
    for k, (block, task) in enumerate(zip(blocks, infer_tasks(run, blocks), strict=True)):
        output = task.outputs[0]

        def work(block=block, output=output) -> str:
            with h5py.File(run["staged"], "r") as f:
                output.write_text(str(int(f["raw"][block.slices].sum())))
            return output.read_text()

        output.parent.mkdir(exist_ok=True)
        if run_once(task.settings, task.inputs, task.outputs, work, task.regions) == "ran":
            ran.add(k)
    return ran


def change_voxel(source, zyx) -> None:
    with h5py.File(source, "r+") as f:
        f["raw"][zyx] = f["raw"][zyx] ^ 1


def blocks_meeting(region: Roi) -> set[int]:
    return {k for k, b in enumerate(BLOCKS) if Roi(b.start, b.stop).overlaps(region)}


def brick_of(zyx) -> Roi:
    start = tuple(a // BRICK * BRICK for a in zyx)
    return Roi(start, tuple(min(a + BRICK, n) for a, n in zip(start, SHAPE, strict=True)))


@pytest.mark.parametrize("zyx", [(30, 100, 100), (30, 200, 20)])
def test_a_changed_voxel_reruns_only_the_blocks_that_read_its_brick(run, zyx):
    stage(run)
    assert infer_all(run) == set(range(len(BLOCKS)))
    tasks = infer_tasks(run)
    tokens = [read_stamp(task.outputs[0])["token"] for task in tasks]
    change_voxel(run["source"], zyx)
    # Before staging, the plan cannot know which part changed: every block waits for it.
    reasons = set(plan([stage_task(run), *tasks]).values())
    assert reasons == {"input changed: user/em.h5", "after stage"}
    assert stage(run) == "ran"
    containing = blocks_meeting(Roi(zyx, tuple(a + 1 for a in zyx)))
    stale = {
        k for k, t in enumerate(tasks) if why_stale(t.settings, t.inputs, t.outputs, t.regions)
    }
    assert containing <= stale == blocks_meeting(brick_of(zyx)) != set(range(len(BLOCKS)))
    assert infer_all(run) == stale
    for k in set(range(len(BLOCKS))) - stale:  # untouched: what reads them (stitching) is kept
        assert read_stamp(tasks[k].outputs[0])["token"] == tokens[k]
    assert set(plan(tasks).values()) == {None}


def test_blocks_that_meet_a_changed_voxel_are_exactly_those_that_contain_it_here(run):
    """(30, 100, 100): its brick's blocks are the ones that read the voxel itself."""
    stage(run)
    infer_all(run)
    change_voxel(run["source"], (30, 100, 100))
    stage(run)
    assert infer_all(run) == blocks_meeting(Roi((30, 100, 100), (31, 101, 101))) == {0, 1, 3, 4}


def test_a_voxel_changed_outside_the_staged_part_reruns_no_block(run):
    roi = "0:64, 0:200, 0:256"  # staged: y 0:200 (no context asked), so y 230 is outside it
    blocks = plan_blocks(Roi.parse(roi).shape, GRID)
    assert len(blocks) == len(BLOCKS) - 3
    stage(run, roi)
    assert infer_all(run, blocks) == set(range(len(blocks)))
    change_voxel(run["source"], (30, 230, 100))
    assert stage(run, roi) == "ran"  # the source changed, the staged content did not
    assert infer_all(run, blocks) == set()


def test_a_changed_voxel_size_reruns_every_block(run):
    stage(run)
    infer_all(run)
    with h5py.File(run["source"], "r+") as f:
        f["raw"].attrs[VOXEL_SIZE_ATTR] = (40.0, 8.0, 8.0)
    assert stage(run) == "ran"
    assert infer_all(run) == set(range(len(BLOCKS)))


def test_a_volume_staged_before_brick_digests_keys_every_block_on_the_whole_volume(run):
    stage(run)
    with h5py.File(run["staged"], "r+") as f:  # as an older version staged it
        del f[BRICK_DIGESTS]
    region = infer_regions(BLOCKS[0])[0]
    assert (
        input_token(run["staged"], region)
        == input_token(run["staged"])
        == read_stamp(run["staged"])["token"]
    )
    assert infer_all(run) == set(range(len(BLOCKS)))
    assert infer_all(run) == set()
