"""How the scales of a precomputed layer are cut into shards (`neuroglancer_uint64_sharded_v1`).

A sharded scale stores many chunks in one file: chunk ids are compressed Morton codes of the
chunk grid; `preshift_bits` + `minishard_bits` low bits of an id pick its place within a shard,
the next `shard_bits` the shard file (hash "identity"), so a shard holds a box of chunks: a power
of two of chunks per axis, bits given to x, y, z in turn while an axis's grid has room
(cloud-volume's `image_shard_shape_from_spec`). igneous recommends the bits for a number of
chunks per shard (`create_sharded_image_info`: small shard and minishard indices).

A shard is written whole by one task, which holds its voxels. This project picks one *region*
(full-resolution voxels) for every scale and both layers: at scale s a shard covers the region
shrunk by the scale's downsampling factor, so the task that writes a region's full resolution
also downsamples it and writes its shard at every coarser scale, reading nothing another task
wrote (as the unsharded export's region tasks do). The region is the largest such box of at most
`task_voxels`^3 voxels (`plan_shards`), larger only where none nests at every scale.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.core.errors import ConfigError
from pipeline.core.roi import ZYX, Roi, tiles


@dataclass(frozen=True)
class ShardPlan:
    """The full-resolution box (z, y, x voxels from the origin) each task writes, one shard at
    every scale, and each scale's `sharding` spec for its `info`."""

    region_zyx: ZYX
    specs: tuple[dict, ...]

    def regions(self, shape_zyx: ZYX) -> list[Roi]:
        """The regions of a volume of `shape_zyx` voxels, clipped at its end: a task each."""
        return tiles(Roi.whole(shape_zyx), self.region_zyx)


# igneous's most chunks a minishard's index lists (`create_sharded_image_info`).
MAX_CHUNKS_PER_MINISHARD = 4000


def _spec(shape_zyx: ZYX, chunk_zyx: ZYX, bits: int) -> dict:
    """A sharding whose shards hold 2^`bits` chunks (fewer where the grid has fewer), with
    igneous's encodings and minishard rule. Written here rather than taken from igneous's
    `create_sharded_image_info`, which gives a volume one chunk deep more bits than asked for
    (shards larger than a task may hold)."""
    grid_bits = sum(
        math.ceil(math.log2(-(-n // c))) for n, c in zip(shape_zyx, chunk_zyx, strict=True)
    )
    bits = min(bits, grid_bits)
    minishard = max(0, math.ceil(math.log2(2**bits / MAX_CHUNKS_PER_MINISHARD)))
    return {
        "@type": "neuroglancer_uint64_sharded_v1",
        "hash": "identity",  # a shard is then a box of chunks
        "preshift_bits": bits - minishard,
        "minishard_bits": minishard,
        "shard_bits": grid_bits - bits,
        "minishard_index_encoding": "gzip",
        "data_encoding": "gzip",
    }


def shard_zyx(spec: dict, shape_zyx: ZYX, chunk_zyx: ZYX) -> ZYX:
    """The box (voxels of the scale) one shard of `spec` covers."""
    from cloudvolume.datasource.precomputed.sharding import image_shard_shape_from_spec

    chunks_xyz = image_shard_shape_from_spec(spec, list(shape_zyx)[::-1], list(chunk_zyx)[::-1])
    return tuple(int(n) for n in np.asarray(chunks_xyz)[::-1])


def _scale_spec(region_zyx: ZYX, shape_zyx: ZYX, chunk_zyx: ZYX) -> dict | None:
    """The spec whose shards are `region_zyx` (voxels of this scale; clipped at the volume's
    end), or None when no shard is: not whole chunks, or not the Morton box of its chunk count."""
    inside = [min(r, n) for r, n in zip(region_zyx, shape_zyx, strict=True)]
    if any(r % c and r < n for r, c, n in zip(region_zyx, chunk_zyx, shape_zyx, strict=True)):
        return None
    per_axis = [-(-r // c) for r, c in zip(region_zyx, chunk_zyx, strict=True)]
    if any(n & (n - 1) for n in per_axis):  # a Morton box is a power of two of chunks an axis
        return None
    spec = _spec(shape_zyx, chunk_zyx, sum(n.bit_length() - 1 for n in per_axis))
    covers = shard_zyx(spec, shape_zyx, chunk_zyx)
    clipped = [min(b, n) for b, n in zip(covers, shape_zyx, strict=True)]
    return spec if clipped == inside else None


def plan_shards(
    shapes_zyx: Sequence[ZYX],
    chunks_zyx: Sequence[ZYX],
    factors_zyx: Sequence[ZYX],
    task_voxels: int,
) -> ShardPlan:
    """The shard plan of a layer whose scale s has `shapes_zyx[s]` voxels in chunks of
    `chunks_zyx[s]`, each voxel `factors_zyx[s]` full-resolution voxels: the full-resolution
    Morton box of the most chunks (a power of two) within `task_voxels`^3 voxels that is also a
    whole shard at every coarser scale (or the least above it)."""
    shape, chunk = shapes_zyx[0], chunks_zyx[0]
    most = max(1, task_voxels**3 // math.prod(chunk)).bit_length() - 1
    grid_bits = sum(math.ceil(math.log2(-(-n // c))) for n, c in zip(shape, chunk, strict=True))
    # Larger regions only where no smaller one nests (many scales), as the unsharded export's
    # regions grow to whole chunks of its coarsest scale.
    for bits in [*range(min(most, grid_bits), -1, -1), *range(most + 1, grid_bits + 1)]:
        region = shard_zyx(_spec(shape, chunk, bits), shape, chunk)
        specs = [
            _scale_spec(tuple(r // f for r, f in zip(region, factor, strict=True)), shape, chunks)
            if all(r % f == 0 for r, f in zip(region, factor, strict=True))
            else None
            for shape, chunks, factor in zip(shapes_zyx, chunks_zyx, factors_zyx, strict=True)
        ]
        if all(s is not None for s in specs):
            return ShardPlan(region, tuple(specs))
    raise ConfigError(
        f"no shard box nests at every scale (shapes {list(shapes_zyx)}, chunks "
        f"{list(chunks_zyx)}): export unsharded ([export] sharded = false) or use fewer scales"
    )
