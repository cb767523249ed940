"""End-to-end benchmark on the default synthetic volume: FFN against a seeded watershed.

Run by hand (not a test), from the repository root:

    PATH=.venv/bin:$PATH python bench/segment_default.py --output data/bench/segment_default.json

The defaults are those of the result in BENCHMARKS.md; a run that is stopped resumes from its last
checkpoint, and `--max-steps` can be raised to train on.

Stages, each skipped when a previous run in the same --workdir finished it:
  1. the default synthetic volume with seed 0 (training), seed 1 (held out, scored) and seed 2
     (selection: kept apart from the scored volume, so selecting by VI does not see it);
  2. FFN partitions and balanced coordinates of the training volume;
  3. training of a small network (FOV 9, 17, 17, depth 5, 16 features: about 100 FOV/s on 2 CPU
     cores, so the default 80,000 steps take about an hour); the rate drops tenfold after 60,000;
  4. selection of the best of the last checkpoints by VI on a crop of the selection volume;
  5. blockwise inference on the held-out volume, stitched;
  6. scores of FFN and of the watershed baseline on the held-out volume.

Prints both methods' scores and the inference speed, and writes them to --output as JSON.
"""

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

import pipeline  # noqa: F401  (sets TensorFlow's oneDNN flag before TF loads)
from pipeline.core import config_io
from pipeline.core.atomic import atomic_path
from pipeline.data.synthetic import PRESETS, generate
from pipeline.data.volumes import read_volume_pair, write_volumes
from pipeline.evaluation.scores import format_scores, score_segmentation
from pipeline.evaluation.watershed import watershed_baseline
from pipeline.inference.blocks import BlockConfig
from pipeline.inference.flood_fill import InferenceConfig, predictor_from_checkpoint
from pipeline.inference.stitching import segment_blockwise
from pipeline.network.model import ModelConfig
from pipeline.preprocess.partitions import (
    DEFAULT_THRESHOLDS,
    build_coordinates,
    compute_partitions,
    save_coordinates,
)
from pipeline.selection.checkpoints import (
    CRITERIA,
    SelectionConfig,
    chosen_checkpoint,
    select_checkpoint,
    selection_done,
)
from pipeline.training.examples import ExampleConfig, canvas_radius
from pipeline.training.train_config import TrainConfig
from pipeline.training.trainer import TrainInputs, run_training, training_complete


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--workdir", type=Path, default=Path("data/bench/segment_default"))
    add("--output", type=Path, default=Path("data/bench/segment_default.json"))
    add("--max-steps", type=int, default=80_000)
    add("--batch-size", type=int, default=4, help="training FOVs per step")
    add("--depth", type=int, default=5)
    add("--features", type=int, default=16)
    add("--fov", type=int, nargs=3, default=(9, 17, 17), metavar=("Z", "Y", "X"))
    add("--deltas", type=int, nargs=3, default=(2, 4, 4), metavar=("Z", "Y", "X"))
    add("--samples-per-class", type=int, default=2000)
    add("--learning-rate", type=float, default=TrainConfig().learning_rate)
    add("--lr-decay-factor", type=float, default=0.1)
    add("--lr-decay-every-steps", type=int, default=60_000)
    add("--checkpoint-every-steps", type=int, default=2000)
    add("--last-checkpoints", type=int, default=3)
    add("--selection-criterion", choices=CRITERIA, default="vi")
    add(
        "--selection-crop",
        type=int,
        nargs=3,
        default=(48, 96, 96),
        metavar=("Z", "Y", "X"),
        help="segment this central crop of the selection volume with each candidate, for its VI "
        "(0 0 0: do not)",
    )
    add("--block-shape", type=int, nargs=3, default=(64, 80, 80), metavar=("Z", "Y", "X"))
    add("--overlap", type=int, nargs=3, default=(16, 24, 24), metavar=("Z", "Y", "X"))
    add("--inference-batch-size", type=int, default=1)
    add("--min-segment-size", type=int, default=100)
    add("--seed-passes", type=int, default=InferenceConfig().seed_passes)
    add("--no-keep-background", action="store_true", help="turn FFN's keep_background rule off")
    return parser


def _volumes(workdir: Path) -> dict[str, Path]:
    paths = {}
    for name, seed in (("train", 0), ("held_out", 1), ("selection", 2)):
        path = paths[name] = workdir / f"{name}.h5"
        if not path.is_file():
            config = dataclasses.replace(PRESETS["default"], seed=seed)
            raw, labels = generate(config)
            write_volumes(path, {"raw": raw, "labels": labels}, config.voxel_size_nm)
    return paths


def _coordinates(volume: Path, path: Path, config: TrainConfig, samples: int) -> Path:
    if path.is_file():
        return path
    labeled = read_volume_pair(f"{volume}:raw", f"{volume}:labels")
    radius = tuple(int(r) for r in canvas_radius(config.model, config.examples))
    lom = tuple(f // 2 for f in config.model.fov_shape_zyx)
    partitions = compute_partitions(labeled.labels, DEFAULT_THRESHOLDS, lom, radius)
    coords = build_coordinates(partitions, samples, seed=0)
    return save_coordinates(path, coords, labeled.name, classes=partitions[tuple(coords.T)])


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    workdir = args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    timings = {}

    start = time.perf_counter()
    volumes = _volumes(workdir)
    timings["volumes_s"] = time.perf_counter() - start

    model = ModelConfig(
        fov_shape_zyx=tuple(args.fov),
        deltas_zyx=tuple(args.deltas),
        depth=args.depth,
        features=args.features,
    )
    train_config = TrainConfig(
        model=model,
        examples=ExampleConfig(),
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        lr_decay_factor=args.lr_decay_factor,
        lr_decay_every_steps=args.lr_decay_every_steps,
        max_steps=args.max_steps,
        log_every_steps=50,
        checkpoint_every_steps=args.checkpoint_every_steps,
        keep_checkpoints=args.last_checkpoints,
    )
    start = time.perf_counter()
    coordinates = _coordinates(
        volumes["train"], workdir / "coords.npz", train_config, args.samples_per_class
    )
    timings["coordinates_s"] = time.perf_counter() - start

    inference = InferenceConfig(
        batch_size=args.inference_batch_size,
        min_segment_size=args.min_segment_size,
        seed_passes=args.seed_passes,
        keep_background=not args.no_keep_background,
    )
    train_dir = workdir / "train"
    start = time.perf_counter()
    if not training_complete(train_dir, args.max_steps):
        inputs = TrainInputs(
            f"{volumes['train']}:raw",
            f"{volumes['train']}:labels",
            str(coordinates),
            str(train_dir),
        )
        run_training(inputs, train_config)
    timings["training_s"] = time.perf_counter() - start
    train_summary = json.loads((train_dir / "train_summary.json").read_text())

    held_out = read_volume_pair(f"{volumes['held_out']}:raw", f"{volumes['held_out']}:labels")
    selection_path = train_dir / "selection.json"
    start = time.perf_counter()
    selection_config = SelectionConfig(
        last_checkpoints=args.last_checkpoints,
        criterion=args.selection_criterion,
        vi_crop_zyx=tuple(args.selection_crop),
        inference=inference,
    )
    if not selection_done(selection_path, train_dir, selection_config):
        selection_volume = read_volume_pair(
            f"{volumes['selection']}:raw", f"{volumes['selection']}:labels"
        )
        select_checkpoint(train_dir, selection_volume, selection_config)
    selection = json.loads(selection_path.read_text())
    checkpoint = str(chosen_checkpoint(selection_path))  # selection.json stores it relative
    timings["selection_s"] = time.perf_counter() - start

    blocks = BlockConfig(block_shape_zyx=tuple(args.block_shape), overlap_zyx=tuple(args.overlap))
    # A fresh blocks dir per run, so the timing is of this run's inference.
    blocks_dir = workdir / f"blocks-{time.strftime('%Y%m%d-%H%M%S')}"
    predict = predictor_from_checkpoint(checkpoint, model)
    start = time.perf_counter()
    segmentation, summary = segment_blockwise(
        held_out.raw,
        predict,
        model,
        inference,
        blocks,
        blocks_dir,
        provenance={"checkpoint": checkpoint},
        progress=True,
    )
    inference_wall = time.perf_counter() - start
    write_volumes(
        workdir / "held_out_segmentation.h5",
        {"segmentation": segmentation},
        held_out.voxel_size_nm,
    )

    start = time.perf_counter()
    baseline = watershed_baseline(held_out.raw)
    watershed_s = time.perf_counter() - start
    scores = {
        "ffn": score_segmentation(segmentation, held_out.labels).to_dict(),
        "watershed": score_segmentation(baseline, held_out.labels).to_dict(),
    }
    voxels = int(held_out.raw.size)
    speed = {
        "volume_voxels": voxels,
        "inference_wall_s": inference_wall,
        "voxels_per_s": voxels / inference_wall,
        "blocks": len(summary["block_seconds"]),
        "seconds_per_block": inference_wall / len(summary["block_seconds"]),
        "block_seconds": summary["block_seconds"],
        "fov_evaluations": summary["inference"]["fov_evaluations"],
        "fov_per_s": summary["inference"]["fov_evaluations"] / inference_wall,
        "watershed_s": watershed_s,
    }
    report = {
        "scores": scores,
        "speed": speed,
        "inference_stats": summary["inference"],
        "stitch": summary["stitch"],
        "selection": {k: selection[k] for k in ("checkpoint", "step", "criterion", "candidates")},
        "training": {
            k: train_summary.get(k) for k in ("step", "wall_s", "loss", "f1", "fov_per_s")
        },
        "config": {
            "model": config_io.to_dict(model),
            "train": config_io.to_dict(train_config),
            "inference": config_io.to_dict(inference),
            "blocks": config_io.to_dict(blocks),
        },
        "timings_s": timings,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }
    with atomic_path(args.output) as tmp:
        tmp.write_text(json.dumps(report, indent=2) + "\n")

    print(format_scores(scores))
    print(
        f"FFN inference: {voxels} voxels in {inference_wall:.1f} s = {speed['voxels_per_s']:.0f} "
        f"voxels/s, {speed['blocks']} blocks, {speed['seconds_per_block']:.1f} s per block, "
        f"{speed['fov_evaluations']} FOVs ({speed['fov_per_s']:.1f} FOV/s); "
        f"watershed {watershed_s:.1f} s"
    )
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
