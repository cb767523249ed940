"""Shard plans (pipeline.export.shards): one region a task, a whole shard at every scale; regions a task
can hold; a layer written shard by shard that reads back through cloud-volume."""

import itertools
import math

import numpy as np
import pytest

from pipeline.export.layers import ExportConfig, plan_scales
from pipeline.export.segmentation_layer import scale_factors
from pipeline.export.shards import plan_shards


def _plan(shape_zyx, voxel_size_nm, num_scales=3, task_voxels=256):
    scales = plan_scales(shape_zyx, voxel_size_nm, ExportConfig(num_scales=num_scales))
    factors = scale_factors(scales)
    plan = plan_shards(
        [s.shape_zyx for s in scales], [s.chunk_zyx for s in scales], factors, task_voxels
    )
    return plan, scales, factors


def _shard_of_chunks(spec: dict, shape_zyx, chunk_zyx, box_zyx) -> set[str]:
    """The shard numbers of every chunk in `box_zyx` (a Roi of the scale), as cloud-volume
    computes them to read."""
    from cloudvolume.datasource.precomputed.common import compressed_morton_code
    from cloudvolume.datasource.precomputed.sharding import ShardingSpecification

    sharding = ShardingSpecification.from_dict(spec)
    grid = [-(-n // c) for n, c in zip(shape_zyx, chunk_zyx, strict=True)]
    ranges = [
        range(a // c, -(-b // c))
        for a, b, c in zip(box_zyx.start, box_zyx.stop, chunk_zyx, strict=True)
    ]
    return {
        sharding.compute_shard_location(compressed_morton_code(zyx[::-1], grid[::-1])).shard_number
        for zyx in itertools.product(*ranges)
    }  # fmt: skip


@pytest.mark.parametrize(
    "shape_zyx, voxel_size_nm",
    [
        ((1024, 1024, 1024), (8, 8, 8)),
        ((520, 1000, 1000), (16, 8, 8)),  # 2:1 serial sections, not whole chunks
        ((64, 1024, 1024), (8, 8, 8)),  # one chunk deep
        ((100, 120, 130), (8, 8, 8)),  # smaller than a region
    ],
)
def test_every_region_is_one_shard_at_every_scale_and_no_two_share_one(shape_zyx, voxel_size_nm):
    plan, scales, factors = _plan(shape_zyx, voxel_size_nm)
    assert math.prod(plan.region_zyx) <= 256**3  # what a task may hold
    for scale, factor, spec in zip(scales, factors, plan.specs, strict=True):
        seen = set()
        for region in plan.regions(shape_zyx):
            at_scale = region.scaled_down(factor, scale.shape_zyx)
            shards = _shard_of_chunks(spec, scale.shape_zyx, scale.chunk_zyx, at_scale)
            assert len(shards) == 1, (region, scale)
            assert not shards & seen
            seen |= shards


def test_1024_cubed_is_64_regions_of_256_cubed_instead_of_4096_chunks_a_scale():
    plan, _, _ = _plan((1024,) * 3, (8, 8, 8))
    assert plan.region_zyx == (256, 256, 256)
    assert len(plan.regions((1024,) * 3)) == 64
    assert [spec["shard_bits"] for spec in plan.specs] == [6, 6, 6]


def test_more_scales_than_a_region_reaches_take_larger_regions():
    """As the unsharded export's regions grow to whole chunks of its coarsest scale."""
    plan, _, _ = _plan((1024,) * 3, (8, 8, 8), num_scales=5)
    assert plan.region_zyx == (1024, 1024, 1024)


def test_a_layer_written_shard_by_shard_reads_back(tmp_path):
    """Every region written whole with cloud-volume's `make_shard` gives the volume back."""
    from cloudvolume import Bbox, CloudVolume

    shape_zyx = (100, 120, 130)
    plan, scales, _ = _plan(shape_zyx, (8, 8, 8), num_scales=1, task_voxels=64)
    labels = np.random.default_rng(0).integers(0, 9, shape_zyx).astype(np.uint64)
    info = CloudVolume.create_new_info(
        1, "segmentation", "uint64", "compressed_segmentation", [8, 8, 8], [0, 0, 0],
        list(shape_zyx)[::-1], chunk_size=list(scales[0].chunk_zyx)[::-1],
    )  # fmt: skip
    info["scales"][0]["sharding"] = plan.specs[0]
    volume = CloudVolume(f"file://{tmp_path}", info=info, progress=False)
    volume.commit_info()
    (tmp_path / volume.key).mkdir()
    regions = plan.regions(shape_zyx)
    for region in regions:
        data = labels[region.slices].T[..., None]
        name, content = volume.image.make_shard(data, Bbox(region.start[::-1], region.stop[::-1]))
        (tmp_path / volume.key / name).write_bytes(content)
    assert len(list((tmp_path / volume.key).iterdir())) == len(regions) > 1
    back = CloudVolume(f"file://{tmp_path}", progress=False)[:, :, :][..., 0].T
    np.testing.assert_array_equal(back, labels)
