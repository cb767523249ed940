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
import numpy as np

from pipeline import stamps
from pipeline.errors import ConfigError, EmptyLabelsError, VolumeShapeError, VoxelSizeError
from pipeline.roi import Roi, check_apart, check_roi
from pipeline.stamps import VolumeDigest, digest_volumes
from pipeline.synthetic import PRESETS, generate
from pipeline.volumes import (
    VolumeSpec,
    new_volumes,
    read_bricks,
    read_header,
    write_volumes,
)

STAGED_ATTR = "staged_from"
SCORED_ATTR = "scored_roi"  # z0:z1, y0:y1, x0:x1 within the staged volume


@dataclass(frozen=True)
class DataConfig:
    """The volumes of a run: training, checkpoint selection, evaluation. With no files given,
    three volumes of the synthetic preset (three seeds)."""

    synthetic_preset: str = "default"
    synthetic_shape_zyx: tuple[int, int, int] | None = None  # the preset's tissue in another box
    train_seed: int = 0
    eval_seed: int = 1
    select_seed: int = 2
    # Volumes: path.h5:dataset, path.zarr:array or precomputed://file:///layer.
    train_raw: str = ""  # your training image ...
    train_labels: str = ""  # ... and its ground truth
    eval_raw: str = ""  # the volume to segment; without eval_labels it is segmented, not scored
    eval_labels: str = ""
    # Selection scores checkpoints on a labeled part of its own: these files, or without them
    # select_roi of the training file; with neither, on the training volume.
    select_raw: str = ""
    select_labels: str = ""
    # Parts of the files, "z0:z1, y0:y1, x0:x1" (voxels, stop excluded); "" = the whole volume.
    # Parts of one file must not overlap.
    train_roi: str = ""
    select_roi: str = ""
    eval_roi: str = ""
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
        if bool(self.select_raw) != bool(self.select_labels):
            raise ConfigError("give both select_raw and select_labels, or neither")
        if self.synthetic and (self.select_raw or any(self.rois.values())):
            raise ConfigError(
                "select_raw and the ROIs are parts of your files: give train_raw and eval_raw too"
            )
        if self.select_roi and not (self.select_raw or self.train_raw):
            raise ConfigError("select_roi is a part of select_raw, or of train_raw")
        for name, text in self.rois.items():
            if text:
                Roi.parse(text, name)

    @property
    def rois(self) -> dict[str, str]:
        return {
            "train_roi": self.train_roi,
            "select_roi": self.select_roi,
            "eval_roi": self.eval_roi,
        }

    @property
    def has_select_part(self) -> bool:
        """Whether selection has a volume of its own (else it scores on the training volume)."""
        return self.synthetic or bool(self.select_raw or self.select_roi)

    @property
    def synthetic(self) -> bool:
        return not self.train_raw and not self.eval_raw


ROLES = ("train", "select", "eval")


def _role_files(data: DataConfig, role: str) -> tuple[str, str]:
    if role == "select" and not data.select_raw:  # a part of the training file
        return data.train_raw, data.train_labels
    return getattr(data, f"{role}_raw"), getattr(data, f"{role}_labels")


def role_settings(data: DataConfig, role: str, context_zyx: Sequence[int] = (0, 0, 0)) -> dict:
    """The settings staging one role's volume depends on ("train", "select" or "eval"): another
    role's change must not re-stage this one. An evaluated ROI is staged with `context_zyx`
    voxels around it (where the volume has them) and scored inside only, so objects at its faces
    can be seeded and followed."""
    if data.synthetic:
        seed = getattr(data, f"{role}_seed")
        shape = data.synthetic_shape_zyx
        return {
            "role": role,
            "synthetic_preset": data.synthetic_preset,
            "seed": seed,
            "shape_zyx": shape,
        }
    raw, labels = _role_files(data, role)
    roi = getattr(data, f"{role}_roi")
    settings = {"role": role, "raw": raw, "labels": labels, "voxel_size_nm": data.voxel_size_nm}
    if not roi:
        return settings
    context = [int(c) for c in context_zyx] if role == "eval" else [0, 0, 0]
    return settings | {"roi": str(Roi.parse(roi)), "context_zyx": context}


def source_files(data: DataConfig, role: str) -> list[Path]:
    """The user's files a role's volume is read from (none for synthetic data), by which a
    resume notices a changed source: of a precomputed layer, its metadata (`info`), not the
    chunk files of a volume that may hold millions."""
    specs = [
        VolumeSpec.parse(s) for s in map(role_settings(data, role).get, ("raw", "labels")) if s
    ]
    return sorted({spec.path / "info" if spec.precomputed else spec.path for spec in specs})


def check_sources(data: DataConfig, min_shape_zyx: Sequence[int]) -> None:
    """Before any job is submitted: every user volume opens, names an existing 3-D dataset of an
    accepted dtype with a voxel size, raw and labels agree in shape and voxel size, each part
    (ROI) lies inside its volume and is at least `min_shape_zyx` (the FOV), and the parts of one
    file do not overlap. Reads no voxels."""
    parts_of: dict[Path, dict[str, Roi]] = {}
    for role in ROLES:
        if data.synthetic or (role == "select" and not data.has_select_part):
            continue
        raw, labels = _role_files(data, role)
        if not raw:
            if role == "eval":
                raise ConfigError("no volume to segment: give eval_raw")
            continue  # inference only: no training or selection volume
        headers = [
            read_header(spec, data.voxel_size_nm, labels=key == "labels")
            for key, spec in (("raw", raw), ("labels", labels))
            if spec
        ]
        if len({h.shape for h in headers}) > 1:
            shapes = {str(h.spec): h.shape for h in headers}
            raise VolumeShapeError(f"{role} volume: raw and labels differ in shape: {shapes}")
        if len({h.voxel_size_nm for h in headers}) > 1:
            sizes = {str(h.spec): h.voxel_size_nm for h in headers}
            raise VoxelSizeError(
                f"{role} volume: raw and labels differ in voxel size (nm): {sizes}"
            )
        shape, roi_text = headers[0].shape, getattr(data, f"{role}_roi")
        part = Roi.parse(roi_text, f"{role}_roi") if roi_text else Roi.whole(shape)
        where = f"{role}_roi" if roi_text else str(headers[0].spec)
        check_roi(part, shape, min_shape_zyx, where)
        parts_of.setdefault(headers[0].spec.path.resolve(), {})[f"{role} part"] = part
    for parts in parts_of.values():
        check_apart(parts)


def stage_role(path: str | Path, settings: dict) -> str:
    """Stage the volume `role_settings` describes; returns the digest of what was staged (the
    token of pipeline.stamps)."""
    if "synthetic_preset" in settings:
        preset, seed, shape = (settings[k] for k in ("synthetic_preset", "seed", "shape_zyx"))
        return stage_synthetic(path, preset, seed, tuple(shape) if shape else None)
    return stage_files(
        path,
        settings["raw"],
        settings["labels"],
        settings["voxel_size_nm"],
        settings.get("roi", ""),
        settings.get("context_zyx", (0, 0, 0)),
    )


def stage_synthetic(path: str | Path, preset: str, seed: int, shape_zyx=None) -> str:
    config = dataclasses.replace(PRESETS[preset].with_geometry(shape_zyx), seed=seed)
    raw, labels = generate(config)
    provenance = json.dumps(
        {"synthetic_preset": preset, "seed": seed, "shape_zyx": config.shape_zyx}
    )
    arrays = {"raw": raw, "labels": labels}
    write_volumes(path, arrays, config.voxel_size_nm, {STAGED_ATTR: provenance})
    return digest_volumes(arrays, [float(v) for v in config.voxel_size_nm])


def stage_files(
    path: str | Path,
    raw_spec: str,
    labels_spec: str = "",
    voxel_size_nm=None,
    roi: str = "",
    context_zyx: Sequence[int] = (0, 0, 0),
) -> str:
    """Validate the user's volume(s) and copy them, or their `roi` with `context_zyx` around it,
    in; labels are optional (then nothing is scored). The staged region is copied brick by brick
    (`volumes.read_bricks`), so the memory of staging does not grow with the volume. The scored
    part within the staged volume is its attribute `scored_roi`. Returns the digest of the
    content read."""
    raw = read_header(raw_spec, voxel_size_nm)
    shape, voxel_size = raw.shape, raw.voxel_size_nm
    sources = {"raw": raw}
    if labels_spec:
        sources["labels"] = read_header(labels_spec, voxel_size, labels=True)
        if sources["labels"].shape != shape:
            raise VolumeShapeError(
                f"{labels_spec}: labels shape {sources['labels'].shape} differs from raw "
                f"{raw_spec} shape {shape}"
            )
    part = Roi.parse(roi) if roi else Roi.whole(shape)
    check_roi(part, shape, (1, 1, 1), f"{raw_spec}: ROI")
    staged = part.grown(context_zyx, shape)
    provenance = json.dumps(
        {
            "raw": str(VolumeSpec.parse(raw_spec)),
            "labels": labels_spec,
            "roi": roi,
            "staged": str(staged),
            "source_shape_zyx": list(shape),
            "voxel_size_nm": list(voxel_size),
        }
    )
    attrs, described = {STAGED_ATTR: provenance}, [float(v) for v in voxel_size]
    if roi:  # the digest of a whole volume is the same, staged from a file or generated
        attrs[SCORED_ATTR] = str(part.relative_to(staged))
        described = [described, attrs[SCORED_ATTR]]
    dtypes = {"raw": np.uint8, "labels": np.uint64}
    layout = {name: (staged.shape, dtypes[name]) for name in sources}
    sha, labeled = VolumeDigest(described), False
    scored = part.relative_to(staged)
    with new_volumes(path, layout, voxel_size, attrs) as datasets:
        for name in sources:
            sha.begin(name, dtypes[name], staged.shape)
            bricks = read_bricks(sources[name].spec, staged.slices, stamps.BRICK, name == "labels")
            for start, brick in bricks:
                box = Roi(start, tuple(a + n for a, n in zip(start, brick.shape, strict=True)))
                datasets[name][box.slices] = brick
                sha.update(name, start, brick)
                if name == "labels" and not labeled and box.overlaps(scored):
                    low = np.maximum(box.start, scored.start) - box.start
                    high = np.minimum(box.stop, scored.stop) - box.start
                    labeled = bool(brick[tuple(map(slice, low, high))].any())
        if labels_spec and not labeled:
            raise EmptyLabelsError(f"{labels_spec}: no labeled voxel in the ROI {part}")
    return sha.hexdigest()


def scored_part(path: str | Path) -> Roi | None:
    """The part of a staged volume that is scored (None: all of it)."""
    with h5py.File(path, "r") as f:
        text = f.attrs.get(SCORED_ATTR)
    return Roi.parse(str(text)) if text else None


def has_labels(path: str | Path) -> bool:
    with h5py.File(path, "r") as f:
        return "labels" in f
