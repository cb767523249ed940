"""Import the FFN authors' released models: google-research/ffn `convstack_3d` TF1 checkpoints.

A TF1 checkpoint of the reference code holds the network's variables under the `seed_update`
scope: `seed_update/conv0_a/{weights,biases}`, `seed_update/conv0_b/...`, one `conv{i}_a` and
`conv{i}_b` per residual module, and `seed_update/conv_lom/...`. Conv weights are
`[kz, ky, kx, in, out]` (TF's conv3d on channels-last (z, y, x) data), exactly the layout of a
Keras Conv3D kernel, and `pipeline.network.model` names its layers after those scopes, so every
variable maps onto one layer unchanged. Depth and feature count are read from the variables (every one is
checked for presence and shape); the field of view, the move deltas and the image normalisation
are not stored in a checkpoint, so they are arguments (defaults: the FIB-25 model's, from its
README: FOV 33, 33, 33, deltas 8, 8, 8, mean 128, stddev 33).

`read_convstack_checkpoint` reads one; `load_pretrained_weights` starts any model of the same depth
and width (a training run's) from such weights, ours or the reference code's;
`write_tf1_checkpoint` goes the other way, for the reference code. Writing an imported model in
this project's own format (a model folder `OUT/checkpoints/ckpt-0` + `OUT/config.json`), and such a
folder as the selection stage's choice: `pipeline.selection.released_models`.

CLI: `python -m pipeline.cli.pretrained --checkpoint ../shared/models/google-ffn-fib25/model.ckpt-27465036
--out data/models/fib25 [--fov-zyx 33 33 33 --deltas-zyx 8 8 8]`.
"""

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.core.errors import CheckpointError, first_line

SCOPE = "seed_update"  # the reference code's variable scope of the network
CHECKPOINT_NUMBER = 0  # the converted folder's one checkpoint: OUT/checkpoints/ckpt-0
SOURCE_FORMAT = "google-research/ffn convstack_3d (TF1 checkpoint)"
# Not stored in a checkpoint: the FIB-25 model's settings (its README), the defaults here.
FIB25_FOV_ZYX = (33, 33, 33)
FIB25_DELTAS_ZYX = (8, 8, 8)
FIB25_IMAGE_MEAN = 128.0
FIB25_IMAGE_STDDEV = 33.0
KERNEL_SIZE = 3

_MODEL_VARIABLE = re.compile(rf"{SCOPE}/(conv(\d+)_[ab]|conv_lom)/(weights|biases)")
# Optimizer slots and moving averages of a model variable (a checkpoint saved during training).
_SLOT_VARIABLE = re.compile(rf"{SCOPE}/(conv\d+_[ab]|conv_lom)/(weights|biases)/.+")


@dataclass(frozen=True)
class ConvStackWeights:
    """A checked convstack_3d checkpoint: `layers` maps a layer name (`conv0_a`, ..., `conv_lom`)
    to its (kernel, bias) float32 arrays, kernels [kz, ky, kx, in, out]."""

    path: str
    depth: int
    features: int
    layers: dict[str, tuple[np.ndarray, np.ndarray]]
    global_step: int | None = None  # the reference code's `global_step`, if saved


def layer_names(depth: int) -> list[str]:
    """The conv layers of a convstack_3d of `depth`, input to output."""
    names = ["conv0_a", "conv0_b"]
    for i in range(1, depth):
        names += [f"conv{i}_a", f"conv{i}_b"]
    return names + ["conv_lom"]


def model_depth(model) -> int:
    """The depth of a Keras convstack_3d: one `conv{i}_a` layer per module."""
    return sum(1 for layer in model.layers if re.fullmatch(r"conv\d+_a", layer.name))


def expected_variables(depth: int, features: int) -> dict[str, tuple[int, ...]]:
    """TF1 variable name -> shape of a convstack_3d with 3x3x3 kernels and 2 input channels."""
    k = (KERNEL_SIZE,) * 3
    shapes: dict[str, tuple[int, ...]] = {}
    for name in layer_names(depth):
        if name == "conv_lom":
            kernel = (1, 1, 1, features, 1)
        else:
            kernel = k + (2 if name == "conv0_a" else features, features)
        shapes[f"{SCOPE}/{name}/weights"] = kernel
        shapes[f"{SCOPE}/{name}/biases"] = (kernel[-1],)
    return shapes


def resolve_checkpoint(checkpoint: str | os.PathLike) -> str:
    """The checkpoint's prefix: given as such, as its `.index`/`.data-*` file, or as a folder that
    holds one checkpoint (or a TF `checkpoint` state file)."""
    import tensorflow as tf

    path = Path(checkpoint)
    if path.is_dir():
        latest = tf.train.latest_checkpoint(str(path))
        if latest:
            return latest
        indexes = sorted(path.glob("*.index"))
        if len(indexes) != 1:
            raise CheckpointError(
                f"{path}: folder holds {len(indexes)} checkpoints (*.index); name one"
            )
        return str(indexes[0].with_suffix(""))
    if path.suffix == ".index":
        return str(path.with_suffix(""))
    if re.fullmatch(r"\.data-\d+-of-\d+", path.suffix):
        return str(path.with_suffix(""))
    if not Path(f"{path}.index").is_file():
        raise CheckpointError(f"{path}: no such checkpoint (missing {path}.index)")
    return str(path)


def _reader(prefix: str):
    """A TF checkpoint reader for `prefix`; CheckpointError (one line) if it cannot be read."""
    import tensorflow as tf

    try:
        return tf.train.load_checkpoint(prefix)
    except (tf.errors.OpError, ValueError) as exc:
        raise CheckpointError(f"{prefix}: cannot read checkpoint ({first_line(exc)})") from None


def _describe(names: Sequence[str]) -> str:
    shown = ", ".join(names[:3])
    return shown + (f" (and {len(names) - 3} more)" if len(names) > 3 else "")


def read_convstack_checkpoint(checkpoint: str | os.PathLike) -> ConvStackWeights:
    """Read and check a TF1 convstack_3d checkpoint; CheckpointError (one line) if its variables
    are not exactly those of a convstack_3d of some depth and feature count."""

    prefix = resolve_checkpoint(checkpoint)
    reader = _reader(prefix)
    shapes = reader.get_variable_to_shape_map()
    dtypes = reader.get_variable_to_dtype_map()

    ours = {n: tuple(s) for n, s in shapes.items() if _MODEL_VARIABLE.fullmatch(n)}
    unexpected = sorted(
        n
        for n in shapes
        if n.startswith(f"{SCOPE}/") and n not in ours and not _SLOT_VARIABLE.fullmatch(n)
    )
    if unexpected:
        raise CheckpointError(
            f"{prefix}: not a convstack_3d checkpoint: unexpected variable(s) {_describe(unexpected)}"
        )
    first = f"{SCOPE}/conv0_a/weights"
    if first not in ours:
        found = sorted(shapes)
        raise CheckpointError(
            f"{prefix}: not a convstack_3d checkpoint (no {first}; "
            f"{len(found)} variables{': ' + _describe(found) if found else ''})"
        )
    if len(ours[first]) != 5:
        raise CheckpointError(
            f"{prefix}: {first} has shape {list(ours[first])}, expected [kz, ky, kx, in, out]"
        )
    features = ours[first][-1]
    depth = 1 + max(int(m[2]) for n in ours if (m := _MODEL_VARIABLE.fullmatch(n)) and m[2])
    expected = expected_variables(depth, features)
    missing = sorted(set(expected) - set(ours), key=list(expected).index)
    if missing:
        raise CheckpointError(
            f"{prefix}: incomplete convstack_3d (depth {depth} from its layers): missing "
            f"{_describe(missing)}"
        )
    for name, shape in expected.items():
        if ours[name] != shape:
            raise CheckpointError(
                f"{prefix}: {name} has shape {list(ours[name])}, expected {list(shape)} "
                f"(depth {depth}, {features} features, {KERNEL_SIZE}^3 kernels)"
            )
        if not dtypes[name].is_floating:
            raise CheckpointError(f"{prefix}: {name} has dtype {dtypes[name].name}, not a float")

    layers = {}
    for layer in layer_names(depth):
        arrays = []
        for kind in ("weights", "biases"):
            value = np.asarray(reader.get_tensor(f"{SCOPE}/{layer}/{kind}"), np.float32)
            if not np.all(np.isfinite(value)):
                raise CheckpointError(f"{prefix}: {SCOPE}/{layer}/{kind} holds NaN or infinity")
            arrays.append(value)
        layers[layer] = (arrays[0], arrays[1])
    step = None
    if "global_step" in shapes and shapes["global_step"] == []:
        step = int(reader.get_tensor("global_step"))
    return ConvStackWeights(prefix, depth, features, layers, step)


def import_checkpoint(
    checkpoint: str | os.PathLike,
    fov_shape_zyx: Sequence[int] = FIB25_FOV_ZYX,
    deltas_zyx: Sequence[int] = FIB25_DELTAS_ZYX,
    image_mean: float = FIB25_IMAGE_MEAN,
    image_stddev: float = FIB25_IMAGE_STDDEV,
    precision: str = "float32",
):
    """Build our model in the checkpoint's shape and load its weights: (Keras model, ModelConfig).

    The FOV, deltas and normalisation are not in a checkpoint; give those the model was trained
    with (defaults: FIB-25's). A checkpoint that is not a convstack_3d raises CheckpointError.
    """
    return build_released_model(
        read_convstack_checkpoint(checkpoint),
        fov_shape_zyx,
        deltas_zyx,
        image_mean,
        image_stddev,
        precision,
    )


def build_released_model(
    weights: ConvStackWeights, fov_shape_zyx, deltas_zyx, image_mean, image_stddev, precision
):
    from pipeline.network.model import ModelConfig, build_model

    config = ModelConfig(
        fov_shape_zyx=tuple(int(s) for s in fov_shape_zyx),
        deltas_zyx=tuple(int(d) for d in deltas_zyx),
        depth=weights.depth,
        features=weights.features,
        image_mean=float(image_mean),
        image_stddev=float(image_stddev),
        precision=precision,
    )
    model = build_model(config)
    for name, (kernel, bias) in weights.layers.items():
        model.get_layer(name).set_weights([kernel, bias])  # same layout: no transpose
    return model, config


def write_tf1_checkpoint(model, prefix: str | os.PathLike, global_step: int | None = None) -> str:
    """Write a Keras FFN model's weights as a reference-code TF1 checkpoint (`seed_update/...`
    names, `[kz, ky, kx, in, out]` kernels), readable by google-research/ffn and by
    `read_convstack_checkpoint`. Returns the prefix."""
    import tensorflow as tf

    depth = model_depth(model)
    names, tensors = [], []
    for layer in layer_names(depth):
        kernel, bias = model.get_layer(layer).get_weights()
        names += [f"{SCOPE}/{layer}/weights", f"{SCOPE}/{layer}/biases"]
        tensors += [tf.constant(kernel, tf.float32), tf.constant(bias, tf.float32)]
    if global_step is not None:
        names.append("global_step")
        tensors.append(tf.constant(global_step, tf.int64))
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    tf.raw_ops.SaveV2(
        prefix=str(prefix), tensor_names=names, shape_and_slices=[""] * len(names), tensors=tensors
    )
    return str(prefix)


def converted_checkpoint(out_dir: str | os.PathLike) -> Path:
    """The checkpoint of a folder written by `convert_checkpoint` (`OUT/checkpoints/ckpt-0`)."""
    out = Path(out_dir)
    checkpoint = out / "checkpoints" / f"ckpt-{CHECKPOINT_NUMBER}"
    if not (out / "config.json").is_file() or not Path(f"{checkpoint}.index").is_file():
        raise CheckpointError(f"{out}: not a converted model (no config.json or {checkpoint})")
    return checkpoint


def is_convstack_checkpoint(checkpoint: str | os.PathLike) -> bool:
    """Whether a checkpoint is the reference code's (TF1 convstack_3d), not one of ours."""
    names = _reader(resolve_checkpoint(checkpoint)).get_variable_to_shape_map()
    return any(name.startswith(f"{SCOPE}/") for name in names)


def load_pretrained_weights(model, source: str | os.PathLike) -> str:
    """Set `model`'s weights (only those: no optimizer state, no step) from `source`: a folder
    written by `convert_checkpoint`, one of our checkpoints (`TRAIN_DIR/checkpoints/ckpt-N`), or a
    TF1 convstack_3d checkpoint of the reference code. For starting a training run from released
    weights. Returns the checkpoint used; CheckpointError (one line) if the shapes differ."""
    import tensorflow as tf

    from pipeline.network.model import load_weights

    path = Path(source)
    if path.is_dir() and (path / "config.json").is_file():
        latest = tf.train.latest_checkpoint(str(path / "checkpoints"))
        if latest is None:
            raise CheckpointError(f"{path}: no checkpoint in {path / 'checkpoints'}")
        path = Path(latest)
    prefix = resolve_checkpoint(path)
    if not is_convstack_checkpoint(prefix):
        load_weights(model, prefix)  # ours: tf.train.Checkpoint(model=...)
        return prefix
    weights = read_convstack_checkpoint(prefix)
    layers = [layer.name for layer in model.layers if layer.weights]
    if layers != list(weights.layers):
        raise CheckpointError(
            f"{prefix}: depth {weights.depth} does not match the model's depth {model_depth(model)}"
        )
    for name, (kernel, bias) in weights.layers.items():
        layer = model.get_layer(name)
        if [tuple(w.shape) for w in layer.weights] != [kernel.shape, bias.shape]:
            raise CheckpointError(
                f"{prefix}: {name} has shapes {[list(kernel.shape), list(bias.shape)]}, the "
                f"model's {[list(w.shape) for w in layer.weights]}"
            )
        layer.set_weights([kernel, bias])
    return prefix
