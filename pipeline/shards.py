"""How one scale of a precomputed layer is cut into shards (`neuroglancer_uint64_sharded_v1`).

A sharded scale stores many chunks in one file: chunk ids are compressed Morton codes of the
chunk grid; `preshift_bits` + `minishard_bits` low bits of an id pick its place within a shard,
the next `shard_bits` the shard file (hash "identity"), so a shard holds a box of chunks.
igneous recommends the bits for a volume size (`create_sharded_image_info`: as few shard files
as the shard size allows, small shard and minishard indices); this project caps the shard's
uncompressed size at what one task may hold (`max_shard_bytes`), since a shard is written whole
by one task. The box a shard covers follows from the bits (cloud-volume's
`image_shard_shape_from_spec`): a power of two of chunks per axis, x first.
"""

from dataclasses import dataclass

import numpy as np

from pipeline.roi import ZYX, Roi, tiles


@dataclass(frozen=True)
class ShardGeometry:
    """A scale's sharding: the spec an `info` carries, and the box (z, y, x voxels of the scale)
    each shard file covers from the scale's origin."""

    spec: dict
    shard_zyx: ZYX

    def boxes(self, shape_zyx: ZYX) -> list[Roi]:
        """The shard boxes of a scale of `shape_zyx` voxels, clipped at its end: one file each."""
        return tiles(Roi.whole(shape_zyx), self.shard_zyx)


def scale_sharding(
    shape_zyx: ZYX, chunk_zyx: ZYX, dtype: str, encoding: str, max_shard_bytes: int
) -> ShardGeometry:
    """The sharding of a scale of `shape_zyx` voxels in chunks of `chunk_zyx`: igneous's
    recommendation for shards of at most `max_shard_bytes` uncompressed."""
    from cloudvolume.datasource.precomputed.sharding import image_shard_shape_from_spec
    from igneous.task_creation.image import create_sharded_image_info

    size_xyz, chunk_xyz = list(shape_zyx)[::-1], list(chunk_zyx)[::-1]
    spec = create_sharded_image_info(
        size_xyz, chunk_xyz, encoding, dtype, uncompressed_shard_bytesize=int(max_shard_bytes)
    )
    shard_xyz = image_shard_shape_from_spec(spec, size_xyz, chunk_xyz)
    return ShardGeometry(spec, tuple(int(n) for n in np.asarray(shard_xyz)[::-1]))
