"""Stitching as tasks (pipeline.stitching): pairs per overlap, one id table, then each block's
core relabelled on its own from its neighbours only. The hand-made cases (slivers taken from a
neighbour, merged objects not swallowing their neighbours) are in test_blocks.py."""

import itertools

import cc3d
import fastremap
import h5py
import numpy as np
from test_inference import assert_same_segmentation
from test_parts import CUT

from pipeline.blocks import BlockConfig, BlockResult, plan_blocks
from pipeline.inference import InferenceStats
from pipeline.stitching import (
    block_core,
    core_neighbours,
    id_offsets,
    join_ids,
    pairs_between,
    relabel_core,
    stitch,
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


def test_blocks_that_agree_with_the_truth_stitch_back_to_it_task_by_task():
    truth = real_bodies()
    results = blocks_of(truth)
    blocks = [r.block for r in results]
    assert len(blocks) == 32  # 2 x 4 x 4: the middle ones have neighbours on every side

    counts = [int(r.labels.max()) for r in results]
    offsets, total = id_offsets(counts), sum(counts)
    pairs = [
        pairs_between(blocks[i], results[i].labels, blocks[j], results[j].labels,
                      (offsets[i], offsets[j]), total, CONFIG)
        for i, j in itertools.combinations(range(len(blocks)), 2)
    ]  # fmt: skip
    lookup, merges = join_ids(total, pairs)
    assert merges > 0

    by_tasks = np.zeros(truth.shape, np.uint64)
    for k in range(len(blocks)):
        asked: list[int] = []

        def labels_of(i: int, asked: list = asked) -> np.ndarray:
            asked.append(i)
            return results[i].labels

        by_tasks[block_core(k, blocks)] = relabel_core(k, blocks, labels_of, offsets, lookup)
        assert set(asked) <= set(core_neighbours(k, blocks))  # only the core's neighbours read
        assert len(core_neighbours(k, blocks)) < len(blocks)
    assert_same_segmentation(by_tasks, truth)
    in_memory, stats = stitch(results, truth.shape, CONFIG)
    assert_same_segmentation(in_memory, truth)
    assert stats.objects == len(np.unique(truth[truth > 0])) and stats.merges == merges
