"""Training throughput on this machine: is the model busy, and is the machine's compute used?

Run by hand (not a test), from the repo root with the venv on PATH:

    PATH=$PWD/.venv/bin:$PATH python bench/train_throughput.py [--steps 30] [--skip-bf16]

Prints, in one run:
  (a) measured fp32 and bf16 matmul FLOP/s;
  (b) the bare model step rate (random tensors, no input pipeline), FOV/s, per precision;
  (c) the end-to-end rate of the real training loop (`pipeline.training.trainer.run_training`: coordinate
      sampling, FOV cutting, augmentation, the movement policy, the Horovod allreduce) for
      1 rank x 2 threads and 2 ranks x 1 thread (mpiexec);
  (d) the ratios (c)/(b) and model FLOP/s / matmul FLOP/s.
Each measurement runs in its own process so thread settings take effect. Results also go to
`--json` (default bench/results/train_throughput.json).
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import cpu_name  # bench/machine.py

import pipeline  # noqa: F401  (sets oneDNN on before TensorFlow loads)

ROOT = Path(__file__).resolve().parents[1]


def _tf(threads: int):
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    return tf


def matmul_flops(precision: str, threads: int, n: int = 2048, seconds: float = 5.0) -> float:
    tf = _tf(threads)
    dtype = tf.float32 if precision == "float32" else tf.bfloat16
    a = tf.random.normal([n, n], dtype=tf.float32)
    a, b = tf.cast(a, dtype), tf.cast(tf.transpose(a), dtype)
    step = tf.function(lambda x, y: tf.reduce_sum(tf.cast(tf.matmul(x, y), tf.float32)))
    step(a, b).numpy()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or count < 2:
        step(a, b).numpy()
        count += 1
    return 2 * n**3 * count / (time.perf_counter() - start)


def bare_step_rate(precision: str, threads: int, batch_size: int, steps: int) -> float:
    """Training FOV/s of the model alone: random tensors in, forward + backward + Adam."""
    import horovod.tensorflow as hvd

    tf = _tf(threads)
    hvd.init()
    from pipeline.network.model import ModelConfig, build_model
    from pipeline.training.trainer import make_train_step

    if precision == "mixed_bfloat16":
        tf.keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = build_model(ModelConfig(precision=precision))
    optimizer = tf.keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)
    train_step = make_train_step(model, optimizer, 0.7)
    shape = (batch_size, *ModelConfig().fov_shape_zyx, 1)
    x = tf.random.normal(shape)
    labels = tf.cast(x > 0, tf.float32)
    batches = [(x, x, labels)]  # one rank's batch: make_train_step takes one per virtual rank
    bool(train_step(batches)[2])  # trace and warm up
    start = time.perf_counter()
    for _ in range(steps):
        bool(train_step(batches)[2])
    return steps * batch_size / (time.perf_counter() - start)


def make_data(folder: Path) -> dict:
    from pipeline.data.synthetic import PRESETS, generate
    from pipeline.data.volumes import write_volumes
    from pipeline.preprocess.partitions import (
        PartitionConfig,
        build_coordinates,
        compute_partitions,
        save_coordinates,
    )

    config = PRESETS["default"]
    raw, labels = generate(config)
    volume = write_volumes(
        folder / "volume.h5", {"raw": raw, "labels": labels}, config.voxel_size_nm
    )
    # Margin = training canvas radius for the default FOV (17, 33, 33) and deltas (4, 8, 8).
    partition = PartitionConfig(margin_zyx=(12, 24, 24), samples_per_class=500)
    parts = compute_partitions(
        labels, partition.thresholds, partition.lom_radius_zyx, partition.margin
    )
    coords = build_coordinates(parts, partition.samples_per_class, seed=0)
    save_coordinates(folder / "coords.npz", coords, "volume", classes=parts[tuple(coords.T)])
    return {
        "raw": f"{volume}:raw",
        "labels": f"{volume}:labels",
        "coordinates": str(folder / "coords.npz"),
    }


def end_to_end_rate(
    data: dict, ranks: int, threads: int, batch_size: int, steps: int, out: Path
) -> float:
    """Steady-state FOV/s of `python -m pipeline.cli.train`, all ranks together, first interval dropped."""
    log_every = max(1, steps // 3)
    command = [
        sys.executable, "-m", "pipeline.cli.train",
        "--raw", data["raw"], "--labels", data["labels"], "--coordinates", data["coordinates"],
        "--train-dir", str(out), "--max-steps", str(steps), "--batch-size", str(batch_size),
        "--log-every-steps", str(log_every), "--checkpoint-every-steps", str(10 * steps),
        "--intra-op-threads", str(threads), "--inter-op-threads", "1",
    ]  # fmt: skip
    if ranks > 1:
        command = ["mpiexec", "-n", str(ranks), *command]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run(command, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    from pipeline.training.train_metrics import read_metrics

    rates = read_metrics(out / "metrics.csv")["fov_per_s"]
    return float(rates[1:].mean()) if len(rates) > 1 else float(rates[0])


def _child(args: argparse.Namespace) -> None:
    """One measurement in a fresh process; prints a JSON number."""
    kind, precision, threads = args.child
    threads = int(threads)
    if kind == "matmul":
        value = matmul_flops(precision, threads)
    else:
        # bf16 without hardware support runs ~30x slower: one timed step is enough to show it.
        steps = max(3, args.steps // 3) if precision == "float32" else 1
        value = bare_step_rate(precision, threads, args.batch_size, steps)
    print(json.dumps(value))


def _measure(kind: str, precision: str, threads: int, args: argparse.Namespace) -> float:
    command = [
        sys.executable,
        __file__,
        "--child",
        kind,
        precision,
        str(threads),
        "--batch-size",
        str(args.batch_size),
    ]
    command += ["--steps", str(args.steps)]
    done = subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30, help="training steps per end-to-end run")
    parser.add_argument("--batch-size", type=int, default=4, help="FOVs per rank per step")
    parser.add_argument(
        "--skip-bf16", action="store_true", help="skip bf16 (very slow without AVX512-BF16/AMX)"
    )
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "train_throughput.json"))
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return

    from pipeline.network.model import ModelConfig, forward_flops_per_fov

    threads = os.cpu_count() or 1
    precisions = ["float32"] + ([] if args.skip_bf16 else ["mixed_bfloat16"])
    train_flop_per_fov = 3 * forward_flops_per_fov(ModelConfig())
    results: dict = {
        "machine": f"{platform.processor() or platform.machine()}, {threads} cores, {cpu_name()}",
        "date": time.strftime("%Y-%m-%d"),
        "batch_size_per_rank": args.batch_size,
        "train_gflop_per_fov": train_flop_per_fov / 1e9,
    }
    print(
        f"machine: {results['machine']}; training FOV zyx 17,33,33 = {train_flop_per_fov / 1e9:.1f} GFLOP"
    )
    for precision in precisions:
        flops = _measure("matmul", precision, threads, args)
        results[f"matmul_gflops_{precision}"] = flops / 1e9
        print(f"(a) matmul {precision}: {flops / 1e9:.0f} GFLOP/s")
    for precision in precisions:
        rate = _measure("bare", precision, threads, args)
        results[f"bare_fov_per_s_{precision}"] = rate
        print(f"(b) bare model step {precision}: {rate:.2f} FOV/s")

    with tempfile.TemporaryDirectory() as tmp:
        data = make_data(Path(tmp))
        for ranks, per_rank_threads in ((1, threads), (2, max(1, threads // 2))):
            rate = end_to_end_rate(
                data, ranks, per_rank_threads, args.batch_size, args.steps, Path(tmp) / f"r{ranks}"
            )
            results[f"e2e_fov_per_s_{ranks}x{per_rank_threads}"] = rate
            print(
                f"(c) end to end fp32, {ranks} rank(s) x {per_rank_threads} thread(s): {rate:.2f} FOV/s"
            )

    bare = results["bare_fov_per_s_float32"]
    one = results[f"e2e_fov_per_s_1x{threads}"]
    two = results[f"e2e_fov_per_s_2x{max(1, threads // 2)}"]
    model_flops = one * train_flop_per_fov
    results |= {
        "e2e_over_bare_1rank": one / bare,
        "e2e_2ranks_over_1rank": two / one,
        "model_over_matmul_fp32": model_flops / (results["matmul_gflops_float32"] * 1e9),
    }
    print(f"(d) end to end / bare (1 rank): {one / bare:.0%}; 2 ranks / 1 rank: {two / one:.0%}")
    print(
        f"    model {model_flops / 1e9:.0f} GFLOP/s = {results['model_over_matmul_fp32']:.0%} of fp32 matmul"
    )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
