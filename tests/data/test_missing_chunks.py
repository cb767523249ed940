"""A chunk of an input volume that is missing or cannot be decoded is an error naming the file and
the chunk, never zeros read silently (unless `[data] fill_missing = true` asks for zeros), and
never retried; the stage that records a volume read in place sees a chunk rewritten, lost or
restored, so what reads it runs again. Each test breaks real chunk files of small zarr (and
precomputed) volumes: the cut of the FlyEM medulla volume of tests/data/test_in_place.py."""

import json
import os
import shutil

import numpy as np
import pytest
import zarr
from test_in_place import CONTEXT, EVAL_ROI, as_zarr, cut_arrays
from test_volumes import VOXEL, small_pair, write_precomputed, write_sharded_precomputed

from pipeline.core.errors import (
    ChunkReadError,
    ConfigError,
    FFNError,
    MissingChunkError,
    VolumeReadError,
)
from pipeline.core.stamps import input_token
from pipeline.data.staging import DataConfig, read_staged, role_settings, source_files, stage_role
from pipeline.data.volumes import open_volume, read_labels, read_raw
from site_configs.base import retry_cost

HINT = (
    "a chunk never written reads as zeros; set [data] fill_missing = true if that is what you want"
)


@pytest.fixture
def source(tmp_path) -> dict:
    """The cut as zarr volumes of 2 x 2 x 2 chunks of 16 x 32 x 32 (keys z.y.x), made afresh for
    each test (they break its chunks)."""
    raw, labels, voxel_size = cut_arrays()
    specs = as_zarr(tmp_path, {"raw": raw, "labels": labels}, voxel_size)
    return {
        "raw_spec": specs["raw"],
        "labels_spec": specs["labels"],
        "raw_chunks": tmp_path / "raw.zarr" / "raw",
        "labels_chunks": tmp_path / "labels.zarr" / "labels",
        "raw": raw,
        "labels": labels,
    }


def test_a_missing_zarr_chunk_is_an_error_naming_it_unless_zeros_are_asked_for(source):
    folder, raw = source["raw_chunks"], source["raw"]
    (folder / "1.0.1").unlink()  # z 16:32, y 0:32, x 32:64
    with pytest.raises(MissingChunkError) as caught:
        read_raw(source["raw_spec"])
    assert str(caught.value) == f"{folder}: chunk 1.0.1 is missing ({HINT})"
    assert retry_cost(caught.value, {}) == float("inf")  # the same next time: not retried
    # A box read in place (what a block reads) that touches it, and one that does not.
    with open_volume(f"{source['raw_spec']}[8:24, 0:16, 24:40]") as window:
        with pytest.raises(MissingChunkError, match="chunk 1.0.1 is missing"):
            window[...]
        np.testing.assert_array_equal(window[:8], raw[8:16, 0:16, 24:40])
    # Zeros where asked for, and only there.
    filled, _ = read_raw(source["raw_spec"] + "#fill_missing")
    assert not filled[16:, :32, 32:].any()
    kept = np.ones(raw.shape, bool)
    kept[16:, :32, 32:] = False
    np.testing.assert_array_equal(filled[kept], raw[kept])


def test_chunks_in_nested_folders_are_named_by_their_path(tmp_path):
    group = zarr.open_group(str(tmp_path / "nested.zarr"), mode="w")
    array = group.create_dataset(
        "raw", shape=(8, 8, 8), chunks=(4, 4, 4), dtype=np.uint8, dimension_separator="/"
    )
    array[...] = 7
    array.attrs["voxel_size_nm"] = list(VOXEL)
    folder = tmp_path / "nested.zarr" / "raw"
    (folder / "1" / "0" / "1").unlink()
    with pytest.raises(MissingChunkError, match=f"^{folder}: chunk 1/0/1 is missing"):
        read_raw(f"{tmp_path / 'nested.zarr'}:raw")
    assert read_raw(f"{tmp_path / 'nested.zarr'}:raw", region=(slice(0, 4),) * 3)[0].all()


@pytest.mark.parametrize("damage", ["truncated", "overwritten", "emptied"])
def test_a_corrupt_zarr_chunk_is_named_and_not_retried(source, damage):
    chunk = source["labels_chunks"] / "0.1.0"
    data = chunk.read_bytes()
    chunk.write_bytes(
        {
            "truncated": data[: len(data) // 2],
            "overwritten": data[:16] + os.urandom(len(data) - 16),
            "emptied": b"",
        }[damage]
    )
    for spec in (source["labels_spec"], source["labels_spec"] + "#fill_missing"):
        with pytest.raises(VolumeReadError) as caught:
            read_labels(spec)
        message = str(caught.value)
        assert isinstance(caught.value, ChunkReadError), message
        assert message.startswith(f"{source['labels_chunks']}: chunk 0.1.0 cannot be read (")
        assert "\n" not in message
        assert isinstance(caught.value, FFNError) and retry_cost(caught.value, {}) == float("inf")


def test_a_corrupt_precomputed_chunk_is_named(tmp_path):
    raw, _ = small_pair(shape=(8, 12, 16))
    spec = write_precomputed(tmp_path / "raw", raw, VOXEL)
    scale = tmp_path / "raw" / "10.0_10.0_20.0"
    (chunk,) = scale.glob("15-23_5-13_7-11*")  # z 4:8, y 0:8, x 8:16 here
    chunk.write_bytes(chunk.read_bytes()[:10])
    with pytest.raises(ChunkReadError) as caught:
        read_raw(spec)
    assert str(caught.value).startswith(
        f"{spec}: chunk 10.0_10.0_20.0/15-23_5-13_7-11 cannot be read ("
    )
    np.testing.assert_array_equal(read_raw(spec, region=(slice(0, 4),) * 3)[0], raw[:4, :4, :4])


def eval_settings(source: dict, roi: str = EVAL_ROI, context=CONTEXT, **changes) -> dict:
    data = DataConfig(
        eval_raw=source["raw_spec"], eval_labels=source["labels_spec"], eval_roi=roi, **changes
    )
    return role_settings(data, "eval", context)


def test_the_record_changes_when_a_chunk_it_reads_changes_and_only_then(source, tmp_path):
    settings = eval_settings(source)
    data = DataConfig(eval_raw=source["raw_spec"], eval_labels=source["labels_spec"])
    watched = source_files(data, "eval")
    assert source["raw_chunks"] in watched and source["labels_chunks"] in watched
    tokens = [input_token(p) for p in watched]
    first = stage_role(tmp_path / "first.json", settings)
    record = json.loads((tmp_path / "first.json").read_text())
    raw_chunks = record["sources"][0]["chunks"]
    assert raw_chunks["chunks"] == 8 and raw_chunks["missing"] == 0
    assert len(raw_chunks["state_sha256"]) == 64

    chunk, saved = source["raw_chunks"] / "1.1.1", tmp_path / "saved"
    shutil.copy2(chunk, saved)
    with open_volume(source["raw_spec"], writable=True) as array:  # the user rewrites a chunk
        array[16:32, 32:64, 32:64] = 255 - source["raw"][16:32, 32:64, 32:64]
    # The stage's inputs changed (a resume re-runs it), and so does its record (what the blocks
    # key on).
    assert [input_token(p) for p in watched] != tokens
    rewritten = stage_role(tmp_path / "rewritten.json", settings)
    assert rewritten != first
    # The chunk restored as `cp -p` does (its bytes and mtime as before): a change again.
    shutil.copy2(saved, chunk)
    assert chunk.stat().st_mtime_ns == saved.stat().st_mtime_ns
    restored = stage_role(tmp_path / "restored.json", settings)
    assert restored not in (first, rewritten)
    assert stage_role(tmp_path / "again.json", settings) == restored  # nothing changed: the same

    # A part read from chunk 1.1.1 only: a chunk outside it changes the stage's inputs, not the
    # record the blocks key on.
    part = eval_settings(source, "16:32, 32:64, 32:64", (0, 0, 0))
    before = stage_role(tmp_path / "part.json", part)
    with open_volume(source["raw_spec"], writable=True) as array:
        array[0:16, 0:32, 0:32] = 0
    assert stage_role(tmp_path / "part-after.json", part) == before


def test_a_missing_chunk_fails_the_stage_unless_zeros_are_asked_for(source, tmp_path):
    (source["raw_chunks"] / "0.1.1").unlink()
    settings = eval_settings(source)
    with pytest.raises(MissingChunkError) as caught:
        stage_role(tmp_path / "eval.json", settings)
    assert str(caught.value).startswith(f"{source['raw_chunks']}: chunk 0.1.1 is missing (")
    assert not (tmp_path / "eval.json").exists()

    filled = eval_settings(source, fill_missing=True)
    assert filled["fill_missing"] and "fill_missing" not in settings  # old stamps stay valid
    stage_role(tmp_path / "eval.json", filled)
    record = json.loads((tmp_path / "eval.json").read_text())
    assert record["sources"][0]["chunks"]["missing"] == 1
    staged = read_staged(tmp_path / "eval.json")
    assert staged.raw.endswith("#fill_missing") and staged.labels.endswith("#fill_missing")
    with open_volume(staged.raw) as raw:  # the box 0:32, 24:64, 16:64 of the source
        assert not raw[0:16, 8:40, 16:48].any()
    # Writing the missing chunk changes the record.
    token = stage_role(tmp_path / "eval.json", filled)
    with open_volume(source["raw_spec"], writable=True) as array:
        array[0:16, 32:64, 32:64] = source["raw"][0:16, 32:64, 32:64]
    assert stage_role(tmp_path / "again.json", filled) != token


def test_fill_missing_is_checked():
    with pytest.raises(ConfigError, match="fill_missing must be true or false"):
        DataConfig(eval_raw="a.zarr:raw", fill_missing="yes")
    with pytest.raises(ConfigError, match="fill_missing is about chunks of your files"):
        DataConfig(fill_missing=True)
    assert DataConfig(eval_raw="a.zarr:raw", fill_missing=True).fill_missing


@pytest.mark.slow
def test_a_resume_reruns_what_reads_a_rewritten_chunk_and_a_lost_one_fails_naming_it(
    source, tmp_path
):
    """Inference only (the shipped demo model) on the zarr cut read in place: a chunk rewritten
    re-runs the stage and the blocks; a chunk lost fails the run with one line naming it."""
    from workflow_runs import ROOT, segmentation, tries, workflow

    config = tmp_path / "in_place.toml"
    config.write_text(
        f'name = "in_place"\npretrained_model = "{ROOT / "models" / "demo-synthetic"}"\n[data]\n'
        f'eval_raw = "{source["raw_spec"]}"\neval_labels = "{source["labels_spec"]}"\n'
        f'eval_roi = "{EVAL_ROI}"\n'
        "[blocks]\nblock_shape_zyx = [32, 40, 40]\noverlap_zyx = [8, 16, 16]\n"
        "[export]\nnum_scales = 2\n"
    )
    run_dir = tmp_path / "run"
    workflow("--config", str(config), "--run-dir", str(run_dir))
    before = segmentation(run_dir)
    args = ("--config", str(config), "--run-dir", str(run_dir), "--resume")
    assert "up to date" in workflow(*args).stdout

    with open_volume(source["raw_spec"], writable=True) as array:
        array[16:32, 32:64, 32:64] = 0  # a chunk of the scored part rewritten
    out = workflow(*args).stdout
    assert "stage      0/1 up to date; runs: input changed: raw.zarr/raw" in out, out[-3000:]
    assert "infer      0/2 up to date; runs: infer[0], infer[1]: after stage" in out
    assert not np.array_equal(segmentation(run_dir), before)

    (source["raw_chunks"] / "1.1.1").unlink()
    done = workflow(*args, expect=1)
    text = done.stdout + done.stderr
    assert f"{source['raw_chunks']}: chunk 1.1.1 is missing" in text, text[-3000:]
    assert tries(run_dir)["stage_volume"] == 1  # named at staging and not retried


def test_a_corrupt_shard_is_named(tmp_path):
    raw, _ = small_pair(shape=(8, 12, 16))
    spec = write_sharded_precomputed(tmp_path / "raw", raw, VOXEL)
    shard = tmp_path / "raw" / "10.0_10.0_20.0" / "1.shard"
    shard.write_bytes(shard.read_bytes()[:-40])  # its last chunks cut off, as by a full disk
    with pytest.raises(ChunkReadError) as caught:
        read_raw(spec)
    assert str(caught.value).startswith(f"{spec}: shard 10.0_10.0_20.0/1.shard (chunk ")
