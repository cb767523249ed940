"""Reading and writing volumes: the round trip, one test per validation error, atomic writes."""

import itertools
import json

import h5py
import numpy as np
import pytest

from pipeline.core.errors import (
    DatasetMissing,
    EmptyLabelsError,
    MissingChunkError,
    NonFiniteError,
    VolumeDtypeError,
    VolumeError,
    VolumeFileMissing,
    VolumeReadError,
    VolumeShapeError,
    VoxelSizeError,
)
from pipeline.data import volumes
from pipeline.data.volumes import VolumeSpec, read_raw, read_volume_pair, write_volumes

VOXEL = (20.0, 10.0, 10.0)


def small_pair(shape=(8, 12, 16), seed=0):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, shape, dtype=np.uint8)
    labels = rng.integers(0, 4, shape).astype(np.uint64)
    return raw, labels


def write_raw_h5(path, datasets: dict, voxel_size=VOXEL):
    """Write datasets with plain h5py, as a user's own tools would (no validation on the way in)."""
    with h5py.File(path, "w") as f:
        for name, array in datasets.items():
            d = f.create_dataset(name, data=array)
            if voxel_size is not None:
                d.attrs["voxel_size_nm"] = voxel_size
    return path


class TestRoundTrip:
    def test_write_then_read_gives_the_same_arrays_and_voxel_size(self, tmp_path):
        raw, labels = small_pair()
        path = write_volumes(tmp_path / "v.h5", {"raw": raw, "labels": labels}, VOXEL)

        volume = read_volume_pair(f"{path}:raw", f"{path}:labels")

        np.testing.assert_array_equal(volume.raw, raw)
        np.testing.assert_array_equal(volume.labels, labels)
        assert volume.raw.dtype == np.uint8 and volume.labels.dtype == np.uint64
        assert volume.voxel_size_nm == VOXEL
        assert volume.name == "v" and volume.shape == raw.shape

    def test_other_integer_label_types_become_uint64(self, tmp_path):
        raw, labels = small_pair()
        path = write_raw_h5(tmp_path / "v.h5", {"raw": raw, "labels": labels.astype(np.int32)})
        assert read_volume_pair(f"{path}:raw", f"{path}:labels").labels.dtype == np.uint64

    def test_voxel_size_can_be_given_when_the_file_has_none(self, tmp_path):
        raw, labels = small_pair()
        path = write_raw_h5(tmp_path / "v.h5", {"raw": raw, "labels": labels}, voxel_size=None)
        volume = read_volume_pair(f"{path}:raw", f"{path}:labels", voxel_size_nm=(40, 8, 8))
        assert volume.voxel_size_nm == (40.0, 8.0, 8.0)

    def test_spec_parsing_keeps_colons_in_the_path(self):
        spec = VolumeSpec.parse("/data/run:1/vol.h5:group/raw")
        assert spec.path.as_posix() == "/data/run:1/vol.h5" and spec.dataset == "group/raw"


class TestValidation:
    """Each bad input fails with one line naming the file and the problem."""

    def test_missing_file(self, tmp_path):
        with pytest.raises(VolumeFileMissing, match=r"nope\.h5: file not found"):
            read_volume_pair(f"{tmp_path}/nope.h5:raw", f"{tmp_path}/nope.h5:labels")

    def test_missing_dataset_lists_what_is_there(self, tmp_path):
        raw, labels = small_pair()
        path = write_raw_h5(tmp_path / "v.h5", {"raw": raw, "gt": labels})
        with pytest.raises(
            DatasetMissing, match=r"v\.h5: no dataset 'labels' \(datasets: gt, raw\)"
        ):
            read_volume_pair(f"{path}:raw", f"{path}:labels")

    def test_spec_without_dataset(self):
        with pytest.raises(DatasetMissing, match="must look like path.h5:dataset"):
            VolumeSpec.parse("volume.h5")

    def test_not_3d(self, tmp_path):
        path = write_raw_h5(tmp_path / "v.h5", {"raw": np.zeros((4, 4), np.uint8)})
        with pytest.raises(
            VolumeShapeError,
            match=r"v\.h5:raw: expected a 3-D \(z, y, x\) array, got shape \(4, 4\)",
        ):
            volumes.read_raw(f"{path}:raw")

    def test_raw_and_labels_shapes_differ(self, tmp_path):
        raw, labels = small_pair()
        path = write_raw_h5(tmp_path / "v.h5", {"raw": raw, "labels": labels[:, :, :5]})
        with pytest.raises(
            VolumeShapeError,
            match=r"labels shape \(8, 12, 5\) differs from raw .* shape \(8, 12, 16\)",
        ):
            read_volume_pair(f"{path}:raw", f"{path}:labels")

    @pytest.mark.parametrize("dtype", [np.uint16, np.int8, np.bool_])
    def test_unsupported_raw_dtype(self, tmp_path, dtype):
        raw, labels = small_pair()
        path = write_raw_h5(tmp_path / "v.h5", {"raw": raw.astype(dtype), "labels": labels})
        with pytest.raises(
            VolumeDtypeError, match=f"raw image must be uint8, got {np.dtype(dtype)}"
        ):
            read_volume_pair(f"{path}:raw", f"{path}:labels")

    def test_float_raw_outside_uint8_range(self, tmp_path):
        raw, labels = small_pair()
        path = write_raw_h5(tmp_path / "v.h5", {"raw": raw / 255.0, "labels": labels})
        with pytest.raises(
            VolumeDtypeError, match=r"not whole numbers in \[0, 255\]; convert it to uint8"
        ):
            read_volume_pair(f"{path}:raw", f"{path}:labels")

    def test_unsupported_labels_dtype(self, tmp_path):
        raw, labels = small_pair()
        path = write_raw_h5(
            tmp_path / "v.h5", {"raw": raw, "labels": labels.astype(np.float32) + 0.5}
        )
        with pytest.raises(VolumeDtypeError, match="labels are float32 with fractional values"):
            read_volume_pair(f"{path}:raw", f"{path}:labels")

    def test_negative_label_ids(self, tmp_path):
        raw, labels = small_pair()
        path = write_raw_h5(tmp_path / "v.h5", {"raw": raw, "labels": -labels.astype(np.int64)})
        with pytest.raises(VolumeDtypeError, match="labels contain negative ids"):
            read_volume_pair(f"{path}:raw", f"{path}:labels")

    def test_nan_in_raw(self, tmp_path):
        raw, labels = small_pair()
        bad = raw.astype(np.float32)
        bad[1, 2, 3] = np.nan
        bad[0, 0, 0] = np.inf
        path = write_raw_h5(tmp_path / "v.h5", {"raw": bad, "labels": labels})
        with pytest.raises(NonFiniteError, match=r"v\.h5:raw: 2 voxel\(s\) are NaN or infinite"):
            read_volume_pair(f"{path}:raw", f"{path}:labels")

    def test_nan_in_labels(self, tmp_path):
        raw, labels = small_pair()
        bad = labels.astype(np.float64)
        bad[0, 1, 1] = np.nan
        path = write_raw_h5(tmp_path / "v.h5", {"raw": raw, "labels": bad})
        with pytest.raises(NonFiniteError, match=r"v\.h5:labels: 1 voxel\(s\) are NaN or infinite"):
            read_volume_pair(f"{path}:raw", f"{path}:labels")

    def test_labels_all_zero(self, tmp_path):
        raw, labels = small_pair()
        path = write_raw_h5(tmp_path / "v.h5", {"raw": raw, "labels": np.zeros_like(labels)})
        with pytest.raises(EmptyLabelsError, match=r"v\.h5:labels: labels are all zero"):
            read_volume_pair(f"{path}:raw", f"{path}:labels")

    def test_smaller_than_field_of_view(self, tmp_path):
        raw, labels = small_pair()
        path = write_volumes(tmp_path / "v.h5", {"raw": raw, "labels": labels}, VOXEL)
        with pytest.raises(
            VolumeShapeError,
            match=r"shape \(8, 12, 16\) .* smaller than the field of view \(17, 33, 33\)",
        ):
            read_volume_pair(f"{path}:raw", f"{path}:labels", min_shape_zyx=(17, 33, 33))

    def test_voxel_size_missing(self, tmp_path):
        raw, labels = small_pair()
        path = write_raw_h5(tmp_path / "v.h5", {"raw": raw, "labels": labels}, voxel_size=None)
        with pytest.raises(
            VoxelSizeError,
            match="no voxel size \\(looked for the attributes 'voxel_size_nm', 'resolution'\\); give",
        ):
            read_volume_pair(f"{path}:raw", f"{path}:labels")

    def test_a_cremi_file_gives_its_voxel_size_as_resolution(self, tmp_path):
        """CREMI's layout: groups, and the voxel size (z, y, x) as `resolution` on each dataset."""
        import h5py

        raw, labels = small_pair()
        path = tmp_path / "sample.h5"
        with h5py.File(path, "w") as f:
            f["volumes/raw"], f["volumes/labels/neuron_ids"] = raw, labels
            for name in ("volumes/raw", "volumes/labels/neuron_ids"):
                f[name].attrs["resolution"] = (40.0, 4.0, 4.0)
        volume = read_volume_pair(f"{path}:volumes/raw", f"{path}:volumes/labels/neuron_ids")
        assert volume.voxel_size_nm == (40.0, 4.0, 4.0)
        with h5py.File(path, "a") as f:
            f["volumes/labels/neuron_ids"].attrs["resolution"] = (40.0, 8.0, 8.0)
        with pytest.raises(VoxelSizeError, match="differ"):
            read_volume_pair(f"{path}:volumes/raw", f"{path}:volumes/labels/neuron_ids")

    @pytest.mark.parametrize("bad", [(0, 10, 10), (10, 10), (np.nan, 1, 1)])
    def test_voxel_size_invalid(self, tmp_path, bad):
        raw, labels = small_pair()
        path = write_raw_h5(tmp_path / "v.h5", {"raw": raw, "labels": labels}, voxel_size=bad)
        with pytest.raises(VoxelSizeError, match="voxel size must be 3 positive numbers"):
            read_volume_pair(f"{path}:raw", f"{path}:labels")

    def test_raw_and_labels_voxel_sizes_differ(self, tmp_path):
        raw, labels = small_pair()
        path = write_raw_h5(tmp_path / "v.h5", {"raw": raw})
        with h5py.File(path, "a") as f:
            f.create_dataset("labels", data=labels).attrs["voxel_size_nm"] = (10, 10, 10)
        with pytest.raises(
            VoxelSizeError, match=r"labels: stored voxel size \(10.0, 10.0, 10.0\) nm differs"
        ):
            read_volume_pair(f"{path}:raw", f"{path}:labels")

    def test_not_an_hdf5_file(self, tmp_path):
        path = tmp_path / "v.h5"
        path.write_text("not hdf5")
        with pytest.raises(VolumeFileMissing, match="not a readable HDF5 file"):
            volumes.read_raw(f"{path}:raw")


class TestAtomicWrite:
    def test_failure_midway_leaves_no_file_behind(self, tmp_path, monkeypatch):
        raw, labels = small_pair()
        calls = []
        real_create = h5py.Group.create_dataset

        def failing_create(self, name, **kwargs):
            calls.append(name)
            if name == "labels":  # the raw dataset is already written when this fails
                raise OSError("disk full (injected)")
            return real_create(self, name, **kwargs)

        monkeypatch.setattr(h5py.Group, "create_dataset", failing_create)
        with pytest.raises(OSError, match="injected"):
            write_volumes(tmp_path / "v.h5", {"raw": raw, "labels": labels}, VOXEL)

        assert calls == ["raw", "labels"]  # the fault really happened after a partial write
        assert list(tmp_path.iterdir()) == []

    def test_failure_keeps_the_previous_complete_file(self, tmp_path, monkeypatch):
        raw, labels = small_pair()
        path = write_volumes(tmp_path / "v.h5", {"raw": raw, "labels": labels}, VOXEL)
        monkeypatch.setattr(
            h5py.Group, "create_dataset", lambda *a, **k: (_ for _ in ()).throw(OSError("boom"))
        )
        with pytest.raises(OSError):
            write_volumes(path, {"raw": raw[::-1], "labels": labels}, VOXEL)
        monkeypatch.undo()
        np.testing.assert_array_equal(read_volume_pair(f"{path}:raw", f"{path}:labels").raw, raw)
        assert [p.name for p in tmp_path.iterdir()] == ["v.h5"]

    def test_refuses_arrays_of_different_shapes(self, tmp_path):
        raw, labels = small_pair()
        with pytest.raises(VolumeShapeError, match="arrays must be 3-D and of one shape"):
            write_volumes(tmp_path / "v.h5", {"raw": raw, "labels": labels[:1]}, VOXEL)
        assert not (tmp_path / "v.h5").exists()


def test_volume_shape_reads_no_voxels_but_checks_as_reading_does(tmp_path):
    raw = np.zeros((4, 5, 6), np.uint8)
    path = write_volumes(tmp_path / "v.h5", {"raw": raw}, (20.0, 10.0, 10.0))
    with h5py.File(path, "a") as f:
        f["flat"] = raw[0]  # a 2-D dataset, which write_volumes refuses to write
    assert volumes.volume_shape(f"{path}:raw") == (4, 5, 6)
    with pytest.raises(VolumeFileMissing, match="file not found"):
        volumes.volume_shape(f"{tmp_path / 'absent.h5'}:raw")
    with pytest.raises(DatasetMissing, match="no dataset 'labels'"):
        volumes.volume_shape(f"{path}:labels")
    with pytest.raises(VolumeShapeError, match="expected a 3-D"):
        volumes.volume_shape(f"{path}:flat")


def test_a_corrupted_chunk_is_named_by_file_and_dataset(tmp_path):
    import h5py

    from pipeline.inference.blocks import Block, segment_block
    from pipeline.inference.flood_fill import InferenceConfig
    from pipeline.network.model import ModelConfig

    path = tmp_path / "volume.h5"
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f.create_dataset(
            "raw",
            data=rng.integers(0, 255, (16, 32, 32), np.uint8),
            chunks=(8, 16, 16),
            compression="gzip",
        )
        f["raw"].attrs["voxel_size_nm"] = (20.0, 10.0, 10.0)
        chunk = f["raw"].id.get_chunk_info(0)
    with open(path, "r+b") as f:  # a valid HDF5 file with one chunk's compressed bytes overwritten
        f.seek(chunk.byte_offset)
        f.write(b"\xff" * min(64, chunk.size))

    with pytest.raises(VolumeReadError) as caught:
        read_raw(f"{path}:raw")
    message = str(caught.value)
    assert message.startswith(f"{path}:raw: cannot read its data (") and "\n" not in message
    with (
        h5py.File(path, "r") as f,
        pytest.raises(VolumeReadError, match=f"{path}:raw: cannot read"),
    ):
        segment_block(
            f["raw"], Block((0, 0, 0), (16, 32, 32)), None, ModelConfig(), InferenceConfig()
        )


class TestZarrVolumes:
    """`path.zarr:array`: the chunked volumes that many tasks write side by side."""

    def test_tasks_write_their_own_chunks_and_every_reader_sees_the_volume(self, tmp_path):
        raw, labels = small_pair(shape=(8, 16, 16))
        path = tmp_path / "seg.zarr"
        volumes.new_chunked_volume(path, "seg", labels.shape, np.uint64, VOXEL, (4, 8, 8))
        for z in (0, 4):  # two "tasks", each its own slab of whole chunks
            with volumes.open_volume(f"{path}:seg", writable=True) as array:
                array[z : z + 4] = labels[z : z + 4]
        assert (
            read_volume_pair(
                write_volumes(tmp_path / "raw.h5", {"raw": raw}, VOXEL).as_posix() + ":raw",
                f"{path}:seg",
            ).labels.tolist()
            == labels.tolist()
        )
        header = volumes.read_header(f"{path}:seg", labels=True)
        assert header.shape == labels.shape and header.voxel_size_nm == VOXEL
        assert sorted(p.name for p in (path / "seg").iterdir() if p.name[0] != ".")[:2] == [
            "0.0.0",
            "0.0.1",
        ]

    def test_an_unwritten_volume_is_refused_unless_zeros_are_asked_for(self, tmp_path):
        from pipeline.core.errors import MissingChunkError

        path = tmp_path / "seg.zarr"
        volumes.new_chunked_volume(path, "seg", (4, 8, 8), np.uint64, VOXEL, (4, 8, 8))
        with pytest.raises(MissingChunkError, match=f"^{path}/seg: chunk 0.0.0 is missing"):
            volumes.read_labels(f"{path}:seg")
        with volumes.open_volume(f"{path}:seg#fill_missing") as array:
            assert not array[...].any()
        with pytest.raises(EmptyLabelsError, match="all zero"):
            volumes.read_labels(f"{path}:seg#fill_missing")

    def test_bad_specs_fail_with_one_line(self, tmp_path):
        path = tmp_path / "seg.zarr"
        with pytest.raises(VolumeFileMissing, match="not a zarr group"):
            volumes.read_raw(f"{path}:seg")
        volumes.new_chunked_volume(path, "seg", (4, 8, 8), np.uint64, VOXEL, (4, 8, 8))
        with pytest.raises(DatasetMissing, match=r"no array 'raw' \(arrays: seg\)"):
            volumes.read_raw(f"{path}:raw")
        with pytest.raises(VoxelSizeError, match="3 positive numbers"):
            volumes.new_chunked_volume(path, "seg", (4, 8, 8), np.uint64, (0, 1, 1), (4, 8, 8))
        h5 = write_volumes(tmp_path / "v.h5", {"raw": np.zeros((4, 8, 8), np.uint8)}, VOXEL)
        with pytest.raises(VolumeError, match="only zarr volumes are written"):
            with volumes.open_volume(f"{h5}:raw", writable=True):
                pass

    def test_a_new_volume_appears_whole_or_not_at_all(self, tmp_path, monkeypatch):
        import zarr

        path = tmp_path / "seg.zarr"

        def fail(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(zarr.hierarchy.Group, "create_dataset", fail)
        with pytest.raises(OSError, match="No space left"):
            volumes.new_chunked_volume(path, "seg", (4, 8, 8), np.uint64, VOXEL, (4, 8, 8))
        assert list(tmp_path.iterdir()) == []


def write_precomputed(
    folder, array: np.ndarray, voxel_size_zyx, layer_type="image", chunk_xyz=(8, 8, 4)
):
    """A precomputed layer of a (z, y, x) array as other tools write them: (x, y, z) order, an
    anisotropic voxel size, a voxel offset, several chunks."""
    from cloudvolume import CloudVolume

    info = CloudVolume.create_new_info(
        num_channels=1,
        layer_type=layer_type,
        data_type=str(array.dtype),
        encoding="raw",
        resolution=list(voxel_size_zyx[::-1]),
        voxel_offset=[7, 5, 3],
        volume_size=list(array.shape[::-1]),
        chunk_size=list(chunk_xyz),
    )
    volume = CloudVolume(f"file://{folder}", info=info, progress=False)
    volume.commit_info()
    volume[:, :, :] = array.T
    return f"precomputed://file://{folder}"


def write_sharded_precomputed(folder, array: np.ndarray, voxel_size_zyx, layer_type="image"):
    """A sharded precomputed layer (`neuroglancer_uint64_sharded_v1`) of a (z, y, x) array, as
    igneous writes one: 8 chunks of 4 x 4 x 2 to a shard (preshift_bits 3), every shard made
    whole by cloud-volume's `make_shard`; a segmentation in compressed_segmentation."""
    from cloudvolume import Bbox, CloudVolume
    from cloudvolume.datasource.precomputed.sharding import image_shard_shape_from_spec

    segmentation = layer_type == "segmentation"
    info = CloudVolume.create_new_info(
        num_channels=1,
        layer_type=layer_type,
        data_type=str(array.dtype),
        encoding="compressed_segmentation" if segmentation else "raw",
        resolution=list(voxel_size_zyx[::-1]),
        voxel_offset=[7, 5, 3],
        volume_size=list(array.shape[::-1]),
        chunk_size=[4, 4, 2],
    )
    spec = {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 3, "hash": "identity",
            "minishard_bits": 0, "shard_bits": 3, "minishard_index_encoding": "gzip",
            "data_encoding": "gzip"}  # fmt: skip
    info["scales"][0]["sharding"] = spec
    volume = CloudVolume(f"file://{folder}", info=info, progress=False)
    volume.commit_info()
    data, offset, size = array.T, np.array([7, 5, 3]), np.array(array.shape[::-1])
    shape = np.asarray(image_shard_shape_from_spec(spec, size, volume.chunk_size), int)
    layer = folder / volume.key
    layer.mkdir(exist_ok=True)
    for start in itertools.product(
        *(range(0, n, step) for n, step in zip(size, shape, strict=True))
    ):
        stop = np.minimum(np.array(start) + shape, size)
        box = tuple(slice(a, b) for a, b in zip(start, stop, strict=True))
        name, content = volume.image.make_shard(
            data[box][..., None], Bbox(start + offset, stop + offset)
        )
        (layer / name).write_bytes(content)
    return f"precomputed://file://{folder}"


class TestPrecomputedInputs:
    """`precomputed://file:///layer`: a Neuroglancer precomputed volume read in place, part by
    part, in the project's (z, y, x) convention."""

    def test_read_whole_and_in_parts_as_z_y_x(self, tmp_path):
        raw, labels = small_pair(shape=(8, 12, 16))
        raw_spec = write_precomputed(tmp_path / "raw", raw, VOXEL)
        labels_spec = write_precomputed(tmp_path / "seg", labels, VOXEL, "segmentation")
        volume = read_volume_pair(raw_spec, labels_spec)
        np.testing.assert_array_equal(volume.raw, raw)
        np.testing.assert_array_equal(volume.labels, labels)
        assert volume.voxel_size_nm == VOXEL  # the layer's (x, y, z) resolution, turned
        with volumes.open_volume(raw_spec) as array:
            assert array.shape == raw.shape and array.dtype == np.uint8
            np.testing.assert_array_equal(array[2:7, 3:11, 5:16], raw[2:7, 3:11, 5:16])
        assert str(VolumeSpec.parse(raw_spec)) == raw_spec

    def test_a_part_is_staged_and_a_resume_watches_the_layers_info(self, tmp_path):
        from pipeline.data.staging import DataConfig, source_files, stage_files

        raw, labels = small_pair(shape=(8, 12, 16))
        raw_spec = write_precomputed(tmp_path / "raw", raw, VOXEL)
        labels_spec = write_precomputed(tmp_path / "seg", labels, VOXEL, "segmentation")
        stage_files(tmp_path / "staged.h5", raw_spec, labels_spec, roi="2:6, 0:12, 4:12")
        with h5py.File(tmp_path / "staged.h5") as f:
            np.testing.assert_array_equal(f["raw"][...], raw[2:6, :, 4:12])
            np.testing.assert_array_equal(f["labels"][...], labels[2:6, :, 4:12])
            read = json.loads(f.attrs["staged_from"])  # what was read, for a person to check
        assert read["raw"] == raw_spec and read["source_shape_zyx"] == [8, 12, 16]
        assert read["voxel_size_nm"] == list(VOXEL)
        data = DataConfig(train_raw=raw_spec, train_labels=labels_spec, eval_raw=raw_spec)
        # The layers' info and their scale-0 chunk folders: a chunk rewritten re-runs the stage.
        scale = "10.0_10.0_20.0"
        assert source_files(data, "train") == [
            tmp_path / "raw" / scale,
            tmp_path / "raw" / "info",
            tmp_path / "seg" / scale,
            tmp_path / "seg" / "info",
        ]

    def test_a_missing_chunk_is_an_error_never_zeros_and_a_part_reads_only_its_chunks(
        self, tmp_path
    ):
        from pipeline.data.staging import stage_files

        raw, _ = small_pair(shape=(8, 12, 16))
        spec = write_precomputed(tmp_path / "raw", raw, VOXEL)
        scale = next(p for p in (tmp_path / "raw").iterdir() if p.is_dir())
        # The chunk at x 7-15, y 5-13, z 3-7 (cloud-volume's names): z 0:4, y 0:8, x 0:8 here.
        (first,) = scale.glob("7-15_5-13_3-7*")
        first.unlink()
        with pytest.raises(
            MissingChunkError, match=f"^{spec}: chunk 10.0_10.0_20.0/7-15_5-13_3-7 is missing"
        ):
            read_raw(spec)
        assert not read_raw(f"{spec}#fill_missing")[0][:4, :8, :8].any()
        # A part away from the lost chunk is staged: only its own chunks were read.
        stage_files(tmp_path / "staged.h5", spec, roi="4:8, 0:12, 0:16")
        with h5py.File(tmp_path / "staged.h5") as f:
            np.testing.assert_array_equal(f["raw"][...], raw[4:8])

    def test_a_sharded_layer_reads_as_an_unsharded_one(self, tmp_path):
        raw, labels = small_pair(shape=(8, 12, 16))
        raw_spec = write_sharded_precomputed(tmp_path / "raw", raw, VOXEL)
        labels_spec = write_sharded_precomputed(tmp_path / "seg", labels, VOXEL, "segmentation")
        assert len(list((tmp_path / "raw" / "10.0_10.0_20.0").glob("*.shard"))) > 1
        volume = read_volume_pair(raw_spec, labels_spec)
        np.testing.assert_array_equal(volume.raw, raw)
        np.testing.assert_array_equal(volume.labels, labels)
        with volumes.open_volume(labels_spec) as array:
            np.testing.assert_array_equal(array[1:7, 3:11, 5:16], labels[1:7, 3:11, 5:16])

    def test_a_missing_shard_is_an_error_naming_it_never_zeros(self, tmp_path):
        raw, _ = small_pair(shape=(8, 12, 16))
        spec = write_sharded_precomputed(tmp_path / "raw", raw, VOXEL)
        (tmp_path / "raw" / "10.0_10.0_20.0" / "0.shard").unlink()
        # Shard 0 holds the layer's first chunks (from x 7, y 5, z 3: 0, 0, 0 here).
        with pytest.raises(MissingChunkError) as caught:
            read_raw(spec)
        assert str(caught.value).startswith(
            f"{spec}: shard 10.0_10.0_20.0/0.shard (chunk 7-11_5-9_3-5) is missing ("
        )
        assert not read_raw(f"{spec}#fill_missing")[0][:2, :4, :4].any()

    def test_bad_specs_fail_with_one_line(self, tmp_path):
        with pytest.raises(VolumeFileMissing, match="no precomputed layer"):
            read_raw(f"precomputed://file://{tmp_path}/nothing")
        with pytest.raises(VolumeError, match="is read from file://, https://, http://, s3://"):
            read_raw("precomputed://ftp://host/layer")  # gs:// and the others: test_remote_inputs
        spec = write_precomputed(tmp_path / "raw", small_pair()[0], VOXEL)
        with pytest.raises(VolumeError, match="only zarr volumes are written"):
            with volumes.open_volume(spec, writable=True):
                pass
