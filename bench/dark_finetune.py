"""Fine-tuning the FIB-25 weights with dark bodies sampled as a class of their own, judged on the
training crop's dark body (issue 58, point 2).

The training data: the training part of configs/flyem.toml without the training crop of
configs/flyem_fib25_training_crop.toml and the margin a training example reaches around it (no
example sees a crop voxel), FFN's partition classes plus one more: the voxels of bodies whose mean
grey lies `--dark-sd` robust standard deviations or more below the median body's (bodies of
>= 5,000 voxels). A rule on grey and labels any training volume has, not a body id.

Then, for the starting weights and every checkpoint: floods from 6 seeds deep inside the crop's
darkest large body on an empty canvas (bench/dark_body.py's measure, the image as it is): how much
of the body they cover and how much outside it (leaks). The whole crop is segmented only for a
checkpoint that follows the body without leaking (configs/flyem_fib25_training_crop.toml with
`pretrained_model` at the folder `--ship` writes).

Run by hand (not a test), from the repository root, after converting the FIB-25 weights:

    PATH=.venv/bin:$PATH python bench/dark_finetune.py --out data/bench/dark_finetune \
        --max-steps 400
    PATH=.venv/bin:$PATH python bench/dark_finetune.py --out data/bench/dark_finetune --judge
    PATH=.venv/bin:$PATH python bench/dark_finetune.py --out data/bench/dark_finetune \
        --ship 300   # data/bench/dark_finetune/model-300, a model folder
    PATH=.venv/bin:$PATH python bench/dark_finetune.py --out data/bench/dark_finetune \
        --held-out 96   # every checkpoint's FOV F1 on the selection part
    PATH=.venv/bin:$PATH python bench/dark_finetune.py --out data/bench/dark_finetune \
        --by-class 10   # the FIB-25 weights' loss and F1 on OUT's examples, class by class

Writes `OUT/train.h5`, `OUT/coordinates.npz`, `OUT/train/`, `OUT/judged.json`, and with
`--held-out` `OUT/held_out.json`, with `--by-class` `OUT/by_class.json`.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
from dark_body import CHECKPOINT, FLYEM, ROOT, flood_all, seeds_in
from scipy import ndimage

from pipeline.core.atomic import atomic_path
from pipeline.core.roi import Roi
from pipeline.data.volumes import LabeledVolume, read_volume_pair
from pipeline.inference.flood_fill import checkpoint_model_config, predictor_from_checkpoint
from pipeline.network.model import build_model
from pipeline.network.released_weights import load_pretrained_weights
from pipeline.preprocess.partitions import (
    DEFAULT_THRESHOLDS,
    EXCLUDED,
    PartitionConfig,
    build_coordinates,
    compute_partitions,
    save_coordinates,
)
from pipeline.selection.checkpoints import fov_f1, held_out_coordinates
from pipeline.selection.released_models import ship_checkpoint
from pipeline.training.examples import ExampleConfig, Trajectory, canvas_radius

TRAINING_PART = Roi.parse("0:125, 0:122, 0:250")  # configs/flyem.toml's train_roi
CROP = Roi.parse("61:125, 0:122, 64:192")  # configs/flyem_fib25_training_crop.toml's eval_roi
SELECTION_PART = Roi.parse("0:61, 122:250, 0:250")  # configs/flyem.toml's select_roi
DARK_CLASS = len(DEFAULT_THRESHOLDS) + 2  # after FFN's classes 1 .. len(thresholds) + 1
MIN_BODY_VOXELS = 5_000
# configs/flyem_finetune.toml's [train]: the rate chosen there on the selection part.
TRAIN_SETTINGS = {
    "batch_size": 2,
    "learning_rate": 1e-5,
    "warmup_steps": 20,
    "log_every_steps": 25,
    "checkpoint_every_steps": 100,
    "model": {
        "fov_shape_zyx": [33, 33, 33],
        "deltas_zyx": [8, 8, 8],
        "depth": 12,
        "features": 32,
        "image_mean": 128.0,
        "image_stddev": 33.0,
    },
}


def dark_bodies(raw: np.ndarray, labels: np.ndarray, below_sd: float) -> list[int]:
    """Bodies of >= MIN_BODY_VOXELS whose mean grey is `below_sd` robust standard deviations
    (1.4826 x the median absolute deviation) or more below the median body's."""
    ids, counts = np.unique(labels, return_counts=True)
    large = ids[(ids != 0) & (counts >= MIN_BODY_VOXELS)]
    means = np.asarray(ndimage.mean(raw, labels, large))
    median = np.median(means)
    spread = 1.4826 * np.median(np.abs(means - median))
    return [int(i) for i in large[means <= median - below_sd * spread]]


def training_partitions(
    raw, labels, below_sd: float, min_object_voxels: int
) -> tuple[np.ndarray, list[int]]:
    """FFN's partitions of the training part (objects under `min_object_voxels` left out), the
    dark bodies' voxels as DARK_CLASS, and every voxel whose example would reach into the crop
    excluded."""
    reach = canvas_radius(checkpoint_model_config(CHECKPOINT), ExampleConfig())
    partitions = compute_partitions(
        labels, margin_zyx=reach, min_object_voxels=min_object_voxels, progress=True
    )
    dark = dark_bodies(raw, labels, below_sd)
    inside = (partitions != EXCLUDED) & (partitions != 0) & np.isin(labels, dark)
    partitions[inside] = DARK_CLASS
    crop = CROP.relative_to(TRAINING_PART)
    partitions[crop.grown(reach, labels.shape).slices] = EXCLUDED
    return partitions, dark


def prepare(out: Path, below_sd: float, min_object_voxels: int) -> None:
    with h5py.File(FLYEM, "r") as f:
        raw = f["volumes/raw"][TRAINING_PART.slices]
        labels = f["volumes/labels/neuron_ids"][TRAINING_PART.slices]
    partitions, dark = training_partitions(raw, labels, below_sd, min_object_voxels)
    config = PartitionConfig(min_object_voxels=min_object_voxels)
    coords = build_coordinates(partitions, config.samples_per_class, config.seed)
    classes = partitions[tuple(coords.T)]
    with atomic_path(out / "train.h5") as tmp, h5py.File(tmp, "w") as f:
        f["raw"], f["labels"] = raw, labels
        f["raw"].attrs["voxel_size_nm"] = f["labels"].attrs["voxel_size_nm"] = [10.0] * 3
    save_coordinates(out / "coordinates.npz", coords, "train", classes=classes, config=config)
    dark_voxels = int((partitions == DARK_CLASS).sum())
    print(f"dark bodies {dark}: {dark_voxels} voxels to sample from; {len(coords)} coordinates")


def train(out: Path, max_steps: int) -> None:
    settings = out / "train_settings.json"
    settings.write_text(json.dumps(TRAIN_SETTINGS | {"max_steps": max_steps}, indent=1))
    command = [
        "mpiexec", "-n", "2", sys.executable, "-m", "pipeline.cli.train",
        "--raw", f"{out}/train.h5:raw", "--labels", f"{out}/train.h5:labels",
        "--coordinates", str(out / "coordinates.npz"), "--train-dir", str(out / "train"),
        "--init-from", str(CHECKPOINT.parents[1]), "--config", str(settings),
    ]  # fmt: skip
    environment = os.environ | {"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1"}
    subprocess.run(command, check=True, env=environment, cwd=ROOT)


def judge(out: Path, seeds: int) -> None:
    """Floods of the crop's darkest large body from the starting weights and each checkpoint."""
    with h5py.File(FLYEM, "r") as f:
        raw_file, labels_file = f["volumes/raw"][:], f["volumes/labels/neuron_ids"][:]
    crop_raw, crop_labels = raw_file[CROP.slices], labels_file[CROP.slices]
    ids, counts = np.unique(crop_labels, return_counts=True)
    large = ids[(ids != 0) & (counts >= MIN_BODY_VOXELS)]
    darkest = large[np.argmin(ndimage.mean(crop_raw, crop_labels, large))]
    body_file = np.zeros(labels_file.shape, bool)
    body_file[CROP.slices] = crop_labels == darkest
    model = checkpoint_model_config(CHECKPOINT)
    radius = np.array(model.fov_shape_zyx) // 2
    zyx = np.argwhere(body_file)
    box = Roi(tuple(zyx.min(0)), tuple(zyx.max(0) + 1)).grown(radius, raw_file.shape)
    raw, body = raw_file[box.slices], body_file[box.slices]
    points = seeds_in(body, radius, seeds)
    judged = []
    for prefix in _checkpoints(out):
        predict = predictor_from_checkpoint(prefix, model)
        _, floods, _ = flood_all(raw, body, points, predict, model)
        row = {
            "weights": "FIB-25" if prefix == CHECKPOINT else prefix.name,
            "floods_kept": sum(f["kept"] for f in floods),
            "fov_evaluations": sum(f["fov_evaluations"] for f in floods),
            "body_voxels_covered_best": max(f["body_voxels_covered"] for f in floods),
            "outside_body_worst": max(f["voxels_outside_body"] for f in floods),
        }
        print(json.dumps(row))
        judged.append(row)
    record = {
        "body": int(darkest),
        "body_voxels": int(body.sum()),
        "seeds": points.tolist(),
        "judged": judged,
    }
    with atomic_path(out / "judged.json") as tmp:
        Path(tmp).write_text(json.dumps(record, indent=1) + "\n")


def _checkpoints(out: Path) -> list[Path]:
    """The starting weights, then every checkpoint of OUT's training, oldest first."""
    found = sorted(out.glob("train/checkpoints/ckpt-*.index"), key=lambda p: int(p.stem[5:]))
    return [CHECKPOINT] + [p.with_suffix("") for p in found]


def held_out(out: Path, fovs: int) -> None:
    """Each checkpoint's FOV F1 on the selection part (the selection stage's measure), its FOVs
    drawn over every object and over objects of >= 10,000 voxels (FFN's --min_size)."""
    with h5py.File(FLYEM, "r") as f:
        raw = f["volumes/raw"][SELECTION_PART.slices]
        labels = f["volumes/labels/neuron_ids"][SELECTION_PART.slices]
    volume = LabeledVolume("selection", raw, labels, (10.0,) * 3)
    model = checkpoint_model_config(CHECKPOINT)
    drawn = {m: held_out_coordinates(labels, model, fovs, 0, m) for m in (0, 10_000)}
    rows = []
    for checkpoint in _checkpoints(out):
        predict = predictor_from_checkpoint(checkpoint, model)
        row = {"weights": checkpoint.name if checkpoint != CHECKPOINT else "FIB-25"}
        row |= {f"fov_f1_min{m}": fov_f1(predict, volume, c, model) for m, c in drawn.items()}
        print(json.dumps(row), flush=True)
        rows.append(row)
    with atomic_path(out / "held_out.json") as tmp:
        Path(tmp).write_text(json.dumps({"fovs": fovs, "rows": rows}, indent=1) + "\n")


def by_class(out: Path, per_class: int) -> None:
    """The FIB-25 weights on `per_class` of OUT's training examples of each partition class,
    each a whole trajectory as training walks it: loss and voxel F1 of its first FOV and of the
    FOVs after (the network reading its own earlier predictions)."""
    model = checkpoint_model_config(CHECKPOINT)
    network = build_model(model)
    load_pretrained_weights(network, CHECKPOINT)
    volume = read_volume_pair(f"{out}/train.h5:raw", f"{out}/train.h5:labels")
    with np.load(out / "coordinates.npz") as saved:
        coords, classes = saved["coords"], saved["classes"]
    rng, rows = np.random.default_rng(1), []
    for c in np.unique(classes):
        scores = {"first": [], "later": []}
        for i in rng.choice(np.flatnonzero(classes == c), per_class, replace=False):
            walk = Trajectory(volume, coords[i], model, ExampleConfig(), np.random.default_rng(i))
            fovs_shown = 0
            while (fov := walk.next_fov()) is not None:
                logits = network([fov.image[None, ..., None], fov.seed[None, ..., None]])
                logits = logits.numpy()[0, ..., 0]
                loss = np.mean(
                    np.maximum(logits, 0) - logits * fov.labels + np.log1p(np.exp(-abs(logits)))
                )
                guess, truth = logits > 0, fov.labels > 0.5
                f1 = 2 * np.sum(guess & truth) / max(1, guess.sum() + truth.sum())
                scores["later" if fovs_shown else "first"].append((loss, f1))
                fov.seed[...] = logits
                fovs_shown += 1
        objects = {int(volume.labels[tuple(p)]) for p in coords[classes == c]}
        sizes = [int(np.count_nonzero(volume.labels == o)) for o in objects]
        row = {"class": int(c), "objects": len(objects), "median_object_voxels": np.median(sizes)}
        for name, values in scores.items():
            mean = np.mean(values, axis=0) if values else (np.nan, np.nan)
            row |= {f"{name}_fovs": len(values), f"{name}_loss": mean[0], f"{name}_f1": mean[1]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    with atomic_path(out / "by_class.json") as tmp:
        Path(tmp).write_text(json.dumps({"per_class": per_class, "rows": rows}, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dark-sd", type=float, default=2.0)
    parser.add_argument(
        "--min-object-voxels",
        type=int,
        default=0,
        help="never sample smaller objects (FFN's --min_size; 10000 there)",
    )
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--judge", action="store_true", help="only judge the checkpoints")
    parser.add_argument("--ship", type=int, help="write checkpoint N as a model folder")
    parser.add_argument("--held-out", type=int, metavar="FOVS", help="only FOV F1 on selection")
    parser.add_argument("--by-class", type=int, metavar="N", help="only the FIB-25 weights' loss")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.ship is not None:
        ship_checkpoint(
            args.out / f"train/checkpoints/ckpt-{args.ship}", args.out / f"model-{args.ship}"
        )
        return
    if args.held_out:
        return held_out(args.out, args.held_out)
    if args.by_class:
        return by_class(args.out, args.by_class)
    if not args.judge:
        if not (args.out / "coordinates.npz").exists():
            prepare(args.out, args.dark_sd, args.min_object_voxels)
        train(args.out, args.max_steps)
    judge(args.out, args.seeds)


if __name__ == "__main__":
    main()
