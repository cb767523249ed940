"""Stitching as small tasks, none of which holds the whole volume (issue 15).

The same rule as `pipeline.blocks.stitch`, cut into the three steps a workflow can spread over
workers, each bounded by a block's size whatever the volume's:

  1. `pairs_between(i, j)`: for two blocks that overlap, the pairs of their objects that agree
     there (global ids: block i's local id k is `offsets[i] + k`, `id_offsets`);
  2. `join_ids`: the pairs of every overlap joined (connected components over ids, not voxels)
     into one table, global id -> stitched id;
  3. `relabel_core(k)`: block k's core (the part of the volume it owns) in stitched ids, filled
     where k found no object from the neighbours that did; reads block k and the blocks that
     overlap its core.

The cores tile the volume, so step 3's outputs can be written straight into a chunked volume.
Stitched ids are the components' numbers: unique per object, not renumbered to 1..N (that would
need the whole volume).
"""

from collections.abc import Callable, Iterable, Sequence

import numpy as np
from scipy import sparse
from scipy.sparse.csgraph import connected_components

from pipeline.blocks import (
    Block,
    BlockConfig,
    _agreeing_pairs,
    _axis_intervals,
    _core,
    _intersection,
    _local,
)
from pipeline.errors import BlockResultError

Pairs = tuple[np.ndarray, np.ndarray]


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


def core_neighbours(k: int, blocks: Sequence[Block]) -> list[int]:
    """The blocks (k included, in index order) that overlap block k's core."""
    core = block_core(k, blocks)
    core_box = Block(tuple(s.start for s in core), tuple(s.stop for s in core))
    return [i for i, block in enumerate(blocks) if _intersection(block, core_box) is not None]


def block_core(k: int, blocks: Sequence[Block]) -> tuple[slice, ...]:
    """The part of the volume block k owns: its overlaps with its neighbours split in the middle."""
    return _core(blocks[k], [_axis_intervals(blocks, axis) for axis in range(3)])


def relabel_core(
    k: int,
    blocks: Sequence[Block],
    labels_of: Callable[[int], np.ndarray],
    offsets: np.ndarray,
    lookup: np.ndarray,
) -> np.ndarray:
    """Block k's core in stitched ids. Where k found no object, the first block (in index order)
    that did fills in: a sliver between a block's border and a membrane is too thin to seed there,
    but whole in the neighbour. `labels_of(i)` gives block i's local labels; only the blocks of
    `core_neighbours(k)` are asked for."""
    core = block_core(k, blocks)
    core_box = Block(tuple(s.start for s in core), tuple(s.stop for s in core))
    out = lookup[_global(labels_of(k)[_local(core, blocks[k])], offsets[k])]
    for i in core_neighbours(k, blocks):
        region = _intersection(blocks[i], core_box)
        filled = lookup[_global(labels_of(i)[_local(region, blocks[i])], offsets[i])]
        target = out[_local(region, core_box)]
        np.copyto(target, filled, where=target == 0)
    return out
