"""Training examples for FFN: FOVs cut around seed coordinates, fed back through the network.

Each example is a *trajectory*, as in google-research/ffn's `train.py`: a canvas of the FOV plus
`fov_moves * deltas` on every side is cut around a coordinate (and flipped/transposed in-plane);
the object mask ("seed") starts at logit(0.05) with the centre at logit(0.95); after every
prediction the network's logits are written back into the seed canvas and, with the
`max_pred_moves` policy, the FOV moves toward faces predicted above the move threshold, so the
network learns the recurrent setting it runs in at inference.

A `BatchStream` keeps `batch_size` trajectories in flight and hands out one FOV of each per step.
Everything here is numpy; the TensorFlow side lives in `pipeline.train`.
"""

from collections.abc import Generator
from dataclasses import dataclass

import numpy as np

from pipeline.errors import ConfigError, CoordinatesError
from pipeline.model import ModelConfig, logit, normalize_image
from pipeline.movement import scored_move_offsets
from pipeline.volumes import LabeledVolume

FOV_POLICIES = ("max_pred_moves", "fixed")


@dataclass(frozen=True)
class ExampleConfig:
    """How training FOVs are made from seed coordinates."""

    fov_policy: str = "max_pred_moves"  # or "fixed": one FOV at the coordinate, no movement
    fov_moves: int = 1  # the canvas extends this many `deltas` beyond the FOV on every side
    move_threshold: float = 0.9
    object_probability: float = 0.95  # soft label (and seed value) inside the central object
    background_probability: float = 0.05  # soft label (and seed padding) elsewhere
    augment: bool = True  # random flips of each axis and a y/x transpose

    def __post_init__(self) -> None:
        if self.fov_policy not in FOV_POLICIES:
            raise ConfigError(f"fov_policy must be one of {FOV_POLICIES}, got {self.fov_policy!r}")
        if self.fov_moves < 0:
            raise ConfigError(f"fov_moves must be >= 0, got {self.fov_moves}")
        if not 0 < self.move_threshold < 1:
            raise ConfigError(f"move_threshold must be in (0, 1), got {self.move_threshold}")
        if not 0 < self.background_probability < self.object_probability < 1:
            raise ConfigError("need 0 < background_probability < object_probability < 1")


def canvas_radius(model: ModelConfig, examples: ExampleConfig) -> np.ndarray:
    """Half-size (z, y, x) of the region one trajectory may touch around its coordinate."""
    moves = examples.fov_moves if examples.fov_policy == "max_pred_moves" else 0
    return np.array(model.fov_shape_zyx) // 2 + moves * np.array(model.deltas_zyx)


def check_coordinates_fit(coords: np.ndarray, volume_shape, radius: np.ndarray) -> None:
    """Every canvas must lie inside the volume: no padding with invented data."""
    coords = np.asarray(coords)
    outside = np.any((coords < radius) | (coords + radius >= np.array(volume_shape)), axis=1)
    if outside.any():
        raise CoordinatesError(
            f"{int(outside.sum())} of {len(coords)} coordinates are closer than {tuple(radius)} "
            f"(z, y, x) to the border of the {tuple(volume_shape)} volume; rebuild them with a "
            "margin of at least that much"
        )


@dataclass
class Fov:
    """One network input/target. `seed` is a view into the trajectory's seed canvas: writing the
    predicted logits into it is how the prediction feeds back."""

    image: np.ndarray
    seed: np.ndarray
    labels: np.ndarray
    offset_zyx: tuple[int, int, int]  # FOV centre relative to the example's coordinate


def _augment(image: np.ndarray, labels: np.ndarray, rng: np.random.Generator):
    flips = tuple(axis for axis in range(3) if rng.random() < 0.5)
    image, labels = np.flip(image, flips), np.flip(labels, flips)
    if image.shape[1] == image.shape[2] and rng.random() < 0.5:
        image, labels = image.transpose(0, 2, 1), labels.transpose(0, 2, 1)
    return np.ascontiguousarray(image), np.ascontiguousarray(labels)


def trajectory(
    volume: LabeledVolume,
    center_zyx: np.ndarray,
    model: ModelConfig,
    examples: ExampleConfig,
    rng: np.random.Generator,
) -> Generator[Fov, None, None]:
    """Yield the FOVs of one training example; the caller writes logits into `fov.seed` before
    asking for the next one (the movement decision reads them)."""
    radius = canvas_radius(model, examples)
    box = tuple(slice(c - r, c + r + 1) for c, r in zip(center_zyx, radius, strict=True))
    image = normalize_image(volume.raw[box], model)
    object_id = volume.labels[tuple(center_zyx)]
    is_object = volume.labels[box] == object_id
    if examples.augment:
        image, is_object = _augment(image, is_object, rng)
    labels = np.where(is_object, examples.object_probability, examples.background_probability)
    labels = labels.astype(np.float32)
    seed = np.full(image.shape, logit(examples.background_probability), dtype=np.float32)
    seed[tuple(radius)] = logit(examples.object_probability)

    fov_radius = np.array(model.fov_shape_zyx) // 2
    deltas = np.maximum(np.array(model.deltas_zyx), 1)
    max_offset = radius - fov_radius
    threshold = logit(examples.move_threshold)
    queue, visited = [np.zeros(3, dtype=int)], set()
    while queue:
        offset = queue.pop(0)
        if np.any(np.abs(offset) > max_offset):
            continue
        key = tuple(offset // deltas)
        if key in visited:
            continue
        visited.add(key)
        sel = tuple(
            slice(r + o - f, r + o + f + 1)
            for r, o, f in zip(radius, offset, fov_radius, strict=True)
        )
        fov = Fov(image[sel], seed[sel], labels[sel], tuple(int(o) for o in offset))
        yield fov
        if examples.fov_policy == "max_pred_moves":
            moves = scored_move_offsets(fov.seed, model.deltas_zyx, threshold)
            queue.extend(offset + np.array(move) for _, move in moves)


class BatchStream:
    """`batch_size` trajectories in flight over this rank's coordinate shard.

    Example `i` of rank `rank` uses coordinate `perm_e[i % n]` of the shard, `perm_e` a permutation
    drawn per epoch `e = i // n`, and augments with a generator seeded by (seed, rank, i): the data
    order is fixed by the seed and can resume from `examples_started`.
    """

    def __init__(
        self,
        volume: LabeledVolume,
        coords: np.ndarray,
        model: ModelConfig,
        examples: ExampleConfig,
        batch_size: int,
        seed: int,
        rank: int = 0,
        examples_started: int = 0,
    ):
        if len(coords) == 0:
            raise CoordinatesError("this rank's coordinate shard is empty")
        check_coordinates_fit(coords, volume.raw.shape, canvas_radius(model, examples))
        self.volume, self.coords, self.model, self.examples = (
            volume,
            np.asarray(coords),
            model,
            examples,
        )
        self.seed, self.rank = seed, rank
        self.examples_started = examples_started
        self._epoch, self._perm = -1, None
        self._slots = [self._next_trajectory() for _ in range(batch_size)]
        self._current: list[Fov] = []

    def _coordinate(self, index: int) -> np.ndarray:
        n = len(self.coords)
        epoch = index // n
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = np.random.default_rng([self.seed, self.rank, epoch]).permutation(n)
        return self.coords[self._perm[index % n]]

    def _next_trajectory(self) -> Generator[Fov, None, None]:
        index = self.examples_started
        self.examples_started += 1
        rng = np.random.default_rng([self.seed, self.rank, index, 1])
        return trajectory(self.volume, self._coordinate(index), self.model, self.examples, rng)

    def next_batch(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(images, seeds, labels), each (batch, z, y, x, 1) float32."""
        self._current = []
        for i, slot in enumerate(self._slots):
            fov = next(slot, None)
            while fov is None:  # trajectory finished: start the next example in this slot
                self._slots[i] = slot = self._next_trajectory()
                fov = next(slot, None)
            self._current.append(fov)
        images, seeds, labels = (
            np.stack([getattr(f, name) for f in self._current])[..., None]
            for name in ("image", "seed", "labels")
        )
        return images, seeds, labels

    def write_back(self, logits: np.ndarray) -> None:
        """Store the network's logits (batch, z, y, x, 1) into each trajectory's seed canvas."""
        for fov, prediction in zip(self._current, logits, strict=True):
            fov.seed[...] = prediction[..., 0]
