"""The untuned baseline: a seeded watershed of the image, markers from FFN's own edge distance."""

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from scipy import ndimage
from skimage.morphology import h_maxima
from skimage.segmentation import watershed

from pipeline.core.errors import ConfigError, VolumeShapeError
from pipeline.inference.flood_fill import InferenceConfig, edge_distance

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class WatershedConfig:
    """The seeded-watershed baseline. `edges` are FFN's seed-policy settings (its edge map)."""

    edges: InferenceConfig = dataclasses.field(default_factory=InferenceConfig)
    # Whether evaluation runs it: it segments the whole image in one process, which a volume
    # larger than a node's memory cannot afford (FFN is then scored alone).
    enabled: bool = True
    # Where the run has a labelled training part: the watershed a lab would tune instead, a
    # boundary forest learned on that part and its parameters chosen on the selection part
    # (pipeline.evaluation.learned_watershed), a far harder baseline than the untuned one below.
    learned: bool = True
    # Markers: maxima of the edge distance at least this much (voxels) above their surroundings.
    marker_h: float = 1.0
    smoothing_sigma_zyx: tuple[float, float, float] = (0.5, 1.0, 1.0)

    def __post_init__(self) -> None:
        if len(self.smoothing_sigma_zyx) != 3 or min(self.smoothing_sigma_zyx) < 0:
            raise ConfigError(
                f"smoothing_sigma_zyx must be 3 numbers >= 0, got {self.smoothing_sigma_zyx}"
            )
        if self.marker_h <= 0:
            raise ConfigError(f"marker_h must be > 0, got {self.marker_h}")


def watershed_baseline(raw: np.ndarray, config: WatershedConfig | None = None) -> np.ndarray:
    """Seeded watershed of a (z, y, x) uint8 image: uint64 ids 1..N, every voxel assigned.

    Markers are the h-maxima of the distance to FFN's edges (plain peaks, as FFN seeds from, give
    several markers per object and split far more); the flooded landscape is the smoothed image,
    inverted so that dark membranes are ridges.
    """
    if raw.ndim != 3:
        raise VolumeShapeError(f"raw image must be 3-D (z, y, x), got shape {raw.shape}")
    config = config or WatershedConfig()
    markers, _ = ndimage.label(h_maxima(edge_distance(raw, config.edges), config.marker_h))
    landscape = -ndimage.gaussian_filter(raw.astype(np.float32), config.smoothing_sigma_zyx)
    return watershed(landscape, markers).astype(np.uint64)
