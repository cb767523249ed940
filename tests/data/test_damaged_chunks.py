"""A damaged chunk of an EM image read in place is an error naming it, not a segmentation of
garbage. An EM image does not compress, so Blosc stores each of its chunks as a plain copy
behind a 16-byte header, and decodes such a chunk from that header alone: a chunk cut short,
with bytes appended or with bytes overwritten was read without an error. Now every chunk read
must have the length its header says (cut short, appended to: `ChunkSizeError`), and a volume
staged in place has a crc32 of each chunk recorded beside the run's staging record (`[data]
chunk_digests`, on by default), which every read checks (overwritten: `ChunkDigestError`).

The image is the FlyEM medulla cut of tests/data/test_in_place.py with noise added (as a
shorter dwell time gives), which is what makes Blosc store it as plain copies: each test checks
that the chunk it damages is one."""

import json
import os
import shutil
import struct

import numpy as np
import pytest
import zarr
from test_in_place import CONTEXT, EVAL_ROI, as_zarr, cut_arrays
from test_volumes import VOXEL

from pipeline.core.errors import (
    ChunkDigestError,
    ChunkReadError,
    ChunkSizeError,
    ConfigError,
    MissingChunkError,
    VolumeReadError,
)
from pipeline.data.staging import DataConfig, read_staged, role_settings, stage_role
from pipeline.data.volumes import VolumeSpec, open_volume, read_labels, read_raw
from site_configs.parsl_config import retry_cost

CHUNK = (16, 32, 32)  # 16,384 voxels: a plain copy is 16,400 bytes with its header
DAMAGED = "0.1.0"  # z 0:16, y 32:64, x 0:32: inside the box the tests stage


@pytest.fixture
def volume(tmp_path) -> dict:
    """The noisy cut as zarr volumes (raw, labels) of 2 x 2 x 2 chunks, made afresh for each
    test (they damage its chunks)."""
    raw, labels, voxel_size = cut_arrays()
    noise = np.random.default_rng(0).normal(0, 30, raw.shape)
    raw = np.clip(raw + noise, 0, 255).astype(np.uint8)
    specs = as_zarr(tmp_path / "source", {"raw": raw, "labels": labels}, voxel_size)
    return {
        "raw_spec": specs["raw"],
        "labels_spec": specs["labels"],
        "raw_chunks": tmp_path / "source" / "raw.zarr" / "raw",
        "labels_chunks": tmp_path / "source" / "labels.zarr" / "labels",
        "raw": raw,
        "labels": labels,
    }


def blosc_header(chunk) -> dict:
    flags, nbytes, cbytes = struct.unpack_from("<2xBxI4xI", chunk.read_bytes())
    return {"plain_copy": bool(flags & 0x02), "nbytes": nbytes, "cbytes": cbytes}


def plain_copy(folder, key: str = DAMAGED):
    """The chunk file `key` of `folder`, checked to be what the fault is about: a Blosc plain
    copy (flag 0x02) of 16,384 voxels, 16,400 bytes long."""
    chunk = folder / key
    assert blosc_header(chunk) == {"plain_copy": True, "nbytes": 16384, "cbytes": 16400}
    assert chunk.stat().st_size == 16400
    return chunk


def overwrite(chunk, offset: int = 5000, count: int = 100) -> None:
    """`count` random bytes over the chunk's payload from `offset` (after its header): its
    length, and so its header, still agree."""
    data = bytearray(chunk.read_bytes())
    data[offset : offset + count] = np.random.default_rng(1).bytes(count)
    chunk.write_bytes(bytes(data))


def stage(volume: dict, record, **changes) -> dict:
    """Stage the volume in place, as a run's `stage[eval]` does; its settings."""
    data = DataConfig(
        eval_raw=volume["raw_spec"],
        eval_labels=volume["labels_spec"],
        eval_roi=EVAL_ROI,
        **changes,
    )
    settings = role_settings(data, "eval", CONTEXT)
    stage_role(record, settings)
    return settings


def test_an_undamaged_volume_of_plain_copies_reads_as_written(volume, tmp_path):
    for key in ("0.0.0", "0.1.0", "1.0.1", "1.1.1"):
        plain_copy(volume["raw_chunks"], key)
    np.testing.assert_array_equal(read_raw(volume["raw_spec"])[0], volume["raw"])
    stage(volume, tmp_path / "eval.json")
    staged = read_staged(tmp_path / "eval.json")
    with open_volume(staged.raw) as raw, open_volume(staged.labels) as labels:
        box = VolumeSpec.parse(staged.raw).box
        np.testing.assert_array_equal(raw[...], volume["raw"][box.slices])
        np.testing.assert_array_equal(labels[...], volume["labels"][box.slices])


@pytest.mark.parametrize(
    "damage, length, how",
    [
        ("cut to 8,000 bytes", 8000, "its Blosc header says 16400: cut short"),
        ("cut to its header", 16, "its Blosc header says 16400: cut short"),
        ("cut inside its header", 10, "less than Blosc's 16-byte header: cut short"),
        ("100 bytes appended", 16500, "its Blosc header says 16400: bytes appended"),
    ],
)
def test_a_plain_copy_cut_short_or_appended_to_is_an_error_naming_it(
    volume, tmp_path, damage, length, how
):
    folder = volume["raw_chunks"]
    chunk = plain_copy(folder)
    data = chunk.read_bytes()
    chunk.write_bytes(
        data[:length] if length < len(data) else data + os.urandom(length - len(data))
    )
    expected = f"{folder}: chunk {DAMAGED} cannot be read (it holds {length} bytes"
    # Read whole, read as zeros where missing, and a box of it as a block reads it: each fails.
    for spec in (volume["raw_spec"], volume["raw_spec"] + "#fill_missing"):
        with pytest.raises(ChunkSizeError) as caught:
            read_raw(spec)
        message = str(caught.value)
        assert message.startswith(expected) and message.endswith(f"{how})"), message
        assert isinstance(caught.value, ChunkReadError) and "\n" not in message
        assert retry_cost(caught.value, {}) == float("inf")  # the same next time: not retried
    with open_volume(f"{volume['raw_spec']}[0:16, 24:40, 0:8]") as window:
        with pytest.raises(ChunkSizeError, match=f"chunk {DAMAGED} cannot be read"):
            window[...]
        np.testing.assert_array_equal(window[:, :8], volume["raw"][0:16, 24:32, 0:8])
    # Staging the volume in place reads every chunk of its box (for their digests): it fails
    # there already, before any block runs, and writes no record.
    with pytest.raises(ChunkSizeError, match=f"chunk {DAMAGED} cannot be read"):
        stage(volume, tmp_path / "eval.json")
    assert not (tmp_path / "eval.json").exists()


def test_random_bytes_over_a_plain_copy_are_an_error_naming_it_where_digests_were_recorded(
    volume, tmp_path
):
    stage(volume, tmp_path / "eval.json")  # [data] chunk_digests: on by default
    staged = read_staged(tmp_path / "eval.json")
    chunk = plain_copy(volume["raw_chunks"])
    overwrite(chunk)
    plain_copy(volume["raw_chunks"])  # its length and header are as they were
    with open_volume(staged.raw) as raw:
        with pytest.raises(ChunkDigestError) as caught:
            raw[...]
        message = str(caught.value)
        assert message.startswith(
            f"{volume['raw_chunks']}: chunk {DAMAGED} differs from the digest recorded when the "
            "run staged the volume (crc32 "
        ), message
        assert isinstance(caught.value, ChunkReadError)
        assert retry_cost(caught.value, {}) == float("inf")
        # The box is 0:32, 24:64, 16:64 of the source: the chunks of z 16:32 read as written.
        np.testing.assert_array_equal(raw[16:], volume["raw"][16:32, 24:64, 16:64])
    # What digests are for: the same chunk read with no digest recorded decodes, wrong.
    damaged = read_raw(volume["raw_spec"])[0]
    wrong = np.count_nonzero(damaged != volume["raw"])
    assert 0 < wrong <= 100 and np.array_equal(damaged[16:], volume["raw"][16:])

    # A labels chunk is compressed; bytes overwritten inside it may decode or not (Blosc's zstd
    # blocks carry no checksum): its digest names it before it is decoded.
    labels_chunk = volume["labels_chunks"] / DAMAGED
    assert not blosc_header(labels_chunk)["plain_copy"]
    overwrite(labels_chunk, offset=16, count=min(100, labels_chunk.stat().st_size - 16))
    with pytest.raises(ChunkDigestError, match=f"chunk {DAMAGED} differs"):
        read_labels(staged.labels)


def test_digests_are_kept_beside_the_record_never_in_the_users_store(volume, tmp_path):
    store = volume["raw_chunks"].parent.parent
    before = sorted(str(p.relative_to(store)) for p in store.rglob("*"))
    run = tmp_path / "run" / "staged"
    run.mkdir(parents=True)
    stage(volume, run / "eval.json")
    assert sorted(str(p.relative_to(store)) for p in store.rglob("*")) == before
    record = json.loads((run / "eval.json").read_text())
    assert set(record["chunk_digests"]) == {"raw", "labels"}
    assert record["chunk_digests"]["raw"]["digest"] == "crc32"
    assert {p.name for p in run.iterdir()} >= {
        "eval.json.chunks-raw.npz",
        "eval.json.chunks-labels.npz",
    }
    # A run dir moved reads the digests where it is now.
    moved = tmp_path / "moved"
    shutil.move(tmp_path / "run", moved)
    staged = read_staged(moved / "staged" / "eval.json")
    assert str(moved) in staged.raw and str(tmp_path / "run") not in staged.raw
    overwrite(plain_copy(volume["raw_chunks"]))
    with pytest.raises(ChunkDigestError, match=f"chunk {DAMAGED} differs"):
        read_raw(staged.raw)
    # Its digests lost: an error naming the file, not a read unchecked.
    (moved / "staged" / "eval.json.chunks-raw.npz").unlink()
    with pytest.raises(VolumeReadError) as caught:
        read_raw(staged.raw)
    assert str(caught.value).startswith(
        f"{moved / 'staged' / 'eval.json.chunks-raw.npz'}: the chunk digests recorded at staging "
        "cannot be read ("
    )


def test_a_chunk_lost_or_written_since_staging_is_named_even_with_fill_missing(volume, tmp_path):
    # Missing when staged (read as zeros, as asked): written since, it is not what was staged.
    (volume["raw_chunks"] / "1.1.1").unlink()
    stage(volume, tmp_path / "eval.json", fill_missing=True)
    staged = read_staged(tmp_path / "eval.json")
    with open_volume(staged.raw) as raw:
        assert not raw[16:32, 8:40, 16:48].any()
    with open_volume(volume["raw_spec"], writable=True) as array:
        array[16:32, 32:64, 32:64] = volume["raw"][16:32, 32:64, 32:64]
    with pytest.raises(ChunkDigestError, match="chunk 1.1.1 was missing when the run staged"):
        read_raw(staged.raw)
    # There when staged: lost since, it is an error, not zeros, though zeros are asked for
    # where chunks were missing.
    (volume["raw_chunks"] / "1.1.1").unlink()
    (volume["raw_chunks"] / DAMAGED).unlink()
    with pytest.raises(MissingChunkError, match=f"chunk {DAMAGED} is missing \\(it was there"):
        read_raw(staged.raw)


def test_chunk_digests_can_be_turned_off_and_are_checked(volume, tmp_path):
    with pytest.raises(ConfigError, match="chunk_digests must be true or false"):
        DataConfig(eval_raw="a.zarr:raw", chunk_digests="yes")
    on = stage(volume, tmp_path / "on.json")
    assert "chunk_digests" not in on  # on by default: the stamps of earlier runs stay valid
    off = stage(volume, tmp_path / "off.json", chunk_digests=False)
    assert off["chunk_digests"] is False
    assert "chunk_digests" not in json.loads((tmp_path / "off.json").read_text())
    assert not list(tmp_path.glob("off.json.chunks-*"))
    staged = read_staged(tmp_path / "off.json")
    assert "#chunk_digests=" not in staged.raw + staged.labels
    # Off, bytes overwritten in place are read as they are; the length is checked still.
    chunk = plain_copy(volume["raw_chunks"])
    overwrite(chunk)
    assert read_raw(staged.raw)[0].shape == VolumeSpec.parse(staged.raw).box.shape
    chunk.write_bytes(chunk.read_bytes()[:8000])
    with pytest.raises(ChunkSizeError):
        read_raw(staged.raw)


@pytest.mark.parametrize("compressor", ["none", "zstd"])
def test_chunks_of_other_stores_are_checked_as_far_as_they_can_be(tmp_path, compressor):
    """Without a compressor a chunk's length must be a chunk's size; a zstd frame (numcodecs'
    Zstd, no Blosc header) cut short fails to decode, named as before."""
    from numcodecs import Zstd

    path = tmp_path / f"{compressor}.zarr"
    array = zarr.open_group(str(path), mode="w").create_dataset(
        "raw",
        shape=(8, 8, 8),
        chunks=(4, 4, 4),
        dtype=np.uint8,
        compressor=None if compressor == "none" else Zstd(level=3),
    )
    array[...] = np.random.default_rng(2).integers(0, 256, (8, 8, 8), dtype=np.uint8)
    array.attrs["voxel_size_nm"] = list(VOXEL)
    chunk = path / "raw" / "1.0.1"
    chunk.write_bytes(chunk.read_bytes()[:40])
    with pytest.raises(ChunkReadError) as caught:
        read_raw(f"{path}:raw")
    message = str(caught.value)
    assert message.startswith(f"{path / 'raw'}: chunk 1.0.1 cannot be read (")
    if compressor == "none":
        assert isinstance(caught.value, ChunkSizeError)
        assert message.endswith(
            "it holds 40 bytes where an uncompressed chunk of (4, 4, 4) uint8 holds 64: cut short)"
        )
    assert read_raw(f"{path}:raw", region=(slice(0, 4),) * 3)[0].shape == (4, 4, 4)
