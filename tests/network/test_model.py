"""The FFN network: its size, its additive seed update, its config checks."""

from pathlib import Path

import numpy as np
import pytest

from pipeline.core.errors import ConfigError
from pipeline.inference.flood_fill import InferenceConfig
from pipeline.network.model import (
    ModelConfig,
    build_model,
    cpu_flags,
    inference_precision,
    weight_count,
)


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


# An AMD EPYC with AVX512-BF16 (no AMX) as Linux lists it, shortened; a CPU without either.
BF16_CPU = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
PLAIN_CPU = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"


@pytest.mark.parametrize(
    "cpuinfo, accelerator, model_precision, expected",
    [
        (BF16_CPU, False, "float32", "mixed_bfloat16"),  # the instructions: bf16
        (PLAIN_CPU, False, "float32", "float32"),
        (PLAIN_CPU, False, "mixed_bfloat16", "float32"),  # emulated bf16 would be 30x slower
        (BF16_CPU, True, "float32", "float32"),  # a GPU's arithmetic as the weights were made
        ("", False, "float32", "float32"),  # no flags line (not Linux)
    ],
)
def test_auto_precision_takes_bf16_only_where_the_cpu_runs_it(
    tmp_path, cpuinfo, accelerator, model_precision, expected
):
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    flags = cpu_flags(path)
    assert inference_precision("auto", model_precision, flags, accelerator) == expected


def test_a_precision_named_is_the_precision_run():
    bf16 = frozenset({"avx512_bf16"})
    assert inference_precision("model", "float32", bf16, False) == "float32"
    assert inference_precision("float32", "mixed_bfloat16", bf16, False) == "float32"
    assert inference_precision("mixed_bfloat16", "float32", frozenset(), True) == "mixed_bfloat16"
    assert cpu_flags(Path("/nonexistent/cpuinfo")) == frozenset()
    with pytest.raises(ConfigError, match="precision must be one of"):
        InferenceConfig(precision="float16")
