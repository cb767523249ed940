"""Importing google-research/ffn TF1 checkpoints, checked against an independent numpy oracle.

The oracle below re-implements convstack_3d from the reference code's definition, in float64
numpy, from the checkpoint's raw arrays (read with `tf.train.load_checkpoint`, not through our
model): 'SAME' 3-D cross-correlation with `[kz, ky, kx, in, out]` kernels over (z, y, x, channel)
data, input channels (image, seed), conv0_a + ReLU, conv0_b, residual modules
x + conv_b(relu(conv_a(relu(x)))), ReLU, the 1x1x1 conv_lom, and the update added to the seed.
Agreement with it proves the layer order, the kernel layout, the channel order and the additive
update; `test_the_oracle_sees_layout_mistakes` shows it would notice each of them going wrong.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import processes
import pytest

from pipeline.cli.pretrained import main
from pipeline.core.errors import CheckpointError
from pipeline.network.model import ModelConfig, build_model, logit, normalize_image
from pipeline.network.released_weights import (
    converted_checkpoint,
    expected_variables,
    import_checkpoint,
    read_convstack_checkpoint,
    write_tf1_checkpoint,
)
from pipeline.selection.released_models import convert_checkpoint

REPO = Path(__file__).parents[2]
SHARED = REPO.parent / "shared"
FIB25 = SHARED / "models" / "google-ffn-fib25" / "model.ckpt-27465036"
needs_fib25 = pytest.mark.skipif(
    not Path(f"{FIB25}.index").is_file(),
    reason=f"the FFN authors' FIB-25 checkpoint is not at {FIB25} (the shared folder is absent)",
)
# The weights do not depend on the FOV: a small, anisotropic one keeps the oracle fast and would
# expose any mix-up of the z and x axes.
FOV = (9, 11, 13)
DELTAS = (2, 2, 2)


# ---------------------------------------------------------------------------------------------
# The oracle


def raw_arrays(prefix: str | Path) -> dict[str, np.ndarray]:
    import tensorflow as tf

    reader = tf.train.load_checkpoint(str(prefix))
    return {
        name: np.asarray(reader.get_tensor(name), np.float64)
        for name in reader.get_variable_to_shape_map()
        if name.startswith("seed_update/")
    }


def _conv_same(x: np.ndarray, kernel: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """out[z, y, x, o] = b[o] + sum over dz, dy, dx, i of in[z + dz - pz, ...][i] * k[dz, dy, dx, i, o],
    zero outside the input (TF's 'SAME' for odd kernels)."""
    kz, ky, kx = kernel.shape[:3]
    pad = [(k // 2, k // 2) for k in (kz, ky, kx)] + [(0, 0)]
    padded = np.pad(x, pad)
    z, y, w = x.shape[:3]
    out = np.broadcast_to(bias, (z, y, w, kernel.shape[-1])).copy()
    for dz in range(kz):
        for dy in range(ky):
            for dx in range(kx):
                out += padded[dz : dz + z, dy : dy + y, dx : dx + w] @ kernel[dz, dy, dx]
    return out


def oracle_logits(
    arrays: dict[str, np.ndarray],
    image: np.ndarray,
    seed: np.ndarray,
    *,
    swap_channels: bool = False,
    transpose_kernels: bool = False,
    add_seed: bool = True,
) -> np.ndarray:
    """convstack_3d on one FOV: (z, y, x) image and seed logits in, (z, y, x) new logits out.
    The keyword arguments make the mistakes the test must be able to notice."""

    def conv(x: np.ndarray, layer: str) -> np.ndarray:
        kernel = arrays[f"seed_update/{layer}/weights"]
        if transpose_kernels:
            kernel = kernel.transpose(2, 1, 0, 3, 4)  # read as (x, y, z)
        return _conv_same(x, kernel, arrays[f"seed_update/{layer}/biases"])

    def relu(x: np.ndarray) -> np.ndarray:
        return np.maximum(x, 0.0)

    channels = [seed, image] if swap_channels else [image, seed]
    net = np.stack(channels, axis=-1).astype(np.float64)
    net = conv(relu(conv(net, "conv0_a")), "conv0_b")
    i = 1
    while f"seed_update/conv{i}_a/weights" in arrays:
        net = net + conv(relu(conv(relu(net), f"conv{i}_a")), f"conv{i}_b")
        i += 1
    update = conv(relu(net), "conv_lom")[..., 0]
    return seed + update if add_seed else update


def fov_inputs(fov=FOV, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A random uint8 patch, normalised as FIB-25's, and a non-trivial seed: logit(0.05) with
    logit(0.95) at the centre, plus noise."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, fov, dtype=np.uint8)
    image = normalize_image(raw, ModelConfig(fov_shape_zyx=fov, deltas_zyx=DELTAS))
    mask = np.full(fov, logit(0.05), np.float32)
    mask[tuple(s // 2 for s in fov)] = logit(0.95)
    mask += rng.normal(0, 0.5, fov).astype(np.float32)
    return image, mask


def keras_logits(model, image: np.ndarray, seed: np.ndarray) -> np.ndarray:
    out = model([image[None, ..., None], seed[None, ..., None]], training=False)
    return np.asarray(out)[0, ..., 0]


def assert_matches_oracle(ours: np.ndarray, oracle: np.ndarray) -> None:
    scale = max(1.0, float(np.abs(oracle).max()))
    np.testing.assert_allclose(ours, oracle, rtol=1e-4, atol=1e-4 * scale)


# ---------------------------------------------------------------------------------------------
# Checkpoints to test with


def fresh_model(depth: int = 9, features: int = 32, seed: int = 0):
    """Our model, freshly built, with random weights large enough that every layer matters (the
    training initialiser's stddev 0.01 would leave an update far below any tolerance)."""
    model = build_model(
        ModelConfig(fov_shape_zyx=FOV, deltas_zyx=DELTAS, depth=depth, features=features)
    )
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if not layer.weights:
            continue
        kernel, bias = layer.get_weights()
        fan_in = np.prod(kernel.shape[:-1])
        gain = 0.5 if layer.name.endswith("_b") else 1.0  # tame the residual sum
        kernel = rng.normal(0, gain * np.sqrt(2.0 / fan_in), kernel.shape)
        bias = rng.normal(0, 0.1, bias.shape)
        layer.set_weights([kernel.astype(np.float32), bias.astype(np.float32)])
    return model


@pytest.fixture(scope="module")
def fresh_checkpoint(tmp_path_factory):
    """A depth-9 model of ours written as a reference-code TF1 checkpoint: (model, prefix)."""
    model = fresh_model()
    prefix = tmp_path_factory.mktemp("fresh") / "model.ckpt-123"
    write_tf1_checkpoint(model, prefix, global_step=123)
    return model, prefix


def save_tf1(prefix: Path, arrays: dict[str, np.ndarray]) -> Path:
    """A TF1-style checkpoint holding exactly `arrays` under their names."""
    import tensorflow as tf

    prefix.parent.mkdir(parents=True, exist_ok=True)
    tf.raw_ops.SaveV2(
        prefix=str(prefix),
        tensor_names=list(arrays),
        shape_and_slices=[""] * len(arrays),
        tensors=[tf.constant(a) for a in arrays.values()],
    )
    return prefix


def small_arrays(depth: int = 3, features: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        name: rng.normal(0, 0.1, shape).astype(np.float32)
        for name, shape in expected_variables(depth, features).items()
    }


# ---------------------------------------------------------------------------------------------
# The forward pass against the oracle


@needs_fib25
def test_fib25_is_read_as_depth_12_with_32_features():
    weights = read_convstack_checkpoint(FIB25)
    assert (weights.depth, weights.features, weights.global_step) == (12, 32, 27465036)
    assert list(weights.layers)[:3] == ["conv0_a", "conv0_b", "conv1_a"]
    assert weights.layers["conv0_a"][0].shape == (3, 3, 3, 2, 32)
    assert weights.layers["conv_lom"][0].shape == (1, 1, 1, 32, 1)


@needs_fib25
def test_fib25_forward_pass_matches_the_numpy_oracle():
    model, config = import_checkpoint(FIB25, FOV, DELTAS)
    assert (config.depth, config.features, config.image_mean, config.image_stddev) == (
        12,
        32,
        128.0,
        33.0,
    )
    image, seed = fov_inputs()
    oracle = oracle_logits(raw_arrays(FIB25), image, seed)
    ours = keras_logits(model, image, seed)
    assert np.abs(oracle - seed).max() > 1.0  # the released network changes the mask
    assert_matches_oracle(ours, oracle)
    swapped = oracle_logits(raw_arrays(FIB25), image, seed, swap_channels=True)
    assert np.abs(ours - swapped).max() > 0.1  # (image, seed) order matters for these weights


def test_fresh_depth_9_model_matches_the_numpy_oracle(fresh_checkpoint):
    """Our freshly built model, written as a TF1 checkpoint: the oracle (from the raw arrays)
    agrees with the original Keras model and with the model imported back from the file."""
    model, prefix = fresh_checkpoint
    image, seed = fov_inputs(seed=1)
    oracle = oracle_logits(raw_arrays(prefix), image, seed)
    assert_matches_oracle(keras_logits(model, image, seed), oracle)
    imported, config = import_checkpoint(prefix, FOV, DELTAS)
    assert (config.depth, config.features) == (9, 32)
    assert_matches_oracle(keras_logits(imported, image, seed), oracle)


@pytest.mark.parametrize(
    "mistake",
    [{"swap_channels": True}, {"transpose_kernels": True}, {"add_seed": False}],
    ids=["channel-order", "kernel-axes", "additive-seed"],
)
def test_the_oracle_sees_layout_mistakes(fresh_checkpoint, mistake):
    """Each plausible mapping mistake moves the logits far beyond the tolerance."""
    model, prefix = fresh_checkpoint
    image, seed = fov_inputs(seed=1)
    arrays = raw_arrays(prefix)
    ours = keras_logits(model, image, seed)
    wrong = oracle_logits(arrays, image, seed, **mistake)
    scale = max(1.0, float(np.abs(wrong).max()))
    assert np.abs(ours - wrong).max() > 100 * 1e-4 * scale


# ---------------------------------------------------------------------------------------------
# Checkpoints that do not match


def _without(*names: str):
    return lambda a: {
        k: v for k, v in a.items() if k.rpartition("/")[0] not in names and k not in names
    }


def _replace(name: str, shape: tuple[int, ...]):
    return lambda a: a | {name: np.zeros(shape, np.float32)}


@pytest.mark.parametrize(
    "change, message",
    [
        (_replace("seed_update/conv1_b/weights", (3, 3, 3, 8, 4)), "conv1_b/weights has shape"),
        (_replace("seed_update/conv0_a/weights", (3, 3, 3, 3, 4)), "conv0_a/weights has shape"),
        (_replace("seed_update/conv2_a/weights", (5, 5, 5, 4, 4)), "conv2_a/weights has shape"),
        (_replace("seed_update/conv_lom/biases", (2,)), "conv_lom/biases has shape"),
        (_without("seed_update/conv1_b/biases"), "missing seed_update/conv1_b/biases"),
        (_without("seed_update/conv1_a", "seed_update/conv1_b"), "missing seed_update/conv1_a"),
        (_without("seed_update/conv_lom"), "missing seed_update/conv_lom"),
        (_replace("seed_update/conv2_c/weights", (3, 3, 3, 4, 4)), "unexpected variable"),
        (_replace("seed_update/conv0_a/BatchNorm/beta", (4,)), "unexpected variable"),
        (lambda a: {"net/conv1/kernel": np.zeros((3, 3, 3, 1, 1), np.float32)}, "no seed_update"),
        (_replace("seed_update/conv1_a/biases", (4,)), None),  # control: nothing wrong
    ],
    ids=[
        "wrong-features",
        "wrong-input-channels",
        "wrong-kernel-size",
        "wrong-lom-bias",
        "missing-bias",
        "missing-module",
        "missing-lom",
        "unexpected-layer",
        "batch-norm",
        "not-a-convstack",
        "control",
    ],
)
def test_mismatching_checkpoints_are_refused_in_one_line(tmp_path, change, message):
    prefix = save_tf1(tmp_path / "model.ckpt-1", change(small_arrays()))
    if message is None:
        assert read_convstack_checkpoint(prefix).depth == 3
        return
    with pytest.raises(CheckpointError) as caught:
        import_checkpoint(prefix, FOV, DELTAS)
    text = str(caught.value)
    assert message in text and "\n" not in text and str(prefix) in text


def test_missing_or_corrupt_checkpoint_is_refused_in_one_line(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint") as caught:
        read_convstack_checkpoint(tmp_path / "absent.ckpt")
    assert "\n" not in str(caught.value)
    (tmp_path / "junk.ckpt.index").write_bytes(b"not a checkpoint\n" * 10)
    with pytest.raises(CheckpointError, match="cannot read checkpoint") as caught:
        read_convstack_checkpoint(tmp_path / "junk.ckpt")
    assert "\n" not in str(caught.value)


def test_optimizer_slots_and_other_scopes_are_ignored(tmp_path):
    """A checkpoint saved during training holds momentum slots and input-pipeline variables."""
    arrays = small_arrays()
    extra = {f"{name}/Momentum": value for name, value in arrays.items()}
    extra["filter_out_bounds_coordinates/fraction"] = np.zeros(2, np.int64)
    prefix = save_tf1(tmp_path / "model.ckpt-7", arrays | extra)
    weights = read_convstack_checkpoint(prefix)
    assert (weights.depth, weights.features, weights.global_step) == (3, 4, None)
    np.testing.assert_array_equal(
        weights.layers["conv2_b"][0], arrays["seed_update/conv2_b/weights"]
    )
    # The folder and the .index file name the same checkpoint.
    assert read_convstack_checkpoint(tmp_path).path == str(prefix)
    assert read_convstack_checkpoint(f"{prefix}.index").path == str(prefix)


# ---------------------------------------------------------------------------------------------
# Conversion to our format


@pytest.fixture(scope="module")
def source_checkpoint(fresh_checkpoint):
    """The FIB-25 checkpoint where the shared folder has it, else the fresh depth-9 one."""
    return FIB25 if Path(f"{FIB25}.index").is_file() else fresh_checkpoint[1]


def test_converted_folder_loads_through_inference(tmp_path, source_checkpoint):
    from pipeline.inference.flood_fill import checkpoint_model_config, predictor_from_checkpoint
    from pipeline.selection.checkpoints import list_checkpoints

    out = tmp_path / "models" / "pretrained"
    checkpoint = convert_checkpoint(source_checkpoint, out, FOV, DELTAS)
    assert checkpoint == out / "checkpoints" / "ckpt-0" == converted_checkpoint(out)
    assert list_checkpoints(out) == [checkpoint]
    assert sorted(p.name for p in tmp_path.joinpath("models").iterdir()) == ["pretrained"]

    imported, config = import_checkpoint(source_checkpoint, FOV, DELTAS)
    assert checkpoint_model_config(checkpoint) == config
    record = json.loads((out / "config.json").read_text())
    assert set(record) >= {"inputs", "config", "world_size"}
    assert record["pretrained"]["source"] == str(Path(source_checkpoint).resolve())

    predict = predictor_from_checkpoint(checkpoint)
    images, seeds = zip(*(fov_inputs(seed=s) for s in range(3)), strict=True)
    images, seeds = np.stack(images)[..., None], np.stack(seeds)[..., None]
    expected = imported([images, seeds], training=False).numpy()
    np.testing.assert_allclose(predict(images, seeds), expected, rtol=1e-6, atol=1e-6)


def test_conversion_is_atomic_and_does_not_overwrite_by_default(tmp_path, fresh_checkpoint):
    _, prefix = fresh_checkpoint
    bad = save_tf1(tmp_path / "bad" / "model.ckpt-1", {"x": np.zeros(1, np.float32)})
    out = tmp_path / "converted"
    with pytest.raises(CheckpointError):
        convert_checkpoint(bad, out, FOV, DELTAS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]  # no OUT, no temporary folder

    convert_checkpoint(prefix, out, FOV, DELTAS)
    with pytest.raises(CheckpointError, match="already exists"):
        convert_checkpoint(prefix, out, FOV, DELTAS)
    convert_checkpoint(prefix, out, (5, 5, 5), (1, 1, 1), overwrite=True)
    config = json.loads((out / "config.json").read_text())["config"]["model"]
    assert config["fov_shape_zyx"] == [5, 5, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "converted"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"TF_CPP_MIN_LOG_LEVEL": "2"}
    return processes.run(
        [sys.executable, "-m", "pipeline.cli.pretrained", *args], cwd=REPO, env=env, timeout=900
    )


def test_cli_help():
    result = _cli("--help")
    assert result.returncode == 0 and "--fov-zyx" in result.stdout


def test_cli_converts_and_reports_errors_in_one_line(tmp_path, source_checkpoint, capsys):
    out = tmp_path / "fib25"
    fov = [str(s) for s in FOV]
    result = _cli(
        "--checkpoint", str(source_checkpoint), "--out", str(out), "--fov-zyx", *fov,
        "--deltas-zyx", "2", "2", "2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout and converted_checkpoint(out).name == "ckpt-0"
    # The same command again, in this process: refused, one line on stderr.
    assert main(["--checkpoint", str(source_checkpoint), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "already exists" in err


# ---------------------------------------------------------------------------------------------
# Starting from released weights: training's initialisation, a run without training


@pytest.mark.parametrize("form", ["tf1", "converted-folder", "our-checkpoint"])
def test_load_pretrained_weights_takes_every_form(tmp_path, fresh_checkpoint, form):
    from pipeline.network.released_weights import load_pretrained_weights

    original, prefix = fresh_checkpoint
    source = prefix
    if form != "tf1":
        out = tmp_path / "converted"
        checkpoint = convert_checkpoint(prefix, out, FOV, DELTAS)
        source = out if form == "converted-folder" else checkpoint
    # Another FOV: the weights do not depend on it.
    model = build_model(ModelConfig(fov_shape_zyx=(5, 7, 9), deltas_zyx=(1, 1, 1), depth=9))
    load_pretrained_weights(model, source)
    for a, b in zip(model.get_weights(), original.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("form", ["tf1", "our-checkpoint"])
def test_load_pretrained_weights_refuses_another_shape(tmp_path, fresh_checkpoint, form):
    from pipeline.network.released_weights import load_pretrained_weights

    _, prefix = fresh_checkpoint
    source = prefix if form == "tf1" else convert_checkpoint(prefix, tmp_path / "c", FOV, DELTAS)
    for depth, features in ((3, 32), (9, 16)):
        model = build_model(
            ModelConfig(fov_shape_zyx=FOV, deltas_zyx=DELTAS, depth=depth, features=features)
        )
        with pytest.raises(CheckpointError) as caught:
            load_pretrained_weights(model, source)
        assert "\n" not in str(caught.value)


def test_pretrained_selection_feeds_the_inference_stage(tmp_path, fresh_checkpoint):
    from pipeline.core.stamps import input_token
    from pipeline.selection.checkpoints import chosen_checkpoint, selection_done
    from pipeline.selection.released_models import (
        stage_pretrained_selection,
        write_pretrained_selection,
    )

    out, selection = tmp_path / "model", tmp_path / "selection.json"
    checkpoint = convert_checkpoint(fresh_checkpoint[1], out, FOV, DELTAS)
    record = write_pretrained_selection(out, selection)
    assert selection_done(selection) and record["criterion"] == "pretrained"
    assert chosen_checkpoint(selection) == checkpoint
    # As the workflow stages it: stamped, so a resume keeps it and the blocks that read it ...
    assert stage_pretrained_selection(out, selection) == "ran"
    token = input_token(selection)
    assert stage_pretrained_selection(out, selection) == "up to date"
    # ... until the model's weights change: then the inference token changes too.
    data = next(out.rglob("*.data-*"))
    data.write_bytes(data.read_bytes()[::-1])  # other weights, same size
    assert stage_pretrained_selection(out, selection) == "ran" and input_token(selection) != token
    with pytest.raises(CheckpointError, match="not a converted model"):
        write_pretrained_selection(tmp_path / "absent", tmp_path / "other.json")
