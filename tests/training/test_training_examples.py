"""How training FOVs are made: soft labels, the initial seed, the movement policy, data order."""

import numpy as np
import pytest

from pipeline.core.errors import CoordinatesError
from pipeline.data.volumes import LabeledVolume
from pipeline.network.model import ModelConfig, logit
from pipeline.network.movement import scored_move_offsets
from pipeline.training.examples import BatchStream, ExampleConfig, Trajectory, canvas_radius

MODEL = ModelConfig(fov_shape_zyx=(5, 9, 9), deltas_zyx=(1, 2, 2), depth=2, features=4)


def two_slabs(shape=(21, 31, 31)) -> LabeledVolume:
    """Object 1 fills x < 20, object 2 the rest; the image is brighter in object 1."""
    labels = np.ones(shape, np.uint64)
    labels[:, :, 20:] = 2
    raw = np.where(labels == 1, 200, 60).astype(np.uint8)
    return LabeledVolume("slabs", raw, labels, (20.0, 10.0, 10.0))


class TestMovement:
    def test_moves_toward_the_face_above_threshold_at_its_best_voxel(self):
        logits = np.full((5, 9, 9), -5.0)
        logits[2, 5, 6] = 3.0  # on the +x face (x = 4 + 2), one voxel above centre in y
        moves = scored_move_offsets(logits, (1, 2, 2), threshold_logit=logit(0.9))
        assert moves == [(3.0, (0, 1, 2))]

    def test_nothing_above_threshold_means_no_move(self):
        assert scored_move_offsets(np.zeros((5, 9, 9)), (1, 2, 2), logit(0.9)) == []

    def test_best_face_first(self):
        logits = np.full((5, 9, 9), -5.0)
        logits[2, 4, 2] = 4.0  # -x face
        logits[3, 4, 4] = 2.5  # +z face
        assert [m for _, m in scored_move_offsets(logits, (1, 2, 2), logit(0.9))] == [
            (0, 0, -2),
            (1, 0, 0),
        ]


class TestTrajectory:
    def test_first_fov_has_soft_labels_and_a_centred_seed(self):
        volume = two_slabs()
        examples = ExampleConfig(fov_policy="fixed", augment=False)
        fovs = list(
            Trajectory(volume, np.array([10, 15, 15]), MODEL, examples, np.random.default_rng(0))
        )
        assert len(fovs) == 1  # the fixed policy never moves
        fov = fovs[0]
        assert fov.image.shape == fov.seed.shape == fov.labels.shape == (5, 9, 9)
        # x 11..19 lie in object 1 (the centre's): label 0.95; none of this FOV reaches x = 20.
        np.testing.assert_allclose(fov.labels, 0.95)
        assert fov.seed[2, 4, 4] == pytest.approx(logit(0.95))
        assert np.count_nonzero(fov.seed == np.float32(logit(0.05))) == fov.seed.size - 1
        np.testing.assert_allclose(fov.image, (200 - 128) / 33, rtol=1e-6)

    def test_max_pred_moves_follows_the_fed_back_prediction_and_stays_in_the_canvas(self):
        """A perfect predictor (high inside the object, peaked at the FOV centre so each face's best
        voxel is its middle) walks the object, each position once."""
        volume = two_slabs()
        examples = ExampleConfig(fov_moves=1, augment=False)
        peak = -0.1 * sum(np.abs(np.indices((5, 9, 9)) - np.array([2, 4, 4])[:, None, None, None]))
        centres = []
        for fov in Trajectory(
            volume, np.array([10, 15, 18]), MODEL, examples, np.random.default_rng(0)
        ):
            fov.seed[...] = np.where(fov.labels > 0.5, 5.0 + peak, -5.0)
            centres.append(fov.offset_zyx)
        # Moves of +-1 in z and +-2 in y stay in object 1; +x from x = 18 reaches x = 20 (object 2),
        # so x takes offsets 0 and -2 only: 3 * 3 * 2 = 18 distinct FOVs within the canvas.
        expected = {(z, y, x) for z in (-1, 0, 1) for y in (-2, 0, 2) for x in (-2, 0)}
        assert len(centres) == 18 and set(centres) == expected
        assert canvas_radius(MODEL, examples).tolist() == [3, 6, 6]

    def test_coordinates_too_close_to_the_border_are_refused(self):
        volume = two_slabs()
        with pytest.raises(CoordinatesError, match="1 of 2 coordinates are closer than"):
            BatchStream(
                volume, np.array([[10, 15, 15], [2, 15, 15]]), MODEL, ExampleConfig(), 2, seed=0
            )


class TestBatchStream:
    def stream(self, seed=0, start=0):
        coords = np.array([[10, 12, 12], [10, 15, 15], [10, 18, 22], [9, 16, 24]])
        return BatchStream(
            two_slabs(), coords, MODEL, ExampleConfig(), 3, seed=seed, examples_started=start
        )

    def test_batches_have_the_network_shape(self):
        images, seeds, labels = self.stream().next_batch()
        assert images.shape == seeds.shape == labels.shape == (3, 5, 9, 9, 1)
        assert images.dtype == np.float32

    def test_same_seed_same_batches_other_seed_other_batches(self):
        a, b, c = self.stream(0), self.stream(0), self.stream(1)
        for _ in range(4):
            batch_a, batch_b, batch_c = a.next_batch(), b.next_batch(), c.next_batch()
            for x, y in zip(batch_a, batch_b, strict=True):
                np.testing.assert_array_equal(x, y)
            a.write_back(batch_a[1])
            b.write_back(batch_b[1])
            c.write_back(batch_c[1])
        assert any(not np.array_equal(x, y) for x, y in zip(batch_a, batch_c, strict=True))

    def test_write_back_reaches_the_trajectorys_seed(self):
        stream = self.stream()
        _, seeds, _ = stream.next_batch()
        stream.write_back(np.full_like(seeds, 7.0))
        assert all(np.all(fov.seed == 7.0) for fov in stream._current)

    def test_a_stream_built_from_its_state_hands_out_what_the_saved_one_would(self):
        """What a resumed training relies on: the examples in flight go on where they were."""
        moving = np.full((3, 5, 9, 9, 1), 5.0, np.float32)  # every move's target looks inside
        original = self.stream()
        for _ in range(2):
            original.next_batch()
            original.write_back(moving)
        saved = original.state()
        coords = original.coords
        resumed = BatchStream(two_slabs(), coords, MODEL, ExampleConfig(), 3, seed=0, state=saved)
        for _ in range(3):
            for x, y in zip(original.next_batch(), resumed.next_batch(), strict=True):
                np.testing.assert_array_equal(x, y)
            original.write_back(moving)
            resumed.write_back(moving)
        # Another batch size cannot take the walks: it starts new examples at the cursor.
        other = BatchStream(two_slabs(), coords, MODEL, ExampleConfig(), 2, seed=0, state=saved)
        assert other.examples_started == 3 + 2 and len(other.next_batch()[0]) == 2
