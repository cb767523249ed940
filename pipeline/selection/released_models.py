"""Released models as this project's model folders, and a model folder as the selection stage's choice.

`convert_checkpoint` writes an imported TF1 convstack_3d checkpoint (pipeline.network.released_weights)
in this project's own format, a train-dir-like folder `OUT/checkpoints/ckpt-0` + `OUT/config.json`
(as pipeline.training.trainer writes them), so inference and selection take it as they take a trained
run; `ship_checkpoint` writes the same folder from one of our own checkpoints.
`write_pretrained_selection` makes such a folder the inference stage's choice.
"""

import json
import os
from collections.abc import Sequence
from pathlib import Path

from pipeline.core import config_io
from pipeline.core.atomic import atomic_dir
from pipeline.core.errors import CheckpointError
from pipeline.network.released_weights import (
    CHECKPOINT_NUMBER,
    FIB25_DELTAS_ZYX,
    FIB25_FOV_ZYX,
    FIB25_IMAGE_MEAN,
    FIB25_IMAGE_STDDEV,
    SOURCE_FORMAT,
    build_released_model,
    converted_checkpoint,
    read_convstack_checkpoint,
    resolve_checkpoint,
)


def convert_checkpoint(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    fov_shape_zyx: Sequence[int] = FIB25_FOV_ZYX,
    deltas_zyx: Sequence[int] = FIB25_DELTAS_ZYX,
    image_mean: float = FIB25_IMAGE_MEAN,
    image_stddev: float = FIB25_IMAGE_STDDEV,
    precision: str = "float32",
    overwrite: bool = False,
) -> Path:
    """Import a TF1 convstack_3d checkpoint and write it as `OUT/checkpoints/ckpt-0` +
    `OUT/config.json` (pipeline.training.trainer's layout); returns the checkpoint path.

    Atomic: the folder is built beside OUT and renamed into place, so OUT is either absent, the
    previous version or complete. An existing OUT is replaced only with `overwrite`.
    """

    from pipeline.training.train_config import TrainConfig

    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out}: already exists (pass --overwrite to replace it)")
    weights = read_convstack_checkpoint(checkpoint)  # fail before writing anything
    model, config = build_released_model(
        weights, fov_shape_zyx, deltas_zyx, image_mean, image_stddev, precision
    )
    record = {
        # pipeline.training.trainer's structure; the training inputs do not apply to an imported model.
        "inputs": {"raw": None, "labels": None, "coordinates": None, "train_dir": str(out)},
        "config": config_io.to_dict(TrainConfig(model=config)),
        "world_size": None,
        "pretrained": {
            "format": SOURCE_FORMAT,
            "source": str(Path(weights.path).resolve()),
            "global_step": weights.global_step,
            "depth": weights.depth,
            "features": weights.features,
        },
    }
    return _write_model_folder(model, record, out)


def _write_model_folder(model, record: dict, out: Path) -> Path:
    """`OUT/checkpoints/ckpt-0` (the weights only) + `OUT/config.json`, built beside OUT and
    renamed into place."""
    import tensorflow as tf

    with atomic_dir(out) as tmp:
        manager = tf.train.CheckpointManager(
            tf.train.Checkpoint(model=model), str(tmp / "checkpoints"), max_to_keep=None
        )
        manager.save(checkpoint_number=CHECKPOINT_NUMBER)  # state file with a relative path
        (tmp / "config.json").write_text(json.dumps(record, indent=2) + "\n")
    return converted_checkpoint(out)


def ship_checkpoint(
    checkpoint: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = False
) -> Path:
    """One checkpoint of a training run of ours (`TRAIN_DIR/checkpoints/ckpt-N`) as a model folder
    of the same layout as `convert_checkpoint`'s: the weights only (no optimizer state, a third of
    the size), the run's settings and where they came from. Small enough to keep in a repository
    and start a fine-tuning from (`train_init_from`), as the demo does."""
    from pipeline.inference.flood_fill import checkpoint_model_config
    from pipeline.network.model import build_model, load_weights

    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out}: already exists (pass --overwrite to replace it)")
    prefix = resolve_checkpoint(checkpoint)
    config = checkpoint_model_config(prefix)
    model = load_weights(build_model(config), prefix)
    run = json.loads((Path(prefix).parent.parent / "config.json").read_text())
    record = {
        "inputs": run["inputs"],  # what it was trained on
        "config": run["config"],  # and how
        "world_size": run.get("world_size"),
        "pretrained": {
            "format": "ffn-workflow training checkpoint",
            "source": str(prefix),
            "global_step": int(prefix.rpartition("-")[2]),
            "depth": config.depth,
            "features": config.features,
        },
    }
    return _write_model_folder(model, record, out)


def write_pretrained_selection(model_dir: str | os.PathLike, output: str | os.PathLike) -> dict:
    """A `selection.json` that chooses a converted model's checkpoint, so the inference stage
    (`pipeline.selection.checkpoints.chosen_checkpoint`) runs it as if training and selection had chosen it."""
    from pipeline.core.atomic import atomic_path

    checkpoint = converted_checkpoint(model_dir)
    source = json.loads((Path(model_dir) / "config.json").read_text()).get("pretrained", {})
    record = {
        "checkpoint": str(checkpoint),
        "step": CHECKPOINT_NUMBER,
        "criterion": "pretrained",
        "score": None,
        "train_dir": str(model_dir),
        "candidates": [],
        "pretrained": source,
    }
    with atomic_path(output) as tmp:
        tmp.write_text(json.dumps(record, indent=2) + "\n")
    return record


def stage_pretrained_selection(model_dir: str | os.PathLike, output: str | os.PathLike) -> str:
    """The selection stage of an inference-only run: `write_pretrained_selection`, stamped
    (pipeline.core.stamps) so that inference re-runs exactly when the model's weights change."""
    from pipeline.core.stamps import run_once
    from pipeline.selection.checkpoints import selection_token

    def work() -> str:
        write_pretrained_selection(model_dir, output)
        return selection_token(output)

    settings = {"pretrained_model": str(Path(model_dir).resolve())}
    return run_once(settings, [model_dir], [output], work)
