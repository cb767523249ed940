"""The FFN network: its size, its additive seed update, its config checks."""

import numpy as np
import pytest

from pipeline.core.errors import ConfigError
from pipeline.network.model import ModelConfig, build_model, weight_count


def test_default_model_has_the_papers_472353_weights():
    model = build_model(ModelConfig())
    assert weight_count() == 472_353
    assert model.count_params() == 472_353
    assert (
        len(model.trainable_weights) == 2 * (2 + 2 * 8) + 2
    )  # 18 convs + conv_lom, kernel and bias


def test_depth_and_features_change_the_size_as_the_formula_says():
    model = build_model(
        ModelConfig(fov_shape_zyx=(9, 9, 9), deltas_zyx=(2, 2, 2), depth=3, features=8)
    )
    assert model.count_params() == weight_count(depth=3, features=8)


def test_layers_carry_the_reference_variable_names():
    model = build_model(ModelConfig(depth=12))
    names = [layer.name for layer in model.layers if layer.weights]
    assert names[:3] == ["conv0_a", "conv0_b", "conv1_a"] and names[-2:] == ["conv11_b", "conv_lom"]


def test_output_is_the_seed_plus_an_update():
    """With the last conv zeroed the update vanishes, so the logits equal the input seed exactly."""
    config = ModelConfig(fov_shape_zyx=(5, 7, 7), deltas_zyx=(1, 2, 2), depth=2, features=4)
    model = build_model(config)
    lom = model.get_layer("conv_lom")
    lom.set_weights([np.zeros_like(w) for w in lom.get_weights()])
    rng = np.random.default_rng(0)
    image = rng.normal(size=(2, 5, 7, 7, 1)).astype(np.float32)
    seed = rng.normal(size=(2, 5, 7, 7, 1)).astype(np.float32)
    np.testing.assert_array_equal(model([image, seed]).numpy(), seed)
    lom.set_weights([np.ones_like(w) * 0.1 for w in lom.get_weights()])
    assert not np.allclose(model([image, seed]).numpy(), seed)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"fov_shape_zyx": (16, 33, 33)}, "3 odd positive sizes"),
        ({"deltas_zyx": (9, 8, 8)}, "at most half the FOV"),
        ({"depth": 0}, "depth and features must be >= 1"),
        ({"precision": "float16"}, "precision must be one of"),
    ],
)
def test_bad_model_settings_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**kwargs)
