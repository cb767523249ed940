"""Stitching as tasks (pipeline.stitching): pairs per overlap, one id table, each block's core
relabelled on its own, gives the same partition of the voxels as stitching in memory."""

import itertools

import fastremap
import h5py
import numpy as np
from test_inference import assert_same_segmentation
from test_parts import CUT

from pipeline.blocks import BlockConfig, BlockResult, plan_blocks, stitch
from pipeline.inference import InferenceStats
from pipeline.stitching import (
    block_core,
    core_neighbours,
    id_offsets,
    join_ids,
    pairs_between,
    relabel_core,
)

CONFIG = BlockConfig(block_shape_zyx=(20, 36, 36), overlap_zyx=(8, 12, 12))


def block_results() -> tuple[list[BlockResult], tuple[int, ...]]:
    """Blocks of the real FlyEM labels as a segmenter might leave them: local ids, objects
    missed (0) in some blocks, some cut in two."""
    with h5py.File(CUT) as f:
        truth = f["volumes/labels/neuron_ids"][...]
    rng = np.random.default_rng(0)
    results = []
    for block in plan_blocks(truth.shape, CONFIG):
        labels = truth[block.slices].copy()
        ids = np.unique(labels[labels > 0])
        labels[np.isin(labels, rng.choice(ids, len(ids) // 4, replace=False))] = 0
        cut = rng.choice(ids)
        labels[(labels == cut) & (np.indices(labels.shape)[2] < labels.shape[2] // 2)] = 10**9
        local, _ = fastremap.renumber(labels, preserve_zero=True)
        results.append(BlockResult(block, local.astype(np.uint32), InferenceStats(), {}))
    return results, truth.shape


def test_stitching_by_tasks_gives_the_partition_of_stitching_in_memory():
    results, shape = block_results()
    blocks = [r.block for r in results]
    assert len(blocks) == 18  # 2 x 3 x 3: the middle ones have neighbours on every side
    whole, stats = stitch(results, shape, CONFIG)

    counts = [int(r.labels.max()) for r in results]
    offsets, total = id_offsets(counts), sum(counts)
    pairs = [
        pairs_between(blocks[i], results[i].labels, blocks[j], results[j].labels,
                      (offsets[i], offsets[j]), total, CONFIG)
        for i, j in itertools.combinations(range(len(blocks)), 2)
    ]  # fmt: skip
    lookup, merges = join_ids(total, pairs)
    assert merges == stats.merges > 0

    by_tasks = np.zeros(shape, np.uint64)
    for k in range(len(blocks)):
        asked = []

        def labels_of(i: int, asked: list = asked) -> np.ndarray:
            asked.append(i)
            return results[i].labels

        by_tasks[block_core(k, blocks)] = relabel_core(k, blocks, labels_of, offsets, lookup)
        assert set(asked) <= set(core_neighbours(k, blocks))  # only the core's neighbours read
    assert_same_segmentation(by_tasks, whole)
    assert len(np.unique(by_tasks[by_tasks > 0])) == stats.objects
