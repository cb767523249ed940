"""Run by tests/training/test_distributed.py under `mpiexec -n N`: real Horovod ranks doing real training
steps. Each rank writes what it saw to `<out>/rank<r>.json`; the test compares the files."""

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np

from pipeline.network.model import ModelConfig, build_model
from pipeline.preprocess.partitions import load_coordinates
from pipeline.training.train_config import TrainConfig
from pipeline.training.trainer import TrainInputs, run_training

SMALL_MODEL = ModelConfig(fov_shape_zyx=(9, 17, 17), deltas_zyx=(2, 4, 4), depth=3, features=8)


def weights_digest(model) -> str:
    return hashlib.sha256(b"".join(w.numpy().tobytes() for w in model.weights)).hexdigest()


def gradient_average_check(hvd, tf) -> dict:
    """Each rank computes gradients on its own toy batch; DistributedGradientTape must return the
    mean of all ranks' local gradients."""
    model = build_model(SMALL_MODEL)
    rng = np.random.default_rng(100 + hvd.rank())  # a different batch on every rank
    image, seed, labels = (rng.normal(size=(2, 9, 17, 17, 1)).astype(np.float32) for _ in range(3))
    labels = (labels > 0).astype(np.float32)

    def loss_fn():
        logits = model([image, seed])
        return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))

    with tf.GradientTape() as tape:
        loss = loss_fn()
    local = tape.gradient(loss, model.trainable_variables)
    with tf.GradientTape() as tape:
        loss = loss_fn()
    averaged = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    flat_local = tf.concat([tf.reshape(g, [-1]) for g in local], 0)
    flat_avg = tf.concat([tf.reshape(g, [-1]) for g in averaged], 0).numpy()
    all_local = hvd.allgather(flat_local[None]).numpy()
    return {
        "max_abs_diff_to_mean": float(np.max(np.abs(all_local.mean(axis=0) - flat_avg))),
        "local_grads_differ_across_ranks": bool(np.ptp(all_local, axis=0).max() > 1e-6),
        "grad_scale": float(np.abs(flat_avg).max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--raw", "--labels", "--coordinates", "--train-dir", "--out"):
        parser.add_argument(name, required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    digests: list[str] = []
    config = TrainConfig(
        model=SMALL_MODEL,
        batch_size=2,
        max_steps=args.steps,
        log_every_steps=1,
        checkpoint_every_steps=100,
    )
    inputs = TrainInputs(args.raw, args.labels, args.coordinates, args.train_dir)
    run_training(inputs, config, on_step=lambda step, model: digests.append(weights_digest(model)))

    import horovod.tensorflow as hvd
    import tensorflow as tf

    rank, size = hvd.rank(), hvd.size()
    shard = load_coordinates(args.coordinates, rank=rank, size=size).coords
    result = {
        "rank": rank,
        "size": size,
        "digests": digests,
        "shard": shard.tolist(),
        "gradients": gradient_average_check(hvd, tf),
    }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
