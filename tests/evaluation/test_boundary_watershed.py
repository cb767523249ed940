"""The real-EM baseline: a random-forest boundary map learned on one part of the FlyEM cut,
a watershed tuned on a second, applied to a third (tests/fixtures/README.md)."""

import h5py
import numpy as np
import pytest
from test_parts import CUT

from pipeline.core.errors import BoundaryForestError, ConfigError, EmptyLabelsError
from pipeline.evaluation.learned_watershed import (
    BoundaryForestConfig,
    WatershedParams,
    boundary_probability,
    boundary_targets,
    box_boundary_probability,
    feature_margin,
    train_boundary_forest,
    tune_watershed,
    watershed_segmentation,
)
from pipeline.evaluation.scores import score_segmentation

SMALL = BoundaryForestConfig(sigma_max=4.0, num_sigma=3, samples_per_class=3000, trees=16)


@pytest.fixture(scope="module")
def parts():
    with h5py.File(CUT) as f:
        raw, labels = f["volumes/raw"][...], f["volumes/labels/neuron_ids"][...]
    # train: x < 32; select: y < 32, x >= 32; eval: y >= 32, x >= 32
    return (
        (raw[:, :, :32], labels[:, :, :32]),
        (raw[:, :32, 32:], labels[:, :32, 32:]),
        (raw[:, 32:, 32:], labels[:, 32:, 32:]),
    )


def test_the_forest_finds_boundaries_in_a_part_it_did_not_learn_from(parts):
    (train_raw, train_labels), _, (eval_raw, eval_labels) = parts
    forest = train_boundary_forest(train_raw, train_labels, SMALL)
    probability = boundary_probability(forest, eval_raw, SMALL)
    assert probability.shape == eval_raw.shape and probability.dtype == np.float32
    boundary = boundary_targets(eval_labels)
    # Real membranes, unseen: far more boundary-like than the bodies' insides.
    assert probability[boundary].mean() > probability[~boundary].mean() + 0.3


def test_a_box_of_the_map_from_the_box_and_its_margin_is_that_of_the_whole_map(parts):
    """As the fill's relabel tasks predict it, part by part: a box inside the volume (its margin
    too) and one at a corner, each from the image within `feature_margin` of it."""
    (train_raw, train_labels), _, (eval_raw, _) = parts
    narrow = BoundaryForestConfig(sigma_max=2.0, num_sigma=2, samples_per_class=3000, trees=8)
    forest = train_boundary_forest(train_raw, train_labels, narrow)
    whole = boundary_probability(forest, eval_raw, narrow)
    margin = feature_margin(narrow)
    read = []

    def reader(box):
        read.append(box)
        return eval_raw[box]

    inside, corner = np.s_[14:18, 13:19, 12:20], np.s_[0:8, 24:32, 0:6]
    for box in (inside, corner):
        part = box_boundary_probability(forest, reader, box, eval_raw.shape, narrow)
        np.testing.assert_allclose(part, whole[box], atol=1e-6)
    grown = read[0]
    assert [(g.start, g.stop) for g in grown] == [
        (s.start - margin, s.stop + margin) for s in inside
    ]
    assert all(0 < g.start and g.stop < n for g, n in zip(grown, eval_raw.shape, strict=True))


def test_the_watershed_tuned_on_one_part_beats_untuned_settings_on_another(parts):
    (train_raw, train_labels), (select_raw, select_labels), (eval_raw, eval_labels) = parts
    forest = train_boundary_forest(train_raw, train_labels, SMALL)
    grid = {
        "smoothing_sigma": (0.0, 1.0),
        "marker_threshold": (0.05, 0.3, 0.7),
        "min_marker_voxels": (20,),
    }
    params, trials = tune_watershed(
        boundary_probability(forest, select_raw, SMALL), select_labels, grid
    )
    assert len(trials) == 6 and min(t["vi"] for t in trials) == next(
        t["vi"] for t in trials if WatershedParams(**{k: t[k] for k in grid}) == params
    )
    probability = boundary_probability(forest, eval_raw, SMALL)
    segmentation = watershed_segmentation(probability, params)
    assert segmentation.min() >= 1  # every voxel assigned
    tuned = score_segmentation(segmentation, eval_labels).vi
    worst = max(trials, key=lambda t: t["vi"])
    untuned = WatershedParams(**{k: worst[k] for k in grid})
    assert tuned < score_segmentation(watershed_segmentation(probability, untuned), eval_labels).vi


def test_bad_training_input_is_one_clear_error(parts):
    (raw, labels), _, _ = parts
    with pytest.raises(EmptyLabelsError, match="all 0"):
        train_boundary_forest(raw, np.zeros_like(labels), SMALL)
    with pytest.raises(ConfigError, match="differ in shape"):
        train_boundary_forest(raw, labels[:, :, :-1], SMALL)
    with pytest.raises(ConfigError, match="marker_threshold"):
        WatershedParams(marker_threshold=1.5)


def test_a_forest_another_run_learned_is_checked_then_copied(parts, tmp_path):
    """`boundary_forest` in a run's config: the file is copied in once it loads as a boundary
    forest; a missing, truncated or foreign file is one clear error and nothing is copied."""
    import joblib

    from pipeline.evaluation.evaluate import copy_boundary_forest

    (train_raw, train_labels), _, _ = parts
    cheap = BoundaryForestConfig(samples_per_class=2000, trees=4)  # the default features
    source = tmp_path / "forest.joblib"
    joblib.dump(train_boundary_forest(train_raw, train_labels, cheap), source)
    copy = tmp_path / "run" / "boundary_forest.joblib"
    copy.parent.mkdir()
    copy_boundary_forest(source, copy)
    assert copy.read_bytes() == source.read_bytes()

    truncated, foreign, other_features = (
        tmp_path / f"{n}.joblib" for n in ("cut", "dict", "small")
    )
    truncated.write_bytes(source.read_bytes()[: source.stat().st_size // 2])
    joblib.dump({"trees": 4}, foreign)
    joblib.dump(train_boundary_forest(train_raw, train_labels, SMALL), other_features)
    refused = {
        tmp_path / "none.joblib": "no such file",
        truncated: "not readable as a forest",
        foreign: "a dict, not a random forest",
        other_features: "a forest of 15 features .* a boundary forest has 25",
    }
    for path, message in refused.items():
        into = tmp_path / "run" / f"from_{path.stem}.joblib"
        with pytest.raises(BoundaryForestError, match=f"{path}: {message}"):
            copy_boundary_forest(path, into)
        assert not into.exists()
