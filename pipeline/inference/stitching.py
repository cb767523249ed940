"""Stitching: the blocks' segmentations joined into one, as small tasks or in one process.

In the region where two blocks overlap, two objects are the same when they share at least
`min_overlap_voxels` voxels and at least `min_overlap_fraction` of their union there
(intersection over union): an object that one block merged does not swallow every smaller object
of its neighbour, which a share of the smaller one would let it do. The merge graph's connected
components become the stitched ids. Each voxel takes its label from the block whose centre is
nearest along each axis (its *core*: the overlaps are split in the middle), because FFN is least
reliable near a block's border where FOVs cannot be centred; where that block found no object,
from the first other block that did.

Three steps that a workflow spreads over workers (apps/stitch.py), each bounded by a block's
size whatever the volume's (issue 15):

  1. `block_pairs(k)`: block k's object count and, for each later block that overlaps it, the
     pairs of their objects (local ids) that agree there;
  2. `join_ids`: every block's pairs joined (connected components over ids, not voxels) into one
     table: block i's local id n is global id `offsets[i] + n`, `lookup[global id]` its stitched
     id (the component's number: unique per object, 1..C with gaps for objects left in no core);
  3. `relabel_region(part)`: a part of the volume in stitched ids, each voxel from the block
     whose centre is nearest, filled where it found no object from the blocks that did; reads
     the blocks that overlap the part. `write_part` puts it into the full resolution of the
     export's segmentation layer (precomputed, `pipeline.export.layers.SegmentationWriter`), a task per
     part (`layer_parts`): unsharded, block k's core with the overlaps split on the chunk grid
     (`block_core(align=...)`), whole chunks; sharded, a region of the shard plan, one shard
     file. So the tasks write side by side; a part's record (a digest per file) lets
     `check_cores` find and rewrite files lost or damaged later.

`stitch` runs the three in one process and renumbers 1..N; `segment_blockwise` segments and
stitches a volume in one process.
"""

import dataclasses
import functools
import hashlib
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import sparse
from scipy.sparse.csgraph import connected_components
from tqdm import tqdm

from pipeline.core import config_io
from pipeline.core.atomic import atomic_path
from pipeline.core.errors import BlockResultError
from pipeline.core.roi import Roi
from pipeline.core.stamps import Cells, Part, digest
from pipeline.export.folder_layout import SEGMENTATION_LAYER
from pipeline.export.segmentation_layer import (
    SegmentationLayout,
    SegmentationWriter,
    holds_segmentation,
    new_segmentation,
)
from pipeline.inference.blocks import (
    Block,
    BlockConfig,
    BlockGrid,
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
from pipeline.inference.flood_fill import InferenceConfig, InferenceStats, Predictor
from pipeline.network.model import ModelConfig

Box = tuple[slice, ...]

Pairs = tuple[np.ndarray, np.ndarray]


def _split(previous: tuple[int, int], following: tuple[int, int], align: int) -> int:
    """Where two consecutive blocks' overlap is split: its middle, or with `align` > 1 the
    multiple of `align` inside the overlap nearest to the middle (so that cores are whole chunks
    of a chunked output)."""
    low, high = following[0], previous[1]
    middle = (low + high) // 2
    if align == 1:
        return middle
    inside = [m for m in (middle // align * align, -(-middle // align) * align) if low <= m <= high]
    if not inside:
        raise BlockResultError(
            f"the overlap {low}:{high} holds no multiple of the chunk size {align}: "
            "make the block overlap at least a chunk"
        )
    return min(inside, key=lambda m: abs(m - middle))


def _core(
    block: Block, intervals: list[list[tuple[int, int]]], align: Sequence[int]
) -> tuple[slice, ...]:
    """The part of `block` it owns: its overlaps with the neighbours are split in the middle."""
    core = []
    for axis, spans in enumerate(intervals):
        k = spans.index((block.start[axis], block.stop[axis]))
        step = align[axis]
        low = block.start[axis] if k == 0 else _split(spans[k - 1], spans[k], step)
        high = block.stop[axis] if k == len(spans) - 1 else _split(spans[k], spans[k + 1], step)
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
    block_i: Block, labels_i: np.ndarray, block_j: Block, labels_j: np.ndarray, config: BlockConfig
) -> Pairs:
    """Local ids of block i's and block j's objects that are one object where the blocks
    overlap (none if they do not)."""
    region = _intersection(block_i, block_j)
    if region is None:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    a = labels_i[_local(region, block_i)].astype(np.uint64)
    b = labels_j[_local(region, block_j)].astype(np.uint64)
    return _agreeing_pairs(a, b, np.uint64(max(int(a.max()), int(b.max())) + 1), config)


@dataclass(frozen=True, eq=False)
class BlockPairs:
    """Step 1's result for block k: its object count, for each later block j that overlaps it
    the pairs (local ids) of objects that agree there, and where each object begins
    (`first_voxels`; None from pairs saved before they were kept)."""

    count: int
    pairs: dict[int, Pairs]
    firsts: np.ndarray | None = None


def later_neighbours(k: int, blocks: BlockGrid) -> list[int]:
    """The blocks after k (in plan order) that overlap it: whose pairs with k block k's task finds."""
    return [j for j in blocks.overlapping(blocks[k]) if j > k]


# The first voxel of a local id the block does not hold (`first_voxels`).
NOT_HELD = np.uint64(2**64 - 1)


def first_voxels(labels: np.ndarray) -> np.ndarray:
    """Per local id 1..max, the index of its first voxel in the block (C order), NOT_HELD for
    an id the block does not hold: where an object begins does not change when the block,
    segmented again after a change elsewhere in it, numbers its objects otherwise."""
    ids, first = np.unique(labels.ravel(), return_index=True)
    firsts = np.full(int(labels.max(initial=0)), NOT_HELD, np.uint64)
    held = ids > 0
    firsts[ids[held].astype(np.int64) - 1] = first[held]
    return firsts


def block_pairs(
    k: int, blocks: BlockGrid, labels_of: Callable[[int], np.ndarray], config: BlockConfig
) -> BlockPairs:
    """Step 1 for block k: reads block k and the later blocks that overlap it."""
    labels = labels_of(k)
    pairs = {
        j: pairs_between(blocks[k], labels, blocks[j], labels_of(j), config)
        for j in later_neighbours(k, blocks)
    }
    return BlockPairs(int(labels.max(initial=0)), pairs, first_voxels(labels))


def save_block_pairs(path: str | Path, found: BlockPairs) -> None:
    arrays = {f"{side}{j}": p[n] for j, p in found.pairs.items() for n, side in enumerate("ab")}
    if found.firsts is not None:
        arrays["firsts"] = found.firsts
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, count=found.count, **arrays)


def load_block_pairs(path: str | Path) -> BlockPairs:
    with np.load(path) as f:
        later = sorted(int(name[1:]) for name in f.files if name.startswith("a"))
        firsts = f["firsts"] if "firsts" in f.files else None
        return BlockPairs(int(f["count"]), {j: (f[f"a{j}"], f[f"b{j}"]) for j in later}, firsts)


def join_ids(found: Sequence[BlockPairs]) -> tuple[np.ndarray, np.ndarray, int]:
    """Step 2, (offsets, lookup, merges): block i's local id k is global id `offsets[i] + k`,
    lookup[global id] its stitched id (0 stays 0; the stitched ids are the numbers of the merge
    graph's components, 1..C); merges counts the pairs joined."""
    offsets = id_offsets([f.count for f in found])
    total = sum(f.count for f in found)
    a, b = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for i, f in enumerate(found):
        for j, (ids_i, ids_j) in f.pairs.items():
            a.append((ids_i + offsets[i]).astype(np.int64))
            b.append((ids_j + offsets[j]).astype(np.int64))
    a, b = np.concatenate(a), np.concatenate(b)
    graph = sparse.coo_array((np.ones(len(a)), (a, b)), shape=(total + 1, total + 1))
    # Components are numbered from node 0 on: the background (in no pair) is component 0.
    _, component = connected_components(graph, directed=False)
    return offsets, component.astype(np.uint64), len(a)


# A block's place in a stitched id that `stable_lookup` makes: its index above this bit, where
# one of its objects begins below (a block of fewer than 2^32 voxels).
BLOCK_BIT = 32


def _object_names(offsets: np.ndarray, found: Sequence[BlockPairs], total: int) -> np.ndarray:
    """Per global id 0..total, a name no other object has that does not change while the
    object does not: block i's object `i << BLOCK_BIT | 1 + its first voxel` (of pairs saved
    before first voxels were kept, `| its local id`); 0 for the background, NOT_HELD for an id
    its block does not hold (it is looked up by no voxel)."""
    names = np.zeros(total + 1, np.uint64)
    for i, (offset, block) in enumerate(zip(offsets, found, strict=True)):
        start = int(offset) + 1
        if block.firsts is None:
            within = np.arange(1, block.count + 1, dtype=np.uint64)
        else:  # wraps to 0 where NOT_HELD, which the name then is
            within = block.firsts + np.uint64(1)
        named = np.uint64(i) << np.uint64(BLOCK_BIT) | within
        names[start : start + block.count] = np.where(within == 0, NOT_HELD, named)
    return names


def stable_lookup(
    offsets: np.ndarray, components: np.ndarray, found: Sequence[BlockPairs]
) -> np.ndarray:
    """`join_ids`'s lookup (global id -> the number of its merge graph's component) with each
    component named by the least name of its objects (`_object_names`): numbered 1..C, a
    component's id would change with any object added or lost before it in any block; named so,
    it changes only where its objects do, and a part of the layer whose blocks' ids are as they
    were is written as it was (its task stays up to date: `table_cells`)."""
    names = _object_names(offsets, found, len(components) - 1)
    order = np.lexsort((names, components))  # by component, then name: each one's least first
    starts = np.flatnonzero(np.diff(components[order], prepend=np.uint64(2**64 - 1)))
    least = np.zeros(int(components.max(initial=0)) + 1, np.uint64)
    least[components[order][starts]] = names[order][starts]
    return least[components]


def table_cells(blocks: BlockGrid, offsets: np.ndarray, lookup: np.ndarray, identity: str) -> Cells:
    """Per block, on the block grid, the sha256 of the stitched ids of its objects: what a task
    that relabels a part of the layer reads of the id table (`table_part`), and alone keys it
    (`stamps.save_cells`)."""
    counts = [len(s) for s in blocks.starts_zyx]
    grid = np.zeros([*counts, 32], np.uint8)
    ends = np.append(offsets[1:], np.uint64(len(lookup) - 1))
    for k, (start, end) in enumerate(zip(offsets, ends, strict=True)):
        ids = np.ascontiguousarray(lookup[int(start) + 1 : int(end) + 1])
        place = np.unravel_index(k, counts)
        grid[place] = np.frombuffer(hashlib.sha256(ids.tobytes()).digest(), np.uint8)
    return Cells(identity, (0, 0, 0), (1, 1, 1), grid)


def table_part(settings: dict) -> Part:
    """The part of the id table a relabel task reads (`table_cells`): the ids of the blocks it
    reads (`settings["reads"]`, a box of the block grid)."""
    blocks = plan_blocks(settings["shape"], config_io.from_dict(BlockConfig, settings["blocks"]))
    places = np.array(np.unravel_index(settings["reads"], [len(s) for s in blocks.starts_zyx]))
    return Part(Roi(tuple(map(int, places.min(1))), tuple(int(p) + 1 for p in places.max(1))))


def block_core(k: int, blocks: BlockGrid, align: Sequence[int] = (1, 1, 1)) -> tuple[slice, ...]:
    """The part of the volume block k owns; with `align` (a chunk shape) its inner faces lie on
    multiples of it, so the cores of a grid write whole chunks, each chunk from one task."""
    return _core(blocks[k], [blocks.axis_intervals(axis) for axis in range(3)], align)


def _box(region: tuple[slice, ...]) -> Block:
    return Block(tuple(s.start for s in region), tuple(s.stop for s in region))


def core_neighbours(k: int, blocks: BlockGrid, align: Sequence[int] = (1, 1, 1)) -> list[int]:
    """The blocks (k included, in index order) that overlap block k's core."""
    return part_neighbours(block_core(k, blocks, align), blocks)


def part_neighbours(part: Box, blocks: BlockGrid) -> list[int]:
    """The blocks (in index order) that overlap `part`: all that relabelling it reads."""
    return blocks.overlapping(_box(part))


def relabel_core(
    k: int,
    blocks: BlockGrid,
    labels_of: Callable[[int], np.ndarray],
    offsets: np.ndarray,
    lookup: np.ndarray,
    align: Sequence[int] = (1, 1, 1),
) -> np.ndarray:
    """Block k's core (on the `align` grid) in stitched ids (`relabel_region`); only the blocks
    of `core_neighbours(k)` are asked for."""
    return relabel_region(block_core(k, blocks, align), blocks, labels_of, offsets, lookup)


def relabel_region(
    region: Box,
    blocks: BlockGrid,
    labels_of: Callable[[int], np.ndarray],
    offsets: np.ndarray,
    lookup: np.ndarray,
) -> np.ndarray:
    """`region` in stitched ids. Each voxel's label comes from the block whose centre is nearest
    (its middle-split core holds the voxel), whatever grid the region is cut on, so that a
    region reaching a block's border does not take labels from there; where that block found
    no object, the first block (in index order) that did fills in: a sliver between a block's
    border and a membrane is too thin to seed there, but whole in the neighbour. `labels_of(i)`
    gives block i's local labels; only the blocks that overlap `region` are asked for."""

    def stitched(i: int, part: tuple[slice, ...]) -> np.ndarray:
        return lookup[_global(labels_of(i)[_local(part, blocks[i])], offsets[i])]

    core = _box(region)
    neighbours = part_neighbours(region, blocks)
    out = np.zeros(core.shape, np.uint64)
    for owner in neighbours:
        part = _intersection(_box(block_core(owner, blocks)), core)
        if part is None:
            continue
        target = out[_local(part, core)]
        target[...] = stitched(owner, part)
        for i in neighbours:
            if region := _intersection(blocks[i], _box(part)):
                near = target[_local(region, _box(part))]
                np.copyto(near, stitched(i, region), where=near == 0)
    return out


# ---------------------------------------------------------------------------------------------
# Into a chunked volume, a task per part


def layer_part_count(blocks: BlockGrid, layout: SegmentationLayout) -> int:
    """How many parts (`layer_part`) a layer stored as `layout` is written in."""
    if layout.region_zyx is None:
        return len(blocks)
    return math.prod(
        -(-n // r) for n, r in zip(blocks.volume_shape, layout.region_zyx, strict=True)
    )


def layer_part(k: int, blocks: BlockGrid, layout: SegmentationLayout) -> Box:
    """Part k of a segmentation layer stored as `layout` says, which one of its writers (the
    stitching's and the second pass's relabel tasks) writes, no two sharing a file: unsharded,
    block k's core on the layer's chunk grid; sharded, region k of the shard plan (z, y, x
    order), a shard file. Found alone: a task does not list the volume's parts."""
    if layout.region_zyx is None:
        return block_core(k, blocks, layout.chunk_zyx)
    shape, region = blocks.volume_shape, layout.region_zyx
    grid = [-(-n // r) for n, r in zip(shape, region, strict=True)]
    place = [int(i) for i in np.unravel_index(k, grid)]
    return tuple(
        slice(i * r, min((i + 1) * r, n)) for i, r, n in zip(place, region, shape, strict=True)
    )


def layer_parts(blocks: BlockGrid, layout: SegmentationLayout) -> list[Box]:
    """Every part of a layer stored as `layout` says, in order (`layer_part`)."""
    return [layer_part(k, blocks, layout) for k in range(layer_part_count(blocks, layout))]


def part_name(part: Box) -> str:
    """A part's record's file name, from its first voxel."""
    return "part_{}_{}_{}".format(*(s.start for s in part))


def owned_blocks(k: int, part: Box, blocks: BlockGrid, layout: SegmentationLayout) -> list[int]:
    """The blocks whose inference stats part k's record carries, each block in one part's:
    unsharded, block k (part k is its core); sharded, the blocks whose centre lies in it."""
    if layout.region_zyx is None:
        return [k]
    return [
        i
        for i in blocks.overlapping(_box(part))
        if all(
            s.start <= a + n // 2 < s.stop
            for s, a, n in zip(part, blocks[i].start, blocks.block_shape, strict=True)
        )
    ]


def write_part_labels(
    k: int, part: Box, labels_of: Callable[[Box], np.ndarray], layer: SegmentationWriter
) -> dict:
    """Part k of `layer` (`layer_parts`), its labels `labels_of(part)`, written into `layer`:
    files that no other task writes. Its record: the part and each file's digest, for
    `check_written_parts` (every relabel task of the stitching and the second pass writes so)."""
    layer.write(part, labels_of(part))
    return {
        "part": k,
        "core": [[s.start, s.stop] for s in part],
        "chunks": {name: layer.digest(name) for name in layer.chunk_names(part)},
    }


def part_changed(record: dict, layer: SegmentationWriter) -> bool:
    """Whether a part's files in `layer` are not what it wrote (missing, truncated or
    rewritten since)."""
    return any(layer.digest(name) != digest for name, digest in record["chunks"].items())


def check_written_parts(
    records: Iterable[dict], layer: SegmentationWriter, rewrite: Callable[[int], dict]
) -> tuple[list[int], str]:
    """Every `write_part_labels` record against `layer`, read once, a record at a time: a part
    whose files changed after its task wrote them (lost, truncated, rewritten) is written again
    with `rewrite(k)`. Returns the parts rewritten and a digest of every record's file digests,
    in order (the check's token). Raises BlockResultError if one cannot be written as recorded."""
    repaired, failed, token = [], [], hashlib.sha256()
    for record in records:
        if part_changed(record, layer):
            repaired.append(record["part"])
            rewrite(record["part"])
            if part_changed(record, layer):
                failed.append(record["part"])
        token.update(digest(record["chunks"]).encode())
    if failed:
        raise BlockResultError(f"{layer.where}: parts {failed} cannot be written as recorded")
    return repaired, token.hexdigest()


def write_part(
    k: int,
    part: Box,
    blocks: BlockGrid,
    labels_of: Callable[[int], np.ndarray],
    offsets: np.ndarray,
    lookup: np.ndarray,
    layer: SegmentationWriter,
) -> dict:
    """Step 3 for part k of `layer` (`layer_parts`): files no other part writes. Returns the
    part's record (`write_part_labels`'s) with the stitched ids in it, which `check_cores`
    checks later."""
    ids = relabel_region(part, blocks, labels_of, offsets, lookup)
    record = write_part_labels(k, part, lambda _: ids, layer)
    return record | {"ids": [int(i) for i in np.unique(ids) if i]}


@dataclass(frozen=True)
class CoresChecked:
    """The stitching's last step: what it found and did."""

    stitch: StitchStats
    repaired: list[int]  # parts (`layer_parts`) written again
    inference: InferenceStats  # the blocks' inference, summed
    token: str  # a digest of every block's chunk digests, in plan order


def check_cores(
    records: Iterable[dict],
    layer: SegmentationWriter,
    blocks: BlockGrid,
    labels_of: Callable[[int], np.ndarray],
    id_table: tuple[np.ndarray, np.ndarray, int],
    cells: "LayerCells | None" = None,
) -> CoresChecked:
    """Every part's record (`write_part`'s, `layer_parts` order) against `layer`: a part whose
    files changed after its task wrote them is written again (`check_written_parts`). `records`
    is read once, a record at a time (of a generator that loads them, one is held): the memory
    is the id table's (`join_ids`'s offsets, lookup, merges), whatever the number of blocks.
    Raises BlockResultError if a part cannot be written as recorded. `cells`, where given,
    takes each record (`LayerCells`)."""
    offsets, lookup, merges = id_table
    present = [np.zeros(0, np.uint64)]  # the stitched ids of each part (`stable_lookup`'s)
    totals = {"inference": InferenceStats()}
    names = [f.name for f in dataclasses.fields(InferenceStats)]

    def counted(records: Iterable[dict]) -> Iterable[dict]:
        for record in records:
            present.append(np.asarray(record["ids"], np.uint64))
            totals["inference"] += InferenceStats(**{n: record["stats"][n] for n in names})
            if cells is not None:
                cells.add(record)
            yield record

    def rewrite(k: int) -> dict:
        part = layer_part(k, blocks, layer.layout)
        return write_part(k, part, blocks, labels_of, offsets, lookup, layer)

    repaired, token = check_written_parts(counted(records), layer, rewrite)
    objects = np.count_nonzero(np.unique(np.concatenate(present)))
    stats = StitchStats(len(blocks), len(lookup) - 1, merges, int(objects))
    return CoresChecked(stats, repaired, totals["inference"], token)


class LayerCells:
    """The digests of a layer's chunks by the parts that wrote them: each part's record's
    digest of its files (`write_part_labels`) in every chunk of its part (the parts are whole
    chunks: a chunk is one part's). What a task reading a region of the layer is keyed on
    (`stamps.save_cells`): a part written again as it was keeps them."""

    def __init__(self, shape: Sequence[int], chunk_zyx: Sequence[int], identity: str) -> None:
        self.chunk, self.identity = tuple(int(c) for c in chunk_zyx), identity
        self.grid = np.zeros(
            [-(-n // c) for n, c in zip(shape, self.chunk, strict=True)] + [32], np.uint8
        )

    def add(self, record: dict) -> None:
        one = np.frombuffer(bytes.fromhex(digest(record["chunks"])), np.uint8)
        met = tuple(
            slice(a // c, -(-b // c)) for (a, b), c in zip(record["core"], self.chunk, strict=True)
        )
        self.grid[met] ^= one

    def cells(self) -> Cells:
        return Cells(self.identity, (0, 0, 0), self.chunk, self.grid)


def _read_block(blocks: BlockGrid, paths: dict[int, str | Path], i: int) -> BlockResult:
    return read_block_result(paths[i], blocks[i])


class BlockReader:
    """Block results by block index, each read when first asked for and kept while it may be
    asked again (a block's neighbourhood); `paths[i]` is block i's result file."""

    def __init__(self, blocks: BlockGrid, paths: dict[int, str | Path]) -> None:
        # A cache of a function, not of a bound method: no reference cycle keeps a task's
        # blocks in its worker's memory after the task.
        read = functools.partial(_read_block, blocks, paths)
        self._read = functools.lru_cache(maxsize=32)(read)

    def __call__(self, i: int) -> np.ndarray:
        return self._read(i).labels

    def inference(self, i: int) -> InferenceStats:
        return self._read(i).stats


def save_id_table(path: str | Path, offsets: np.ndarray, lookup: np.ndarray, merges: int) -> None:
    """One uint64 .npy: merges, the number of blocks, the offsets, then the lookup, so that
    `load_id_table` can map it instead of reading it."""
    # Filled in place: no copy of the lookup, which holds 8 bytes per object of the volume.
    with atomic_path(path) as tmp:
        size = 2 + len(offsets) + len(lookup)
        table = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint64, shape=(size,))
        table[:2] = merges, len(offsets)
        table[2 : 2 + len(offsets)] = offsets
        table[2 + len(offsets) :] = lookup
        table.flush()
        del table


def load_id_table(path: str | Path) -> tuple[np.ndarray, np.ndarray, int]:
    """(offsets, lookup, merges) as `join_ids` returned them. The lookup is mapped from the
    file, not read: a relabel task touches only the ids of its core's blocks, where reading
    the table would cost every task 8 bytes per object of the whole volume."""
    table = np.load(path, mmap_mode="r")
    merges, count = int(table[0]), int(table[1])
    return np.array(table[2 : 2 + count]), table[2 + count :], merges


def save_core_record(path: str | Path, record: dict) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(record))


def load_core_record(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


# ---------------------------------------------------------------------------------------------
# The tasks' settings (apps/stitch.py; the second pass's tasks too): {"blocks": BlockConfig,
# "shape": volume zyx, "layout": how the layer written is stored (SegmentationLayout), "reads":
# which block's result each of a task's results is, "part": k}


def task_blocks(
    settings: dict, results: Sequence[str | Path] = ()
) -> tuple[BlockGrid, BlockConfig, BlockReader]:
    """The block grid, the stitching settings and a reader of the task's block results by block
    index (`settings["reads"]` says which block's result each of `results` is)."""
    config = config_io.from_dict(BlockConfig, settings["blocks"])
    blocks = plan_blocks(settings["shape"], config)
    reads = settings.get("reads", [])
    return blocks, config, BlockReader(blocks, dict(zip(reads, results, strict=True)))


def new_layer(settings: dict, folder: str | Path, staged: str | Path) -> None:
    """The empty segmentation layer in `folder`: the staged volume's shape and voxel size,
    stored as `settings["layout"]` says."""
    from pipeline.data.staging import read_staged

    layout = config_io.from_dict(SegmentationLayout, settings["layout"])
    new_segmentation(folder, settings["shape"], read_staged(staged).voxel_size_nm, layout)


def layer_identity(settings: dict, staged: str | Path) -> str:
    """What the layer a stitching writes is besides its voxels: its shape, voxel size and how
    it is stored; the identity of the cells of its id table and of the layer."""
    from pipeline.data.staging import read_staged

    voxel_size = [float(v) for v in read_staged(staged).voxel_size_nm]
    return digest(
        {"shape": settings["shape"], "layout": settings["layout"], "voxel_size_nm": voxel_size}
    )


def keep_layer(settings: dict, folder: str | Path, staged: str | Path) -> None:
    """`new_layer`, unless the layer in `folder` is stored as it would make it: then the files
    its relabel tasks wrote stay, for those whose blocks' ids did not change (`table_cells`
    keeps their stamps up to date)."""
    from pipeline.data.staging import read_staged

    layout = config_io.from_dict(SegmentationLayout, settings["layout"])
    voxel_size = read_staged(staged).voxel_size_nm
    if not holds_segmentation(folder, settings["shape"], voxel_size, layout):
        new_layer(settings, folder, staged)


def writer_of(settings: dict, folder: str | Path) -> SegmentationWriter:
    """The writer of the segmentation layer in `folder` (`new_layer`'s)."""
    return SegmentationWriter(folder, settings["layout"]["gzip"])


def layer_to_check(settings: dict, folder: str | Path, staged: str | Path) -> SegmentationWriter:
    """The writer of the layer in `folder` that a last task checks; made anew (empty) if it was
    lost whole, when the check rewrites every part."""
    if not (Path(folder) / SEGMENTATION_LAYER / "info").is_file():
        new_layer(settings, folder, staged)
    return writer_of(settings, folder)


def relabel_task_part(
    settings: dict, folder: str | Path, table: str | Path, results: Sequence[str | Path]
) -> dict:
    """Part `settings["part"]` of the layer in `folder` written in stitched ids (`write_part`)
    from the id table and the results of the blocks that overlap it; its record, with the
    inference stats of the blocks it owns (`owned_blocks`)."""
    blocks, _, read = task_blocks(settings, results)
    offsets, lookup, _ = load_id_table(table)
    layer, k = writer_of(settings, folder), settings["part"]
    part = layer_part(k, blocks, layer.layout)
    record = write_part(k, part, blocks, read, offsets, lookup, layer)
    owned = owned_blocks(k, part, blocks, layer.layout)
    record["stats"] = sum((read.inference(i) for i in owned), InferenceStats()).to_dict()
    return record


# ---------------------------------------------------------------------------------------------
# In one process


def stitch_blocks(
    blocks: BlockGrid,
    labels_of: Callable[[int], np.ndarray],
    config: BlockConfig,
    write: Callable[[tuple[slice, ...], np.ndarray], None],
) -> StitchStats:
    """The three steps over `blocks`, one after the other, in one process that never holds more
    than a block's neighbourhood: `labels_of(i)` reads block i's labels (cache them if reading is
    slow), `write(core, ids)` stores each core. Ids are 1..N: a first pass over the cores finds
    which stitched ids are left (an object may survive in no core), the second writes them
    renumbered."""
    found = [block_pairs(k, blocks, labels_of, config) for k in range(len(blocks))]
    offsets, lookup, merges = join_ids(found)
    total = sum(f.count for f in found)
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
    """Join block results that tile `volume_shape` into one uint64 segmentation in memory: the
    results of `plan_blocks(volume_shape, config)`'s blocks, in its order."""
    grid = plan_blocks(volume_shape, config)
    if [r.block for r in results] != list(grid):
        raise BlockResultError(
            f"{len(results)} block results do not form the grid of {len(grid)} blocks that "
            f"these block settings cut the volume {tuple(volume_shape)} into"
        )
    segmentation = np.zeros(tuple(volume_shape), np.uint64)

    def write(core: tuple[slice, ...], ids: np.ndarray) -> None:
        segmentation[core] = ids

    stats = stitch_blocks(grid, lambda i: results[i].labels, config, write)
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
