"""Segmentation scores: zero for a perfect segmentation, hand-computed values for a split and a
merge, and the watershed baseline."""

import json

import numpy as np
import pytest
from test_inference import hand_made_volume

from pipeline.cli.metrics import main
from pipeline.core.errors import ConfigError, VolumeShapeError
from pipeline.data.volumes import write_volumes
from pipeline.evaluation import scores as metrics
from pipeline.evaluation.scores import (
    OverlapCounts,
    SegmentationScores,
    count_overlaps,
    largest_errors,
    score_counts,
    score_segmentation,
    truth_in_pieces,
)
from pipeline.evaluation.watershed import watershed_baseline

# Ten voxels in a row: ground-truth objects 1 and 2 of four voxels each, then two unlabeled ones.
TRUTH = np.array([1, 1, 1, 1, 2, 2, 2, 2, 0, 0], np.uint64).reshape(1, 1, 10)


def row(*ids: int) -> np.ndarray:
    return np.array(ids, np.uint64).reshape(1, 1, -1)


def score(prediction: np.ndarray) -> SegmentationScores:
    return score_segmentation(prediction, TRUTH, min_overlap_voxels=1, min_overlap_fraction=0.1)


def test_identical_segmentations_score_perfectly_whatever_the_ids():
    _, labels = hand_made_volume()
    relabeled = np.array([0, 70, 9, 1234], np.uint64)[labels]
    for prediction in (labels, relabeled):
        scores = score_segmentation(prediction, labels)
        assert scores.vi == scores.vi_split == scores.vi_merge == 0
        assert scores.adapted_rand_error == pytest.approx(0, abs=1e-12)
        assert scores.split_objects == scores.merged_segments == 0
        assert scores.gt_objects == scores.segments == 3 and scores.unsegmented_fraction == 0


def test_a_split_scores_as_computed_by_hand():
    # Object 1 is cut in halves (predicted 1 and 2), object 2 is whole (3); the unlabeled voxels
    # are ignored whatever they are predicted.
    scores = score(row(1, 1, 2, 2, 3, 3, 3, 3, 7, 8))
    # VI split = H(pred | truth) = p(1) H(halves) + p(2) * 0 = 0.5 * 1 bit; merge = H(truth | pred) = 0.
    assert scores.vi_split == pytest.approx(0.5) and scores.vi_merge == pytest.approx(0)
    # Contingency counts 2, 2, 4 (8 voxels). Ordered pairs together in both: 4 + 4 + 16 - 8 = 16;
    # in the truth: 16 + 16 - 8 = 24; in the prediction: 4 + 4 + 16 - 8 = 16.
    # Precision 16 / 16 = 1, recall 16 / 24, error 1 - 16 / (16 / 2 + 24 / 2) = 0.2.
    assert scores.adapted_rand_precision == pytest.approx(1)
    assert scores.adapted_rand_recall == pytest.approx(2 / 3)
    assert scores.adapted_rand_error == pytest.approx(0.2)
    assert (scores.split_objects, scores.merged_segments) == (1, 0)
    assert (scores.gt_objects, scores.segments, scores.voxels) == (2, 3, 8)


def test_a_merge_scores_as_computed_by_hand():
    scores = score(row(5, 5, 5, 5, 5, 5, 5, 5, 1, 2))
    # VI merge = H(truth | pred) = H(1/2, 1/2) = 1 bit; split = 0.
    assert scores.vi_merge == pytest.approx(1) and scores.vi_split == pytest.approx(0)
    # Counts 4, 4. Pairs together in both: 16 + 16 - 8 = 24; truth 24; prediction 64 - 8 = 56.
    # Precision 24 / 56 = 3 / 7, recall 1, error 1 - 24 / (56 / 2 + 24 / 2) = 0.4.
    assert scores.adapted_rand_precision == pytest.approx(3 / 7)
    assert scores.adapted_rand_recall == pytest.approx(1)
    assert scores.adapted_rand_error == pytest.approx(0.4)
    assert (scores.split_objects, scores.merged_segments) == (0, 1)


def test_unsegmented_voxels_are_counted_and_pooled_into_one_segment():
    scores = score(row(1, 1, 1, 0, 0, 2, 2, 2, 0, 0))
    assert scores.unsegmented_fraction == pytest.approx(2 / 8)
    # The two 0s, one of each object, are one segment: a merge for VI, not for the counts.
    assert scores.vi_merge > 0 and scores.vi_split > 0 and scores.segments == 2
    assert scores.split_objects == scores.merged_segments == 0


def test_small_overlaps_are_not_counted_as_splits_or_merges():
    scores = score_segmentation(
        row(1, 1, 1, 2, 2, 2, 2, 2, 0, 0), TRUTH, min_overlap_voxels=2, min_overlap_fraction=0.1
    )
    assert scores.split_objects == scores.merged_segments == 0  # one stray voxel only
    assert scores.vi > 0


def test_scores_are_json_ready():
    record = json.loads(json.dumps(score(TRUTH).to_dict()))
    assert record["vi"] == 0 and set(record) >= {"vi_split", "vi_merge", "adapted_rand_error"}


def test_a_body_in_two_pieces_within_the_part_costs_every_segmentation_its_split():
    # Body 1 is cut by body 2 into pieces of 2 and 6 voxels (a U that closes outside the part),
    # body 3 touches itself only at a corner: one 26-connected piece.
    truth = np.zeros((1, 3, 10), np.uint64)
    truth[0, 0] = [1, 1, 2, 1, 1, 1, 1, 1, 1, 0]
    truth[0, 1, 2] = 2
    truth[0, 1, 5], truth[0, 2, 6] = 3, 3
    pieces = truth_in_pieces(truth)
    assert (pieces["bodies"], pieces["bodies_in_pieces"]) == (3, 1)
    # H(pieces | truth) = p(body 1) H(2/8, 6/8): what the truth's own pieces score as a split.
    h = -(0.25 * np.log2(0.25) + 0.75 * np.log2(0.75))
    assert pieces["vi_split"] == pytest.approx(8 / 12 * h)
    best = truth.copy()
    best[0, 0, :2] = 7  # the truth with body 1's pieces under two ids: split that much, no more
    assert score_segmentation(best, truth).vi_split == pytest.approx(pieces["vi_split"])
    whole = truth.copy()
    whole[0, 0, 2] = 1  # joined inside the part: nothing to pay
    joined = truth_in_pieces(whole)
    assert joined["vi_split"] == 0 and joined["bodies_in_pieces"] == 0


def test_the_largest_errors_name_the_split_body_and_the_merging_segment_and_sum_to_vi():
    # Body 1 split into segments 5 (3 voxels) and 6 (1); segment 7 merges bodies 2 and 3; body 4
    # right; one voxel of body 4 left unsegmented.
    truth = row(1, 1, 1, 1, 2, 2, 3, 3, 3, 4, 4, 4)
    segmentation = row(5, 5, 5, 6, 7, 7, 7, 7, 7, 8, 8, 0)
    counts = OverlapCounts.of(truth, segmentation)
    errors = largest_errors(counts, n=2, overlaps=1)
    # p(body 1) H(3/4, 1/4), in bits, is body 1's share of VI split.
    h = -(0.75 * np.log2(0.75) + 0.25 * np.log2(0.25))
    assert errors["split"][0] == {"id": 1, "voxels": 4, "bits": pytest.approx(4 / 12 * h),
                                  "largest": [[5, 3]]}  # fmt: skip
    assert errors["split"][1]["id"] == 4  # its unsegmented voxel: a piece of its own
    assert errors["merge"][0]["id"] == 7 and errors["merge"][0]["largest"] == [[3, 3]]
    # Unsegmented voxels are a segment as the scores count them; named 0.
    everything = largest_errors(counts, n=100)
    assert [r["id"] for r in everything["merge"]] == [7]  # segment 0 holds one body: no merge
    scores = score_counts(counts)
    assert sum(r["bits"] for r in everything["split"]) == pytest.approx(scores.vi_split)
    assert sum(r["bits"] for r in everything["merge"]) == pytest.approx(scores.vi_merge)
    assert largest_errors(OverlapCounts.of(truth, truth)) == {"split": [], "merge": []}
    with pytest.raises(ConfigError, match="no labeled voxel"):
        largest_errors(OverlapCounts.empty())


def test_bad_inputs_are_refused():
    with pytest.raises(VolumeShapeError, match="differs from ground truth"):
        score_segmentation(row(1, 2), TRUTH)
    with pytest.raises(ConfigError, match="no labeled voxel"):
        score_segmentation(row(1, 2), row(0, 0))


def test_the_watershed_baseline_separates_the_hand_made_objects():
    raw, labels = hand_made_volume()
    segmentation = watershed_baseline(raw)
    assert segmentation.dtype == np.uint64 and segmentation.all()
    scores = score_segmentation(segmentation, labels)
    assert scores.vi == pytest.approx(0, abs=1e-9) and scores.segments == 3


def test_command_line_scores_a_segmentation_and_the_baseline(tmp_path, capsys):
    raw, labels = hand_made_volume()
    volume = write_volumes(tmp_path / "v.h5", {"raw": raw, "labels": labels}, (20, 10, 10))
    output = tmp_path / "scores.json"
    args = ["--segmentation", f"{volume}:labels", "--labels", f"{volume}:labels"]
    assert main([*args, "--raw", f"{volume}:raw", "--output", str(output)]) == 0
    scores = json.loads(output.read_text())
    assert scores["segmentation"]["vi"] == 0 and "watershed" in scores
    assert "watershed" in capsys.readouterr().out
    assert main(["--segmentation", f"{volume}:nothing", "--labels", f"{volume}:labels"]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_counts_summed_over_blocks_score_as_the_whole_volume():
    # Real labels (the FlyEM cut) against a segmentation with splits, merges and holes.
    import h5py
    from test_parts import CUT

    with h5py.File(CUT) as f:
        truth = f["volumes/labels/neuron_ids"][...]
    rng = np.random.default_rng(0)
    ids, sizes = np.unique(truth[truth > 0], return_counts=True)
    largest = ids[np.argsort(sizes)[-2:]]
    prediction = truth.copy()
    prediction[truth == largest[0]] = largest[1]  # a merge
    prediction[:, :, 40:] += 10_000  # splits
    prediction[rng.random(truth.shape) < 0.05] = 0  # unsegmented voxels
    whole = score_segmentation(prediction, truth)
    blocks = [np.s_[:16, :40, :], np.s_[:16, 40:, :], np.s_[16:, :, :30], np.s_[16:, :, 30:]]
    summed = sum(
        (OverlapCounts.of(truth[b], prediction[b]) for b in blocks[1:]),
        OverlapCounts.of(truth[blocks[0]], prediction[blocks[0]]),
    )
    by_blocks = score_counts(summed).to_dict()
    assert by_blocks == pytest.approx(whole.to_dict(), rel=1e-12, abs=1e-12)
    assert whole.split_objects and whole.merged_segments and whole.unsegmented_fraction > 0.04


def test_a_volume_read_in_slabs_from_its_files_scores_as_in_memory(tmp_path, monkeypatch):
    import h5py
    from test_parts import CUT

    from pipeline.core.roi import Roi
    from pipeline.evaluation.evaluate import evaluate_volume
    from pipeline.evaluation.watershed import WatershedConfig

    with h5py.File(CUT) as f:
        raw, truth = f["volumes/raw"][...], f["volumes/labels/neuron_ids"][...]
    prediction = truth.copy()
    prediction[:, :, 40:] += 10_000  # splits
    prediction[::3, ::2, :] = 0  # holes
    volume = write_volumes(tmp_path / "v.h5", {"raw": raw, "labels": truth}, (10.0, 10.0, 10.0))
    seg = write_volumes(tmp_path / "s.h5", {"segmentation": prediction}, (10.0, 10.0, 10.0))
    part = Roi.parse("4:30, 8:64, 0:60")
    in_memory = score_segmentation(prediction[part.slices], truth[part.slices]).to_dict()
    with h5py.File(volume) as v, h5py.File(seg) as s:
        # Slabs of 2 sections (8,192 voxels): 13 reads of each file.
        slabs = score_counts(count_overlaps(v["labels"], s["segmentation"], part, 8192))
        # Each slab read counted a section (56 x 60 voxels) at a time.
        monkeypatch.setattr(metrics, "_COUNT_VOXELS", 56 * 60)
        sections = score_counts(count_overlaps(v["labels"], s["segmentation"], part, 8192))
    assert slabs.to_dict() == pytest.approx(in_memory, rel=1e-12, abs=1e-12)
    assert sections.to_dict() == pytest.approx(in_memory, rel=1e-12, abs=1e-12)
    scored = evaluate_volume(
        f"{volume}:raw", f"{volume}:labels", f"{seg}:segmentation",
        WatershedConfig(enabled=False), tmp_path / "e.json", part,
    )  # fmt: skip
    assert scored["ffn"] == pytest.approx(in_memory, rel=1e-12, abs=1e-12)
    assert "watershed" not in scored  # turned off: a volume too large for one process
    with_watershed = evaluate_volume(f"{volume}:raw", f"{volume}:labels", f"{seg}:segmentation")
    assert with_watershed["watershed"]["voxels"] == with_watershed["ffn"]["voxels"]


def test_counts_of_region_tasks_saved_and_summed_score_as_in_memory(tmp_path):
    import h5py
    from test_parts import CUT

    from pipeline.core.roi import Roi
    from pipeline.evaluation.evaluate import EvaluationConfig, count_region, count_regions

    with h5py.File(CUT) as f:
        truth = f["volumes/labels/neuron_ids"][...]
    prediction = truth.copy()
    prediction[:, 20:, :] += 7  # splits
    prediction[:, :, ::5] = 0  # holes
    volume = write_volumes(tmp_path / "v.h5", {"labels": truth}, (10.0, 10.0, 10.0))
    seg = write_volumes(tmp_path / "s.h5", {"segmentation": prediction}, (10.0, 10.0, 10.0))
    part = Roi.parse("4:30, 8:64, 0:60")  # cuts across the regions
    regions = count_regions(truth.shape, EvaluationConfig(task_voxels=16))
    assert len(regions) == 2 * 4 * 4
    files = []
    for k, region in enumerate(regions):  # as the tasks do: one file each
        files.append(tmp_path / f"{k}.npz")
        count_region(f"{volume}:labels", f"{seg}:segmentation", region, part).save(files[-1])
    summed = OverlapCounts.total([OverlapCounts.load(p) for p in files])
    in_memory = score_segmentation(prediction[part.slices], truth[part.slices]).to_dict()
    assert score_counts(summed).to_dict() == pytest.approx(in_memory, rel=1e-12, abs=1e-12)
    outside = count_region(
        f"{volume}:labels", f"{seg}:segmentation", regions[0], Roi.parse("20:30, 40:60, 40:60")
    )
    assert len(outside.voxels) == 0  # a region apart from the scored part counts nothing
