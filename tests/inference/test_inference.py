"""Flood-filling inference: exact on a hand-made volume with a stand-in network, its guards, its
errors, the Keras predictor and the command line.

The helpers at the top (hand-made volume, stand-in predictor, hand-made checkpoints) are shared
with test_blocks.py and test_selection.py.
"""

import dataclasses
import json

import h5py
import numpy as np
import pytest

from pipeline.cli.infer import main
from pipeline.core import config_io
from pipeline.core.errors import (
    CheckpointError,
    ConfigError,
    InferenceError,
    VolumeDtypeError,
    VolumeShapeError,
)
from pipeline.data.volumes import write_volumes
from pipeline.inference.flood_fill import (
    InferenceConfig,
    edge_distance,
    inference_model,
    make_model_predictor,
    predictor_from_checkpoint,
    seed_peaks,
    segment,
)
from pipeline.network.model import ModelConfig, build_model, logit
from pipeline.training.train_config import TrainConfig

# A small network shape for the hand-made volume: FOV 5, 9, 9 moving by 2, 4, 4.
MODEL = ModelConfig(fov_shape_zyx=(5, 9, 9), deltas_zyx=(2, 4, 4), depth=1, features=2)
MEMBRANE_GREY = 20
OBJECT_GREYS = (150, 180, 210)
CONFIG = InferenceConfig(min_segment_size=50)


def hand_made_volume() -> tuple[np.ndarray, np.ndarray]:
    """(raw, labels) of shape (16, 40, 40): three boxes of distinct grey levels, separated by
    one-voxel dark membranes (label 0). Object 1 is x < 18, objects 2 and 3 share x > 18 and
    are split at y = 20."""
    labels = np.zeros((16, 40, 40), np.uint64)
    labels[:, :, :18] = 1
    labels[:, :20, 19:] = 2
    labels[:, 21:, 19:] = 3
    greys = np.array([MEMBRANE_GREY, *OBJECT_GREYS], np.uint8)
    return greys[labels], labels


def stand_in_predictor(images: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """A perfect network: large logits on the object under the seed, small ones elsewhere.

    The object is the grey level of most voxels the seed already marks as object (p > 0.5);
    membranes are never an object. Logits fall off slightly from the FOV's centre, as a real
    network's confidence does, so an evenly filled face moves the FOV straight.
    """
    centre = np.array(images.shape[1:4]) // 2
    offsets = np.indices(images.shape[1:4]) - centre.reshape(3, 1, 1, 1)
    confidence = (5.0 - 0.01 * np.abs(offsets).sum(axis=0))[..., None].astype(np.float32)
    membrane = (MEMBRANE_GREY - MODEL.image_mean) / MODEL.image_stddev
    logits = np.full(images.shape, -5.0, np.float32)
    for out, image, seed in zip(logits, images, seeds, strict=True):
        values, counts = np.unique(image[seed > 0], return_counts=True)
        if len(values) and not np.isclose(values[np.argmax(counts)], membrane):
            inside = image == values[np.argmax(counts)]
            out[inside] = confidence[inside]
    return logits


def assert_same_segmentation(segmentation: np.ndarray, labels: np.ndarray) -> None:
    """Equal up to a permutation of the non-zero ids: one-to-one overlap, same zeros."""
    np.testing.assert_array_equal(segmentation == 0, labels == 0)
    pairs = np.unique(np.stack([segmentation.ravel(), labels.ravel()]), axis=1)
    assert len(pairs[0]) == len(np.unique(pairs[0])) == len(np.unique(pairs[1])), pairs


def bright_weights(model) -> None:
    """Weights of a depth-1 network that marks bright voxels as object: logits = seed +
    20 * relu(image) - 10. On the hand-made volume that is the true mask wherever a FOV shows
    only one object, a clearly better network than an untrained one."""
    for layer in model.layers:
        if layer.weights:
            layer.set_weights([np.zeros_like(w) for w in layer.get_weights()])
    a, b, lom = (model.get_layer(n) for n in ("conv0_a", "conv0_b", "conv_lom"))
    kernel, bias = a.get_weights()
    kernel[1, 1, 1, 0, 0] = 1.0  # feature 0 = relu(image) ...
    a.set_weights([kernel, bias])
    kernel, bias = b.get_weights()
    kernel[1, 1, 1, 0, 0] = 1.0  # ... passed through
    b.set_weights([kernel, bias])
    lom.set_weights([np.full((1, 1, 1, MODEL.features, 1), 20.0), np.array([-10.0])])


def make_checkpoint(train_dir, step: int, weights=None, model: ModelConfig = MODEL) -> str:
    """Write TRAIN_DIR/checkpoints/ckpt-STEP (and the run's config.json) as training does;
    `weights(model)` sets the weights, None leaves the untrained initialisation."""
    import tensorflow as tf

    network = build_model(model)
    if weights is not None:
        weights(network)
    train_dir.mkdir(parents=True, exist_ok=True)
    (train_dir / "config.json").write_text(
        json.dumps({"config": config_io.to_dict(TrainConfig(model=model))})
    )
    manager = tf.train.CheckpointManager(
        tf.train.Checkpoint(model=network), str(train_dir / "checkpoints"), max_to_keep=None
    )
    return manager.save(checkpoint_number=step)


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        CONFIG,
        dataclasses.replace(CONFIG, batch_size=4),
        dataclasses.replace(CONFIG, consistency_check=True),
        dataclasses.replace(CONFIG, move_threshold=CONFIG.seed_probability),
    ],
    ids=["fov-by-fov", "batched", "consistency-check", "move-threshold-at-seed"],
)
def test_perfect_network_segments_the_hand_made_volume_exactly(config):
    raw, labels = hand_made_volume()
    segmentation, stats = segment(raw, stand_in_predictor, MODEL, config)
    assert segmentation.dtype == np.uint64
    assert_same_segmentation(segmentation, labels)
    assert stats.objects == 3 and stats.segmented_voxels == np.count_nonzero(labels)
    assert stats.fov_evaluations > 0 and stats.seconds > 0 and stats.voxels == raw.size
    assert json.loads(json.dumps(stats.to_dict()))["objects"] == 3
    if config.batch_size > 1:
        assert stats.batches < stats.fov_evaluations  # some FOVs did share a call


def test_long_moves_where_the_network_is_sure_make_the_same_objects_from_fewer_fovs():
    raw, labels = hand_made_volume()
    short_steps = dataclasses.replace(MODEL, deltas_zyx=(1, 2, 2))  # half MODEL's
    ffn, ffn_stats = segment(raw, stand_in_predictor, short_steps, CONFIG)
    # The stand-in is about 0.993 sure inside objects: long moves (MODEL's steps again) at 0.99,
    # none at 0.999 (FFN's moves alone, FOV for FOV).
    long = dataclasses.replace(CONFIG, move_step_scale=2.0, long_move_threshold=0.99)
    far, far_stats = segment(raw, stand_in_predictor, short_steps, long)
    unsure = dataclasses.replace(long, long_move_threshold=0.999)
    near, near_stats = segment(raw, stand_in_predictor, short_steps, unsure)
    for segmentation in (ffn, far, near):
        assert_same_segmentation(segmentation, labels)
    assert far_stats.fov_evaluations < 0.7 * ffn_stats.fov_evaluations
    assert near_stats.fov_evaluations == ffn_stats.fov_evaluations
    with pytest.raises(ConfigError, match="past its radius"):
        segment(raw, stand_in_predictor, MODEL, long)  # MODEL's deltas are its radius


def test_fovs_the_flood_has_already_seen_take_their_moves_from_its_predictions():
    raw, labels = hand_made_volume()
    short_steps = dataclasses.replace(MODEL, deltas_zyx=(1, 2, 2))  # FOVs overlap heavily
    ffn, ffn_stats = segment(raw, stand_in_predictor, short_steps, CONFIG)
    seen = dataclasses.replace(CONFIG, min_unseen_share=0.02)
    fewer, stats = segment(raw, stand_in_predictor, short_steps, seen)
    assert_same_segmentation(ffn, labels)
    # The same objects, but for the few voxels that only the FOVs not evaluated would have seen.
    assert stats.objects == 3
    assert_no_merges(fewer, labels)
    assert 0 < np.count_nonzero((fewer == 0) != (labels == 0)) < 1e-3 * labels.size
    assert ffn_stats.fovs_seen_enough == 0 and stats.fovs_seen_enough > 0
    assert stats.fov_evaluations < 0.5 * ffn_stats.fov_evaluations


def test_seeds_are_inside_objects_and_innermost_first():
    raw, labels = hand_made_volume()
    seeds = seed_peaks(raw, CONFIG, (2, 4, 4))
    assert set(labels[tuple(seeds.T)]) == {1, 2, 3}  # every object, never a membrane
    assert np.all(seeds >= (2, 4, 4)) and np.all(seeds < np.array(raw.shape) - (2, 4, 4))
    distance = edge_distance(raw, CONFIG)[tuple(seeds.T)]
    assert np.all(np.diff(distance) <= 1e-3)  # tie-breaking noise is below 1e-3
    np.testing.assert_array_equal(seed_peaks(raw, CONFIG, (2, 4, 4)), seeds)


def test_seeds_in_raster_order_are_the_same_seeds_z_then_y_then_x():
    """A consensus's second pass seeds in the other order (`seed_order`)."""
    raw, _ = hand_made_volume()
    innermost = seed_peaks(raw, CONFIG, (2, 4, 4))
    raster = seed_peaks(raw, dataclasses.replace(CONFIG, seed_order="raster"), (2, 4, 4))
    assert sorted(map(tuple, raster)) == sorted(map(tuple, innermost)) == list(map(tuple, raster))
    assert raster.tolist() != innermost.tolist()
    with pytest.raises(ConfigError, match="seed_order"):
        dataclasses.replace(CONFIG, seed_order="random")


def assert_no_merges(segmentation: np.ndarray, labels: np.ndarray) -> None:
    for k in np.unique(segmentation[segmentation > 0]):
        assert len(np.unique(labels[segmentation == k])) == 1, f"segment {k} merges objects"


def test_later_seed_passes_fill_what_the_first_left():
    """Floods cut short after one FOV leave most of each object unsegmented; later passes seed
    the peaks of what is left (segmented voxels count as edges) until a pass adds nothing."""
    raw, labels = hand_made_volume()
    short = dataclasses.replace(CONFIG, max_fov_evaluations_per_object=1)
    one, first = segment(raw, stand_in_predictor, MODEL, dataclasses.replace(short, seed_passes=1))
    many, stats = segment(
        raw, stand_in_predictor, MODEL, dataclasses.replace(short, seed_passes=50)
    )
    assert first.seed_passes == 1 and 1 < stats.seed_passes < 50
    assert stats.seeds > first.seeds and stats.objects > first.objects
    assert np.count_nonzero(many) > 2 * np.count_nonzero(one)
    np.testing.assert_array_equal(many[one > 0], one[one > 0])  # the first pass's objects stay
    assert_no_merges(many, labels)


class JobStopped(Exception):
    """Stands in for a batch job reaching its wall time in the middle of an object."""


def test_an_interrupted_segmentation_resumes_from_its_checkpoint_to_the_same_result(tmp_path):
    raw, labels = hand_made_volume()
    config = dataclasses.replace(CONFIG, max_fov_evaluations_per_object=1, seed_passes=50)
    whole, whole_stats = segment(raw, stand_in_predictor, MODEL, config)
    state = tmp_path / "inference-state.npz"
    calls = []

    def stopped_after_40_fovs(images, seeds):
        calls.append(len(images))
        if len(calls) > 40:
            raise JobStopped
        return stand_in_predictor(images, seeds)

    with pytest.raises(JobStopped):  # the fault happened ...
        segment(
            raw, stopped_after_40_fovs, MODEL, config, checkpoint_path=state, checkpoint_every_s=0
        )
    with np.load(state) as saved:  # ... after some objects, long before the end
        assert 0 < np.count_nonzero(saved["segmentation"]) < np.count_nonzero(whole)
    resumed, stats = segment(raw, stand_in_predictor, MODEL, config, checkpoint_path=state)
    np.testing.assert_array_equal(resumed, whole)
    assert stats.objects == whole_stats.objects and stats.seed_passes == whole_stats.seed_passes
    # The FOVs of the object cut short are evaluated again; the finished ones are not.
    assert whole_stats.fov_evaluations <= stats.fov_evaluations <= whole_stats.fov_evaluations + 1
    assert not state.exists()  # removed once the segmentation is complete


def test_a_checkpoint_of_other_inputs_or_a_damaged_one_is_refused(tmp_path):
    raw, _ = hand_made_volume()
    state = tmp_path / "inference-state.npz"

    def stop(images, seeds):
        raise JobStopped

    with pytest.raises(JobStopped):
        segment(raw, stop, MODEL, CONFIG, checkpoint_path=state, checkpoint_every_s=0)
    assert not state.exists()  # no object was finished: nothing to save yet
    short = dataclasses.replace(CONFIG, max_fov_evaluations_per_object=1)
    calls = []

    def stop_after_one(images, seeds):
        calls.append(1)
        if len(calls) > 1:
            raise JobStopped
        return stand_in_predictor(images, seeds)

    with pytest.raises(JobStopped):
        segment(raw, stop_after_one, MODEL, short, checkpoint_path=state, checkpoint_every_s=0)
    assert state.exists()
    with pytest.raises(CheckpointError, match="another volume or other settings"):
        segment(raw, stand_in_predictor, MODEL, CONFIG, checkpoint_path=state)
    with pytest.raises(CheckpointError, match="another volume or other settings"):
        segment(raw[:, ::-1].copy(), stand_in_predictor, MODEL, short, checkpoint_path=state)
    with pytest.raises(CheckpointError, match="another volume or other settings"):
        segment(
            raw, stand_in_predictor, MODEL, short, checkpoint_path=state, checkpoint_key="ckpt-2"
        )
    state.write_bytes(state.read_bytes()[:100])  # truncated, as by a full disk
    with pytest.raises(CheckpointError, match="unreadable inference checkpoint"):
        segment(raw, stand_in_predictor, MODEL, short, checkpoint_path=state)


def shell_blind_predictor(images: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """The stand-in network, wrong on the FOV's outermost voxels where nothing was predicted yet
    (it calls them background), as a briefly trained network is unsure at the faces of new
    ground."""
    logits = stand_in_predictor(images, seeds)
    shell = np.zeros(images.shape, bool)
    for axis in (1, 2, 3):
        edge = [slice(None)] * 5
        edge[axis] = [0, -1]
        shell[tuple(edge)] = True
    unseen = np.isclose(seeds, logit(CONFIG.pad_probability))
    logits[shell & unseen] = -5.0
    return logits


def test_keep_background_locks_in_what_a_fov_face_got_wrong():
    raw, labels = hand_made_volume()
    model = dataclasses.replace(MODEL, deltas_zyx=(1, 2, 2))  # neighbours see the faces inside
    kept, _ = segment(raw, shell_blind_predictor, model, CONFIG)  # FFN's rule
    free, _ = segment(
        raw, shell_blind_predictor, model, dataclasses.replace(CONFIG, keep_background=False)
    )
    # With the rule, every FOV face predicted stays a hole; without it the next FOV fills it.
    assert np.count_nonzero(kept) < 0.7 * np.count_nonzero(labels)
    assert np.count_nonzero(free) > 0.9 * np.count_nonzero(labels)
    assert_no_merges(kept, labels)
    assert_no_merges(free, labels)


def test_objects_below_the_minimum_size_are_dropped():
    raw, labels = hand_made_volume()
    smallest = min(np.count_nonzero(labels == k) for k in (1, 2, 3))
    config = dataclasses.replace(CONFIG, min_segment_size=smallest + 1)
    segmentation, stats = segment(raw, stand_in_predictor, MODEL, config)
    assert stats.objects == 2 and stats.objects_too_small >= 1
    assert not np.any(segmentation[labels == 3])  # object 3 is the smallest


def test_runaway_objects_stop_at_the_fov_budget():
    raw, _ = hand_made_volume()
    config = dataclasses.replace(
        CONFIG, max_fov_evaluations_per_object=2, min_segment_size=1, seed_passes=1
    )
    _, stats = segment(raw, stand_in_predictor, MODEL, config)
    assert stats.objects_truncated == stats.objects > 0
    assert stats.fov_evaluations <= 2 * stats.seeds_tried


def test_a_seed_the_network_rejects_makes_no_object():
    raw, _ = hand_made_volume()
    segmentation, stats = segment(raw, lambda i, s: np.full(i.shape, -5.0, np.float32), MODEL)
    assert not segmentation.any() and stats.objects == 0
    assert stats.seeds_too_weak == stats.seeds_tried == stats.fov_evaluations > 0


@pytest.mark.parametrize(
    "predict, message",
    [
        (lambda i, s: i[:, :-1], "predictor returned shape"),
        (lambda i, s: np.full(i.shape, np.nan, np.float32), "NaN or infinite"),
    ],
)
def test_a_broken_predictor_is_named(predict, message):
    raw, _ = hand_made_volume()
    with pytest.raises(InferenceError, match=message):
        segment(raw, predict, MODEL, CONFIG)


@pytest.mark.parametrize(
    "raw, error",
    [
        (np.zeros((16, 40, 40), np.float32), VolumeDtypeError),
        (np.zeros((40, 40), np.uint8), VolumeShapeError),
        (np.zeros((4, 40, 40), np.uint8), VolumeShapeError),  # thinner than the FOV
    ],
)
def test_bad_images_are_refused(raw, error):
    with pytest.raises(error):
        segment(raw, stand_in_predictor, MODEL, CONFIG)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"move_threshold": 1.2}, "move_threshold must be in"),
        ({"move_threshold": 0.97}, "above seed_probability"),
        ({"pad_probability": 0.99}, "pad_probability < seed_probability"),
        ({"batch_size": 0}, "batch_size must be >= 1"),
        ({"seed_passes": 0}, "seed_passes must be >= 1"),
        ({"move_step_scale": 0.5}, "move_step_scale must be >= 1"),
        ({"long_move_threshold": 0.8}, "long_move_threshold below move_threshold"),
        ({"min_boundary_distance_zyx": (1, -1, 1)}, "min_boundary_distance_zyx"),
    ],
)
def test_bad_inference_settings_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        InferenceConfig(**kwargs)


def test_the_keras_predictor_is_the_model_in_inference_mode():
    network = build_model(MODEL)
    predict = make_model_predictor(network)
    rng = np.random.default_rng(0)
    images, seeds = (rng.normal(size=(3, 5, 9, 9, 1)).astype(np.float32) for _ in range(2))
    expected = network([images, seeds], training=False).numpy()
    np.testing.assert_allclose(predict(images, seeds), expected, rtol=1e-5, atol=1e-6)
    assert predict(images[:1], seeds[:1]).shape == (1, 5, 9, 9, 1)  # any batch size


def test_a_checkpoint_runs_in_bfloat16_too(tmp_path):
    checkpoint = make_checkpoint(tmp_path, 7, bright_weights)
    raw, _ = hand_made_volume()
    images = ((raw[None, :5, :9, :9, None] - 128.0) / 33.0).astype(np.float32)
    seeds = np.zeros_like(images)
    fp32 = predictor_from_checkpoint(checkpoint)(images, seeds)
    bf16 = predictor_from_checkpoint(
        checkpoint, dataclasses.replace(MODEL, precision="mixed_bfloat16")
    )
    assert bf16(images, seeds).dtype == np.float32
    np.testing.assert_allclose(bf16(images, seeds), fp32, rtol=0.05, atol=0.3)


@pytest.mark.parametrize(
    "flags, asked, expected",
    [
        ({"avx512_bf16"}, "auto", "mixed_bfloat16"),
        ({"avx2"}, "auto", "float32"),
        ({"amx_bf16"}, "model", "float32"),
        (set(), "mixed_bfloat16", "mixed_bfloat16"),
    ],
)
def test_inference_runs_the_checkpoint_in_the_precision_this_cpu_takes(
    tmp_path, monkeypatch, flags, asked, expected
):
    import pipeline.network.model

    checkpoint = make_checkpoint(tmp_path, 7, bright_weights)
    monkeypatch.setattr(pipeline.network.model, "cpu_flags", lambda: frozenset(flags))
    model = inference_model(checkpoint, InferenceConfig(precision=asked))
    assert model == dataclasses.replace(MODEL, precision=expected)


def test_a_missing_checkpoint_is_named(tmp_path):
    make_checkpoint(tmp_path, 1)
    with pytest.raises(CheckpointError, match="ckpt-2: no such checkpoint"):
        predictor_from_checkpoint(tmp_path / "checkpoints" / "ckpt-2")
    with pytest.raises(CheckpointError, match="no training config"):
        predictor_from_checkpoint(tmp_path / "elsewhere" / "checkpoints" / "ckpt-1")


def test_command_line_segments_whole_and_in_blocks(tmp_path, capsys):
    checkpoint = make_checkpoint(tmp_path, 3, bright_weights)
    raw, _ = hand_made_volume()
    volume = write_volumes(tmp_path / "vol.h5", {"raw": raw}, (20.0, 10.0, 10.0))
    common = ["--raw", f"{volume}:raw", "--checkpoint", checkpoint, "--min-segment-size", "10"]
    assert main([*common, "--output", str(tmp_path / "whole.h5")]) == 0
    blocked = ["--block-shape-zyx", "16", "24", "24", "--overlap-zyx", "0", "8", "8"]
    assert main([*common, "--output", str(tmp_path / "blocks.h5"), *blocked]) == 0
    assert "objects from" in capsys.readouterr().out
    for name in ("whole", "blocks"):
        with h5py.File(tmp_path / f"{name}.h5") as f:
            segmentation = f["segmentation"][...]
            assert segmentation.shape == raw.shape and segmentation.any()
            assert json.loads(f.attrs["inference_config"])["min_segment_size"] == 10
            assert f.attrs["checkpoint"] == checkpoint
    assert len(list((tmp_path / "blocks.h5.blocks").glob("block_*.npz"))) == 4


def test_command_line_errors_are_one_line(tmp_path, capsys):
    raw, _ = hand_made_volume()
    volume = write_volumes(tmp_path / "vol.h5", {"raw": raw}, (20.0, 10.0, 10.0))
    code = main(
        [
            "--raw",
            f"{volume}:raw",
            "--checkpoint",
            str(tmp_path / "nothing" / "checkpoints" / "ckpt-1"),
            "--output",
            str(tmp_path / "s.h5"),
        ]
    )
    assert code == 2
    assert capsys.readouterr().err.strip().startswith("error: ")
    assert not (tmp_path / "s.h5").exists()
