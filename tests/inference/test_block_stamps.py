"""Inference blocks are keyed on the part of the staged volume they read (issues 31 and 60): a
voxel changed in the volume to segment re-runs only the blocks that read its brick (a copy) or
its chunk (a volume read in place) (`stamps.region_token`), the real staging
(`staging.stage_files`, `staging.stage_in_place`) and stamps (`run_once` with
`blocks.infer_regions`, as apps/infer.py and the workflow's plan use them)."""

import h5py
import numpy as np
import pytest
from test_volumes import write_precomputed

from pipeline.core.roi import Roi
from pipeline.core.stamps import (
    BRICK,
    BRICK_DIGESTS,
    Task,
    input_token,
    plan,
    read_stamp,
    run_once,
    why_stale,
)
from pipeline.data.staging import read_staged, stage_files, stage_in_place
from pipeline.data.volumes import VOXEL_SIZE_ATTR, new_chunked_volume, open_volume, write_volumes
from pipeline.inference.blocks import Block, BlockConfig, block_path, infer_regions, plan_blocks

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
    settings = {"raw": run.get("spec", f"{run['source']}:raw"), "roi": roi}
    return Task("stage[eval]", "stage", settings, (run["source"],), (run["staged"],))


def stage(run: dict, roi: str = "") -> str:
    """The stage task of the volume to segment, as apps/stage.py runs it: a copy of an HDF5
    volume, a record of a zarr one read in place."""
    task = stage_task(run, roi)
    staged = task.outputs[0]
    how = stage_in_place if staged.suffix == ".json" else stage_files
    return run_once(
        task.settings, task.inputs, task.outputs, lambda: how(staged, task.settings["raw"], roi=roi)
    )


def infer_task(run: dict, block: Block, k: int) -> Task:
    """Block k's task as apps.plan.dag.dag_steps plans it."""
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
            with open_volume(read_staged(run["staged"]).raw) as raw:
                output.write_text(str(int(raw[block.slices].sum())))
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


def brick_of(zyx, edge=(BRICK,) * 3) -> Roi:
    """The brick (or with `edge`, the chunk) that holds voxel `zyx`."""
    start = tuple(a // e * e for a, e in zip(zyx, edge, strict=True))
    return Roi(start, tuple(min(a + e, n) for a, e, n in zip(start, edge, SHAPE, strict=True)))


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


@pytest.fixture
def zarr_run(run, tmp_path):
    """The same volume as zarr (chunks of 32 x 64 x 64, so a 128^3 brick holds several), read in
    place: the stage writes a record, the blocks read the user's chunks."""
    with h5py.File(run["source"], "r") as f:
        image, voxel_size = f["raw"][...], tuple(f["raw"].attrs[VOXEL_SIZE_ATTR])
    source = tmp_path / "user" / "em.zarr"
    new_chunked_volume(source, "raw", SHAPE, np.uint8, voxel_size, (32, 64, 64))
    with open_volume(f"{source}:raw", writable=True) as target:
        target[...] = image
    # The stage's input is the chunks' folder (as staging.source_files names it).
    return run | {
        "source": source / "raw",
        "spec": f"{source}:raw",
        "staged": tmp_path / "staged" / "eval.json",
    }


def test_a_chunk_rewritten_in_a_volume_read_in_place_reruns_only_the_blocks_over_it(zarr_run):
    stage(zarr_run)
    assert infer_all(zarr_run) == set(range(len(BLOCKS)))
    with open_volume(zarr_run["spec"], writable=True) as target:  # one voxel: one chunk rewritten
        target[30, 200, 20] ^= 1
    assert stage(zarr_run) == "ran"
    # The blocks that read its chunk (z 0:32, y 192:256, x 0:64), not all that meet its brick.
    chunk = brick_of((30, 200, 20), (32, 64, 64))
    assert infer_all(zarr_run) == blocks_meeting(chunk) == {6}
    assert blocks_meeting(brick_of((30, 200, 20))) == {3, 4, 6, 7}
    assert infer_all(zarr_run) == set()


def test_a_chunk_written_again_with_its_bytes_reruns_no_block(zarr_run):
    """Keyed on the chunks' crc32 (`[data] chunk_digests`), not their files' states."""
    stage(zarr_run)
    infer_all(zarr_run)
    with open_volume(zarr_run["spec"], writable=True) as target:
        target[0:32, 192:256, 0:64] = target[0:32, 192:256, 0:64]  # the chunk's file rewritten
    assert stage(zarr_run) == "ran"
    assert infer_all(zarr_run) == set()


@pytest.fixture
def precomputed_run(run, tmp_path):
    """The same volume as a precomputed layer (chunks of 64 x 64 x 32 voxels in x, y, z, and a
    voxel offset), read in place."""
    with h5py.File(run["source"], "r") as f:
        image, voxel_size = f["raw"][...], tuple(f["raw"].attrs[VOXEL_SIZE_ATTR])
    layer = tmp_path / "user" / "em"
    spec = write_precomputed(layer, image, voxel_size, chunk_xyz=(64, 64, 32))
    scale = next(p for p in layer.iterdir() if p.is_dir())  # scale 0's chunk files
    return run | {"source": scale, "spec": spec, "staged": tmp_path / "staged" / "eval.json"}


def test_a_chunk_rewritten_in_a_precomputed_layer_reruns_only_the_blocks_over_it(precomputed_run):
    from cloudvolume import CloudVolume

    stage(precomputed_run)
    assert infer_all(precomputed_run) == set(range(len(BLOCKS)))
    layer = CloudVolume(precomputed_run["spec"][len("precomputed://") :], progress=False)
    ox, oy, oz = (int(o) for o in layer.voxel_offset)
    z, y, x = 30, 200, 20  # one chunk rewritten (x 0-64, y 192-256, z 0-32)
    chunk = layer[ox : ox + 64, oy + 192 : oy + 256, oz : oz + 32]
    chunk[x, y - 192, z] ^= 1
    layer[ox : ox + 64, oy + 192 : oy + 256, oz : oz + 32] = chunk
    assert stage(precomputed_run) == "ran"
    assert infer_all(precomputed_run) == blocks_meeting(brick_of((z, y, x), (32, 64, 64))) == {6}
    assert infer_all(precomputed_run) == set()


def test_a_file_of_a_precomputed_layer_not_named_for_its_voxels_reruns_every_block(
    precomputed_run,
):
    """A shard file's name does not say which voxels it holds: a change to one keys every
    block anew."""
    stage(precomputed_run)
    infer_all(precomputed_run)
    (precomputed_run["source"] / "0.shard").write_bytes(b"stand-in for a shard")
    assert stage(precomputed_run) == "ran"
    assert infer_all(precomputed_run) == set(range(len(BLOCKS)))
