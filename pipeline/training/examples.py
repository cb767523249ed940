"""Training examples for FFN: FOVs cut around seed coordinates, fed back through the network.

Each example is a *trajectory*, as in google-research/ffn's `train.py`: a canvas of the FOV plus
`fov_moves * deltas` on every side is cut around a coordinate (and flipped/transposed in-plane);
the object mask ("seed") starts at logit(0.05) with the centre at logit(0.95); after every
prediction the network's logits are written back into the seed canvas and, with the
`max_pred_moves` policy, the FOV moves toward faces predicted above the move threshold, so the
network learns the recurrent setting it runs in at inference.

A `BatchStream` keeps `batch_size` trajectories in flight and hands out one FOV of each per step.
Everything here is numpy; the TensorFlow side lives in `pipeline.training.trainer`.
"""

import io
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from pipeline.core.errors import ConfigError, CoordinatesError
from pipeline.data.volumes import LabeledVolume
from pipeline.network.model import ModelConfig, logit, normalize_image
from pipeline.network.movement import scored_move_offsets

FOV_POLICIES = ("max_pred_moves", "fixed")


@dataclass(frozen=True)
class ExampleConfig:
    """How training FOVs are made from seed coordinates."""

    fov_policy: str = "max_pred_moves"  # or "fixed": one FOV at the coordinate, no movement
    fov_moves: int = 1  # the canvas extends this many `deltas` beyond the FOV on every side
    # max_pred_moves: the FOV moves to a face where the prediction reaches this probability.
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


class Trajectory:
    """The FOVs of one training example, handed out one at a time; the caller writes logits into
    `fov.seed` before asking for the next one (the movement decision reads them).

    Its whole state (seed canvas, the walk so far) can be saved and put back: a run resumed from
    a checkpoint goes on with the examples that were in flight, as the uninterrupted run does.
    The image and labels are not saved: they follow from the coordinate and `rng`.
    """

    def __init__(
        self,
        volume: LabeledVolume,
        center_zyx: np.ndarray,
        model: ModelConfig,
        examples: ExampleConfig,
        rng: np.random.Generator,
    ):
        self.model, self.examples = model, examples
        self.radius = canvas_radius(model, examples)
        box = tuple(slice(c - r, c + r + 1) for c, r in zip(center_zyx, self.radius, strict=True))
        image = normalize_image(volume.raw[box], model)
        object_id = volume.labels[tuple(center_zyx)]
        is_object = volume.labels[box] == object_id
        if examples.augment:
            image, is_object = _augment(image, is_object, rng)
        labels = np.where(is_object, examples.object_probability, examples.background_probability)
        self.image, self.labels = image, labels.astype(np.float32)
        self.seed = np.full(image.shape, logit(examples.background_probability), dtype=np.float32)
        self.seed[tuple(self.radius)] = logit(examples.object_probability)
        self.queue = [np.zeros(3, dtype=int)]
        self.visited: set[tuple[int, ...]] = set()
        self.shown: np.ndarray | None = None  # the last FOV's offset: its moves are still to decide

    def _fov_box(self, offset: np.ndarray) -> tuple[slice, ...]:
        fov_radius = np.array(self.model.fov_shape_zyx) // 2
        return tuple(
            slice(r + o - f, r + o + f + 1)
            for r, o, f in zip(self.radius, offset, fov_radius, strict=True)
        )

    def next_fov(self) -> Fov | None:
        """The next FOV, None when the example is done."""
        if self.shown is not None and self.examples.fov_policy == "max_pred_moves":
            threshold = logit(self.examples.move_threshold)
            moves = scored_move_offsets(
                self.seed[self._fov_box(self.shown)], self.model.deltas_zyx, threshold
            )
            self.queue.extend(self.shown + np.array(move) for _, move in moves)
        self.shown = None
        deltas = np.maximum(np.array(self.model.deltas_zyx), 1)
        max_offset = self.radius - np.array(self.model.fov_shape_zyx) // 2
        while self.queue:
            offset = self.queue.pop(0)
            if np.any(np.abs(offset) > max_offset):
                continue
            key = tuple(int(k) for k in offset // deltas)
            if key in self.visited:
                continue
            self.visited.add(key)
            self.shown = offset
            sel = self._fov_box(offset)
            return Fov(
                self.image[sel], self.seed[sel], self.labels[sel], tuple(int(o) for o in offset)
            )
        return None

    def __iter__(self) -> Iterator[Fov]:
        while (fov := self.next_fov()) is not None:
            yield fov

    def state(self) -> dict[str, np.ndarray]:
        return {
            "seed": self.seed,
            "queue": np.array(self.queue, dtype=np.int64).reshape(-1, 3),
            "visited": np.array(sorted(self.visited), dtype=np.int64).reshape(-1, 3),
            "shown": np.array([] if self.shown is None else [self.shown], np.int64).reshape(-1, 3),
        }

    def set_state(self, state: dict[str, np.ndarray]) -> None:
        self.seed[...] = state["seed"]
        self.queue = list(state["queue"].astype(int))
        self.visited = {tuple(int(k) for k in key) for key in state["visited"]}
        self.shown = state["shown"][0].astype(int) if len(state["shown"]) else None


class BatchStream:
    """`batch_size` trajectories in flight over this rank's coordinate shard.

    Example `i` of rank `rank` uses coordinate `perm_e[i % n]` of the shard, `perm_e` a permutation
    drawn per epoch `e = i // n`, and augments with a generator seeded by (seed, rank, i): the data
    order is fixed by the seed. `state()` (saved with the checkpoint) holds the cursor and the
    trajectories in flight; a stream built from it hands out what the saved one would have.
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
        state: bytes = b"",
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
        self._epoch, self._perm = -1, None
        self._current: list[Fov] = []
        if state:
            self._set_state(state, batch_size)
        else:
            self.examples_started = examples_started
            self._slots = [self._next_trajectory() for _ in range(batch_size)]

    def _coordinate(self, index: int) -> np.ndarray:
        n = len(self.coords)
        epoch = index // n
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = np.random.default_rng([self.seed, self.rank, epoch]).permutation(n)
        return self.coords[self._perm[index % n]]

    def _trajectory(self, index: int) -> Trajectory:
        rng = np.random.default_rng([self.seed, self.rank, index, 1])
        return Trajectory(self.volume, self._coordinate(index), self.model, self.examples, rng)

    def _next_trajectory(self) -> tuple[int, Trajectory]:
        index = self.examples_started
        self.examples_started += 1
        return index, self._trajectory(index)

    def next_batch(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(images, seeds, labels), each (batch, z, y, x, 1) float32."""
        self._current = []
        for i, (_, walk) in enumerate(self._slots):
            fov = walk.next_fov()
            while fov is None:  # trajectory finished: start the next example in this slot
                self._slots[i] = self._next_trajectory()
                fov = self._slots[i][1].next_fov()
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

    def state(self) -> bytes:
        """The cursor and the trajectories in flight, after `write_back` of the last batch."""
        arrays = {"examples_started": np.int64(self.examples_started)}
        for i, (index, walk) in enumerate(self._slots):
            arrays[f"{i}/index"] = np.int64(index)
            arrays |= {f"{i}/{name}": value for name, value in walk.state().items()}
        with io.BytesIO() as out:
            np.savez_compressed(out, **arrays)  # the seed canvases are mostly one value
            return out.getvalue()

    def _set_state(self, state: bytes, batch_size: int) -> None:
        with np.load(io.BytesIO(state)) as arrays:
            saved = {name: arrays[name] for name in arrays.files}
        self.examples_started = int(saved["examples_started"])
        if sum(name.endswith("/index") for name in saved) != batch_size:  # another batch size
            self._slots = [self._next_trajectory() for _ in range(batch_size)]
            return
        self._slots = []
        for i in range(batch_size):
            index = int(saved[f"{i}/index"])
            walk = self._trajectory(index)
            walk.set_state(
                {k.partition("/")[2]: v for k, v in saved.items() if k.startswith(f"{i}/")}
            )
            self._slots.append((index, walk))
