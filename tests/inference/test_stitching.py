"""Stitching as tasks (pipeline.inference.stitching): pairs per overlap, one id table, then each block's
core relabelled on its own from its neighbours only. The hand-made cases (slivers taken from a
neighbour, merged objects not swallowing their neighbours) are in test_blocks.py."""

import dataclasses
import time

import cc3d
import fastremap
import h5py
import numpy as np
import pytest
from test_inference import assert_same_segmentation
from test_parts import CUT

from pipeline.core.errors import ConfigError
from pipeline.data.volumes import open_volume
from pipeline.export.folder_layout import ExportConfig
from pipeline.export.layers import begin_export, segmentation_layout, segmentation_spec
from pipeline.export.segmentation_layer import (
    SegmentationLayout,
    SegmentationWriter,
    holds_segmentation,
    new_segmentation,
)
from pipeline.export.shards import plan_shards
from pipeline.inference.blocks import Block, BlockConfig, BlockResult, plan_blocks
from pipeline.inference.flood_fill import InferenceStats
from pipeline.inference.stitching import (
    block_core,
    block_pairs,
    check_cores,
    core_neighbours,
    join_ids,
    later_neighbours,
    layer_parts,
    load_block_pairs,
    load_id_table,
    owned_blocks,
    relabel_core,
    save_block_pairs,
    save_id_table,
    stable_lookup,
    stitch,
    table_cells,
    write_part,
)

# Any shared voxel joins two blocks' objects: blocks that agree with the truth must rebuild it.
CONFIG = BlockConfig(block_shape_zyx=(20, 24, 24), overlap_zyx=(8, 8, 8), min_overlap_voxels=1)


def real_bodies() -> np.ndarray:
    """The FlyEM cut's bodies, each piece that is connected within the cut on its own."""
    with h5py.File(CUT) as f:
        return cc3d.connected_components(f["volumes/labels/neuron_ids"][...], connectivity=6)


def blocks_of(truth: np.ndarray) -> list[BlockResult]:
    """Each block's view of `truth`, in local ids 1..n as a block task would leave them."""
    results = []
    for block in plan_blocks(truth.shape, CONFIG):
        local, _ = fastremap.renumber(truth[block.slices], preserve_zero=True)
        results.append(BlockResult(block, local.astype(np.uint32), InferenceStats(), {}))
    return results


def test_blocks_that_agree_with_the_truth_stitch_back_to_it_task_by_task(tmp_path):
    truth = real_bodies()
    results = blocks_of(truth)
    blocks = plan_blocks(truth.shape, CONFIG)
    assert len(blocks) == 32  # 2 x 4 x 4: the middle ones have neighbours on every side

    # Step 1, a task per block, each leaving a file; step 2 reads only those files.
    for k in range(len(blocks)):
        save_block_pairs(
            tmp_path / f"{k}.npz", block_pairs(k, blocks, lambda i: results[i].labels, CONFIG)
        )
    found = [load_block_pairs(tmp_path / f"{k}.npz") for k in range(len(blocks))]
    assert [f.count for f in found] == [int(r.labels.max()) for r in results]
    save_id_table(tmp_path / "ids.npy", *join_ids(found))
    offsets, lookup, merges = load_id_table(tmp_path / "ids.npy")
    assert merges > 0

    # Step 3, a task per block: cores on a chunk grid, each written whole by one task.
    chunk = (4, 8, 8)
    by_tasks = np.zeros(truth.shape, np.uint64)
    written = np.zeros(truth.shape, np.uint8)
    for k in range(len(blocks)):
        asked: list[int] = []

        def labels_of(i: int, asked: list = asked) -> np.ndarray:
            asked.append(i)
            return results[i].labels

        core = block_core(k, blocks, chunk)
        assert all(s.start % c == 0 for s, c in zip(core, chunk, strict=True))
        by_tasks[core] = relabel_core(k, blocks, labels_of, offsets, lookup, chunk)
        written[core] += 1
        assert set(asked) <= set(core_neighbours(k, blocks, chunk))  # only the core's neighbours
        assert len(core_neighbours(k, blocks, chunk)) < len(blocks)
    assert (written == 1).all()  # the cores tile the volume
    assert_same_segmentation(by_tasks, truth)
    in_memory, stats = stitch(results, truth.shape, CONFIG)
    assert_same_segmentation(in_memory, truth)
    assert stats.objects == len(np.unique(truth[truth > 0])) and stats.merges == merges


def stitched_tasks(results: list[BlockResult], blocks) -> dict:
    """The id table's cells per block (`table_cells`, on the block grid flattened), every core
    in stitched ids (`stable_lookup`'s) and in the merge graph's component numbers 1..C."""
    found = [block_pairs(k, blocks, lambda i: results[i].labels, CONFIG) for k in range(32)]
    offsets, components, _ = join_ids(found)
    lookup = stable_lookup(offsets, components, found)

    def cores(table: np.ndarray) -> list[np.ndarray]:
        return [
            relabel_core(k, blocks, lambda i: results[i].labels, offsets, table) for k in range(32)
        ]

    cells = table_cells(blocks, offsets, lookup, "the layer").grid.reshape(32, 32)
    return {"cells": cells, "cores": cores(lookup), "numbered": cores(components)}


def segmented_again(result: BlockResult, blocks, k: int) -> BlockResult:
    """Block k segmented again: its objects numbered in reverse, and one more object, the last
    voxel that no other block holds (so no pair changes)."""
    labels = result.labels
    again = np.where(labels > 0, labels.max() + 1 - labels, 0).astype(np.uint32)
    alone = np.ones(labels.shape, bool)
    for j in blocks.overlapping(blocks[k]):
        if j != k:
            shared = Block(
                np.maximum(blocks[j].start, blocks[k].start),
                np.minimum(blocks[j].stop, blocks[k].stop),
            )
            alone[
                tuple(
                    slice(a - o, b - o)
                    for a, b, o in zip(shared.start, shared.stop, blocks[k].start, strict=True)
                )
            ] = False
    again[np.unravel_index(np.flatnonzero(alone)[-1], labels.shape)] = labels.max() + 1
    return dataclasses.replace(result, labels=again)


def test_stitched_ids_change_only_where_their_objects_do():
    """Block 9 segmented again numbers its objects otherwise and finds one more: named by where
    they begin, every other object keeps its stitched id, and only block 9's ids in the table
    change (the relabel tasks that do not read it stay up to date). The merge graph's component
    numbers 1..C change in cores that do not meet block 9."""
    truth = real_bodies()
    results = blocks_of(truth)
    blocks = plan_blocks(truth.shape, CONFIG)
    again = [*results[:9], segmented_again(results[9], blocks, 9), *results[10:]]
    before, after = stitched_tasks(results, blocks), stitched_tasks(again, blocks)
    away = [k for k in range(32) if 9 not in core_neighbours(k, blocks)]
    assert away and all(np.array_equal(before["cores"][k], after["cores"][k]) for k in away)
    assert any(not np.array_equal(before["numbered"][k], after["numbered"][k]) for k in away)
    changed = [k for k in range(32) if not np.array_equal(before["cells"][k], after["cells"][k])]
    assert changed == [9]
    # The same objects as the components' numbers make.
    every = [np.concatenate([c.ravel() for c in after[key]]) for key in ("cores", "numbered")]
    assert_same_segmentation(*every)


def test_a_layer_stored_as_asked_is_kept_with_what_its_writers_wrote(tmp_path):
    """The join makes the layer anew only where it is not stored as asked (`keep_layer`): the
    export's scales, meshes and properties added to it keep it; another shape, voxel size or
    storage does not."""
    shape, voxel_size, config = (16, 32, 32), (20.0, 10.0, 10.0), ExportConfig(num_scales=2)
    layout = segmentation_layout(shape, voxel_size, config, (8, 16, 16))
    assert not holds_segmentation(tmp_path, shape, voxel_size, layout)  # no layer yet
    new_segmentation(tmp_path, shape, voxel_size, layout)
    begin_export(tmp_path, shape, voxel_size, config)
    assert holds_segmentation(tmp_path, shape, voxel_size, layout)
    assert not holds_segmentation(tmp_path, (16, 32, 48), voxel_size, layout)
    assert not holds_segmentation(tmp_path, shape, (10.0, 10.0, 10.0), layout)
    unsharded = dataclasses.replace(layout, sharding=None, region_zyx=None)
    assert not holds_segmentation(tmp_path, shape, voxel_size, unsharded)


def test_a_relabel_task_pages_in_only_its_blocks_ids_not_the_whole_id_table(tmp_path):
    from pipeline.core.memory import peak_memory_mib, reset_peak_memory, resident_memory_mib

    truth = real_bodies()
    results = blocks_of(truth)
    blocks = plan_blocks(truth.shape, CONFIG)

    def labels_of(i: int) -> np.ndarray:
        return results[i].labels

    found = [block_pairs(k, blocks, labels_of, CONFIG) for k in range(len(blocks))]
    offsets, lookup, merges = join_ids(found)
    # The same blocks' table as if 32 million objects (256 MiB of ids) came before them.
    before = 32_000_000
    table = np.zeros(before + len(lookup), np.uint64)
    table[before + 1 :] = lookup[1:]
    save_id_table(tmp_path / "ids.npy", offsets + np.uint64(before), table, merges)
    del table
    chunk, k = (4, 8, 8), 5
    expected = relabel_core(k, blocks, labels_of, offsets, lookup, chunk)

    reset_peak_memory()
    held = resident_memory_mib()
    if held is None:
        pytest.skip("no /proc/self/status here")
    far_offsets, far_lookup, _ = load_id_table(tmp_path / "ids.npy")
    relabelled = relabel_core(k, blocks, labels_of, far_offsets, far_lookup, chunk)
    assert peak_memory_mib() - held < 16  # MiB; reading the table would take 256
    np.testing.assert_array_equal(relabelled, expected)


def test_a_part_written_again_with_its_labels_keeps_its_shard_file(tmp_path):
    """Its mtime is what the export's records hold of the stitched files they read: a relabel
    task run again with the same labels (its blocks' ids changed elsewhere) leaves the export
    complete; other labels replace the file."""
    shape, voxel_size, config = (16, 32, 32), (20.0, 10.0, 10.0), ExportConfig(num_scales=2)
    new_segmentation(tmp_path, shape, voxel_size, segmentation_layout(shape, voxel_size, config, (8, 16, 16)))  # fmt: skip
    writer = SegmentationWriter(tmp_path)
    part, labels = (
        (slice(0, 16), slice(0, 32), slice(0, 32)),
        np.arange(16 * 32 * 32).reshape(shape),
    )
    writer.write(part, labels.astype(np.uint64))
    (name,) = writer.chunk_names(part)
    shard = tmp_path / "segmentation" / name
    before = shard.stat()
    writer.write(part, labels.astype(np.uint64))
    assert (shard.stat().st_ino, shard.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    writer.write(part, (labels + 1).astype(np.uint64))
    assert shard.stat().st_ino != before.st_ino


def test_cores_on_a_chunk_grid_keep_the_labels_of_the_blocks_nearest_each_voxel():
    # Objects with less than 200 voxels in an overlap stay apart, so which block labels a voxel
    # of an overlap shows in the result. Chunks as wide as the overlaps put the chunk-aligned
    # split at an overlap's edge: a core then reaches its block's border, where FFN is least
    # reliable. Its content must still come from the block whose centre is nearest.
    truth = real_bodies()
    results = blocks_of(truth)
    blocks = plan_blocks(truth.shape, CONFIG)
    config = dataclasses.replace(CONFIG, min_overlap_voxels=200)
    labels_of = lambda i: results[i].labels  # noqa: E731
    offsets, lookup, _ = join_ids([block_pairs(k, blocks, labels_of, config) for k in range(32)])
    chunk = config.overlap_zyx
    by_tasks = np.zeros(truth.shape, np.uint64)
    for k in range(len(blocks)):
        core = block_core(k, blocks, chunk)
        by_tasks[core] = relabel_core(k, blocks, labels_of, offsets, lookup, chunk)
    middle = [block_core(k, blocks) for k in range(len(blocks))]
    assert any(block_core(k, blocks, chunk) != middle[k] for k in range(len(blocks)))
    in_memory, _ = stitch(results, truth.shape, config)
    assert_same_segmentation(by_tasks, in_memory)


def _layout(shape_zyx, sharded: bool) -> SegmentationLayout:
    """The unsharded layout on the stitching's chunks, or shards of 32^3 voxels in chunks of 8^3."""
    if not sharded:
        return SegmentationLayout((4, 8, 8))
    plan = plan_shards([shape_zyx], [(8, 8, 8)], [(1, 1, 1)], task_voxels=32)
    return SegmentationLayout((8, 8, 8), sharding=plan.specs[0], region_zyx=plan.region_zyx)


@pytest.mark.parametrize("sharded", [False, True], ids=["unsharded", "sharded"])
def test_parts_go_into_the_segmentation_layer_and_a_lost_or_cut_file_is_written_again(
    tmp_path, sharded
):
    truth = real_bodies()
    results = blocks_of(truth)
    blocks = plan_blocks(truth.shape, CONFIG)
    labels_of = lambda i: results[i].labels  # noqa: E731
    found = [block_pairs(k, blocks, labels_of, CONFIG) for k in range(len(blocks))]
    offsets, lookup, merges = join_ids(found)
    layout = _layout(truth.shape, sharded)
    new_segmentation(tmp_path, truth.shape, (10.0, 10.0, 10.0), layout)
    layer = SegmentationWriter(tmp_path)
    parts = layer_parts(blocks, layer.layout)
    assert len(parts) == len(blocks) if not sharded else 1 < len(parts) < len(blocks)
    records = [
        write_part(k, part, blocks, labels_of, offsets, lookup, layer)
        for k, part in enumerate(parts)
    ]
    with open_volume(segmentation_spec(tmp_path)) as array:
        assert_same_segmentation(array[...], truth)  # read back in place, as evaluation does

    layer_dir = tmp_path / "segmentation"  # file names are relative to it: 10_10_10/...
    files = [name for r in records for name in r["chunks"]]
    assert sorted(files) == sorted(f"10_10_10/{p.name}" for p in (layer_dir / "10_10_10").iterdir())
    assert len(files) == len(parts) if sharded else len(files) > len(parts)  # a shard a part
    lost, cut = records[1]["chunks"], records[-1]["chunks"]
    (layer_dir / next(iter(lost))).unlink()
    cut_file = layer_dir / next(iter(cut))
    cut_file.write_bytes(cut_file.read_bytes()[:-5])
    for k, record in enumerate(records):  # as the relabel task adds them: its blocks' stats
        owned = owned_blocks(k, parts[k], blocks, layout)
        stats = sum((InferenceStats(fov_evaluations=i + 1) for i in owned), InferenceStats())
        record["stats"] = stats.to_dict()
    table = (offsets, lookup, merges)
    checked = check_cores(iter(records), layer, blocks, labels_of, table)
    assert checked.repaired == [1, len(parts) - 1]
    assert checked.stitch.objects == len(np.unique(truth[truth > 0]))
    assert checked.inference.fov_evaluations == sum(range(1, len(blocks) + 1))
    again = check_cores(iter(records), layer, blocks, labels_of, table)
    assert again.repaired == [] and again.token == checked.token
    with open_volume(segmentation_spec(tmp_path)) as array:
        assert_same_segmentation(array[...], truth)


def test_the_output_chunks_must_fit_in_the_overlaps():
    assert BlockConfig(overlap_zyx=(16, 24, 100)).chunks == (16, 16, 64)  # powers of two
    with pytest.raises(ConfigError, match="chunk_zyx <= overlap_zyx"):
        BlockConfig(overlap_zyx=(8, 8, 8), chunk_zyx=(8, 16, 16))


def test_a_task_finds_its_neighbours_in_a_teravoxel_grid_without_listing_its_blocks():
    # 10^12 voxels in 128^3 blocks every 96: over a million blocks. The tasks of block k ask
    # only about its neighbourhood; going through every block would take seconds per task.
    config = BlockConfig((128, 128, 128), (32, 32, 32))
    started = time.perf_counter()
    grid = plan_blocks((10_000, 10_000, 10_000), config)
    middle = grid.overlapping(Block((5000, 5000, 5000), (5001, 5001, 5001)))[0]
    later = later_neighbours(middle, grid)
    around = core_neighbours(middle, grid, config.chunks)
    assert time.perf_counter() - started < 1.0
    assert len(grid) > 10**6
    # An inner block: 26 neighbours, half of them later in plan order; all overlap its core.
    assert len(later) == 13 and all(k > middle for k in later)
    assert len(around) == 27 and middle in around
    block = grid[middle]
    for k in around:
        assert all(
            a < d and c < b
            for a, b, c, d in zip(block.start, block.stop, grid[k].start, grid[k].stop, strict=True)
        )
