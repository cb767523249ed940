"""Blockwise segmentation: the block plan, exact stitching, determinism, restarts, atomic files."""

import dataclasses

import numpy as np
import pytest
from test_inference import (
    CONFIG,
    MEMBRANE_GREY,
    MODEL,
    OBJECT_GREYS,
    assert_same_segmentation,
    bright_weights,
    hand_made_volume,
    stand_in_predictor,
)

from pipeline.core.errors import BlockResultError, ConfigError
from pipeline.core.roi import Roi
from pipeline.inference.blocks import (
    Block,
    BlockConfig,
    BlockResult,
    block_done,
    block_path,
    face_padding,
    ground_truth_block,
    plan_blocks,
    read_block_result,
    segment_block,
    write_block_result,
)
from pipeline.inference.flood_fill import InferenceStats, make_model_predictor
from pipeline.inference.stitching import segment_blockwise, stitch
from pipeline.network.model import build_model

BLOCKS = BlockConfig(block_shape_zyx=(16, 24, 24), overlap_zyx=(0, 8, 8))


def never_called(images, seeds):
    raise AssertionError("a finished block was segmented again")


def test_blocks_tile_the_volume_with_at_least_the_overlap():
    blocks = plan_blocks((64, 100, 128), BlockConfig((32, 48, 64), (8, 16, 16)))
    assert {b.shape for b in blocks} == {(32, 48, 64)}
    covered = np.zeros((64, 100, 128), int)
    for block in blocks:
        covered[block.slices] += 1
    assert covered.min() >= 1
    starts = [sorted({b.start[axis] for b in blocks}) for axis in range(3)]
    # The fewest blocks with at least the overlap, spread evenly: overlaps 16, 22, 32.
    assert starts == [[0, 16, 32], [0, 26, 52], [0, 32, 64]]
    assert list(plan_blocks((10, 20, 30), BlockConfig((64, 64, 64), (8, 8, 8)))) == [
        Block((0, 0, 0), (10, 20, 30))
    ]


@pytest.mark.parametrize(
    "volume, config",
    [
        ((64, 100, 128), BlockConfig((32, 48, 64), (8, 16, 16))),  # overlaps 16, 22, 32
        ((10, 20, 30), BlockConfig((64, 64, 64), (8, 8, 8))),  # one block
        ((40, 57, 300), BlockConfig((16, 16, 40), (4, 6, 0))),  # no overlap along x
    ],
)
def test_the_blocks_a_region_overlaps_are_found_from_the_grid_axes(volume, config):
    grid = plan_blocks(volume, config)
    listed = list(grid)
    assert len(listed) == len(grid) and grid[-1] == listed[-1]
    rng = np.random.default_rng(0)
    for _ in range(200):
        start = [int(rng.integers(0, n)) for n in volume]
        stop = [int(rng.integers(a + 1, n + 1)) for a, n in zip(start, volume, strict=True)]
        region = np.zeros(volume, bool)
        region[tuple(slice(a, b) for a, b in zip(start, stop, strict=True))] = True
        expected = [k for k, block in enumerate(listed) if region[block.slices].any()]
        assert grid.overlapping(Block(tuple(start), tuple(stop))) == expected


@pytest.mark.parametrize(
    "blocks, pieces",
    [
        # Narrow overlaps: each block sees thin slivers of the objects it shares with its
        # neighbours, too thin to seed; the stitch takes those voxels from the neighbours.
        (BLOCKS, 4),
        # Wide overlaps: every block finds all three objects, which the stitch joins.
        (BlockConfig(block_shape_zyx=(16, 32, 32), overlap_zyx=(0, 24, 24)), 12),
    ],
    ids=["narrow-overlap", "wide-overlap"],
)
def test_stitched_blocks_segment_the_hand_made_volume_exactly(tmp_path, blocks, pieces):
    raw, labels = hand_made_volume()
    segmentation, summary = segment_blockwise(
        raw, stand_in_predictor, MODEL, CONFIG, blocks, tmp_path
    )
    assert_same_segmentation(segmentation, labels)
    stitched = summary["stitch"]
    assert stitched["blocks"] == 4 and stitched["objects"] == 3
    assert stitched["block_objects"] == summary["inference"]["objects"] == pieces
    assert stitched["merges"] >= pieces - 3  # at least a spanning tree of each object's pieces
    assert len(summary["block_seconds"]) == 4


def test_a_block_segmented_twice_gives_the_same_result():
    raw, _ = hand_made_volume()
    network = build_model(MODEL)
    bright_weights(network)
    predict = make_model_predictor(network)
    block = plan_blocks(raw.shape, BLOCKS)[1]
    first, second = (segment_block(raw, block, predict, MODEL, CONFIG) for _ in range(2))
    assert first.labels.any() and first.labels.shape == block.shape
    np.testing.assert_array_equal(first.labels, second.labels)
    assert first.provenance == second.provenance


def test_a_restarted_run_skips_finished_blocks(tmp_path):
    raw, _ = hand_made_volume()
    first, _ = segment_blockwise(raw, stand_in_predictor, MODEL, CONFIG, BLOCKS, tmp_path)
    again, summary = segment_blockwise(raw, never_called, MODEL, CONFIG, BLOCKS, tmp_path)
    np.testing.assert_array_equal(first, again)
    assert summary["inference"]["fov_evaluations"] > 0  # the stored blocks' stats
    # Half done: only the missing block runs.
    block_path(tmp_path, plan_blocks(raw.shape, BLOCKS)[2]).unlink()
    again, _ = segment_blockwise(raw, stand_in_predictor, MODEL, CONFIG, BLOCKS, tmp_path)
    np.testing.assert_array_equal(first, again)
    other = dataclasses.replace(CONFIG, segment_threshold=0.7)
    with pytest.raises(BlockResultError, match="made with other settings"):
        segment_blockwise(raw, never_called, MODEL, other, BLOCKS, tmp_path)


def test_block_results_round_trip_and_are_done_only_when_complete(tmp_path):
    raw, _ = hand_made_volume()
    block = plan_blocks(raw.shape, BLOCKS)[0]
    result = segment_block(raw, block, stand_in_predictor, MODEL, CONFIG, {"checkpoint": "c"})
    path = block_path(tmp_path, block)
    assert not block_done(path)
    write_block_result(path, result)
    assert block_done(path) and path.name == "block_0_0_0.npz"
    back = read_block_result(path, block)
    np.testing.assert_array_equal(back.labels, result.labels)
    assert back.stats == result.stats and back.provenance["checkpoint"] == "c"
    with pytest.raises(BlockResultError, match="expected Block"):
        read_block_result(path, plan_blocks(raw.shape, BLOCKS)[1])


def test_a_failed_write_leaves_no_block_file(tmp_path, monkeypatch):
    raw, _ = hand_made_volume()
    block = plan_blocks(raw.shape, BLOCKS)[0]
    result = segment_block(raw, block, stand_in_predictor, MODEL, CONFIG)

    def crash(file, **arrays):
        file.write(b"PK\x03\x04 half a zip")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez_compressed", crash)
    path = block_path(tmp_path, block)
    with pytest.raises(OSError, match="disk full"):
        write_block_result(path, result)
    assert not block_done(path) and list(tmp_path.iterdir()) == []


def test_unreadable_block_files_are_named(tmp_path):
    path = tmp_path / "block_0_0_0.npz"
    with pytest.raises(BlockResultError, match="not found"):
        read_block_result(path)
    path.write_bytes(b"not a zip")
    with pytest.raises(BlockResultError, match="not a readable block result"):
        read_block_result(path)
    np.savez(path, labels=np.zeros((2, 2, 2)))
    with pytest.raises(BlockResultError, match="missing format_version"):
        read_block_result(path)


def test_a_block_file_with_corrupted_bytes_is_named_in_one_line(tmp_path):
    import struct
    import zipfile

    raw, _ = hand_made_volume()
    block = plan_blocks(raw.shape, BLOCKS)[0]
    result = segment_block(raw, block, stand_in_predictor, MODEL, CONFIG)
    path = write_block_result(block_path(tmp_path, block), result)
    with zipfile.ZipFile(path) as archive:
        member = archive.getinfo("labels.npy")
    with open(path, "r+b") as f:  # a valid zip whose labels' compressed bytes are overwritten
        f.seek(member.header_offset + 26)  # the local header's name and extra field lengths
        name_length, extra_length = struct.unpack("<HH", f.read(4))
        f.seek(name_length + extra_length, 1)
        f.write(b"\xff" * min(16, member.compress_size))
    with pytest.raises(BlockResultError) as caught:
        read_block_result(path, block)
    message = str(caught.value)
    assert message.startswith(f"{path}: not a readable block result (") and "\n" not in message


def _result(start, stop, labels) -> BlockResult:
    return BlockResult(Block(start, stop), np.asarray(labels, np.uint32), InferenceStats(), {})


def test_stitching_merges_ids_that_share_enough_voxels():
    # Two blocks along x, volume (1, 2, 6), overlapping at x = 2, 3 (4 voxels). Left: one object.
    # Right: id 1 has 1 voxel in the overlap, id 2 has 3; left's id 1 has all 4.
    left = _result((0, 0, 0), (1, 2, 4), np.ones((1, 2, 4)))
    right = _result((0, 0, 2), (1, 2, 6), [[[1, 2, 1, 1], [2, 2, 1, 1]]])
    config = BlockConfig((1, 2, 4), (0, 0, 2), min_overlap_voxels=2, min_overlap_fraction=0.5)
    segmentation, stats = stitch([left, right], (1, 2, 6), config)
    # Only left 1 / right 2 share >= 2 voxels. Left owns x < 3, right x >= 3 (the overlap is
    # split in the middle), so x = 3 shows right's id 2, now left's id 1.
    np.testing.assert_array_equal(segmentation, [[[1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 2, 2]]])
    assert stats.merges == 1 and stats.objects == 2 and stats.block_objects == 3
    _, stats = stitch([left, right], (1, 2, 6), dataclasses.replace(config, min_overlap_voxels=4))
    assert stats.merges == 0 and stats.objects == 3


def test_stitching_merges_ids_whose_overlap_is_enough_of_their_union():
    # In the overlap (x = 2, 3) left's id 1 has 2 voxels and right's id 1 has 2: they share 1,
    # a third of their union.
    left = _result((0, 0, 0), (1, 2, 4), [[[1, 1, 1, 1], [1, 1, 0, 0]]])
    right = _result((0, 0, 2), (1, 2, 6), [[[1, 0, 1, 1], [1, 0, 1, 1]]])
    config = BlockConfig((1, 2, 4), (0, 0, 2), min_overlap_voxels=1, min_overlap_fraction=0.33)
    assert stitch([left, right], (1, 2, 6), config)[1].objects == 1
    config = dataclasses.replace(config, min_overlap_fraction=0.34)
    assert stitch([left, right], (1, 2, 6), config)[1].objects == 2


def test_an_object_merged_in_one_block_does_not_swallow_its_neighbours_objects():
    # Left saw one object where right saw two; each of right's lies wholly inside left's (all of
    # the smaller one is shared) but is only half of their union: nothing is joined.
    left = _result((0, 0, 0), (1, 2, 4), np.ones((1, 2, 4)))
    right = _result((0, 0, 2), (1, 2, 6), [[[1, 2, 1, 2], [1, 2, 1, 2]]])
    config = BlockConfig((1, 2, 4), (0, 0, 2), min_overlap_voxels=1, min_overlap_fraction=0.6)
    segmentation, stats = stitch([left, right], (1, 2, 6), config)
    assert stats.merges == 0 and stats.objects == 3
    # Left owns x < 3, right x >= 3: three ids, none of them shared.
    assert len(set(segmentation[0, 0, :3])) == 1 and len(set(segmentation[0, 0])) == 3


def test_blocks_that_do_not_tile_the_volume_are_refused():
    left = _result((0, 0, 0), (1, 2, 4), np.ones((1, 2, 4)))
    with pytest.raises(BlockResultError, match="do not form the grid"):
        stitch([left], (1, 2, 6), BlockConfig((1, 2, 4), (0, 0, 2)))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"block_shape_zyx": (16, 0, 16)}, "block_shape_zyx >= 1"),
        ({"overlap_zyx": (64, 8, 8)}, "overlap_zyx < block_shape_zyx"),
        ({"min_overlap_fraction": 1.5}, "min_overlap_fraction in"),
    ],
)
def test_bad_block_settings_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        BlockConfig(**kwargs)


def test_a_running_block_reports_its_progress_and_clears_it_when_done(tmp_path):
    import json

    from pipeline.inference.blocks import block_progress_path
    from pipeline.inference.flood_fill import ETA_MIN_SEEDS

    raw, _ = hand_made_volume()
    block = plan_blocks(raw.shape, BLOCKS)[0]
    progress = block_progress_path(block_path(tmp_path, block))
    seen = []

    def watched_predictor(images, seeds):  # what the workflow would read, call by call
        if progress.is_file():
            seen.append(json.loads(progress.read_text()))
        return stand_in_predictor(images, seeds)

    result = segment_block(
        raw, block, watched_predictor, MODEL, CONFIG, progress_path=progress, progress_every_s=0
    )
    assert seen and seen[0]["block"] == block.name and seen[0]["precision"] == MODEL.precision
    assert [r["fov_evaluations"] for r in seen] == sorted(r["fov_evaluations"] for r in seen)
    assert 0 < seen[-1]["seed_share"] <= 1 and seen[-1]["fov_per_s"] > 0
    assert all(
        (r["eta_s"] is None) == (r["seeds_tried"] < ETA_MIN_SEEDS and r["segmented_share"] == 0)
        for r in seen
    )
    shares = [r["segmented_share"] for r in seen]
    assert shares == sorted(shares) and 0 <= shares[-1] <= 1
    assert seen[-1]["objects"] <= result.stats.objects
    assert not progress.exists()  # done: nothing stale left for the next run to print


def test_reflected_faces_let_objects_in_the_volumes_shell_be_segmented(tmp_path):
    raw, labels = hand_made_volume()
    # A slab 3 voxels thick on the x = 0 face: no FOV (9 wide) can be centred in it.
    labels[:, :, :3], labels[:, :, 3] = 4, 0
    raw = np.array([MEMBRANE_GREY, *OBJECT_GREYS, 120], np.uint8)[labels]
    whole = BlockConfig(block_shape_zyx=raw.shape, overlap_zyx=(0, 0, 0))
    plain, _ = segment_blockwise(raw, stand_in_predictor, MODEL, CONFIG, whole, tmp_path / "a")
    assert not plain[labels == 4].any()  # FFN as published leaves the shell empty
    reflecting = dataclasses.replace(CONFIG, reflect_faces=True)
    padded, summary = segment_blockwise(
        raw, stand_in_predictor, MODEL, reflecting, whole, tmp_path / "b"
    )
    assert_same_segmentation(padded, labels)
    assert summary["inference"]["voxels"] == raw.size  # stats count the volume, not the padding


def test_only_the_volumes_own_faces_are_padded():
    blocks = plan_blocks((16, 40, 40), BLOCKS)
    first, last = blocks[0], blocks[-1]
    assert face_padding(first, (16, 40, 40), MODEL) == ((2, 2), (4, 0), (4, 0))
    assert face_padding(last, (16, 40, 40), MODEL) == ((2, 2), (0, 4), (0, 4))
    # A scored part with context around it: only what the context lacks is reflected.
    part = Roi((2, 3, 10), (16, 40, 40))
    assert face_padding(first, (16, 40, 40), MODEL, part) == ((0, 2), (1, 0), (0, 0))


def test_the_ground_truth_stand_in_gives_block_results_that_stitch_back_to_the_truth():
    truth = np.zeros((24, 40, 40), np.uint64)
    truth[:, :20], truth[:, 20:, :25], truth[:, 20:, 25:] = 7, 1_000_000_000_000, 3
    config = BlockConfig(block_shape_zyx=(16, 24, 24), overlap_zyx=(8, 8, 8))
    blocks = plan_blocks(truth.shape, config)
    results = [ground_truth_block(truth, b) for b in blocks]
    for result in results:  # block-local ids 1..n, as inference writes them
        assert result.labels.max() == len(np.unique(result.labels[result.labels > 0]))
    stitched, _ = stitch(results, truth.shape, config)
    pairs = np.unique(np.stack([truth.ravel(), stitched.ravel()]), axis=1)
    assert pairs.shape[1] == 3 == len(np.unique(stitched))  # the same three objects


def test_a_blocks_time_left_is_the_smaller_of_the_seed_and_the_voxel_extrapolation():
    """Early the first seeds have made the largest objects (a seed count says thousands of
    minutes); late the unsegmented rest stays unsegmented (a voxel count never reaches 100 %)."""
    from collections import Counter

    from pipeline.inference.flood_fill import _SeedLoop, progress_record

    def record(tried: int, pending: int, segmented: int) -> dict:
        loop = _SeedLoop(pending=[(0, 0, 0)] * pending, tried={(i, 0, 0) for i in range(tried)})
        counts = Counter(objects=5, fov_evaluations=5000, segmented_voxels=segmented)
        return progress_record(counts, loop, seconds=1000.0, voxels=100)

    early = record(tried=25, pending=2475, segmented=40)  # 1 % of the seeds, 40 % of the voxels
    assert early["eta_s"] == pytest.approx(1000 * 0.6 / 0.4)  # not 99,000 s
    late = record(tried=900, pending=100, segmented=90)  # 90 % of the seeds, 90 % of the voxels
    assert late["eta_s"] == pytest.approx(1000 * 0.1 / 0.9)
    nearly = record(tried=990, pending=10, segmented=90)  # the last seeds, voxels stuck at 90 %
    assert nearly["eta_s"] == pytest.approx(1000 * 0.01 / 0.99)
    assert record(tried=3, pending=997, segmented=0)["eta_s"] is None  # the first object filling
