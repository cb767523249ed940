"""Stitching: the blocks' segmentations joined into one, as small tasks or in one process.

In the region where two blocks overlap, two objects are the same when they share at least
`min_overlap_voxels` voxels and at least `min_overlap_fraction` of their union there
(intersection over union): an object that one block merged does not swallow every smaller object
of its neighbour, which a share of the smaller one would let it do. The merge graph's connected
components become the stitched ids. Each voxel takes its label from the block whose centre is
nearest along each axis (its *core*: the overlaps are split in the middle), because FFN is least
reliable near a block's border where FOVs cannot be centred; where that block found no object,
from the first other block that did.

Three steps that a workflow can spread over workers, each bounded by a block's size whatever the
volume's (issue 15):

  1. `pairs_between(i, j)`: for two blocks that overlap, the pairs of their objects that agree
     there (global ids: block i's local id k is `offsets[i] + k`, `id_offsets`);
  2. `join_ids`: the pairs of every overlap joined (connected components over ids, not voxels)
     into one table, global id -> stitched id;
  3. `relabel_core(k)`: block k's core in stitched ids, filled where k found no object from the
     blocks that did; reads block k and the blocks that overlap its core.

The cores tile the volume, so step 3's outputs can go straight into a chunked volume; there the
ids are the components' numbers (unique per object, not 1..N). `stitch` runs the three in one
process and renumbers 1..N; `segment_blockwise` segments and stitches a volume in one process.
"""

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import sparse
from scipy.sparse.csgraph import connected_components
from tqdm import tqdm

from pipeline import config as config_io
from pipeline.blocks import (
    Block,
    BlockConfig,
    BlockResult,
    _provenance,
    block_done,
    block_path,
    block_state_path,
    plan_blocks,
    read_block_result,
    segment_block,
    write_block_result,
)
from pipeline.errors import BlockResultError
from pipeline.inference import InferenceConfig, InferenceStats, Predictor
from pipeline.model import ModelConfig

Pairs = tuple[np.ndarray, np.ndarray]


def _axis_intervals(blocks: Sequence[Block], axis: int) -> list[tuple[int, int]]:
    return sorted({(b.start[axis], b.stop[axis]) for b in blocks})


def _core(block: Block, intervals: list[list[tuple[int, int]]]) -> tuple[slice, ...]:
    """The part of `block` it owns: its overlaps with the neighbours are split in the middle."""
    core = []
    for axis, spans in enumerate(intervals):
        k = spans.index((block.start[axis], block.stop[axis]))
        low = block.start[axis] if k == 0 else (spans[k - 1][1] + spans[k][0]) // 2
        high = block.stop[axis] if k == len(spans) - 1 else (spans[k][1] + spans[k + 1][0]) // 2
        core.append(slice(low, high))
    return tuple(core)


def _intersection(a: Block, b: Block) -> tuple[slice, ...] | None:
    low = np.maximum(a.start, b.start)
    high = np.minimum(a.stop, b.stop)
    if np.any(low >= high):
        return None
    return tuple(slice(int(lo), int(hi)) for lo, hi in zip(low, high, strict=True))


def _local(region: tuple[slice, ...], block: Block) -> tuple[slice, ...]:
    return tuple(slice(r.start - s, r.stop - s) for r, s in zip(region, block.start, strict=True))


def _agreeing_pairs(
    a: np.ndarray, b: np.ndarray, base: np.uint64, config: BlockConfig
) -> tuple[np.ndarray, np.ndarray]:
    """Ids (global, < `base`) of `a` and `b`, same region, that overlap enough to be one object."""
    both = (a > 0) & (b > 0)
    # One integer per pair: a 1-D unique is far faster than np.unique of rows.
    keys, shared = np.unique(a[both] * base + b[both], return_counts=True)
    pair_a, pair_b = keys // base, keys % base
    ids_a, size_a = np.unique(a[a > 0], return_counts=True)
    ids_b, size_b = np.unique(b[b > 0], return_counts=True)
    union = size_a[np.searchsorted(ids_a, pair_a)] + size_b[np.searchsorted(ids_b, pair_b)] - shared
    keep = (shared >= config.min_overlap_voxels) & (shared >= config.min_overlap_fraction * union)
    return pair_a[keep], pair_b[keep]


@dataclass(frozen=True)
class StitchStats:
    blocks: int
    block_objects: int  # objects over all blocks, before stitching
    merges: int  # pairs of block objects joined across an overlap
    objects: int  # in the stitched volume


# ---------------------------------------------------------------------------------------------
# The three steps


def id_offsets(object_counts: Sequence[int]) -> np.ndarray:
    """offsets[i]: what block i's local ids are shifted by to be unique over all blocks."""
    total = int(sum(object_counts))
    if total >= 2**32:  # pairs of ids are packed into one uint64
        raise BlockResultError(f"{total} objects in the blocks: too many to stitch")
    return np.concatenate([[0], np.cumsum(object_counts)[:-1]]).astype(np.uint64)


def _global(labels: np.ndarray, offset: np.uint64) -> np.ndarray:
    local = labels.astype(np.uint64)
    return np.where(local > 0, local + offset, np.uint64(0))


def pairs_between(
    block_i: Block,
    labels_i: np.ndarray,
    block_j: Block,
    labels_j: np.ndarray,
    offsets: tuple[int, int],
    total: int,
    config: BlockConfig,
) -> Pairs:
    """Global ids of block i's and block j's objects that are one object where the blocks
    overlap (none if they do not)."""
    region = _intersection(block_i, block_j)
    if region is None:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    return _agreeing_pairs(
        _global(labels_i[_local(region, block_i)], np.uint64(offsets[0])),
        _global(labels_j[_local(region, block_j)], np.uint64(offsets[1])),
        np.uint64(total + 1),
        config,
    )


def join_ids(total: int, pairs: Iterable[Pairs]) -> tuple[np.ndarray, int]:
    """(lookup, merges): lookup[global id] is the stitched id (0 stays 0); merges counts pairs."""
    found = list(pairs)
    a = np.concatenate([p[0] for p in found] or [np.zeros(0, np.uint64)]).astype(np.int64)
    b = np.concatenate([p[1] for p in found] or [np.zeros(0, np.uint64)]).astype(np.int64)
    graph = sparse.coo_array((np.ones(len(a)), (a, b)), shape=(total + 1, total + 1))
    _, component = connected_components(graph, directed=False)
    lookup = component.astype(np.uint64) + np.uint64(1)
    lookup[0] = 0
    return lookup, len(a)


def block_core(k: int, blocks: Sequence[Block]) -> tuple[slice, ...]:
    """The part of the volume block k owns."""
    return _core(blocks[k], [_axis_intervals(blocks, axis) for axis in range(3)])


def _box(region: tuple[slice, ...]) -> Block:
    return Block(tuple(s.start for s in region), tuple(s.stop for s in region))


def core_neighbours(k: int, blocks: Sequence[Block]) -> list[int]:
    """The blocks (k included, in index order) that overlap block k's core."""
    core = _box(block_core(k, blocks))
    return [i for i, block in enumerate(blocks) if _intersection(block, core) is not None]


def relabel_core(
    k: int,
    blocks: Sequence[Block],
    labels_of: Callable[[int], np.ndarray],
    offsets: np.ndarray,
    lookup: np.ndarray,
) -> np.ndarray:
    """Block k's core in stitched ids; where k found no object, the first block (in index order)
    that did fills in: a sliver between a block's border and a membrane is too thin to seed there,
    but whole in the neighbour. `labels_of(i)` gives block i's local labels; only the blocks of
    `core_neighbours(k)` are asked for."""
    core = _box(block_core(k, blocks))
    out = lookup[_global(labels_of(k)[_local(core.slices, blocks[k])], offsets[k])]
    for i in core_neighbours(k, blocks):
        region = _intersection(blocks[i], core)
        filled = lookup[_global(labels_of(i)[_local(region, blocks[i])], offsets[i])]
        target = out[_local(region, core)]
        np.copyto(target, filled, where=target == 0)
    return out


# ---------------------------------------------------------------------------------------------
# In one process


def _check_grid(blocks: Sequence[Block], volume_shape: Sequence[int]) -> None:
    intervals = [_axis_intervals(blocks, axis) for axis in range(3)]
    grid = {tuple(b.start) for b in blocks}
    expected = np.prod([len(spans) for spans in intervals])
    covers = all(
        spans[0][0] == 0 and spans[-1][1] == s
        for spans, s in zip(intervals, volume_shape, strict=True)
    )
    if len(grid) != len(blocks) or len(blocks) != expected or not covers:
        raise BlockResultError(
            f"{len(blocks)} block results do not form a grid covering the volume {tuple(volume_shape)}"
        )


def stitch_blocks(
    blocks: Sequence[Block],
    labels_of: Callable[[int], np.ndarray],
    volume_shape: Sequence[int],
    config: BlockConfig,
    write: Callable[[tuple[slice, ...], np.ndarray], None],
) -> StitchStats:
    """The three steps over `blocks` (a grid tiling `volume_shape`), one after the other, in one
    process that never holds more than a block's neighbourhood: `labels_of(i)` reads block i's
    labels (cache them if reading is slow), `write(core, ids)` stores each core. Ids are 1..N:
    a first pass over the cores finds which stitched ids are left (an object may survive in no
    core), the second writes them renumbered."""
    _check_grid(blocks, volume_shape)
    counts = [int(labels_of(i).max(initial=0)) for i in range(len(blocks))]
    offsets, total = id_offsets(counts), int(sum(counts))
    pairs = (
        pairs_between(blocks[i], labels_of(i), blocks[j], labels_of(j),
                      (offsets[i], offsets[j]), total, config)
        for i, j in itertools.combinations(range(len(blocks)), 2)
        if _intersection(blocks[i], blocks[j]) is not None
    )  # fmt: skip
    lookup, merges = join_ids(total, pairs)
    left = np.zeros(total + 2, bool)
    for k in range(len(blocks)):
        left[relabel_core(k, blocks, labels_of, offsets, lookup)] = True
    left[0] = False
    renumbered = np.cumsum(left).astype(np.uint64) * left  # 1..N in stitched-id order, else 0
    lookup = renumbered[lookup]
    for k in range(len(blocks)):
        write(block_core(k, blocks), relabel_core(k, blocks, labels_of, offsets, lookup))
    return StitchStats(len(blocks), total, merges, int(left.sum()))


def stitch(
    results: Sequence[BlockResult], volume_shape: Sequence[int], config: BlockConfig
) -> tuple[np.ndarray, StitchStats]:
    """Join block results that tile `volume_shape` into one uint64 segmentation in memory."""
    segmentation = np.zeros(tuple(volume_shape), np.uint64)

    def write(core: tuple[slice, ...], ids: np.ndarray) -> None:
        segmentation[core] = ids

    stats = stitch_blocks(
        [r.block for r in results], lambda i: results[i].labels, volume_shape, config, write
    )
    return segmentation, stats


def segment_blockwise(
    raw: np.ndarray,
    predict: Predictor,
    model: ModelConfig,
    inference: InferenceConfig,
    blocks_config: BlockConfig,
    blocks_dir: str | Path,
    *,
    provenance: dict | None = None,
    progress: bool = False,
) -> tuple[np.ndarray, dict]:
    """Segment every unfinished block into `blocks_dir`, then stitch all of them.

    Returns the segmentation and a JSON-ready summary: inference stats summed over blocks (their
    `seconds` is compute time), per-block seconds, and the stitching stats. A finished block made
    with other settings raises BlockResultError (use a fresh `blocks_dir`).
    """
    blocks = plan_blocks(raw.shape, blocks_config)
    expected = _provenance(model, inference, provenance)
    results = []
    for block in tqdm(blocks, desc="blocks", unit="block", disable=not progress):
        path = block_path(blocks_dir, block)
        if block_done(path):
            result = read_block_result(path, block)
            if result.provenance != expected:
                raise BlockResultError(f"{path}: made with other settings than this run")
        else:
            state = block_state_path(blocks_dir, block)
            result = segment_block(raw, block, predict, model, inference, provenance, state)
            write_block_result(path, result)
        results.append(result)
    segmentation, stitched = stitch(results, raw.shape, blocks_config)
    total = sum((r.stats for r in results), InferenceStats())
    summary = {
        "inference": total.to_dict(),
        "block_seconds": [round(r.stats.seconds, 3) for r in results],
        "stitch": dataclasses.asdict(stitched),
        "blocks_config": config_io.to_dict(blocks_config),
    }
    return segmentation, summary
