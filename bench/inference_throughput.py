"""Inference speed of the FFN authors' FIB-25 model: does flood filling keep the network busy?

Run by hand (not a test), from the repository root with the venv on PATH:

    PATH=$PWD/.venv/bin:$PATH python bench/inference_throughput.py [--shape 100 100 100]
        [--raw vol.h5:raw] [--precision float32|mixed_bfloat16] [--batch-size 1]

Segments one volume (default: a 250^3 synthetic volume at 10 nm isotropic voxels, like FIB-25;
`--raw` takes any HDF5 dataset instead, cropped to `--shape` from its corner) with the FIB-25
model (depth 12, FOV 33^3, deltas 8, 8, 8) and its authors' inference settings (seed 0.95, pad
0.05, move threshold 0.9), and measures in the same process:
  (a) the bare forward rate of the model: random tensors through the same compiled predictor at
      the same batch size, before and after the segmentation (the CPU may be shared);
  (b) the end-to-end rate of `pipeline.inference.flood_fill.segment`: voxels/s, FOV evaluations/s, seconds,
      the share of the time spent inside the network and the mean number of FOVs per call;
  (c) (b) / (a), the issue's criterion (>= 0.8), and a 250^3 extrapolation where a smaller volume
      was run, labelled as such.
Results go to `--json` (default bench/results/inference_throughput.json).

On a CPU a 250^3 volume takes hours: the segmentation is checkpointed to `--state` every minute,
and a run stopped by `--max-minutes` (or killed) is continued by the same command; the totals
(seconds, FOV evaluations) then cover all runs, the bare rate and the time in the network the last.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from machine import cpu_name  # bench/machine.py

import pipeline  # noqa: F401  (sets oneDNN on before TensorFlow loads)

ROOT = Path(__file__).resolve().parents[1]

FIB25 = ROOT.parent / "shared" / "models" / "google-ffn-fib25" / "model.ckpt-27465036"
TARGET_SHAPE = (250, 250, 250)
TARGET_SECONDS = 15 * 60


def load_volume(args: argparse.Namespace) -> tuple[np.ndarray, str]:
    shape = tuple(args.shape)
    if args.raw:
        import h5py

        from pipeline.data.volumes import VolumeSpec

        spec = VolumeSpec.parse(args.raw)
        with h5py.File(spec.path, "r") as f:
            data = f[spec.dataset]
            crop = tuple(slice(0, min(s, t)) for s, t in zip(data.shape, shape, strict=True))
            return np.ascontiguousarray(data[crop]), f"{args.raw}, crop {crop}"
    from pipeline.data.synthetic import PRESETS, generate

    config = PRESETS["default"].with_geometry(shape, (10.0, 10.0, 10.0))
    raw, _ = generate(config)
    return raw, f"synthetic default preset, {shape} voxels at 10 nm, seed {config.seed}"


def load_model(checkpoint: str, precision: str):
    """A TF1 checkpoint of the reference code (imported), or one of ours (TRAIN_DIR/checkpoints/ckpt-N)."""
    import dataclasses

    from pipeline.inference.flood_fill import checkpoint_model_config
    from pipeline.network.model import build_model, load_weights
    from pipeline.network.released_weights import import_checkpoint

    if (Path(checkpoint).parent.parent / "config.json").is_file():
        config = dataclasses.replace(checkpoint_model_config(checkpoint), precision=precision)
        return load_weights(build_model(config), checkpoint), config
    return import_checkpoint(checkpoint, precision=precision)


class OutOfTime(Exception):
    """The --max-minutes budget ran out before the volume was segmented."""


class TimedPredictor:
    """The predictor, with the time spent inside it and the batch sizes it saw; raises OutOfTime
    once `deadline` (perf_counter seconds) has passed."""

    def __init__(self, predict, deadline: float = float("inf")):
        self.predict, self.deadline = predict, deadline
        self.seconds, self.calls, self.fovs = 0.0, 0, 0
        self.started = time.perf_counter()

    def __call__(self, images: np.ndarray, seeds: np.ndarray) -> np.ndarray:
        start = time.perf_counter()
        if start > self.deadline:
            raise OutOfTime
        out = self.predict(images, seeds)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        self.fovs += len(images)
        return out


def bare_forward_rate(predict, fov_zyx, batch_size: int, seconds: float) -> tuple[float, float]:
    """The predictor alone on random tensors (after one warm-up call): (FOV/s, CPU s per FOV).
    CPU time per FOV hardly depends on other processes sharing the cores; wall time does."""
    rng = np.random.default_rng(0)
    shape = (batch_size, *fov_zyx, 1)
    images = rng.normal(size=shape).astype(np.float32)
    seeds = rng.normal(size=shape).astype(np.float32)
    predict(images, seeds)
    calls, start, cpu = 0, time.perf_counter(), time.process_time()
    while calls < 2 or time.perf_counter() - start < seconds:
        predict(images, seeds)
        calls += 1
    fovs = calls * batch_size
    return fovs / (time.perf_counter() - start), (time.process_time() - cpu) / fovs


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--shape", type=int, nargs=3, default=TARGET_SHAPE, metavar=("Z", "Y", "X"))
    add("--raw", metavar="PATH.h5:DATASET", help="segment this volume instead (cropped to --shape)")
    add("--checkpoint", default=str(FIB25), help="TF1 checkpoint, or TRAIN_DIR/checkpoints/ckpt-N")
    add("--precision", choices=("float32", "mixed_bfloat16"), default="float32")
    add("--batch-size", type=int, default=1, help="InferenceConfig.batch_size (default 1)")
    add("--forward-seconds", type=float, default=20.0, help="per bare-rate measurement")
    add(
        "--max-minutes",
        type=float,
        help="stop segmenting after this long and report the rates so far (marked incomplete); "
        "a later run goes on from --state",
    )
    add(
        "--state",
        type=Path,
        default=ROOT / "bench" / "results" / "inference_state.npz",
        help="inference checkpoint, written every minute and removed when the volume is done",
    )
    add("--json", type=Path, default=ROOT / "bench" / "results" / "inference_throughput.json")
    args = parser.parse_args()

    import tensorflow as tf

    from pipeline.core.atomic import atomic_path
    from pipeline.inference.flood_fill import (
        InferenceConfig,
        InferenceStats,
        make_model_predictor,
        segment,
    )
    from pipeline.network.model import forward_flops_per_fov

    if args.precision == "mixed_bfloat16":
        tf.keras.mixed_precision.set_global_policy("mixed_bfloat16")
    started = time.perf_counter()
    raw, source = load_volume(args)
    prepare_s = time.perf_counter() - started
    model, model_config = load_model(args.checkpoint, args.precision)
    config = InferenceConfig(
        seed_probability=0.95,
        pad_probability=0.05,
        move_threshold=0.9,
        batch_size=args.batch_size,
    )
    predict = make_model_predictor(model)
    fov = model_config.fov_shape_zyx
    gflop = forward_flops_per_fov(model_config) / 1e9
    machine = f"{cpu_name()}, {os.cpu_count()} cores"
    print(
        f"machine: {machine}; volume {raw.shape} ({source}, {prepare_s:.0f} s to prepare); "
        f"model depth {model_config.depth}, FOV {fov}, {gflop:.1f} GFLOP/FOV, {args.precision}, "
        f"batch {args.batch_size}",
        flush=True,
    )

    bare_before, cpu_before = bare_forward_rate(predict, fov, args.batch_size, args.forward_seconds)
    print(
        f"(a) bare forward before: {bare_before:.3f} FOV/s, {cpu_before:.2f} CPU s/FOV", flush=True
    )
    budget = args.max_minutes * 60 if args.max_minutes else float("inf")
    timed = TimedPredictor(predict, time.perf_counter() + budget)
    cpu_start = time.process_time()
    resumed = args.state.is_file()
    try:
        segmentation, stats = segment(
            raw,
            timed,
            model_config,
            config,
            progress=True,
            checkpoint_path=args.state,
            checkpoint_every_s=60.0,
            checkpoint_key=f"{args.checkpoint} {args.precision}",
        )
        complete = True
    except OutOfTime:
        # The figures of the work saved in the state (all runs so far); what this run did after
        # its last save is redone by the next one.
        segmentation, complete = np.zeros(raw.shape, np.uint64), False
        stats = InferenceStats(voxels=int(raw.size))
        if args.state.is_file():
            with np.load(args.state) as saved:
                segmentation = saved["segmentation"]
                state = json.loads(str(saved["state"]))
            stats = InferenceStats(
                voxels=int(raw.size), seconds=state["seconds"], **state["counts"]
            )
    run_seconds = time.perf_counter() - timed.started
    loop_cpu = time.process_time() - cpu_start
    bare_after, cpu_after = bare_forward_rate(predict, fov, args.batch_size, args.forward_seconds)
    bare, bare_cpu = (bare_before + bare_after) / 2, (cpu_before + cpu_after) / 2
    print(f"(a) bare forward after: {bare_after:.3f} FOV/s, {cpu_after:.2f} CPU s/FOV", flush=True)
    loop_cpu_per_fov = loop_cpu / timed.fovs if timed.fovs else 0.0

    fov_rate = stats.fov_evaluations / stats.seconds if stats.seconds else 0.0
    results = {
        "machine": machine,
        "date": time.strftime("%Y-%m-%d"),
        "volume": source,
        "shape_zyx": list(raw.shape),
        "complete": complete,
        "resumed_from_state": resumed,
        "this_run_seconds": run_seconds,
        "this_run_fov_evaluations": timed.fovs,
        "checkpoint": str(args.checkpoint),
        "precision": args.precision,
        "batch_size": args.batch_size,
        "fov_zyx": list(fov),
        "deltas_zyx": list(model_config.deltas_zyx),
        "gflop_per_fov": gflop,
        "bare_forward_fov_per_s_before": bare_before,
        "bare_forward_fov_per_s_after": bare_after,
        "bare_forward_fov_per_s": bare,
        "seconds": stats.seconds,
        "voxels_per_s": stats.voxels_per_second if complete else None,
        "fov_evaluations": stats.fov_evaluations,
        "fov_evaluations_per_s": fov_rate,
        "fov_per_s_over_bare": fov_rate / bare if bare else 0.0,
        # The same comparison in CPU time, which other processes on the cores hardly change.
        "bare_forward_cpu_s_per_fov": bare_cpu,
        "segment_cpu_s_per_fov": loop_cpu_per_fov,
        "bare_over_segment_cpu_per_fov": bare_cpu / loop_cpu_per_fov if loop_cpu_per_fov else 0.0,
        "seconds_in_network": timed.seconds,
        "network_busy_fraction": timed.seconds / run_seconds if run_seconds else 0.0,
        "mean_fovs_per_call": timed.fovs / timed.calls if timed.calls else 0.0,
        "model_gflops_in_loop": gflop * fov_rate,
        "inference": stats.to_dict(),
        "segmented_fraction": float(np.count_nonzero(segmentation)) / segmentation.size,
    }
    if complete and tuple(raw.shape) != TARGET_SHAPE and stats.fov_evaluations:
        # An estimate, not a run: FOV evaluations scaled to 250^3 by the voxel count, and by the
        # count of the cells the flood visits at most once per object (deltas-sized, plus one at
        # each border, as `inference.Canvas._key`); a small volume is mostly border.
        def cells(shape) -> float:
            counts = []
            for size, f, d in zip(shape, fov, model_config.deltas_zyx, strict=True):
                r, q = f // 2, max(d, 1)
                keys = {
                    -1 if p == r else -2 if p == size - r - 1 else p // q
                    for p in range(r, size - r)
                }
                counts.append(len(keys))
            return float(np.prod(counts))

        by_voxels = stats.fov_evaluations * np.prod(TARGET_SHAPE) / raw.size
        by_cells = stats.fov_evaluations * cells(TARGET_SHAPE) / cells(raw.shape)
        results["extrapolated_250"] = {
            "note": f"EXTRAPOLATED from {tuple(raw.shape)}, not measured: FOV evaluations "
            "scaled by the voxel count or by the count of deltas-sized cells the flood visits, "
            "at the measured end-to-end FOV rate",
            "fov_evaluations": [float(by_voxels), float(by_cells)],
            "seconds": [float(by_voxels / fov_rate), float(by_cells / fov_rate)],
            "fov_per_s_needed_for_15_min": [
                float(by_voxels / TARGET_SECONDS),
                float(by_cells / TARGET_SECONDS),
            ],
        }

    if not complete:
        print(
            f"    STOPPED after --max-minutes {args.max_minutes}: the volume is NOT segmented yet; "
            f"run again to go on from {args.state}. This run: {timed.fovs} FOV evaluations in "
            f"{run_seconds:.0f} s = {timed.fovs / run_seconds:.3f} FOV/s, work after the last "
            "save included"
        )
    print(
        f"(b) segment {raw.shape}: {stats.seconds:.1f} s, "
        + (f"{stats.voxels_per_second:.0f} voxels/s, " if complete else "(unfinished) ")
        + f"{stats.fov_evaluations} FOV evaluations = {fov_rate:.3f} FOV/s "
        f"({results['network_busy_fraction']:.1%} of the time in the network, "
        f"{results['mean_fovs_per_call']:.2f} FOVs per call); {stats.objects} objects, "
        f"{results['segmented_fraction']:.1%} of voxels segmented"
    )
    print(
        f"(c) FOV/s end-to-end / bare forward: {results['fov_per_s_over_bare']:.2f} "
        f"(bare {bare:.3f} FOV/s = {gflop * bare:.0f} GFLOP/s); in CPU time: bare "
        f"{bare_cpu:.2f} s/FOV, segment {loop_cpu_per_fov:.2f} s/FOV, ratio "
        f"{results['bare_over_segment_cpu_per_fov']:.2f}"
    )
    if "extrapolated_250" in results:
        extra = results["extrapolated_250"]
        (fov_low, fov_high), (s_low, s_high) = extra["fov_evaluations"], extra["seconds"]
        need_low, need_high = extra["fov_per_s_needed_for_15_min"]
        print(
            f"    EXTRAPOLATION to 250^3 (not measured): ~{fov_low:.0f}-{fov_high:.0f} FOV "
            f"evaluations, ~{s_low / 60:.0f}-{s_high / 60:.0f} min at this rate; 15 min would need "
            f"{need_low:.1f}-{need_high:.1f} FOV/s"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(args.json) as tmp:
        tmp.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
