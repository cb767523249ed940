"""Data staging: put validated copies of the input volumes into the run directory.

Either the embedded synthetic data set (a training volume and a held-out volume from two seeds of
one preset) or the user's own HDF5 volumes. Staged files hold `raw` and, when known, `labels`,
with the voxel size; later stages read only these, so a run does not depend on files elsewhere
changing under it.
"""

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import h5py

from pipeline.errors import ConfigError
from pipeline.synthetic import PRESETS, generate
from pipeline.volumes import VolumeSpec, read_raw, read_volume_pair, write_volumes

STAGED_ATTR = "staged_from"


@dataclass(frozen=True)
class DataConfig:
    """The volumes of a run. With no files given, the synthetic preset is used for both."""

    synthetic_preset: str = "default"
    synthetic_shape_zyx: tuple[int, int, int] | None = None  # the preset's tissue in another box
    train_seed: int = 0
    eval_seed: int = 1
    train_raw: str = ""  # path.h5:dataset of your training image ...
    train_labels: str = ""  # ... and its ground truth
    eval_raw: str = ""  # the volume to segment; without eval_labels it is segmented, not scored
    eval_labels: str = ""
    voxel_size_nm: tuple[float, float, float] | None = None  # only for files without the attribute

    def __post_init__(self) -> None:
        if self.synthetic_preset not in PRESETS:
            raise ConfigError(
                f"synthetic_preset must be one of {sorted(PRESETS)}, got {self.synthetic_preset!r}"
            )
        if bool(self.train_raw) != bool(self.train_labels):
            raise ConfigError("give both train_raw and train_labels, or neither")
        if self.eval_labels and not self.eval_raw:
            raise ConfigError("eval_labels given without eval_raw")

    @property
    def synthetic(self) -> bool:
        return not self.train_raw and not self.eval_raw


def staged_complete(path: str | Path) -> bool:
    """A staged file is complete once it exists: it is written under a temporary name."""
    return Path(path).is_file()


def stage_synthetic(path: str | Path, preset: str, seed: int, shape_zyx=None) -> Path:
    config = dataclasses.replace(PRESETS[preset].with_geometry(shape_zyx), seed=seed)
    raw, labels = generate(config)
    provenance = json.dumps(
        {"synthetic_preset": preset, "seed": seed, "shape_zyx": config.shape_zyx}
    )
    return write_volumes(
        path, {"raw": raw, "labels": labels}, config.voxel_size_nm, {STAGED_ATTR: provenance}
    )


def stage_files(path: str | Path, raw_spec: str, labels_spec: str = "", voxel_size_nm=None) -> Path:
    """Validate the user's volume(s) and copy them in; labels are optional (then nothing is scored)."""
    if labels_spec:
        volume = read_volume_pair(raw_spec, labels_spec, voxel_size_nm=voxel_size_nm)
        arrays, voxel_size = {"raw": volume.raw, "labels": volume.labels}, volume.voxel_size_nm
    else:
        raw, voxel_size = read_raw(raw_spec, voxel_size_nm)
        arrays = {"raw": raw}
    provenance = json.dumps({"raw": str(VolumeSpec.parse(raw_spec)), "labels": labels_spec})
    return write_volumes(path, arrays, voxel_size, {STAGED_ATTR: provenance})


def has_labels(path: str | Path) -> bool:
    with h5py.File(path, "r") as f:
        return "labels" in f
