"""Data staging: put validated copies of the input volumes into the run directory.

Either the embedded synthetic data set (a training volume and a held-out volume from two seeds of
one preset) or the user's own HDF5 volumes. Staged files hold `raw` and, when known, `labels`,
with the voxel size; later stages read only these, so a run does not depend on files elsewhere
changing under it.
"""

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import h5py

from pipeline.errors import ConfigError, VolumeShapeError, VoxelSizeError
from pipeline.stamps import digest_arrays
from pipeline.synthetic import PRESETS, generate
from pipeline.volumes import VolumeSpec, read_header, read_raw, read_volume_pair, write_volumes

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


def role_settings(data: DataConfig, role: str) -> dict:
    """The settings staging one role's volume depends on ("train" or "eval"): another role's
    change must not re-stage this one."""
    if data.synthetic:
        seed = data.train_seed if role == "train" else data.eval_seed
        shape = data.synthetic_shape_zyx
        return {
            "role": role,
            "synthetic_preset": data.synthetic_preset,
            "seed": seed,
            "shape_zyx": shape,
        }
    raw, labels = (
        (data.train_raw, data.train_labels)
        if role == "train"
        else (data.eval_raw, data.eval_labels)
    )
    return {"role": role, "raw": raw, "labels": labels, "voxel_size_nm": data.voxel_size_nm}


def source_files(data: DataConfig, role: str) -> list[Path]:
    """The user's files a role's volume is read from (none for synthetic data)."""
    specs = [role_settings(data, role).get(key, "") for key in ("raw", "labels")]
    return sorted({VolumeSpec.parse(spec).path for spec in specs if spec})


def check_sources(data: DataConfig, min_shape_zyx: Sequence[int]) -> None:
    """Before any job is submitted: every user volume opens, names an existing 3-D dataset of an
    accepted dtype with a voxel size, raw and labels agree in shape and voxel size, and each is at
    least `min_shape_zyx` (the FOV). Reads no voxels."""
    for role in ("train", "eval"):
        settings = role_settings(data, role)
        headers = [
            read_header(settings[key], data.voxel_size_nm, labels=key == "labels")
            for key in ("raw", "labels")
            if settings.get(key)
        ]
        if len({h.shape for h in headers}) > 1:
            shapes = {str(h.spec): h.shape for h in headers}
            raise VolumeShapeError(f"{role} volume: raw and labels differ in shape: {shapes}")
        if len({h.voxel_size_nm for h in headers}) > 1:
            sizes = {str(h.spec): h.voxel_size_nm for h in headers}
            raise VoxelSizeError(
                f"{role} volume: raw and labels differ in voxel size (nm): {sizes}"
            )
        for header in headers:
            if any(s < m for s, m in zip(header.shape, min_shape_zyx, strict=True)):
                raise VolumeShapeError(
                    f"{header.spec}: shape {header.shape} (z, y, x) is smaller than the field of view "
                    f"{tuple(min_shape_zyx)}"
                )


def stage_role(path: str | Path, settings: dict) -> str:
    """Stage the volume `role_settings` describes; returns the digest of what was staged (the
    token of pipeline.stamps)."""
    if "synthetic_preset" in settings:
        preset, seed, shape = (settings[k] for k in ("synthetic_preset", "seed", "shape_zyx"))
        return stage_synthetic(path, preset, seed, tuple(shape) if shape else None)
    return stage_files(path, settings["raw"], settings["labels"], settings["voxel_size_nm"])


def stage_synthetic(path: str | Path, preset: str, seed: int, shape_zyx=None) -> str:
    config = dataclasses.replace(PRESETS[preset].with_geometry(shape_zyx), seed=seed)
    raw, labels = generate(config)
    provenance = json.dumps(
        {"synthetic_preset": preset, "seed": seed, "shape_zyx": config.shape_zyx}
    )
    arrays = {"raw": raw, "labels": labels}
    write_volumes(path, arrays, config.voxel_size_nm, {STAGED_ATTR: provenance})
    return digest_arrays(arrays, [float(v) for v in config.voxel_size_nm])


def stage_files(path: str | Path, raw_spec: str, labels_spec: str = "", voxel_size_nm=None) -> str:
    """Validate the user's volume(s) and copy them in; labels are optional (then nothing is scored).
    Returns the digest of the content read."""
    if labels_spec:
        volume = read_volume_pair(raw_spec, labels_spec, voxel_size_nm=voxel_size_nm)
        arrays, voxel_size = {"raw": volume.raw, "labels": volume.labels}, volume.voxel_size_nm
    else:
        raw, voxel_size = read_raw(raw_spec, voxel_size_nm)
        arrays = {"raw": raw}
    provenance = json.dumps({"raw": str(VolumeSpec.parse(raw_spec)), "labels": labels_spec})
    write_volumes(path, arrays, voxel_size, {STAGED_ATTR: provenance})
    return digest_arrays(arrays, [float(v) for v in voxel_size])


def has_labels(path: str | Path) -> bool:
    with h5py.File(path, "r") as f:
        return "labels" in f
