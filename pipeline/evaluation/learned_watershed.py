"""The baseline a lab tries on real EM before FFN: a seeded watershed over a learned boundary map.

A random forest (scikit-learn) tells boundary voxels from the rest by multiscale filter features
of the image (scikit-image's `multiscale_basic_features`: smoothed intensity, gradient magnitude
and Hessian eigenvalues at several scales, as ilastik's pixel classification), learned from the
boundaries between the bodies of a labeled training part. The watershed floods the smoothed
boundary probability from markers (connected regions where it is low); its few parameters are
chosen on a selection part by VI (`tune_watershed`), never on the part that is scored.
"""

import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import cc3d
import numpy as np
from scipy import ndimage
from skimage.feature import multiscale_basic_features
from skimage.segmentation import find_boundaries, watershed
from sklearn.ensemble import RandomForestClassifier

from pipeline.core.errors import BoundaryForestError, ConfigError, EmptyLabelsError
from pipeline.core.roi import with_context
from pipeline.evaluation.scores import score_segmentation


@dataclass(frozen=True)
class BoundaryForestConfig:
    """Features and forest. Scales in voxels; defaults as ilastik's usual pick (0.7 to 10)."""

    sigma_min: float = 0.7
    sigma_max: float = 10.0
    num_sigma: int = 5
    samples_per_class: int = 20000  # boundary and interior voxels drawn from the training part
    trees: int = 64
    max_depth: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.sigma_min <= self.sigma_max or self.num_sigma < 1:
            raise ConfigError("need 0 < sigma_min <= sigma_max and num_sigma >= 1")
        for name in ("samples_per_class", "trees", "max_depth"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class WatershedParams:
    """The watershed's parameters, the ones tuned on the selection part."""

    smoothing_sigma: float = 1.0  # voxels, of the probability map before flooding
    marker_threshold: float = 0.3  # markers: connected regions of probability below this ...
    min_marker_voxels: int = 50  # ... at least this large

    def __post_init__(self) -> None:
        if self.smoothing_sigma < 0 or not 0 < self.marker_threshold < 1:
            raise ConfigError("need smoothing_sigma >= 0 and 0 < marker_threshold < 1")
        if self.min_marker_voxels < 1:
            raise ConfigError(f"min_marker_voxels must be >= 1, got {self.min_marker_voxels}")


# What `tune_watershed` tries by default: 3 x 6 x 3 = 54 watersheds of the selection part.
DEFAULT_GRID = {
    "smoothing_sigma": (0.0, 1.0, 2.0),
    "marker_threshold": (0.02, 0.05, 0.1, 0.2, 0.3, 0.5),
    "min_marker_voxels": (20, 200, 1000),
}


def image_features(raw: np.ndarray, config: BoundaryForestConfig) -> np.ndarray:
    """(z, y, x, features) float32 of a (z, y, x) uint8 image."""
    return multiscale_basic_features(
        raw.astype(np.float32) / 255.0,
        sigma_min=config.sigma_min,
        sigma_max=config.sigma_max,
        num_sigma=config.num_sigma,
    ).astype(np.float32, copy=False)


def boundary_targets(labels: np.ndarray) -> np.ndarray:
    """True on voxels at a boundary between two bodies (both sides) or unlabeled (0)."""
    return find_boundaries(labels, connectivity=1, mode="thick") | (labels == 0)


def train_boundary_forest(
    raw: np.ndarray, labels: np.ndarray, config: BoundaryForestConfig
) -> RandomForestClassifier:
    """A forest whose class 1 is `boundary_targets`, from a balanced sample of the voxels."""
    if raw.shape != labels.shape:
        raise ConfigError(f"image {raw.shape} and labels {labels.shape} differ in shape")
    if not labels.any():
        raise EmptyLabelsError("the training labels are all 0: no bodies to learn boundaries from")
    target = boundary_targets(labels).ravel()
    rng = np.random.default_rng(config.seed)
    picked = np.concatenate(
        [
            rng.choice(where, min(config.samples_per_class, len(where)), replace=False)
            for where in (np.flatnonzero(target), np.flatnonzero(~target))
        ]
    )
    features = image_features(raw, config).reshape(-1, _feature_count(raw, config))[picked]
    forest = RandomForestClassifier(
        n_estimators=config.trees,
        max_depth=config.max_depth,
        n_jobs=-1,
        random_state=config.seed,
    )
    return forest.fit(features, target[picked])


def _feature_count(raw: np.ndarray, config: BoundaryForestConfig) -> int:
    per_scale = 2 + raw.ndim  # intensity, gradient magnitude, Hessian eigenvalues
    return per_scale * config.num_sigma


def check_boundary_forest(forest: object, config: BoundaryForestConfig, where: str) -> None:
    """Refuse (`BoundaryForestError`, naming `where`) anything but a forest of boundaries learned
    on `config`'s features of a 3-D image."""
    if not isinstance(forest, RandomForestClassifier):
        raise BoundaryForestError(f"{where}: a {type(forest).__name__}, not a random forest")
    expected = _feature_count(np.empty((1, 1, 1)), config)
    if getattr(forest, "n_features_in_", None) != expected or list(forest.classes_) != [0, 1]:
        raise BoundaryForestError(
            f"{where}: a forest of {getattr(forest, 'n_features_in_', 'no')} features and "
            f"classes {list(getattr(forest, 'classes_', []))}; a boundary forest has {expected} "
            "features of a 3-D image and the classes [False, True]"
        )


def boundary_probability(
    forest: RandomForestClassifier, raw: np.ndarray, config: BoundaryForestConfig
) -> np.ndarray:
    """P(boundary) per voxel, float32, the shape of `raw`."""
    features = image_features(raw, config).reshape(-1, _feature_count(raw, config))
    boundary = list(forest.classes_).index(True)
    return forest.predict_proba(features)[:, boundary].astype(np.float32).reshape(raw.shape)


def learned_boundary_map(
    train: tuple[np.ndarray, np.ndarray],
    raw: np.ndarray,
    config: BoundaryForestConfig | None = None,
) -> np.ndarray:
    """P(boundary) of `raw` by a forest learned on `train` (image, labels)."""
    config = config or BoundaryForestConfig()
    return boundary_probability(train_boundary_forest(*train, config), raw, config)


def feature_margin(config: BoundaryForestConfig) -> int:
    """Voxels of image around a box that its features depend on: the widest Gaussian (scikit-image
    truncates at 4 sigma), its gradient and its Hessian."""
    return math.ceil(4 * config.sigma_max) + 3


def box_boundary_probability(
    forest: RandomForestClassifier,
    read_raw: Callable[[tuple[slice, ...]], np.ndarray],
    box: tuple[slice, ...],
    volume_shape: Sequence[int],
    config: BoundaryForestConfig,
) -> np.ndarray:
    """P(boundary) of one box of a volume, as `boundary_probability` of the whole volume gives it,
    from the box and `feature_margin` voxels of image around it (as far as the volume goes)."""
    grown, inner = with_context(box, feature_margin(config), volume_shape)
    return boundary_probability(forest, read_raw(grown), config)[inner]


def watershed_segmentation(probability: np.ndarray, params: WatershedParams) -> np.ndarray:
    """uint64 ids 1..N, every voxel assigned to the marker it floods from."""
    landscape = (
        ndimage.gaussian_filter(probability, params.smoothing_sigma)
        if params.smoothing_sigma
        else probability
    )
    markers = cc3d.connected_components(landscape < params.marker_threshold, connectivity=6)
    markers = cc3d.dust(markers, params.min_marker_voxels, connectivity=6)
    return watershed(landscape, markers).astype(np.uint64)


def tune_watershed(
    probability: np.ndarray, labels: np.ndarray, grid: dict[str, Iterable] | None = None
) -> tuple[WatershedParams, list[dict]]:
    """The parameters of `grid` (default `DEFAULT_GRID`) with the lowest VI against `labels`, and
    every trial's {parameters, vi, vi_split, vi_merge}, in the order tried."""
    grid = grid or DEFAULT_GRID
    trials = []
    for values in itertools.product(*grid.values()):
        params = WatershedParams(**dict(zip(grid, values, strict=True)))
        scores = score_segmentation(watershed_segmentation(probability, params), labels)
        trials.append(
            {**dict(zip(grid, values, strict=True)), "vi": scores.vi}
            | {"vi_split": scores.vi_split, "vi_merge": scores.vi_merge}
        )
    best = min(range(len(trials)), key=lambda i: trials[i]["vi"])
    return WatershedParams(**{k: trials[best][k] for k in grid}), trials


@dataclass(frozen=True, eq=False)
class LearnedWatershed:
    """A volume segmented the way a lab would before FFN: the watershed over a forest's map,
    tuned on a selection part (every trial kept), and the seconds each step took."""

    segmentation: np.ndarray
    params: WatershedParams
    trials: list[dict]
    seconds: dict[str, float]

    def record(self) -> dict:
        params, trials, seconds = self.params.__dict__, self.trials, self.seconds
        return {"params": params, "tuning_trials": trials, "seconds": seconds}


def learned_watershed(
    forest: RandomForestClassifier,
    select: tuple[np.ndarray, np.ndarray],
    raw: np.ndarray,
    config: BoundaryForestConfig | None = None,
) -> LearnedWatershed:
    """Tune the watershed over `forest`'s map (learned on a training part by
    `train_boundary_forest`) on `select` (image, labels), segment `raw`; no part sees another's
    labels."""
    config = config or BoundaryForestConfig()
    started = time.perf_counter()
    params, trials = tune_watershed(boundary_probability(forest, select[0], config), select[1])
    tuned = time.perf_counter()
    segmentation = watershed_segmentation(boundary_probability(forest, raw, config), params)
    seconds = {"tune": tuned - started, "segment": time.perf_counter() - tuned}
    return LearnedWatershed(segmentation, params, trials, seconds)
