"""The FFN network: google-research/ffn's `convstack_3d` in TF2/Keras.

Input (batch, z, y, x, 2): channel 0 the normalised image, channel 1 the current object-mask
logits (the "seed"). The stack predicts an *update* that is added to the seed logits, so the
output is the new object-mask logits over the same field of view.

Layer names follow the authors' TF1 variable scopes (`conv0_a`, `conv1_a`, ..., `conv_lom`) so a
released checkpoint maps onto this model one variable to one layer.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline.core.errors import CheckpointError, ConfigError
from pipeline.network.devices import required_devices

if TYPE_CHECKING:  # TensorFlow takes seconds to import: only where a network is built
    import tensorflow as tf

PRECISIONS = ("float32", "mixed_bfloat16")
# Inference's `precision` setting: one of PRECISIONS, the weights' own ("model"), or "auto".
INFERENCE_PRECISIONS = ("auto", "model", *PRECISIONS)
# /proc/cpuinfo flags of the instructions oneDNN runs bf16 convolutions with; without them bf16
# is emulated, 30x slower than float32 (BENCHMARKS.md, "bf16 where the CPU has AMX").
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True)
class ModelConfig:
    """Network shape and input normalisation. Sizes are (z, y, x); FFN's flags write (x, y, z)."""

    # The field of view: the subvolume the network sees and predicts at once, odd sizes.
    fov_shape_zyx: tuple[int, int, int] = (17, 33, 33)
    # How far the FOV moves in one step, at most half the FOV.
    deltas_zyx: tuple[int, int, int] = (4, 8, 8)
    depth: int = 9  # input module + (depth - 1) residual modules
    # Feature maps of every convolution.
    features: int = 32
    # Input normalisation: the network sees (image - image_mean) / image_stddev.
    image_mean: float = 128.0
    # Input normalisation's divisor (see image_mean), > 0.
    image_stddev: float = 33.0
    precision: str = "float32"  # or "mixed_bfloat16" (oneDNN uses AMX/AVX512-BF16 where present)

    def __post_init__(self) -> None:
        if len(self.fov_shape_zyx) != 3 or any(s < 1 or s % 2 == 0 for s in self.fov_shape_zyx):
            raise ConfigError(
                f"fov_shape_zyx must be 3 odd positive sizes, got {self.fov_shape_zyx}"
            )
        if len(self.deltas_zyx) != 3 or any(
            d < 0 or d > s // 2 for d, s in zip(self.deltas_zyx, self.fov_shape_zyx, strict=True)
        ):
            raise ConfigError(
                f"deltas_zyx {self.deltas_zyx} must be >= 0 and at most half the FOV {self.fov_shape_zyx}"
            )
        if self.depth < 1 or self.features < 1:
            raise ConfigError(f"depth and features must be >= 1, got {self.depth}, {self.features}")
        if self.image_stddev <= 0:
            raise ConfigError(f"image_stddev must be > 0, got {self.image_stddev}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")


def weight_count(depth: int = 9, features: int = 32) -> int:
    """Trainable weights of convstack_3d: 472,353 for the FFN defaults (depth 9, 32 features)."""
    conv = 27 * features * features + features
    return (27 * 2 * features + features) + conv + 2 * (depth - 1) * conv + (features + 1)


def forward_flops_per_fov(config: ModelConfig) -> float:
    """Multiply-adds x 2 of one forward pass over one FOV ('same' padding: every conv sees every
    voxel). Training costs about 3x this (forward, input gradients, weight gradients)."""
    f = config.features
    macs_per_voxel = 27 * 2 * f + (2 * config.depth - 1) * 27 * f * f + f
    return 2.0 * macs_per_voxel * float(np.prod(config.fov_shape_zyx))


def _kernel_init() -> tf.keras.initializers.Initializer:
    import tensorflow as tf

    # One instance per layer: a shared instance would give every layer the same weights.
    return tf.keras.initializers.TruncatedNormal(stddev=0.01)


def build_model(config: ModelConfig) -> tf.keras.Model:
    """Build the residual conv stack; returns a Keras model mapping (image, seed) to new logits.
    TensorFlow is shown this process's accelerators first (pipeline.network.devices): Intel's
    extension loaded, so that the network runs on an XPU where there is one, and a process of a
    site whose jobs require a kind of device stopped where it finds none."""
    import tensorflow as tf

    required_devices(tf, "the network")
    dtype = "mixed_bfloat16" if config.precision == "mixed_bfloat16" else "float32"

    def conv(name: str, activation: str | None) -> tf.keras.layers.Conv3D:
        return tf.keras.layers.Conv3D(
            config.features,
            3,
            padding="same",
            activation=activation,
            kernel_initializer=_kernel_init(),
            name=name,
            dtype=dtype,
        )

    fov = tuple(config.fov_shape_zyx)
    image = tf.keras.Input(fov + (1,), name="image")
    seed = tf.keras.Input(fov + (1,), name="seed")
    net = tf.keras.layers.Concatenate(name="input_channels", dtype=dtype)([image, seed])
    net = conv("conv0_a", "relu")(net)
    net = conv("conv0_b", None)(net)
    for i in range(1, config.depth):
        shortcut = net
        net = tf.keras.layers.ReLU(dtype=dtype)(net)
        net = conv(f"conv{i}_a", "relu")(net)
        net = conv(f"conv{i}_b", None)(net)
        net = tf.keras.layers.Add(dtype=dtype)([net, shortcut])
    net = tf.keras.layers.ReLU(dtype=dtype)(net)
    update = tf.keras.layers.Conv3D(
        1, 1, kernel_initializer=_kernel_init(), name="conv_lom", dtype=dtype
    )(net)
    # The update is added in float32 so bf16 rounding does not accumulate in the recurrent seed.
    update = tf.keras.layers.Activation("linear", dtype="float32", name="update_fp32")(update)
    logits = tf.keras.layers.Add(dtype="float32", name="logits")([seed, update])
    return tf.keras.Model([image, seed], logits, name="ffn_convstack_3d")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The instruction-set flags Linux reports for the first CPU (none where it reports none)."""
    try:
        text = cpuinfo.read_text()
    except OSError:  # not Linux
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def inference_precision(
    requested: str, model_precision: str, flags: frozenset[str], accelerator: bool
) -> str:
    """The precision an inference runs in. "auto": on the CPU, mixed_bfloat16 where it has
    BF16_CPU_FLAGS (about 2x faster than float32 with AVX512-BF16, 3.7x with AMX; scores that
    differ in the third decimal: BENCHMARKS.md) and float32 where it has not; on an
    accelerator, the weights' own. "model": the weights' own; otherwise as requested."""
    if requested == "model" or (requested == "auto" and accelerator):
        return model_precision
    if requested == "auto":
        return "mixed_bfloat16" if flags & set(BF16_CPU_FLAGS) else "float32"
    return requested


def normalize_image(raw: np.ndarray, config: ModelConfig) -> np.ndarray:
    """uint8 EM intensities to the network's float32 input scale."""
    return (raw.astype(np.float32) - np.float32(config.image_mean)) / np.float32(
        config.image_stddev
    )


def logit(p: float) -> float:
    return float(np.log(p / (1.0 - p)))


class UnreadableCheckpoint(CheckpointError):
    """A checkpoint whose files cannot be read (cut short by a full disk or a killed copy,
    overwritten): its message names them."""


def load_weights(model: tf.keras.Model, checkpoint: str) -> tf.keras.Model:
    """Restore `model`'s weights from a training checkpoint (`.../checkpoints/ckpt-N`), ignoring
    the optimizer state; a checkpoint of another shape raises CheckpointError, one whose files
    cannot be read UnreadableCheckpoint (naming them)."""
    import tensorflow as tf

    from pipeline.core.errors import first_line

    if not tf.io.gfile.exists(f"{checkpoint}.index"):
        raise CheckpointError(f"{checkpoint}: no such checkpoint (missing {checkpoint}.index)")
    try:
        status = tf.train.Checkpoint(model=model).restore(checkpoint).expect_partial()
        status.assert_existing_objects_matched()
    except (AssertionError, ValueError) as exc:
        raise CheckpointError(
            f"{checkpoint}: does not match the model ({first_line(exc)})"
        ) from None
    # IndexError: a data file cut short ("Read less bytes than requested"), which names no file.
    except (IndexError, OSError, tf.errors.OpError) as exc:
        files = sorted(
            p.name for p in Path(checkpoint).parent.glob(glob.escape(Path(checkpoint).name) + ".*")
        )
        raise UnreadableCheckpoint(
            f"{checkpoint}: cannot be read, a file of it damaged or cut short "
            f"({', '.join(files) or 'no files'}: {first_line(exc)})"
        ) from None
    return model
