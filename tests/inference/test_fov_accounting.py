"""Where the FOV evaluations go: every flood recorded (the object it made, its seed pass and
seed, its FOVs, its voxels, why it ended), in the block results and across a checkpoint's
resume, and bench/fov_accounting.py's table of a tiny run directory made here by hand."""

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from test_inference import (
    CONFIG,
    MODEL,
    JobStopped,
    hand_made_volume,
    stand_in_predictor,
)

from pipeline.core import config_io
from pipeline.inference.blocks import (
    BlockConfig,
    block_path,
    plan_blocks,
    read_block_result,
    segment_block,
    write_block_result,
)
from pipeline.inference.flood_fill import (
    FloodEnd,
    FloodRecords,
    InferenceStats,
    segment,
    segment_with_floods,
)

ROOT = Path(__file__).resolve().parents[2]
KEPT, WEAK, SMALL, INCONSISTENT = (
    FloodEnd.KEPT,
    FloodEnd.SEED_TOO_WEAK,
    FloodEnd.TOO_SMALL,
    FloodEnd.INCONSISTENT,
)


def assert_records_are_the_stats(floods: FloodRecords, stats: InferenceStats) -> None:
    """Every FOV evaluation is one flood's, and the stats' counts are the records'."""
    first = ~floods.check  # one flood per seed tried, and its consistency check's
    assert floods.fov_evaluations.sum() == stats.fov_evaluations
    assert first.sum() == stats.seeds_tried
    assert (first & (floods.end == KEPT)).sum() == stats.objects
    assert (first & (floods.end == SMALL)).sum() == stats.objects_too_small
    assert (first & (floods.end == INCONSISTENT)).sum() == stats.objects_inconsistent
    assert (floods.end == WEAK).sum() == stats.seeds_too_weak
    assert floods.truncated.sum() == stats.objects_truncated
    assert np.all((floods.object > 0) == (floods.end == KEPT))


def assert_same_records(a: FloodRecords, b: FloodRecords) -> None:
    for name, values in dataclasses.asdict(a).items():
        np.testing.assert_array_equal(values, getattr(b, name), err_msg=name)


@pytest.mark.parametrize(
    "config",
    [
        CONFIG,
        dataclasses.replace(CONFIG, batch_size=4),
        dataclasses.replace(CONFIG, consistency_check=True),
        dataclasses.replace(CONFIG, max_fov_evaluations_per_object=1, seed_passes=50),
    ],
    ids=["fov-by-fov", "batched", "consistency-check", "short-floods-many-passes"],
)
def test_every_fov_evaluation_is_one_recorded_floods(config):
    raw, _ = hand_made_volume()
    segmentation, stats, floods = segment_with_floods(raw, stand_in_predictor, MODEL, config)
    plain, _ = segment(raw, stand_in_predictor, MODEL, config)
    np.testing.assert_array_equal(segmentation, plain)
    assert_records_are_the_stats(floods, stats)
    # The records name the objects as the segmentation does, with their voxels when made (no
    # later object takes an earlier one's voxels).
    made = (floods.end == KEPT) & ~floods.check
    assert sorted(floods.object[made]) == list(range(1, stats.objects + 1))
    for obj, voxels in zip(floods.object[made], floods.voxels[made], strict=True):
        assert np.count_nonzero(segmentation == obj) == voxels
    for obj, seed in zip(floods.object[made], floods.seed[made], strict=True):
        assert segmentation[tuple(seed)] == obj
    assert floods.seed_pass.min() == 1 and floods.seed_pass.max() <= stats.seed_passes
    if config.consistency_check:  # each object also flooded from its innermost voxel
        assert floods.check.sum() == stats.objects
        assert np.array_equal(floods.object[floods.check], floods.object[made])
    if config.max_fov_evaluations_per_object == 1:
        assert floods.fov_evaluations.max() == 1 and floods.truncated.sum() > 1


def test_discarded_floods_carry_their_reason():
    raw, labels = hand_made_volume()

    def weak(images, seeds):  # no voxel is ever an object: every seed falls
        return np.full(images.shape, -5.0, np.float32)

    segmentation, stats, floods = segment_with_floods(raw, weak, MODEL, CONFIG)
    assert not segmentation.any() and len(floods) == stats.seeds_tried > 0
    assert np.all(floods.end == WEAK) and not floods.object.any()
    assert_records_are_the_stats(floods, stats)

    # Objects 2 and 3 (6,720 and 6,384 voxels) are under 7,000; object 1 (11,520) is not.
    large = dataclasses.replace(CONFIG, min_segment_size=7_000)
    segmentation, stats, floods = segment_with_floods(raw, stand_in_predictor, MODEL, large)
    assert_records_are_the_stats(floods, stats)
    assert (floods.end == KEPT).sum() == 1 and (floods.end == SMALL).sum() >= 2
    small = floods.end == SMALL
    assert np.all(floods.voxels[small] < 7_000) and not floods.object[small].any()
    assert {int(labels[tuple(s)]) for s in floods.seed[small]} == {2, 3}

    fresh = []

    def unsure_twice(images, seeds):
        """The stand-in network, blind on every second flood (a flood begins with one seed
        voxel): every consistency check's flood loses its seed."""
        if np.count_nonzero(seeds > 0) == 1:
            fresh.append(1)
        return weak(images, seeds) if len(fresh) % 2 == 0 else stand_in_predictor(images, seeds)

    checked = dataclasses.replace(CONFIG, consistency_check=True)
    segmentation, stats, floods = segment_with_floods(raw, unsure_twice, MODEL, checked)
    assert_records_are_the_stats(floods, stats)
    assert not segmentation.any() and stats.objects_inconsistent > 0
    assert np.all(floods.end[floods.check] == WEAK)  # the check's flood: its own end ...
    after = np.flatnonzero(floods.check) - 1
    assert np.all(floods.end[after] == INCONSISTENT)  # ... the flood it checked: the attempt's


def test_a_resumed_segmentation_has_the_records_of_an_uninterrupted_one(tmp_path):
    raw, _ = hand_made_volume()
    config = dataclasses.replace(CONFIG, max_fov_evaluations_per_object=1, seed_passes=50)
    whole, whole_stats, whole_floods = segment_with_floods(raw, stand_in_predictor, MODEL, config)
    state = tmp_path / "inference-state.npz"
    calls = []

    def stopped_after_40_fovs(images, seeds):
        calls.append(1)
        if len(calls) > 40:
            raise JobStopped
        return stand_in_predictor(images, seeds)

    def interrupted() -> None:
        with pytest.raises(JobStopped):
            segment(raw, stopped_after_40_fovs, MODEL, config, checkpoint_path=state,
                    checkpoint_every_s=0)  # fmt: skip
        calls.clear()

    interrupted()
    resumed, stats, floods = segment_with_floods(
        raw, stand_in_predictor, MODEL, config, checkpoint_path=state
    )
    np.testing.assert_array_equal(resumed, whole)
    assert_same_records(floods, whole_floods)
    assert_records_are_the_stats(floods, stats)

    # A state saved before floods were recorded: the segmentation goes on, its records are lost.
    interrupted()
    with np.load(state) as saved:
        arrays = {k: saved[k] for k in saved.files if not k.startswith(FloodRecords.PREFIX)}
    arrays["state"] = json.dumps(
        {k: v for k, v in json.loads(str(arrays["state"])).items() if k != "floods_recorded"}
    )
    np.savez(state, **arrays)
    resumed, _, floods = segment_with_floods(
        raw, stand_in_predictor, MODEL, config, checkpoint_path=state
    )
    np.testing.assert_array_equal(resumed, whole)
    assert floods is None


def test_block_results_keep_their_records_in_the_volumes_coordinates(tmp_path):
    raw, _ = hand_made_volume()
    blocks = plan_blocks(raw.shape, BlockConfig((16, 24, 24), (0, 8, 8)))
    block = blocks[len(blocks) - 1]  # at the volume's far faces: padded there
    reflecting = dataclasses.replace(CONFIG, reflect_faces=True)
    result = segment_block(raw, block, stand_in_predictor, MODEL, reflecting)
    floods = result.floods
    assert_records_are_the_stats(floods, result.stats)
    made = floods.end == KEPT
    assert np.all(floods.seed[made] >= block.start) and np.all(floods.seed[made] < block.stop)
    for obj, seed in zip(floods.object[made], floods.seed[made], strict=True):
        assert result.labels[tuple(np.subtract(seed, block.start))] == obj
    path = write_block_result(block_path(tmp_path, block), result)
    assert_same_records(read_block_result(path, block).floods, floods)
    # A result written before records were kept is read as it was, without them.
    with np.load(path) as saved:
        old = {k: saved[k] for k in saved.files if not k.startswith(FloodRecords.PREFIX)}
    np.savez_compressed(path, **old)
    back = read_block_result(path, block)
    assert back.floods is None and back.stats == result.stats


def test_a_kept_object_wholly_in_a_blocks_padding_is_cropped():
    floods = FloodRecords(
        object=np.array([1, 0, 2, 3], np.uint64),
        seed_pass=np.array([1, 1, 1, 2]),
        seed=np.array([[2, 2, 2], [0, 1, 2], [3, 3, 3], [4, 4, 4]]),
        fov_evaluations=np.array([5, 1, 4, 2]),
        voxels=np.array([100, 0, 80, 90]),
        end=np.array([KEPT, WEAK, KEPT, KEPT], np.uint8),
        truncated=np.zeros(4, bool),
        check=np.zeros(4, bool),
    )
    # Objects 1 and 3 reach into the block (renumbered 2 and 1); object 2 lay in the padding.
    moved = floods.in_volume((10, 20, 30), {0: 0, 3: 1, 1: 2})
    assert moved.object.tolist() == [2, 0, 0, 1]
    assert moved.end.tolist() == [KEPT, WEAK, FloodEnd.CROPPED, KEPT]
    assert moved.seed[0].tolist() == [12, 22, 32]
    back = FloodRecords.read(moved.arrays())
    assert_same_records(back, moved)
    assert moved.arrays()["flood_fov_evaluations"].dtype == np.uint8  # compact


# ---------------------------------------------------------------------------------------------
# bench/fov_accounting.py on a tiny run directory


@pytest.fixture(scope="module")
def accounting():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import fov_accounting
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return fov_accounting


def tiny_run(run: Path, fill_min_size: int, decisions: list) -> dict:
    """A run directory as the workflow leaves it, made here from its pieces: the hand-made volume
    segmented in two blocks, stitched, the second pass's objects under `fill_min_size` dropped
    and their voxels filled (over the image's darkness), `decisions` as its pair decisions.
    Returns the block results and the layers."""
    from pipeline.export.segmentation_layer import (
        SegmentationLayout,
        SegmentationWriter,
        new_segmentation,
    )
    from pipeline.inference.stitching import (
        block_pairs,
        join_ids,
        relabel_region,
        save_id_table,
        stable_lookup,
    )
    from pipeline.run.run_config import RunConfig
    from pipeline.secondpass.agglomeration import (
        AgglomerationConfig,
        fill_unsegmented,
        save_decisions,
        save_merges,
        save_sizes,
        segment_sizes,
        small_objects,
    )

    raw, _ = hand_made_volume()
    config = RunConfig(
        name="tiny-accounting",
        inference=CONFIG,
        blocks=BlockConfig((16, 40, 28), (0, 8, 16)),
        agglomeration=AgglomerationConfig(fill_unsegmented=True, fill_min_size=fill_min_size),
    )
    (run / "config.json").write_text(json.dumps(config_io.to_dict(config)))
    (run / "staged").mkdir()  # the record of a volume read in place: its scored part
    scored = {"raw": "", "labels": "", "voxel_size_nm": [8, 8, 8], "scored_roi": "0:16, 0:40, 0:20"}
    (run / "staged/eval.json").write_text(json.dumps(scored))
    blocks = plan_blocks(raw.shape, config.blocks)
    results = [segment_block(raw, b, stand_in_predictor, MODEL, CONFIG) for b in blocks]
    for block, result in zip(blocks, results, strict=True):
        write_block_result(block_path(run / "inference/blocks", block), result)

    def labels_of(i: int) -> np.ndarray:
        return results[i].labels

    found = [block_pairs(k, blocks, labels_of, config.blocks) for k in range(len(blocks))]
    offsets, components, merges = join_ids(found)
    lookup = stable_lookup(offsets, components, found)
    (run / "inference/stitch").mkdir(parents=True)
    save_id_table(run / "inference/stitch/ids.npy", offsets, lookup, merges)
    whole = tuple(slice(0, n) for n in raw.shape)
    first = relabel_region(whole, blocks, labels_of, offsets, lookup)
    (run / "agglomerate").mkdir()
    empty = (np.zeros(0, np.uint64), np.zeros(0, np.uint64))
    save_merges(run / "agglomerate/merges.npz", *empty)
    save_sizes(run / "agglomerate/sizes.npz", *segment_sizes(first))
    (run / "agglomerate/decisions").mkdir()
    save_decisions(run / "agglomerate/decisions/block_0_0_0.npz", decisions)
    dropped = small_objects(segment_sizes(first), empty, fill_min_size)
    kept = np.where(np.isin(first, dropped), 0, first).astype(np.uint64)
    exported = fill_unsegmented(kept, 1 - raw / 255.0)
    for folder, layer in (("agglomerate/first_pass", first), ("precomputed", exported)):
        new_segmentation(run / folder, raw.shape, (8.0, 8.0, 8.0), SegmentationLayout((16, 8, 8)))
        SegmentationWriter(run / folder).write(whole, layer)
    return {"results": results, "first": first, "exported": exported, "dropped": dropped}


def test_the_bench_accounts_for_every_fov_of_a_tiny_run(tmp_path, accounting):
    from pipeline.secondpass.agglomeration import PairDecision

    decisions = [
        PairDecision(1, 2, 0.9, 0.95, 0.95, 12, True),
        PairDecision(1, 3, 0, 0, 0, 7, True),
    ]
    # Object 3 of the volume (6,384 voxels) is dropped, the others (6,720 and 11,520) stay.
    made = tiny_run(tmp_path, 6_500, decisions)
    table = accounting.account_run(tmp_path)
    first_pass = sum(r.stats.fov_evaluations for r in made["results"])
    totals = table["fov_evaluations"]
    assert totals["first_pass"] == first_pass and totals["second_pass"] == 19
    assert table["scored_voxels"] == 16 * 40 * 20 and table["voxels"] == 16 * 40 * 40
    assert totals["both_per_scored_mvoxel"] == round((first_pass + 19) * 1e6 / (16 * 40 * 20), 1)
    rows = {row["row"]: row for row in table["first_pass"]}
    assert sum(row["fov_evaluations"] for row in rows.values()) == first_pass
    assert sum(row["fov_evaluations"] for row in table["by_seed_pass"]) == first_pass
    # The floods of object 3, in both blocks, are the dropped ones; the rest are kept at sizes
    # of their stitched objects in the exported layer (with object 3's voxels filled in).
    assert len(made["dropped"]) == 1
    _, labels = hand_made_volume()
    in_three = 0
    for floods in (r.floods for r in made["results"]):
        seeded_in_three = labels[tuple(floods.seed.T)] == 3
        in_three += floods.fov_evaluations[seeded_in_three & (floods.end == KEPT)].sum()
    dropped = rows[accounting.DROPPED]
    assert dropped["fov_evaluations"] == in_three > 0
    kept = [rows[accounting.size_class(n)] for n in (0, 1_000, 10_000, 100_000)]
    assert sum(row["fov_evaluations"] for row in kept) == first_pass - in_three
    # Object 3's voxels went to a segment that a flood before them made in its block.
    assert 0 < dropped["in_earlier_segment"] <= in_three
    second = {row["row"]: row for row in table["second_pass"]}
    assert second["pair fills, merged"]["fov_evaluations"] == 12  # the thresholds' call
    text = accounting.markdown(table, "tiny")
    assert "| kept, dropped by fill_min_size |" in text and "| 1 |" in text


def test_a_flood_is_in_an_earlier_floods_segment_only_after_a_flood_made_it(accounting):
    # A block's floods in order: the object each made (0: none), the exported segment holding
    # most of its voxels, and the exported segment it is part of by its id (0: dropped).
    objects = np.array([1, 2, 3, 0, 4, 5, 3, 6, 7], np.uint64)
    ends_in = np.array([10, 10, 30, 0, 10, 60, 30, 70, 70], np.uint64)
    made = np.array([10, 0, 30, 0, 10, 0, 30, 0, 70], np.uint64)
    earlier = accounting.earlier_segment(objects, ends_in, made)
    assert earlier.tolist() == [
        False,  # object 1 makes segment 10
        True,  # object 2, dropped: its voxels were filled into 10
        False,  # object 3 makes 30
        False,  # a flood that made no object
        True,  # object 4, merged into 10 by the second pass
        False,  # object 5, dropped into a segment no flood of the block made
        False,  # object 3's consistency check: the same object
        False,  # object 6, dropped into 70, which a later flood makes
        False,  # object 7 makes 70
    ]
