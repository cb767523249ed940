"""Shard geometry (pipeline.shards): shards a task can hold, every chunk in exactly one, and a
layer written shard by shard that reads back through cloud-volume."""

import numpy as np
import pytest

from pipeline.shards import scale_sharding


@pytest.mark.parametrize(
    "shape_zyx, chunk_zyx, dtype, encoding, voxel_bytes",
    [
        ((1024, 1024, 1024), (64, 64, 64), "uint8", "raw", 1),
        ((1024, 1024, 1024), (64, 64, 64), "uint64", "compressed_segmentation", 8),
        ((5000, 10000, 10000), (32, 64, 64), "uint8", "raw", 1),  # 2:1 serial sections
    ],
)
def test_a_shard_holds_at_most_what_a_task_may_and_is_whole_chunks(
    shape_zyx, chunk_zyx, dtype, encoding, voxel_bytes
):
    limit = 256**3 * voxel_bytes  # a 256^3 task's uncompressed voxels
    geometry = scale_sharding(shape_zyx, chunk_zyx, dtype, encoding, limit)
    assert np.prod(geometry.shard_zyx) * voxel_bytes <= limit
    assert all(s % c == 0 for s, c in zip(geometry.shard_zyx, chunk_zyx, strict=True))
    assert geometry.spec["@type"] == "neuroglancer_uint64_sharded_v1"


def test_1024_cubed_is_64_shards_of_256_cubed_instead_of_4096_chunk_files():
    geometry = scale_sharding((1024,) * 3, (64,) * 3, "uint8", "raw", 256**3)
    assert geometry.shard_zyx == (256, 256, 256)
    boxes = geometry.boxes((1024,) * 3)
    assert len(boxes) == 64
    covered = np.zeros((16, 16, 16), int)  # the chunk grid
    for box in boxes:
        covered[
            tuple(slice(a // 64, b // 64) for a, b in zip(box.start, box.stop, strict=True))
        ] += 1
    assert (covered == 1).all()


def test_a_layer_written_shard_by_shard_reads_back(tmp_path):
    """Every shard box written whole with cloud-volume's `make_shard` gives the volume back."""
    from cloudvolume import Bbox, CloudVolume

    shape_zyx, chunk_zyx = (20, 48, 40), (4, 8, 8)  # not a whole number of shards
    labels = np.random.default_rng(0).integers(0, 9, shape_zyx).astype(np.uint64)
    geometry = scale_sharding(shape_zyx, chunk_zyx, "uint64", "compressed_segmentation", 8 * 16**3)
    info = CloudVolume.create_new_info(
        1, "segmentation", "uint64", "compressed_segmentation", [8, 8, 8], [0, 0, 0],
        list(shape_zyx)[::-1], chunk_size=list(chunk_zyx)[::-1],
    )  # fmt: skip
    info["scales"][0]["sharding"] = geometry.spec
    volume = CloudVolume(f"file://{tmp_path}", info=info, progress=False)
    volume.commit_info()
    (tmp_path / volume.key).mkdir()
    boxes = geometry.boxes(shape_zyx)
    for box in boxes:
        data = labels[box.slices].T[..., None]
        name, content = volume.image.make_shard(data, Bbox(box.start[::-1], box.stop[::-1]))
        (tmp_path / volume.key / name).write_bytes(content)
    assert len(list((tmp_path / volume.key).iterdir())) == len(boxes) > 1
    back = CloudVolume(f"file://{tmp_path}", progress=False)[:, :, :][..., 0].T
    np.testing.assert_array_equal(back, labels)
