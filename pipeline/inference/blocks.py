"""Blockwise segmentation: overlapping blocks, each segmented on its own.

A volume is cut into a grid of blocks of one shape that overlap by at least `overlap_zyx`
(`plan_blocks`: the blocks along each axis are spread evenly, so every overlap is about the same).
`segment_block` is a pure function of its inputs, meant to run as one parallel task per block;
`write_block_result` stores its result atomically as `block_Z_Y_X.npz`, so `block_done` (the file
exists) means finished, and a restarted run skips finished blocks. The file holds the block's
flood records too (`FloodRecords`, the arrays named `flood_*`); a result written before they
were kept has none and is read as it was (same format: its labels, on which the stamps key
everything after, are what they would be now).

Stitching the blocks' results into one segmentation: `pipeline.inference.stitching`.
"""

import bisect
import dataclasses
import itertools
import json
import math
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import fastremap
import numpy as np

from pipeline.core import config_io
from pipeline.core.atomic import atomic_path
from pipeline.core.errors import BlockResultError, ConfigError, VolumeShapeError, first_line
from pipeline.core.roi import Roi
from pipeline.data.volumes import reading
from pipeline.inference.flood_fill import (
    ZYX,
    FloodRecords,
    InferenceConfig,
    InferenceStats,
    Predictor,
    segment_with_floods,
)
from pipeline.network.model import ModelConfig

BLOCK_FORMAT = 1


@dataclass(frozen=True)
class BlockConfig:
    """Block grid and stitching settings, (z, y, x) voxels."""

    # Each block's size including its overlaps; each is segmented by one task.
    block_shape_zyx: ZYX = (64, 128, 128)
    overlap_zyx: ZYX = (16, 32, 32)  # at least; about one FOV, so both blocks see context
    # Two blocks' objects are stitched into one only where they share at least this many voxels
    # in their overlap (and min_overlap_fraction of their union there).
    min_overlap_voxels: int = 50
    min_overlap_fraction: float = 0.5  # intersection over union, in the overlap region
    # Chunks of the stitched segmentation (precomputed): each is written whole by one task, so the
    # overlaps are split on chunk multiples and a chunk may be no larger than the overlap.
    # None: per axis the largest power of two up to the overlap and 64 (`chunks`).
    chunk_zyx: ZYX | None = None

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
        chunk = self.chunks
        if len(chunk) != 3 or any(
            not 1 <= c <= max(o, 1) for c, o in zip(chunk, overlap, strict=True)
        ):
            raise ConfigError(
                f"need 1 <= chunk_zyx <= overlap_zyx (a chunk multiple must lie in every overlap), "
                f"got chunk_zyx {chunk}, overlap_zyx {overlap}"
            )
        if self.min_overlap_voxels < 1 or not 0 <= self.min_overlap_fraction <= 1:
            raise ConfigError("need min_overlap_voxels >= 1 and min_overlap_fraction in [0, 1]")

    @property
    def chunks(self) -> ZYX:
        """The stitched segmentation's chunk shape: `chunk_zyx`, or derived from the overlap."""
        if self.chunk_zyx is not None:
            return tuple(self.chunk_zyx)
        return tuple(1 << (min(max(o, 1), 64).bit_length() - 1) for o in self.overlap_zyx)


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


@dataclass(frozen=True)
class BlockGrid(Sequence[Block]):
    """The blocks of `plan_blocks`: per axis the blocks' starts, and the one block shape. Block k
    is the k-th of the starts' product (z, y, x order); the blocks that overlap a region are
    found from the axes alone, so a task asks about its neighbourhood without listing the whole
    grid (10^6 blocks at 10^12 voxels)."""

    starts_zyx: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    block_shape: ZYX

    def __len__(self) -> int:
        return math.prod(len(starts) for starts in self.starts_zyx)

    def __getitem__(self, k: int) -> Block:  # type: ignore[override]  (no slices)
        if not -len(self) <= k < len(self):
            raise IndexError(f"block {k} of a grid of {len(self)}")
        place = np.unravel_index(k % len(self), [len(s) for s in self.starts_zyx])
        start = tuple(s[i] for s, i in zip(self.starts_zyx, place, strict=True))
        return Block(start, tuple(a + b for a, b in zip(start, self.block_shape, strict=True)))

    @property
    def volume_shape(self) -> ZYX:
        """The shape of the volume the grid covers (its last blocks end there)."""
        return tuple(s[-1] + n for s, n in zip(self.starts_zyx, self.block_shape, strict=True))

    def axis_intervals(self, axis: int) -> list[tuple[int, int]]:
        """The blocks' (start, stop) along `axis`, in order."""
        return [(s, s + self.block_shape[axis]) for s in self.starts_zyx[axis]]

    def overlapping(self, region: Block) -> list[int]:
        """The blocks that share a voxel with `region`, in index order."""
        ranges = [
            range(bisect.bisect_right(starts, low - size), bisect.bisect_left(starts, high))
            for starts, size, low, high in zip(
                self.starts_zyx, self.block_shape, region.start, region.stop, strict=True
            )
        ]
        counts = [len(s) for s in self.starts_zyx]
        return [int(np.ravel_multi_index(place, counts)) for place in itertools.product(*ranges)]


def plan_blocks(volume_shape: Sequence[int], config: BlockConfig) -> BlockGrid:
    """The block grid over `volume_shape`, in z, y, x order; blocks larger than the volume shrink
    to it."""
    if len(volume_shape) != 3:
        raise VolumeShapeError(f"volume shape must be (z, y, x), got {tuple(volume_shape)}")
    shape = tuple(min(b, s) for b, s in zip(config.block_shape_zyx, volume_shape, strict=True))
    starts = tuple(
        tuple(_axis_starts(s, b, o))
        for s, b, o in zip(volume_shape, shape, config.overlap_zyx, strict=True)
    )
    return BlockGrid(starts, shape)


# ---------------------------------------------------------------------------------------------
# One block


@dataclass(frozen=True, eq=False)
class BlockResult:
    """A block's segmentation (local ids 1..n, 0 = none), its stats, the settings that made it
    and its flood records (seeds in the volume's coordinates, objects in `labels`' ids; None:
    not recorded)."""

    block: Block
    labels: np.ndarray
    stats: InferenceStats
    provenance: dict
    floods: FloodRecords | None = None


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
    (`pipeline.inference.flood_fill.segment`), and a restarted task goes on from it. With `progress_path`
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
    labels, stats, floods = segment_with_floods(
        np.pad(region, padding, mode="reflect"),
        predict,
        model,
        config,
        checkpoint_path=state_path,
        checkpoint_key=json.dumps(record, sort_keys=True),
        on_progress=None
        if progress_path is None
        else partial(_write_progress, progress_path, block, model.precision),
        progress_every_s=progress_every_s,
    )
    if progress_path is not None:
        Path(progress_path).unlink(missing_ok=True)
    ids = None
    if padding != ((0, 0),) * 3:
        core = tuple(
            slice(before, before + n) for (before, _), n in zip(padding, block.shape, strict=True)
        )
        kept, ids = fastremap.renumber(labels[core], preserve_zero=True)
        labels = kept.astype(labels.dtype, copy=False)
        stats = dataclasses.replace(
            stats, voxels=int(labels.size), segmented_voxels=int(np.count_nonzero(labels))
        )
    if floods is not None:
        corner = [a - before for a, (before, _) in zip(block.start, padding, strict=True)]
        floods = floods.in_volume(corner, ids)
    return BlockResult(block, labels, stats, record, floods)


def infer_regions(block: Block) -> tuple[Roi, None]:
    """The parts of an inference task's inputs (the staged volume, the selection) it reads,
    which alone key it (`stamps.run_once`'s `regions`): of the image the block (`segment_block`
    reads `raw[block.slices]`; the padding, by the volume's shape and scored part, is in the
    region's token), the selection whole."""
    return Roi(block.start, block.stop), None


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


def _write_progress(path: str | Path, block: Block, precision: str, record: dict) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps({"block": block.name, "precision": precision, **record}))


def block_progress_path(result_path: str | Path) -> Path:
    """Where a running block reports its progress (beside its result)."""
    result_path = Path(result_path)
    return result_path.with_name(result_path.stem + ".progress.json")


def _provenance(model: ModelConfig, config: InferenceConfig, extra: dict | None) -> dict:
    """The settings a block result depends on, as they read back from JSON."""
    record = {"model": config_io.to_dict(model), "inference": config_io.to_dict(config)}
    return json.loads(json.dumps(record | (extra or {})))


def ground_truth_block(labels: np.ndarray, block: Block) -> BlockResult:
    """A stand-in for `segment_block` for benchmarks of the data path (bench/scale.py): the
    block's ground truth (`labels`: anything that slices, e.g. an h5py dataset) with block-local
    ids 1..n, as a block result. What follows inference (stitching, evaluation, export) then
    runs on real files without the cost of a network."""
    local, _ = fastremap.renumber(np.asarray(labels[block.slices]), preserve_zero=True)
    stats = InferenceStats(voxels=local.size, objects=int(local.max()))
    return BlockResult(block, local, stats, {"stand_in": "ground truth"})


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
    if result.floods is not None:
        arrays |= result.floods.arrays()
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
        stored,
        found["labels"],
        InferenceStats(**stats),
        json.loads(str(found["provenance"])),
        FloodRecords.read(found),
    )
