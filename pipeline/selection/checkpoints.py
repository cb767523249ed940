"""Checkpoint selection: score the last checkpoints of a training run on a held-out volume.

The score is the voxel F1 of the network's first prediction in one FOV around each of a set of
held-out coordinates (sampled as training samples them, balanced over `pipeline.preprocess.partitions`
classes), averaged over the FOVs: the same task training optimises, on data it never saw.
Optionally each checkpoint also segments a central crop of the held-out volume and is scored by
its variation of information, which sees what F1 cannot (movement, merges), at far higher cost;
`criterion` picks which of the two decides.

A candidate whose files cannot be read (cut short by a full disk or a killed copy) is set aside
in `checkpoints/unreadable/`, as training does, and the checkpoint before it takes its place; the
workflow's select task records the chosen checkpoint's files (size, mtime) in its stamp, so a
chosen checkpoint damaged later runs the selection again (pipeline.core.stamps, "checked").

The choice is written atomically to `selection.json` (`selection_done` is the stage's check) with
every candidate's scores; `pipeline.inference.flood_fill` accepts that file in place of a checkpoint. A
checkpoint inside the folder of the selection file (the run dir) is named relative to it, and read
back against the folder the file is in now (`chosen_checkpoint`): a run dir moved or copied uses its
own weights. A checkpoint outside it (a pretrained model) is named by its absolute path.

CLI: `python -m pipeline.cli.selection --train-dir RUN --raw held.h5:raw --labels held.h5:labels`.
"""

import glob
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.core import config_io
from pipeline.core.atomic import atomic_path
from pipeline.core.errors import CheckpointError, ConfigError, first_line
from pipeline.core.stamps import digest, digest_files, forget
from pipeline.data.volumes import LabeledVolume
from pipeline.evaluation.scores import score_segmentation
from pipeline.inference.flood_fill import (
    InferenceConfig,
    Predictor,
    checkpoint_model_config,
    make_model_predictor,
    predictor_from_checkpoint,
    segment,
)
from pipeline.network.model import (
    ModelConfig,
    UnreadableCheckpoint,
    build_model,
    load_weights,
    logit,
    normalize_image,
)
from pipeline.preprocess.partitions import DEFAULT_THRESHOLDS, build_coordinates, compute_partitions

SELECTION_FILE = "selection.json"
CRITERIA = ("fov_f1", "vi")


@dataclass(frozen=True)
class SelectionConfig:
    last_checkpoints: int = 3  # the candidates: this many of the newest checkpoints ...
    # ... and a fine-tune's starting weights (ckpt-0), so that a fine-tune worse than its start
    # on the held-out part is not taken.
    start_as_candidate: bool = False
    # FOVs of the held-out volume each candidate predicts (balanced as training's coordinates).
    held_out_fovs: int = 128
    seed: int = 0  # sampling of the held-out coordinates
    # FOVs predicted together.
    batch_size: int = 8
    criterion: str = "fov_f1"  # or "vi" (needs vi_crop_zyx)
    # Also segment this central crop with each checkpoint and score its VI; (0, 0, 0): don't.
    vi_crop_zyx: tuple[int, int, int] = (0, 0, 0)
    inference: InferenceConfig = field(default_factory=InferenceConfig)

    def __post_init__(self) -> None:
        for name in ("last_checkpoints", "held_out_fovs", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.criterion not in CRITERIA:
            raise ConfigError(f"criterion must be one of {CRITERIA}, got {self.criterion!r}")
        crop = tuple(self.vi_crop_zyx)
        if len(crop) != 3 or not (min(crop) >= 1 or crop == (0, 0, 0)):
            raise ConfigError(f"vi_crop_zyx must be 3 sizes >= 1, or 0 0 0 (off), got {crop}")
        if self.criterion == "vi" and crop == (0, 0, 0):
            raise ConfigError("criterion 'vi' needs vi_crop_zyx (the crop to segment)")


def list_checkpoints(train_dir: str | Path) -> list[Path]:
    """The checkpoints `TRAIN_DIR/checkpoints/ckpt-N` (paths without suffix), oldest first."""
    found = []
    for index in (Path(train_dir) / "checkpoints").glob("ckpt-*.index"):
        if match := re.fullmatch(r"ckpt-(\d+)\.index", index.name):
            found.append((int(match[1]), index.with_suffix("")))
    return [path for _, path in sorted(found)]


def candidate_checkpoints(
    train_dir: str | Path, config: SelectionConfig, excluding: Sequence[Path] = ()
) -> list[Path]:
    """The newest `config.last_checkpoints` checkpoints, and with `config.start_as_candidate`
    a fine-tune's starting weights (step 0) where it wrote them; `excluding`: checkpoints not
    counted (found unreadable)."""
    found = [c for c in list_checkpoints(train_dir) if c not in excluding]
    last = config.last_checkpoints
    start = [c for c in found[:-last] if checkpoint_step(c) == 0 and config.start_as_candidate]
    return start + found[-last:]


def recorded_path(path: str | Path, folder: str | Path) -> str:
    """How a record in `folder` (a run dir) names `path`: relative to `folder` with "/" when it
    lies inside it, so a moved or copied folder names its own file; else absolute."""
    path, folder = Path(os.path.abspath(path)), Path(os.path.abspath(folder))
    for inside, root in ((path, folder), (path.resolve(), folder.resolve())):
        if inside.is_relative_to(root):
            return inside.relative_to(root).as_posix()
    return str(path)


def checkpoint_files(checkpoint: str | Path) -> list[Path]:
    """The files of checkpoint `checkpoint` (`ckpt-N.index`, `ckpt-N.data-...`), sorted."""
    checkpoint = Path(checkpoint)
    return sorted(checkpoint.parent.glob(glob.escape(checkpoint.name) + ".*"))


def _has_files(checkpoint: Path) -> bool:
    return any(checkpoint.parent.glob(glob.escape(checkpoint.name) + ".*"))


def resolve_recorded(recorded: str, folder: str | Path) -> Path:
    """The path a record in `folder` names (`recorded_path`): a relative one against `folder`,
    where the record is now. An absolute one (a file outside the folder, or a record written
    before paths were relative) as it is while it exists; when it is gone (a run dir moved
    since), the same path's longest tail found under `folder`, else as it is (its reader names
    it missing)."""
    path = Path(recorded)
    if not path.is_absolute():
        return Path(folder) / path
    if _has_files(path) or path.exists():
        return path
    for start in range(1, len(path.parts) - 1):
        local = Path(folder).joinpath(*path.parts[start:])
        if _has_files(local):
            return local
    return path


def checkpoint_step(checkpoint: str | Path) -> int:
    return int(Path(checkpoint).name.rpartition("-")[2])


def held_out_coordinates(
    labels: np.ndarray, model: ModelConfig, count: int, seed: int, min_object_voxels: int = 0
) -> np.ndarray:
    """`count` FOV centres (N, 3) zyx, balanced over FFN's partition classes as in training (local
    object mask radius: the FOV's; objects under `min_object_voxels` left out as training leaves
    them out), all at least a FOV radius from the border."""
    radius = tuple(int(f) // 2 for f in model.fov_shape_zyx)
    partitions = compute_partitions(
        labels, DEFAULT_THRESHOLDS, radius, radius, min_object_voxels=min_object_voxels
    )
    # Shuffled and balanced: any prefix is a balanced sample in expectation.
    return build_coordinates(partitions, count, seed)[:count]


def fov_f1(
    predict: Predictor,
    volume: LabeledVolume,
    coords: np.ndarray,
    model: ModelConfig,
    *,
    batch_size: int = 8,
    seed_probability: float = 0.95,
    pad_probability: float = 0.05,
) -> float:
    """Mean over FOVs of the voxel F1 of one prediction (object: p >= 0.5) against the object
    under the FOV's centre; the seed is set as at the start of inference."""
    radius = np.array(model.fov_shape_zyx) // 2
    seed = np.full(model.fov_shape_zyx, logit(pad_probability), np.float32)
    seed[tuple(radius)] = logit(seed_probability)
    scores = []
    for first in range(0, len(coords), batch_size):
        batch = coords[first : first + batch_size]
        boxes = [
            tuple(slice(c - r, c + r + 1) for c, r in zip(p, radius, strict=True)) for p in batch
        ]
        images = np.stack([normalize_image(volume.raw[b], model) for b in boxes])[..., None]
        seeds = np.broadcast_to(seed[..., None], images.shape).copy()
        predicted = np.asarray(predict(images, seeds))[..., 0] >= 0
        for box, centre, guess in zip(boxes, batch, predicted, strict=True):
            truth = volume.labels[box] == volume.labels[tuple(centre)]
            tp = np.count_nonzero(guess & truth)
            scores.append(2 * tp / (np.count_nonzero(guess) + np.count_nonzero(truth)))
    return float(np.mean(scores))


def _recorded_losses(metrics_csv: Path) -> dict[int, float]:
    """The training loss logged at each step (metrics.csv), where there is one."""
    from pipeline.training.train_metrics import read_metrics

    if not metrics_csv.is_file():
        return {}
    metrics = read_metrics(metrics_csv)
    return {
        int(step): float(loss) for step, loss in zip(metrics["step"], metrics["loss"], strict=True)
    }


def _unusable(model, checkpoint: Path, losses: dict[int, float]) -> str | None:
    """Why a checkpoint must not be selected (loaded into `model` otherwise), or None; a
    checkpoint whose files cannot be read raises UnreadableCheckpoint."""
    loss = losses.get(checkpoint_step(checkpoint))
    if loss is not None and not np.isfinite(loss):
        return f"its recorded training loss is {loss}"
    try:
        load_weights(model, str(checkpoint))
    except UnreadableCheckpoint:
        raise
    except CheckpointError as exc:
        return first_line(exc)
    if not all(np.all(np.isfinite(w)) for w in model.get_weights()):
        return "its weights are not all finite"
    return None


def set_aside_unreadable(checkpoints: Sequence[Path]) -> Path | None:
    """Move the files of `checkpoints` (unreadable) to their folder's `unreadable/`, as training
    does (pipeline.training.trainer), and drop them from the folder's checkpoint state, so that
    neither a later selection nor a training that goes on takes them. Returns that folder."""
    import tensorflow as tf

    if not checkpoints:
        return None
    directory = checkpoints[0].parent
    folder = directory / "unreadable"
    folder.mkdir(exist_ok=True)
    for checkpoint in checkpoints:
        for file in checkpoint_files(checkpoint):
            os.replace(file, folder / file.name)
    names = {c.name for c in checkpoints}
    state = tf.train.get_checkpoint_state(str(directory))
    if state is not None:
        # Names, not paths, as training writes them: a run dir moved later reads its own.
        kept = [Path(p).name for p in state.all_model_checkpoint_paths]
        kept = [name for name in kept if name not in names]
        latest = Path(state.model_checkpoint_path).name
        if latest in names:
            latest = kept[-1] if kept else ""
        if latest:
            tf.compat.v1.train.update_checkpoint_state(
                str(directory), latest, all_model_checkpoint_paths=kept
            )
    return folder


def _central_crop(shape: Sequence[int], crop: Sequence[int]) -> tuple[slice, ...]:
    size = [min(c, s) for c, s in zip(crop, shape, strict=True)]
    return tuple(slice((s - c) // 2, (s - c) // 2 + c) for s, c in zip(shape, size, strict=True))


def _score(
    checkpoint: Path,
    predict: Predictor,
    volume: LabeledVolume,
    coords: np.ndarray,
    model_config: ModelConfig,
    config: SelectionConfig,
    output: Path,
) -> dict:
    """The scores of `checkpoint`, whose weights `predict` holds."""
    row = {
        "checkpoint": recorded_path(checkpoint, output.parent),
        "step": checkpoint_step(checkpoint),
        "fov_f1": fov_f1(
            predict,
            volume,
            coords,
            model_config,
            batch_size=config.batch_size,
            seed_probability=config.inference.seed_probability,
            pad_probability=config.inference.pad_probability,
        ),
    }
    if min(config.vi_crop_zyx) > 0:
        crop = _central_crop(volume.shape, config.vi_crop_zyx)
        segmentation, _ = segment(volume.raw[crop], predict, model_config, config.inference)
        row |= score_segmentation(segmentation, volume.labels[crop]).to_dict()
    return row


def select_checkpoint(
    train_dir: str | Path,
    volume: LabeledVolume,
    config: SelectionConfig | None = None,
    output: str | Path | None = None,
    *,
    min_object_voxels: int = 0,
) -> dict:
    """Score the candidates of `train_dir` (`candidate_checkpoints`) on the held-out `volume`,
    write the choice to `output` (default TRAIN_DIR/selection.json) and return it. Held-out FOVs
    are centred on objects of at least `min_object_voxels`: the training's partition setting."""
    config = config or SelectionConfig()
    output = Path(output) if output is not None else Path(train_dir) / SELECTION_FILE
    candidates = candidate_checkpoints(train_dir, config)
    if not candidates:
        raise CheckpointError(f"{train_dir}: no checkpoints (checkpoints/ckpt-N.index)")
    model_config = checkpoint_model_config(candidates[-1])
    coords = held_out_coordinates(
        volume.labels, model_config, config.held_out_fovs, config.seed, min_object_voxels
    )
    model = build_model(model_config)
    predict = make_model_predictor(model)  # reads the model's variables: reloading updates it
    losses = _recorded_losses(Path(train_dir) / "metrics.csv")
    rows, skipped, unreadable, tried = [], [], {}, set()
    # A checkpoint that cannot be read is not a candidate: the one before takes its place.
    while todo := [
        c for c in candidate_checkpoints(train_dir, config, [*unreadable]) if c not in tried
    ]:
        for checkpoint in todo:
            tried.add(checkpoint)
            try:
                reason = _unusable(model, checkpoint, losses)
            except UnreadableCheckpoint as exc:
                print(f"[select] {first_line(exc)}", flush=True)
                unreadable[checkpoint] = first_line(exc).removeprefix(f"{checkpoint}: ")
                continue
            if reason:
                print(f"[select] skipping {checkpoint}: {reason}", flush=True)
                skipped.append(
                    {"checkpoint": recorded_path(checkpoint, output.parent), "reason": reason}
                )
                continue
            rows.append(_score(checkpoint, predict, volume, coords, model_config, config, output))
    if not rows:
        reasons = [f"{Path(s['checkpoint']).name}: {s['reason']}" for s in skipped]
        reasons += [f"{c.name}: {reason}" for c, reason in unreadable.items()]
        raise CheckpointError(
            f"{train_dir}: none of the last {len(skipped) + len(unreadable)} checkpoints can be "
            "used (" + "; ".join(reasons) + ")"
        )
    rows.sort(key=lambda r: r["step"])
    skipped.sort(key=lambda s: checkpoint_step(s["checkpoint"]))
    if folder := set_aside_unreadable([*unreadable]):
        print(
            f"[select] set aside in {folder}: {', '.join(c.name for c in unreadable)}", flush=True
        )
    # Ties go to the later checkpoint.
    if config.criterion == "vi":
        best = min(rows, key=lambda r: (r["vi"], -r["step"]))
    else:
        best = max(rows, key=lambda r: (r["fov_f1"], r["step"]))
    record = {
        "checkpoint": best["checkpoint"],
        "step": best["step"],
        "criterion": config.criterion,
        "score": best[config.criterion],
        "train_dir": recorded_path(train_dir, output.parent),
        "held_out_volume": volume.name,
        "held_out_fovs": len(coords),
        "candidates": rows,
        "skipped": skipped,
        # Not candidates: moved to checkpoints/unreadable/ (where they are named).
        "set_aside": [
            {"checkpoint": recorded_path(folder / c.name, output.parent), "reason": reason}
            for c, reason in unreadable.items()
        ],
        "config": config_io.to_dict(config),
    }
    with atomic_path(output) as tmp:
        tmp.write_text(json.dumps(record, indent=2) + "\n")
    return record


def selection_done(
    path: str | Path, train_dir: str | Path | None = None, config: SelectionConfig | None = None
) -> bool:
    """True when `path` is a complete selection (written atomically, so present means whole) and,
    given the training run, one made from its current last checkpoints with `config`: a selection
    made before training went on, or by other settings, is stale."""
    path = Path(path)
    if not path.is_file():
        return False
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError:
        return False
    if "checkpoint" not in record:
        return False
    if train_dir is None:
        return True
    config = config or SelectionConfig()
    current = [checkpoint_step(c) for c in candidate_checkpoints(train_dir, config)]
    seen = [row.get("step") for row in record.get("candidates", [])]
    seen += [checkpoint_step(row["checkpoint"]) for row in record.get("skipped", [])]
    return sorted(seen) == current and record.get("config") == config_io.to_dict(config)


def chosen_checkpoint(path: str | Path) -> Path:
    """A checkpoint path as given, or the one a selection.json chose (`resolve_recorded`
    against the folder the file is in)."""
    path = Path(path)
    if path.suffix != ".json":
        return path
    return resolve_recorded(recorded_checkpoint(path), path.parent)


def chosen_predictor(selection: str | Path, model: ModelConfig) -> Predictor:
    """The network with the weights selection.json `selection` chose. Weights that cannot be read
    (cut short since, in a run whose selection predates its stamp's record of the chosen files)
    are an UnreadableCheckpoint naming them, and the selection no longer counts as done: the next
    --resume selects again, setting them aside, with no file deleted by hand."""
    checkpoint = chosen_checkpoint(selection)
    try:
        return predictor_from_checkpoint(checkpoint, model)
    except UnreadableCheckpoint as exc:
        forget(selection)
        raise UnreadableCheckpoint(
            f"{exc}; {Path(selection).name} no longer counts as done: --resume chooses again"
        ) from None


def recorded_checkpoint(path: str | Path) -> str:
    """The checkpoint as selection.json `path` names it: relative to its folder (or absolute,
    outside it or in a file from before): what does not change when the run dir is moved."""
    path = Path(path)
    if not selection_done(path):
        raise CheckpointError(f"{path}: not a complete selection file")
    return str(json.loads(path.read_text())["checkpoint"])


def selection_token(path: str | Path) -> str:
    """Digest of the weights a selection chose and of their model settings (the stage's
    pipeline.core.stamps token): a selection made again that chose the same weights re-segments
    nothing downstream."""
    checkpoint = chosen_checkpoint(path)
    files = checkpoint_files(checkpoint)
    if not files:
        raise CheckpointError(f"{path}: the chosen checkpoint {checkpoint} has no files")
    model = config_io.to_dict(checkpoint_model_config(checkpoint))
    return digest([digest_files(files), model])
