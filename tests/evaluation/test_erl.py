"""Expected run length (ERL) along ground-truth skeletons (pipeline/evaluation/erl.py), on
hand-made tubes whose ERL is known: the whole tube, the tube cut in two, two tubes merged, and
what is not scored (background, unsegmented voxels); then every evaluation row's ERL."""

import math

import numpy as np
import pytest
from test_inference import hand_made_volume

from pipeline.core.errors import EmptyLabelsError, VolumeShapeError, VoxelSizeError
from pipeline.data.volumes import write_volumes
from pipeline.evaluation import evaluate
from pipeline.evaluation.erl import Skeletons, run_length, run_length_at, skeletons_of
from pipeline.evaluation.scores import OverlapCounts

VOXEL_NM = (20.0, 10.0, 10.0)  # z, y, x: the synthetic volumes' anisotropy
STEP_NM = 10.0  # along x, the tubes' axis: one skeleton edge per voxel


def two_tubes() -> np.ndarray:
    """Ground truth (z, y, x) = (9, 20, 80): tubes 1 and 2, 5 x 5 voxels across, along x from
    one face of the volume to the other, apart in y; 0 around them (membrane, unlabeled)."""
    labels = np.zeros((9, 20, 80), np.uint64)
    labels[2:7, 2:7, :] = 1
    labels[2:7, 12:17, :] = 2
    return labels


# The tubes run from face to face, so kimimaro centres their ends on the faces (fix_borders) and
# each skeleton is the tube's axis: 80 nodes, 79 edges of 10 nm.
TUBE_NM = 79 * STEP_NM


@pytest.fixture(scope="module")
def skeletons() -> Skeletons:
    return skeletons_of(two_tubes(), VOXEL_NM)


def test_each_tube_is_skeletonized_along_its_axis(skeletons):
    record = skeletons.record()
    assert record["bodies"] == 2 and record["nodes"] == 160
    assert record["length_nm"] == pytest.approx(2 * TUBE_NM)
    # The ground truth's own ERL: a random point's run is its whole tube.
    assert record["erl_nm"] == pytest.approx(TUBE_NM)
    assert set(np.unique(skeletons.nodes[:, 2])) == set(range(80))


def test_a_segmentation_equal_to_the_ground_truth_scores_the_tube_length(skeletons):
    scored = run_length(skeletons, two_tubes())
    # Each tube one run: (L^2 + L^2) / 2L = L.
    assert scored.erl_nm == pytest.approx(TUBE_NM)
    assert (scored.merges, scored.splits) == (0, 0)
    relabeled = np.array([0, 70, 9], np.uint64)[two_tubes()]  # the ids do not matter
    assert run_length(skeletons, relabeled) == scored


def test_a_tube_cut_in_two_scores_half_its_length(skeletons):
    cut = two_tubes()
    cut[:, :, 40:] *= 5  # both tubes: x < 40 in segments 1 and 2, the rest in 5 and 10
    scored = run_length(skeletons, cut)
    # Each tube: two runs of 39 edges; the edge across the cut is wrong, a split.
    half = 39 * STEP_NM
    assert scored.erl_nm == pytest.approx(4 * half**2 / (2 * TUBE_NM))
    assert scored.erl_nm == pytest.approx(TUBE_NM / 2, abs=STEP_NM)  # (L/2)^2 * 2 / L = L/2
    assert (scored.merges, scored.splits) == (0, 2)


def test_two_tubes_merged_both_score_zero(skeletons):
    merged = (two_tubes() > 0).astype(np.uint64)
    scored = run_length(skeletons, merged)
    assert (scored.erl_nm, scored.merges, scored.splits) == (0, 1, 0)
    # One section of tube 2 (x = 40) in tube 1's segment merges them too: funlib counts every
    # edge of a merged skeleton as wrong, so both score 0 however little they share.
    touched = two_tubes()
    touched[:, 12:17, 40] = 1
    scored = run_length(skeletons, touched)
    assert (scored.erl_nm, scored.merges) == (0, 1)
    assert scored.splits == 2  # the edges on either side of that node


def test_background_and_unlabelled_voxels_are_not_scored(skeletons):
    # Where the ground truth is 0 the segmentation may hold anything: no skeleton lies there.
    flooded = two_tubes()
    flooded[flooded == 0] = 1  # tube 1's segment fills all the background, up to tube 2
    assert run_length(skeletons, flooded).erl_nm == pytest.approx(TUBE_NM)


def test_unsegmented_voxels_merge_nothing_and_their_edges_are_lost(skeletons):
    holes = two_tubes()
    holes[:, :, 30:50] = 0  # both tubes left unsegmented over 20 voxels
    scored = run_length(skeletons, holes)
    assert (scored.merges, scored.splits) == (0, 0)  # 0 is no segment
    # Each tube keeps 29 + 29 edges in its one segment: a segment left and entered again along a
    # skeleton is one run (funlib's definition): 58 edges, not two runs of 29.
    kept = 58 * STEP_NM
    assert scored.erl_nm == pytest.approx(2 * kept**2 / (2 * TUBE_NM))


def test_erl_from_segment_ids_at_hand_made_nodes():
    # funlib.evaluate's own test case (funlib/tests/test_run_length.py): skeleton 1, two edges of
    # sqrt(2); skeleton 2, one edge of sqrt(2) (voxel size 1 nm).
    nodes = np.array([[0, 0, 0], [1, 1, 0], [0, 1, 1], [1, 1, 1], [0, 0, 1]], np.int64)
    edges = np.array([[0, 1], [1, 2], [3, 4]], np.int64)
    skeletons = Skeletons(
        (2, 2, 2), nodes, np.array([1, 1, 1, 2, 2], np.uint64), edges, np.full(3, math.sqrt(2))
    )
    # One split in each skeleton: skeleton 1 keeps a run of sqrt(2), skeleton 2 none.
    scored = run_length_at(skeletons, np.array([10, 10, 30, 20, 40]))
    assert scored.erl_nm == pytest.approx(2.0 / 3 * 0.5 * math.sqrt(2))
    assert (scored.merges, scored.splits) == (0, 2)
    assert run_length_at(skeletons, np.full(5, 10)).erl_nm == 0  # all in one segment: a merge


def test_bad_input_is_refused(skeletons):
    with pytest.raises(VolumeShapeError, match="differs from ground truth"):
        run_length(skeletons, two_tubes()[:, :, :40])
    with pytest.raises(VolumeShapeError, match="5 segment ids for 160 skeleton nodes"):
        run_length_at(skeletons, np.ones(5))
    with pytest.raises(EmptyLabelsError, match="no labeled voxel"):
        skeletons_of(np.zeros((4, 4, 4), np.uint64), VOXEL_NM)
    with pytest.raises(VolumeShapeError, match="3-D"):
        skeletons_of(np.ones((4, 4), np.uint64), VOXEL_NM)
    with pytest.raises(VoxelSizeError, match="3 positive numbers"):
        skeletons_of(two_tubes(), (10.0, 0.0, 10.0))


def test_every_evaluation_row_has_its_erl_from_skeletons_made_once(tmp_path, monkeypatch):
    raw, labels = hand_made_volume()  # three boxes, which the watershed baseline finds exactly
    volume = write_volumes(tmp_path / "v.h5", {"raw": raw, "labels": labels}, VOXEL_NM)
    first_pass = labels.copy()
    first_pass[labels == 1] = 0  # box 1 left unsegmented: its run length lost
    segmentations = {}
    for key, segmentation in {"ffn": labels, "ffn_first_pass": first_pass}.items():
        path = write_volumes(tmp_path / f"{key}.h5", {"segmentation": segmentation}, VOXEL_NM)
        segmentations[key] = f"{path}:segmentation"
    made = []
    monkeypatch.setattr(
        evaluate, "skeletons_of", lambda *args: made.append(args) or skeletons_of(*args)
    )
    result = evaluate.score_volume(
        OverlapCounts.of(labels, labels), f"{volume}:raw", f"{volume}:labels",
        also={"ffn_first_pass": OverlapCounts.of(labels, first_pass)},
        segmentations=segmentations,
    )  # fmt: skip
    assert len(made) == 1  # one set of skeletons for every row
    best = result["skeletons"]["erl_nm"]
    assert best > 0 and result["erl_seconds"] >= 0
    assert result["ffn"]["erl_nm"] == pytest.approx(best)
    assert result["watershed"]["erl_nm"] == pytest.approx(best)
    assert 0 < result["ffn_first_pass"]["erl_nm"] < best
    for row in ("ffn", "ffn_first_pass", "watershed"):
        assert result[row]["erl_merges"] == result[row]["erl_splits"] == 0
