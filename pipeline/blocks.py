"""Blockwise segmentation: overlapping blocks segmented independently, then stitched.

A volume is cut into a grid of blocks of one shape that overlap by at least `overlap_zyx`
(`plan_blocks`: the blocks along each axis are spread evenly, so every overlap is about the same).
`segment_block` is a pure function of its inputs, meant to run as one parallel task per block;
`write_block_result` stores its result atomically as `block_Z_Y_X.npz`, so `block_done` (the file
exists) means finished, and a restarted run skips finished blocks.

`stitch` reconciles the blocks' ids: in the region where two blocks overlap, two objects are the
same when they share at least `min_overlap_voxels` voxels and at least `min_overlap_fraction` of
their union there (intersection over union): an object that one block merged does not swallow
every smaller object of its neighbour, which a share of the smaller one would let it do. The
merge graph's connected components become the global ids.
Each voxel takes its label from the block whose centre is nearest along each axis (the overlap is
split in the middle), because FFN is least reliable near a block's border where FOVs cannot be
centred; where that block found no object, from any other block that did.
"""

import dataclasses
import itertools
import json
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import fastremap
import numpy as np
from scipy import sparse
from scipy.sparse.csgraph import connected_components
from tqdm import tqdm

from pipeline import config as config_io
from pipeline.atomic import atomic_path
from pipeline.errors import BlockResultError, ConfigError, VolumeShapeError, first_line
from pipeline.inference import (
    ZYX,
    InferenceConfig,
    InferenceStats,
    Predictor,
    segment,
)
from pipeline.model import ModelConfig
from pipeline.roi import Roi
from pipeline.volumes import reading

BLOCK_FORMAT = 1


@dataclass(frozen=True)
class BlockConfig:
    """Block grid and stitching settings, (z, y, x) voxels."""

    block_shape_zyx: ZYX = (64, 128, 128)
    overlap_zyx: ZYX = (16, 32, 32)  # at least; about one FOV, so both blocks see context
    min_overlap_voxels: int = 50
    min_overlap_fraction: float = 0.5  # intersection over union, in the overlap region

    def __post_init__(self) -> None:
        shape, overlap = tuple(self.block_shape_zyx), tuple(self.overlap_zyx)
        if len(shape) != 3 or len(overlap) != 3:
            raise ConfigError(
                f"block_shape_zyx and overlap_zyx need 3 values, got {shape}, {overlap}"
            )
        if any(b < 1 or not 0 <= o < b for b, o in zip(shape, overlap, strict=True)):
            raise ConfigError(
                f"need block_shape_zyx >= 1 and 0 <= overlap_zyx < block_shape_zyx, got {shape}, {overlap}"
            )
        if self.min_overlap_voxels < 1 or not 0 <= self.min_overlap_fraction <= 1:
            raise ConfigError("need min_overlap_voxels >= 1 and min_overlap_fraction in [0, 1]")


@dataclass(frozen=True)
class Block:
    """One block: voxels start..stop (exclusive) of the volume, (z, y, x)."""

    start: ZYX
    stop: ZYX

    @property
    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in zip(self.start, self.stop, strict=True))

    @property
    def shape(self) -> ZYX:
        return tuple(b - a for a, b in zip(self.start, self.stop, strict=True))

    @property
    def name(self) -> str:
        return "block_{}_{}_{}".format(*self.start)


def _axis_starts(size: int, block: int, overlap: int) -> list[int]:
    if block >= size:
        return [0]
    count = -(-(size - overlap) // (block - overlap))  # fewest blocks with at least the overlap
    return [int(s) for s in np.round(np.linspace(0, size - block, count))]


def plan_blocks(volume_shape: Sequence[int], config: BlockConfig) -> list[Block]:
    """The block grid over `volume_shape`, in z, y, x order; blocks larger than the volume shrink
    to it."""
    if len(volume_shape) != 3:
        raise VolumeShapeError(f"volume shape must be (z, y, x), got {tuple(volume_shape)}")
    shape = [min(b, s) for b, s in zip(config.block_shape_zyx, volume_shape, strict=True)]
    starts = [
        _axis_starts(s, b, o)
        for s, b, o in zip(volume_shape, shape, config.overlap_zyx, strict=True)
    ]
    return [
        Block(tuple(start), tuple(a + b for a, b in zip(start, shape, strict=True)))
        for start in itertools.product(*starts)
    ]


# ---------------------------------------------------------------------------------------------
# One block


@dataclass(frozen=True, eq=False)
class BlockResult:
    """A block's segmentation (local ids 1..n, 0 = none), its stats and the settings that made it."""

    block: Block
    labels: np.ndarray
    stats: InferenceStats
    provenance: dict


def segment_block(
    raw: np.ndarray,
    block: Block,
    predict: Predictor,
    model: ModelConfig,
    config: InferenceConfig,
    provenance: dict | None = None,
    state_path: str | Path | None = None,
    progress_path: str | Path | None = None,
    progress_every_s: float = 60.0,
    scored: Roi | None = None,
) -> BlockResult:
    """Segment the `block` of `raw` (any array that slices, e.g. an h5py dataset) on its own.

    `provenance` (e.g. the checkpoint) is stored with the result so a restart with other settings
    is noticed. With `state_path` a long block checkpoints its progress there
    (`pipeline.inference.segment`), and a restarted task goes on from it. With `progress_path`
    the block reports where it stands there every `progress_every_s` (JSON, written atomically;
    the workflow prints it) and removes it when done. `scored`: the part of `raw` that counts,
    the rest being context around it (`InferenceConfig.reflect_faces` pads only what lacks it).
    """
    record = _provenance(model, config, provenance)
    source = f"{raw.file.filename}:{raw.name.lstrip('/')}" if hasattr(raw, "file") else "the image"
    with reading(source):  # h5py names no file when a chunk cannot be read
        region = np.asarray(raw[block.slices])
    padding = (
        face_padding(block, raw.shape, model, scored) if config.reflect_faces else ((0, 0),) * 3
    )
    labels, stats = segment(
        np.pad(region, padding, mode="reflect"),
        predict,
        model,
        config,
        checkpoint_path=state_path,
        checkpoint_key=json.dumps(record, sort_keys=True),
        on_progress=None
        if progress_path is None
        else partial(_write_progress, progress_path, block),
        progress_every_s=progress_every_s,
    )
    if progress_path is not None:
        Path(progress_path).unlink(missing_ok=True)
    if padding != ((0, 0),) * 3:
        core = tuple(
            slice(before, before + n) for (before, _), n in zip(padding, block.shape, strict=True)
        )
        kept, _ = fastremap.renumber(labels[core], preserve_zero=True)
        labels = kept.astype(labels.dtype, copy=False)
        stats = dataclasses.replace(
            stats, voxels=int(labels.size), segmented_voxels=int(np.count_nonzero(labels))
        )
    return BlockResult(block, labels, stats, record)


def face_padding(
    block: Block, volume_shape: Sequence[int], model: ModelConfig, scored: Roi | None = None
) -> tuple[tuple[int, int], ...]:
    """(before, after) voxels of reflection per axis: where `block` meets a face of the volume,
    half a FOV less the context the volume has beyond its `scored` part there; none inside."""
    scored = scored or Roi.whole(volume_shape)
    return tuple(
        (
            max(0, radius - scored.start[axis]) if block.start[axis] == 0 else 0,
            max(0, radius - (size - scored.stop[axis])) if block.stop[axis] == size else 0,
        )
        for axis, (size, radius) in enumerate(
            zip(volume_shape, [s // 2 for s in model.fov_shape_zyx], strict=True)
        )
    )


def _write_progress(path: str | Path, block: Block, record: dict) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps({"block": block.name, **record}))


def block_progress_path(result_path: str | Path) -> Path:
    """Where a running block reports its progress (beside its result)."""
    result_path = Path(result_path)
    return result_path.with_name(result_path.stem + ".progress.json")


def _provenance(model: ModelConfig, config: InferenceConfig, extra: dict | None) -> dict:
    """The settings a block result depends on, as they read back from JSON."""
    record = {"model": config_io.to_dict(model), "inference": config_io.to_dict(config)}
    return json.loads(json.dumps(record | (extra or {})))


def block_path(blocks_dir: str | Path, block: Block) -> Path:
    return Path(blocks_dir) / f"{block.name}.npz"


def block_state_path(blocks_dir: str | Path, block: Block) -> Path:
    """Where an unfinished block keeps its inference checkpoint."""
    return Path(blocks_dir) / f"{block.name}.state.npz"


def block_done(path: str | Path) -> bool:
    """Results are renamed into place only when complete, so existing means finished."""
    return Path(path).is_file()


def write_block_result(path: str | Path, result: BlockResult) -> Path:
    """Write one block's result atomically (readers never see a partial file)."""
    labels = result.labels
    if labels.shape != result.block.shape:
        raise VolumeShapeError(f"{path}: labels {labels.shape} do not fit block {result.block}")
    arrays = {
        "format_version": np.int64(BLOCK_FORMAT),
        "start": np.array(result.block.start, np.int64),
        "stop": np.array(result.block.stop, np.int64),
        # Local ids are small: uint32 keeps the files (and the stitching's memory) small.
        "labels": labels.astype(np.uint32 if labels.max(initial=0) < 2**32 else np.uint64),
        "stats": np.str_(json.dumps(result.stats.to_dict())),
        "provenance": np.str_(json.dumps(result.provenance)),
    }
    # A file object, because np.savez would append ".npz" to a temporary name without it.
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.savez_compressed(f, **arrays)
    return Path(path)


def read_block_result(path: str | Path, block: Block | None = None) -> BlockResult:
    """Read a block result; with `block`, check that the file is that block's."""
    path = Path(path)
    if not path.is_file():
        raise BlockResultError(f"{path}: block result not found")
    try:
        with np.load(path, allow_pickle=False) as data:
            found = {k: data[k] for k in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise BlockResultError(f"{path}: not a readable block result ({first_line(exc)})") from None
    required = ("format_version", "start", "stop", "labels", "stats", "provenance")
    if missing := [k for k in required if k not in found]:
        raise BlockResultError(f"{path}: not a block result (missing {', '.join(missing)})")
    if found["format_version"] != BLOCK_FORMAT:
        raise BlockResultError(
            f"{path}: block format {found['format_version']}, expected {BLOCK_FORMAT}"
        )
    stored = Block(tuple(int(v) for v in found["start"]), tuple(int(v) for v in found["stop"]))
    if block is not None and stored != block:
        raise BlockResultError(f"{path}: holds {stored}, expected {block}")
    if found["labels"].shape != stored.shape:
        raise BlockResultError(f"{path}: labels {found['labels'].shape} do not fit {stored}")
    stats = json.loads(str(found["stats"]))
    stats.pop("voxels_per_second")
    return BlockResult(
        stored, found["labels"], InferenceStats(**stats), json.loads(str(found["provenance"]))
    )


# ---------------------------------------------------------------------------------------------
# Stitching


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


def stitch(
    results: Sequence[BlockResult], volume_shape: Sequence[int], config: BlockConfig
) -> tuple[np.ndarray, StitchStats]:
    """Join block results that tile `volume_shape` into one uint64 segmentation, ids 1..N."""
    blocks = [r.block for r in results]
    intervals = [_axis_intervals(blocks, axis) for axis in range(3)]
    grid = {tuple(b.start) for b in blocks}
    expected = np.prod([len(spans) for spans in intervals])
    covers = all(
        spans[0][0] == 0 and spans[-1][1] == s
        for spans, s in zip(intervals, volume_shape, strict=True)
    )
    if len(grid) != len(blocks) or len(blocks) != expected or not covers:
        raise BlockResultError(
            f"{len(results)} block results do not form a grid covering the volume {tuple(volume_shape)}"
        )
    # Block i's local id k becomes the global id offsets[i] + k.
    counts = [int(r.labels.max(initial=0)) for r in results]
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.uint64)
    total = int(sum(counts))
    if total >= 2**32:  # pairs of ids are packed into one uint64
        raise BlockResultError(f"{total} objects in the blocks: too many to stitch")

    def global_ids(i: int, region: tuple[slice, ...]) -> np.ndarray:
        local = results[i].labels[_local(region, blocks[i])].astype(np.uint64)
        return np.where(local > 0, local + offsets[i], np.uint64(0))

    edges_a, edges_b = [], []
    for i, j in itertools.combinations(range(len(blocks)), 2):
        region = _intersection(blocks[i], blocks[j])
        if region is not None:
            a, b = _agreeing_pairs(
                global_ids(i, region), global_ids(j, region), np.uint64(total + 1), config
            )
            edges_a.append(a)
            edges_b.append(b)
    a = np.concatenate(edges_a or [np.zeros(0, np.uint64)]).astype(np.int64)
    b = np.concatenate(edges_b or [np.zeros(0, np.uint64)]).astype(np.int64)
    graph = sparse.coo_array((np.ones(len(a)), (a, b)), shape=(total + 1, total + 1))
    _, component = connected_components(graph, directed=False)
    # Component numbers are arbitrary; 0 stays 0 and the rest are renumbered below.
    lookup = component.astype(np.uint64) + np.uint64(1)
    lookup[0] = 0

    segmentation = np.zeros(tuple(volume_shape), np.uint64)
    for i, block in enumerate(blocks):
        core = _core(block, intervals)
        segmentation[core] = lookup[global_ids(i, core)]
    # Where the owner found no object, another block may have: a sliver of an object between a
    # block's border and a membrane is too thin to seed there, but whole in the neighbour.
    for i, block in enumerate(blocks):
        labels = lookup[global_ids(i, block.slices)]
        region = segmentation[block.slices]
        np.copyto(region, labels, where=region == 0)
    segmentation, _ = fastremap.renumber(segmentation, preserve_zero=True, in_place=True)
    stats = StitchStats(len(blocks), total, len(a), int(segmentation.max(initial=0)))
    return segmentation.astype(np.uint64, copy=False), stats


# ---------------------------------------------------------------------------------------------
# The whole run


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
