"""Synchronous data-parallel FFN training on Horovod (Dong et al., SC'19).

The same command runs as one process, under `mpiexec -n N` / `horovodrun -np N`, or under a site's
launcher (`aprun`, `srun`, `mpiexec`):

    python -m pipeline.cli.train --raw vol.h5:raw --labels vol.h5:labels \\
        --coordinates coords.npz --train-dir data/runs/demo/train [--max-steps 2000 ...]

Every rank reads only its shard of the coordinates, computes gradients on its own batch, and
Horovod averages them (ring-allreduce) before the optimizer's update
(`optimizer`: Adam, or SGD with momentum), so all ranks hold identical weights
after every step. With `virtual_ranks` V each process stands for V ranks of a world of
(processes x V): it computes the gradients of each of its ranks' batches in turn and averages them
before Horovod averages over the processes, the update as many real ranks make. Rank 0 writes
checkpoints, metrics and the config; a restart with the same `--train-dir` resumes from the latest
checkpoint (step, weights, optimizer state and each rank's position in its data), also at another
world size: the weights and the optimizer's state do not depend on it; the learning rate follows
the rule for the new size (ramping up again where it rises), the coordinates are sharded anew, and
the step where the size changed is kept (`worlds.json` per checkpoint, metrics.csv, the curves).
"""

import contextlib
import errno
import json
import math
import os
import resource
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core import config_io
from pipeline.core.atomic import atomic_path
from pipeline.core.errors import (
    CheckpointError,
    CheckpointNotWritten,
    ConfigError,
    TrainingDiverged,
)
from pipeline.training.examples import BatchStream
from pipeline.training.lr_scaling import target_learning_rate, world_learning_rate
from pipeline.training.train_config import TrainConfig
from pipeline.training.train_metrics import (
    COUNT_NAMES,
    MetricsLog,
    confusion_counts,
    last_metrics,
    plot_curves,
    summarize,
)

SUMMARY_FILE = "train_summary.json"


@dataclass(frozen=True)
class TrainInputs:
    raw: str  # path.h5:dataset
    labels: str
    coordinates: str  # .npz from pipeline.preprocess.partitions
    train_dir: str
    init_from: str = (
        ""  # start from these weights (pipeline.network.released_weights folder, ckpt-N, or TF1)
    )


def local_ranks(train_dir: str | Path) -> list:
    """The processes on this machine that train into `train_dir`: its ranks, not the launcher
    whose command line names them too (what a fault test or benchmark kills)."""
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline"]):
        line = process.info["cmdline"] or []
        if line[1:3] == ["-m", "pipeline.cli.train"] and str(train_dir) in line:
            found.append(process)
    return found


def training_complete(train_dir: str | Path, max_steps: int) -> bool:
    """True when a finished run left its summary at `max_steps` or beyond (the stage's check)."""
    path = Path(train_dir) / SUMMARY_FILE
    return path.is_file() and json.loads(path.read_text()).get("step", -1) >= max_steps


def _init_runtime(config: TrainConfig, expected_ranks: int | None = None):
    """Thread pools and the rank's GPU must be set before TensorFlow runs its first op; Horovod
    before the model. Ranks that are not one world stop here."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from pipeline.network.devices import bind_to_gpu, check_world_size, gpu_order

    tf.config.threading.set_intra_op_parallelism_threads(config.intra_op_threads)
    tf.config.threading.set_inter_op_parallelism_threads(config.inter_op_threads)
    os.environ["HOROVOD_CYCLE_TIME"] = str(config.horovod_cycle_time_ms)  # read by hvd.init
    hvd.init()
    check_world_size(hvd.size(), expected_ranks)
    device = bind_to_gpu(tf, hvd.local_rank(), gpu_order(os.environ))  # the site's order
    if hvd.rank() == 0:
        virtual = config.virtual_ranks
        world = f" x {virtual} virtual = {hvd.size() * virtual}" if virtual > 1 else ""
        print(f"[train] {hvd.size()} rank(s){world}; rank 0 on {device}", flush=True)
    if config.deterministic:
        tf.config.experimental.enable_op_determinism()
    tf.keras.utils.set_random_seed(config.seed)
    if config.model.precision == "mixed_bfloat16":
        tf.keras.mixed_precision.set_global_policy("mixed_bfloat16")
    return hvd, tf


def virtual_rank_indices(rank: int, virtual_ranks: int) -> range:
    """The ranks of the world that real rank `rank` stands for: consecutive, so the world's ranks
    in order are its processes' in order (as an allgather returns them)."""
    return range(rank * virtual_ranks, (rank + 1) * virtual_ranks)


def make_train_step(model, optimizer, grad_clip: float, virtual_ranks: int = 1):
    """One synchronous step over this process's `virtual_ranks` batches, a list of (images,
    seeds, labels), one per rank it stands for: each batch's forward, loss and gradients on their
    own (as that rank computes them), their mean, Horovod's average over the processes (op
    Average, as DistributedGradientTape's; a copy in a world of one), clip, one Adam update: the
    mean over every rank of the world, as as many real ranks average. Returns (logits per batch,
    loss per batch, applied): the update is applied only when every averaged gradient is finite,
    a verdict every rank reaches alike, since a rank whose own loss is not finite makes its
    gradients NaN and so everyone's average."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    @tf.function
    def rank_gradients(images, seeds, labels):
        with tf.GradientTape() as tape:
            logits = model([images, seeds], training=True)
            loss = tf.reduce_mean(
                tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)
            )
            # 1 when the loss is finite, NaN when not (an infinite loss can have finite gradients).
            poison = tf.stop_gradient(tf.where(tf.math.is_finite(loss), 1.0, float("nan")))
            checked = loss * tf.cast(poison, loss.dtype)
        return logits, loss, tape.gradient(checked, model.trainable_variables)

    @tf.function
    def apply_mean(summed):
        grads = [g / virtual_ranks for g in summed]
        if hvd.size() > 1:
            grads = [hvd.allreduce(g, op=hvd.Average) for g in grads]
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])

        def update():
            clipped = [tf.clip_by_value(g, -grad_clip, grad_clip) for g in grads]
            optimizer.apply_gradients(zip(clipped, model.trainable_variables, strict=True))
            return tf.constant(True)

        return tf.cond(finite, update, lambda: tf.constant(False))

    def train_step(batches):
        # One batch at a time: memory stays one rank's, however many ranks a process stands for.
        logits, losses, summed = [], [], None
        for images, seeds, labels in batches:
            rank_logits, loss, grads = rank_gradients(images, seeds, labels)
            logits.append(rank_logits)
            losses.append(loss)
            summed = (
                grads if summed is None else [a + b for a, b in zip(summed, grads, strict=True)]
            )
        return logits, losses, apply_mean(summed)

    return train_step


START_CHECKPOINT = "ckpt-0"  # a fine-tune's starting weights
# Settings that change how long or how verbosely a run goes, not what it computes: a run that
# changes only these goes on from the checkpoints of the earlier one.
BOOKKEEPING = (
    "max_steps",
    "log_every_steps",
    "checkpoint_every_steps",
    "checkpoint_every_seconds",
    "keep_checkpoints",
    "intra_op_threads",
    "inter_op_threads",
    "horovod_cycle_time_ms",
    # How the world splits into processes and virtual ranks changes no update
    # (tests/test_virtual_ranks.py); the world size itself is not a setting (see `run_training`).
    "virtual_ranks",
)
# What an earlier run wrote into the train dir; set aside together when a run cannot go on from it.
RUN_OUTPUTS = (
    "checkpoints",
    "metrics.csv",
    "curves.png",
    SUMMARY_FILE,
    "tensorboard",
    "config.json",
)


def _lineage_settings(config: TrainConfig, init_from: str) -> dict:
    settings = {k: v for k, v in config_io.to_dict(config).items() if k not in BOOKKEEPING}
    if config.optimizer == "adam":  # as runs made before the setting: their checkpoints go on
        del settings["optimizer"], settings["momentum"]
    return settings | {"init_from": init_from}


@dataclass(frozen=True)
class Lineage:
    """What the checkpoints of a run depend on: the settings that are not bookkeeping, the
    training voxels and coordinates, the starting weights. Not the world size: a run goes on at
    another one."""

    settings: dict
    data: list  # digests of the training voxels and the coordinates file

    @classmethod
    def of(cls, config: TrainConfig, volume, coordinates: str | Path, init_from: str = ""):
        from pipeline.core.stamps import digest_arrays, digest_files

        data = [
            digest_arrays({"raw": volume.raw, "labels": volume.labels}),
            digest_files([coordinates]),
        ]
        return cls(_lineage_settings(config, init_from), data)

    def digest(self, world_size: int | None = None) -> str:
        """The lineage's digest; with `world_size`, as versions that kept the world size in it
        made it (their runs go on too)."""
        from pipeline.core.stamps import digest

        extra = {} if world_size is None else {"world_size": world_size}
        return digest([self.settings | extra, self.data])


def _checkpoint_steps(train_dir: Path) -> list[int]:
    return sorted(
        int(p.name[5:-6])
        for p in (train_dir / "checkpoints").glob("ckpt-*.index")
        if p.name[5:-6].isdigit()
    )


def _why_not_go_on(train_dir: Path, lineage: Lineage, max_steps: int) -> str | None:
    """None when the train dir's checkpoints (if any) can be gone on from, else why not."""
    steps = _checkpoint_steps(train_dir)
    if not steps:
        return None
    try:
        earlier = json.loads((train_dir / "config.json").read_text())
    except (OSError, ValueError):
        earlier = {}
    made_as = {lineage.digest(), lineage.digest(earlier.get("world_size"))}
    if earlier.get("lineage") not in made_as:
        before = {k: v for k, v in earlier.get("lineage_settings", {}).items() if k != "world_size"}
        settings = lineage.settings
        changed = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))
        what = f"settings changed: {', '.join(changed)}" if changed else "training data changed"
        return (
            what if earlier.get("lineage") else "made by an earlier version (no lineage recorded)"
        )
    if steps[-1] > max_steps:
        return f"its latest checkpoint (step {steps[-1]}) is beyond max_steps {max_steps}"
    return None


def set_aside_earlier_run(train_dir: Path, reason: str) -> Path:
    """Move an earlier run's outputs to train_dir/set_aside/<UTC time>/ (nothing is deleted)."""
    folder = train_dir / "set_aside" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    folder.mkdir(parents=True, exist_ok=True)
    for name in RUN_OUTPUTS:
        if (train_dir / name).exists():
            os.replace(train_dir / name, folder / name)
    print(
        f"[train] starting again: the earlier run cannot be gone on from ({reason}); its outputs are in {folder}",
        flush=True,
    )
    return folder


def _save_run_config(
    train_dir: Path, inputs: TrainInputs, config: TrainConfig, world_size: int, lineage: Lineage
) -> None:
    record = {
        "inputs": config_io.to_dict(inputs),
        "config": config_io.to_dict(config),
        "world_size": world_size,
        "lineage": lineage.digest(),
        "lineage_settings": lineage.settings,
    }
    with atomic_path(train_dir / "config.json") as tmp:
        tmp.write_text(json.dumps(record, indent=2) + "\n")


# Per checkpoint, each rank's data stream (`BatchStream.state`: the examples in flight, whose
# next views depend on the network's outputs so far), in a file of its own: written by every rank
# side by side, nothing gathered, whatever the number of ranks.
STREAMS_DIR = "streams"


def _stream_state_path(checkpoint_dir: Path, name: str, rank: int, size: int) -> Path:
    return checkpoint_dir / STREAMS_DIR / name / f"rank-{rank}-of-{size}.npz"


def write_stream_state(checkpoint_dir: Path, name: str, rank: int, size: int, state: bytes) -> None:
    path = _stream_state_path(checkpoint_dir, name, rank, size)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_bytes(state)


def read_stream_state(checkpoint_dir: Path, restored: str | None, rank: int, size: int) -> bytes:
    """This rank's stream at checkpoint `restored`; empty (the stream starts its next example
    anew) without one: no checkpoint, one written before streams were kept, or another world
    size."""
    if not restored:
        return b""
    path = _stream_state_path(checkpoint_dir, Path(restored).name, rank, size)
    return path.read_bytes() if path.is_file() else b""


def prune_stream_states(checkpoint_dir: Path, kept: list[str]) -> None:
    """Remove the streams of checkpoints the manager no longer keeps."""
    names = {Path(c).name for c in kept}
    folder = checkpoint_dir / STREAMS_DIR
    for streams in folder.iterdir() if folder.is_dir() else ():
        if streams.name not in names:
            shutil.rmtree(streams, ignore_errors=True)


# Per checkpoint, rank 0 also writes the world sizes that led to it: (first step, size) of each
# stretch, from which every rank computes the learning rate after a change (`world_learning_rate`).
WORLDS_FILE = "worlds.json"


def write_worlds(checkpoint_dir: Path, name: str, worlds: list[tuple[int, int]]) -> None:
    path = checkpoint_dir / STREAMS_DIR / name / WORLDS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps([list(w) for w in worlds]) + "\n")


def read_worlds(
    checkpoint_dir: Path, restored: str | None, saved_size: int
) -> list[tuple[int, int]]:
    """The stretches that led to checkpoint `restored` ([] without one); a checkpoint made before
    they were kept ran at one size throughout, `saved_size` (the number of its ranks' cursors)."""
    if not restored:
        return []
    path = checkpoint_dir / STREAMS_DIR / Path(restored).name / WORLDS_FILE
    if not path.is_file():
        return [(0, saved_size)]
    return [(int(start), int(size)) for start, size in json.loads(path.read_text())]


def worlds_going_on(recorded: list[tuple[int, int]], step: int, size: int) -> list[tuple[int, int]]:
    """The stretches of a run that goes on from `step` at world size `size`."""
    kept = [w for w in recorded if w[0] < step]
    if not kept or kept[-1][1] != size:
        kept.append((step, size))
    return kept


def starting_cursors(saved: np.ndarray, size: int) -> list[int]:
    """Examples each rank has started: the saved ones at the same world size; at another, the
    examples per rank so far, where every rank begins in its new shard (so the epochs go on)."""
    if len(saved) == size:
        return [int(c) for c in saved]
    return [int(saved.sum()) // size] * size


def check_world(config: TrainConfig, size: int) -> None:
    """A world the run's rule gives no usable rate for stops before anything is written."""
    rate = target_learning_rate(config.learning_rate, size, config.lr_policy)
    if not math.isfinite(rate) or rate <= 0:
        raise ConfigError(
            f"lr_policy {config.lr_policy!r} gives a learning rate of {rate} at {size} ranks "
            f"(learning_rate {config.learning_rate:g}); lower learning_rate or use fewer ranks "
            "(nothing written, the checkpoints untouched)"
        )


def _restore_newest_readable(
    checkpoint, manager, checkpoint_dir: Path
) -> tuple[str | None, list[str]]:
    """Restore the newest checkpoint that can be read; returns it (None: there are none) and the
    newer ones that could not be read, each named in one line. Every rank tries the same files
    in the same order, so all reach the same one."""
    import tensorflow as tf

    from pipeline.core.errors import first_line

    unreadable = []
    for path in reversed(manager.checkpoints):
        try:
            checkpoint.restore(path).assert_existing_objects_matched()
        except (AssertionError, ValueError) as exc:
            raise CheckpointError(
                f"{path}: does not match this model ({first_line(exc)})"
            ) from None
        except (IndexError, OSError, tf.errors.OpError) as exc:
            print(
                f"[train] {path}: cannot be read ({first_line(exc)}); trying the one before",
                flush=True,
            )
            unreadable.append(path)
            continue
        return path, unreadable
    if unreadable:
        raise CheckpointError(
            f"no readable checkpoint in {checkpoint_dir} ({', '.join(Path(p).name for p in unreadable)} "
            "cannot be read); move them away to start the training again"
        )
    return None, []


def _set_aside_unreadable(
    manager, checkpoint_dir: Path, unreadable: list[str], restored: str
) -> None:
    """Move unreadable checkpoints to checkpoints/unreadable/ and drop them from the manager's
    state file, so it neither lists nor later deletes them."""
    import tensorflow as tf

    folder = checkpoint_dir / "unreadable"
    folder.mkdir(exist_ok=True)
    for path in unreadable:
        for file in Path(path).parent.glob(Path(path).name + ".*"):
            os.replace(file, folder / file.name)
    # Names, not paths: TensorFlow reads them relative to the folder (as CheckpointManager writes
    # its own), so a run dir moved or copied later reads and deletes its own checkpoints.
    kept = [Path(p).name for p in manager.checkpoints if p not in unreadable]
    tf.compat.v1.train.update_checkpoint_state(
        str(checkpoint_dir), Path(restored).name, all_model_checkpoint_paths=kept
    )
    print(
        f"[train] set aside in {folder}: {', '.join(Path(p).name for p in unreadable)}", flush=True
    )


def _loss_to_report(losses: list, ranks: range) -> tuple[float, int]:
    """The first loss of this process's ranks that is not finite (else its first rank's), and
    whose it is: what a diverged step's error names."""
    values = [float(loss) for loss in losses]
    i = next((i for i, value in enumerate(values) if not np.isfinite(value)), 0)
    return values[i], ranks[i]


def make_optimizer(tf, config: TrainConfig):
    """The update rule `config.optimizer` at the base rate (the loop sets each step's rate)."""
    if config.optimizer == "sgd_momentum":
        return tf.keras.optimizers.SGD(learning_rate=config.learning_rate, momentum=config.momentum)
    return tf.keras.optimizers.Adam(learning_rate=config.learning_rate)


@dataclass(frozen=True)
class _World:
    """This process's place in the world it trains in."""

    hvd: Any
    tf: Any
    # Everything that depends on the world size uses the world trained as: processes x virtual.
    size: int
    ranks: range  # the ranks of the world this process stands for
    lead: bool  # rank 0: writes the config, checkpoints, metrics and the summary


def _join_world(config: TrainConfig, expected_ranks: int | None) -> _World:
    """Start TensorFlow and Horovod (`_init_runtime`); this process's ranks in the world."""
    hvd, tf = _init_runtime(config, expected_ranks)
    rank = hvd.rank()
    size = hvd.size() * config.virtual_ranks
    return _World(hvd, tf, size, virtual_rank_indices(rank, config.virtual_ranks), rank == 0)


def _read_training_data(inputs: TrainInputs, config: TrainConfig, world: _World) -> tuple:
    """The training volume, the coordinates' shards of this process's ranks, and the lineage
    the checkpoints are made from."""
    from pipeline.data.volumes import read_volume_pair
    from pipeline.preprocess.partitions import load_coordinates

    volume = read_volume_pair(inputs.raw, inputs.labels, min_shape_zyx=config.model.fov_shape_zyx)
    coordinates = load_coordinates(inputs.coordinates)
    shards = [coordinates.shard(r, world.size, inputs.coordinates) for r in world.ranks]
    lineage = Lineage.of(config, volume, inputs.coordinates, inputs.init_from)
    return volume, shards, lineage


def _prepare_train_dir(
    world: _World, train_dir: Path, inputs: TrainInputs, config: TrainConfig, lineage: Lineage
) -> None:
    """Rank 0 sets aside an earlier run this one cannot go on from and saves this run's config;
    the other ranks look at checkpoints only after."""
    from horovod.tensorflow.functions import broadcast_object

    if world.lead:
        train_dir.mkdir(parents=True, exist_ok=True)
        if reason := _why_not_go_on(train_dir, lineage, config.max_steps):
            set_aside_earlier_run(train_dir, reason)
        _save_run_config(train_dir, inputs, config, world.size, lineage)
    broadcast_object(None, root_rank=0)


@dataclass
class _Checkpointed:
    """What a checkpoint holds, and the manager that writes and rotates the checkpoints."""

    model: Any
    optimizer: Any
    step: Any  # tf.Variable: the steps taken
    examples_started: Any  # tf.Variable: per rank of the world, the examples it has started
    checkpoint: Any
    manager: Any
    directory: Path


def _build_checkpointed(tf, config: TrainConfig, size: int, train_dir: Path) -> _Checkpointed:
    """The model, its optimizer and the training's counters, fresh, under a checkpoint manager."""
    from pipeline.network.model import build_model

    model = build_model(config.model)
    optimizer = make_optimizer(tf, config)
    optimizer.build(model.trainable_variables)
    step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
    examples_started = tf.Variable(
        tf.zeros([size], tf.int64), trainable=False, shape=tf.TensorShape(None)
    )
    checkpoint = tf.train.Checkpoint(
        model=model, optimizer=optimizer, step=step, examples_started=examples_started
    )
    manager = tf.train.CheckpointManager(
        checkpoint, str(train_dir / "checkpoints"), config.keep_checkpoints
    )
    checkpoint_dir = train_dir / "checkpoints"
    return _Checkpointed(
        model, optimizer, step, examples_started, checkpoint, manager, checkpoint_dir
    )


def _restore_or_start(
    world: _World, state: _Checkpointed, inputs: TrainInputs, config: TrainConfig
) -> str | None:
    """Restore the newest readable checkpoint, or a fine-tune's starting weights (kept as
    ckpt-0); then rank 0's state everywhere, and rank 0 sets aside the checkpoints that could not
    be read. Returns the checkpoint restored (None: none)."""
    restored, unreadable = _restore_newest_readable(
        state.checkpoint, state.manager, state.directory
    )
    fine_tuning_starts = not restored and bool(inputs.init_from)
    if fine_tuning_starts:  # weights only; step 0, fresh Adam state, warm-up again
        from pipeline.network.released_weights import load_pretrained_weights

        used = load_pretrained_weights(state.model, inputs.init_from)
        if world.lead:
            print(f"[train] initialised weights from {used}", flush=True)
    # Rank 0's state wins everywhere: identical start, even if ranks saw different files.
    world.hvd.broadcast_variables(
        state.model.variables + state.optimizer.variables + [state.step], root_rank=0
    )
    if world.lead and fine_tuning_starts:
        # The starting weights as ckpt-0, outside the manager (which would delete it as it rotates):
        # selection weighs them against the fine-tune's checkpoints, so a fine-tune that made them
        # worse on held-out data is not taken.
        state.checkpoint.save_counter  # noqa: B018 (created on first access; loaders expect it)
        with _room_for_checkpoint(world, state.directory, START_CHECKPOINT, streams=False):
            state.checkpoint.write(str(state.directory / START_CHECKPOINT))
    if world.lead and unreadable:  # every rank has read what it needed
        _set_aside_unreadable(state.manager, state.directory, unreadable, restored)
        state.manager = world.tf.train.CheckpointManager(
            state.checkpoint, str(state.directory), config.keep_checkpoints
        )
    return restored


def _going_on(
    world: _World, state: _Checkpointed, restored: str | None
) -> tuple[int, list[tuple[int, int]], list[int]]:
    """The step the run goes on from, the world sizes that led to it (this one last) and the
    examples each rank has started; rank 0 says where it resumes and at which world size."""
    resumed_from = int(state.step.numpy())
    saved_cursors = state.examples_started.numpy()
    worlds = worlds_going_on(
        read_worlds(state.directory, restored, len(saved_cursors)), resumed_from, world.size
    )
    cursors = starting_cursors(saved_cursors, world.size)
    if world.lead and resumed_from:
        print(f"[train] resuming from {restored} at step {resumed_from}", flush=True)
        if worlds[-1][0] == resumed_from and len(worlds) > 1:
            print(
                f"[train] going on at {world.size} rank(s) (was {worlds[-2][1]}): the coordinates "
                f"sharded anew, the learning rate for {world.size} from step {resumed_from}",
                flush=True,
            )
    return resumed_from, worlds, cursors


def _open_streams(
    volume,
    shards: list,
    config: TrainConfig,
    world: _World,
    cursors: list[int],
    checkpoint_dir: Path,
    restored: str | None,
) -> list[BatchStream]:
    """Each of this process's ranks' data stream, where the restored checkpoint left it."""
    return [
        BatchStream(
            volume,
            shard.coords,
            config.model,
            config.examples,
            config.batch_size,
            config.seed,
            r,
            cursors[r],
            read_stream_state(checkpoint_dir, restored, r, world.size),
        )
        for r, shard in zip(world.ranks, shards, strict=True)
    ]


@dataclass
class _Loop:
    """The training loop's own: its ranks' streams and step, the world sizes so far, the metrics
    log (rank 0's), and what it counts and times between two log lines and two checkpoints."""

    streams: list[BatchStream]
    train_step: Callable
    worlds: list[tuple[int, int]]
    log: MetricsLog | None
    counts: np.ndarray
    interval_start: float
    last_save: float
    run_start: float
    summary: dict  # the last interval's, what the run returns


def _start_loop(
    streams: list[BatchStream],
    train_step: Callable,
    worlds: list[tuple[int, int]],
    train_dir: Path,
    resumed_from: int,
    lead: bool,
) -> _Loop:
    log = MetricsLog(train_dir, resumed_from) if lead else None
    counts = np.zeros(len(COUNT_NAMES))
    interval_start = last_save = time.monotonic()
    run_start = time.monotonic()
    # What the summary says when there is nothing left to train (resumed at max_steps).
    summary: dict = {
        "fov_per_s": 0.0,
        **(last_metrics(train_dir / "metrics.csv") or {}),
        "step": resumed_from,
    }
    return _Loop(
        streams, train_step, worlds, log, counts, interval_start, last_save, run_start, summary
    )


def _save_checkpoint(world: _World, state: _Checkpointed, loop: _Loop) -> None:
    """Every rank's stream, then (rank 0) the world sizes so far and the checkpoint. A write that
    finds no room ends the run in one line and leaves nothing of the checkpoint
    (`_room_for_checkpoint`)."""
    # Identical weights on every rank, so every rank stops here alike.
    if not all(np.all(np.isfinite(v.numpy())) for v in state.model.trainable_variables):
        raise TrainingDiverged(
            f"step {int(state.step.numpy())}: weights are not finite at learning rate "
            f"{state.optimizer.learning_rate.numpy():.3g}; no checkpoint written (last: "
            f"{state.manager.latest_checkpoint or 'none'}); lower learning_rate"
        )
    name = f"ckpt-{int(state.step.numpy())}"
    try:
        with _room_for_checkpoint(world, state.directory, name, streams=False):
            for r, stream in zip(world.ranks, loop.streams, strict=True):
                write_stream_state(state.directory, name, r, world.size, stream.state())
        # A collective: every rank's stream is on disk before rank 0 saves the checkpoint.
        started = [stream.examples_started for stream in loop.streams]
        gathered = world.hvd.allgather(world.tf.constant(started, world.tf.int64)).numpy()
    except Exception:
        # No checkpoint `name` will be (this rank found no room, or another did and left the
        # collective): its streams go, whichever rank the launcher stops first.
        _drop_streams(world, state.directory, name)
        raise
    state.examples_started.assign(gathered)
    if world.lead:
        with _room_for_checkpoint(world, state.directory, name, streams=True):
            write_worlds(state.directory, name, loop.worlds)
            state.manager.save(checkpoint_number=int(state.step.numpy()))
        prune_stream_states(state.directory, state.manager.checkpoints)


def _drop_streams(world: _World, directory: Path, name: str) -> None:
    """The streams of checkpoint `name`, which will not be: rank 0 removes them all, every other
    rank its own (rank 0 may be gone)."""
    if world.lead:
        shutil.rmtree(directory / STREAMS_DIR / name, ignore_errors=True)
        return
    for r in world.ranks:
        _stream_state_path(directory, name, r, world.size).unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # the last one out (rank 0's own may still be there)
        (directory / STREAMS_DIR / name).rmdir()


# How a file system that takes no more reaches a writer: no space or no quota left, or a file past
# the file-size limit (`ulimit -f`). TensorFlow's errors (ResourceExhausted, OutOfRange) carry
# only the system's words for it.
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def no_room(exc: BaseException) -> int | None:
    """The errno of a write that found no room, from an OSError or from the message of a
    TensorFlow error; None for any other error."""
    if isinstance(exc, OSError) and exc.errno in _NO_ROOM:
        return exc.errno
    text = str(exc)
    return next((code for code in _NO_ROOM if os.strerror(code) in text), None)


def remove_unfinished_checkpoint(tf, directory: Path, name: str, streams: bool) -> None:
    """What a failed write of checkpoint `name` leaves, so that no later run sees a half
    checkpoint: TensorFlow's `<name>_temp/` (the shards it writes before merging them), the
    merged `<name>.index` and `<name>.data-*` if it got that far, the temporary of the manager's
    state file, and with `streams` the ranks' streams of it. Nothing when the state file names
    `name`: it was complete. Only `name`'s files: another writer's are not this one's."""
    if _recorded_latest(tf, directory) == name:
        return
    shutil.rmtree(directory / f"{name}_temp", ignore_errors=True)
    for path in [*directory.glob(f"{name}.*"), *directory.glob("checkpoint.tmp*")]:
        path.unlink(missing_ok=True)
    if streams:
        shutil.rmtree(directory / STREAMS_DIR / name, ignore_errors=True)


def _recorded_latest(tf, directory: Path) -> str | None:
    """The name of the latest checkpoint the manager's state file records (None: none, or the
    file cannot be read)."""
    try:
        recorded = tf.train.get_checkpoint_state(str(directory))
    except Exception:  # a state file that cannot be parsed records nothing usable
        return None
    return Path(recorded.model_checkpoint_path).name if recorded is not None else None


def _what_to_do(code: int, directory: Path, goes_on_from: str | None) -> str:
    """The rest of a checkpoint's no-room line: what is kept, how much room there is, and where
    a resumed run goes on from."""
    resumed = (
        f"--resume goes on from {goes_on_from}"
        if goes_on_from
        else "--resume starts again from step 0"
    )
    if code != errno.EFBIG:
        free = shutil.disk_usage(directory).free if directory.exists() else 0
        return f"nothing of it kept; {free / 2**20:.1f} MiB free on its file system: free space, then {resumed}"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit == resource.RLIM_INFINITY:
        return f"nothing of it kept; its file system takes no file that large: {resumed} elsewhere"
    return (
        f"nothing of it kept; files here may not grow past {limit / 2**10:.0f} KiB (ulimit -f): "
        f"raise the limit, then {resumed}"
    )


@contextlib.contextmanager
def _room_for_checkpoint(
    world: _World, directory: Path, name: str, streams: bool
) -> Iterator[None]:
    """A checkpoint write that finds no room (a full disk or quota, the file-size limit) raises
    CheckpointNotWritten, one line naming the checkpoint, on the rank it happened to; rank 0
    first removes what was written of it (`remove_unfinished_checkpoint`; `streams` once every
    rank's are written). Any other error passes unchanged."""
    try:
        yield
    except Exception as exc:
        code = no_room(exc)
        if code is None:
            raise
        if world.lead:
            remove_unfinished_checkpoint(world.tf, directory, name, streams)
        goes_on_from = _recorded_latest(world.tf, directory)
        detail = _what_to_do(code, directory, goes_on_from)
        raise CheckpointNotWritten(code, str(directory / name), detail) from None


def _step_learning_rate(config: TrainConfig, worlds: list[tuple[int, int]], step: int) -> float:
    return world_learning_rate(
        config.learning_rate,
        worlds,
        config.lr_policy,
        step,
        config.warmup_steps,
        config.lr_decay_factor,
        config.lr_decay_every_steps,
    )


def _train_one_step(
    world: _World,
    state: _Checkpointed,
    loop: _Loop,
    config: TrainConfig,
    on_step: Callable[[int, object], None] | None,
) -> tuple[int, float]:
    """One update from every rank's next batch, counted; returns the step reached and its
    learning rate. A step whose loss or gradients are not finite stops the run."""
    current = int(state.step.numpy())
    lr = _step_learning_rate(config, loop.worlds, current)
    state.optimizer.learning_rate.assign(lr)
    batches = [stream.next_batch() for stream in loop.streams]
    logits, losses, applied = loop.train_step(batches)
    if not bool(applied):
        loss, loss_rank = _loss_to_report(losses, world.ranks)
        raise TrainingDiverged(
            f"step {current + 1}: the loss ({loss:.4g} on rank {loss_rank}) or a gradient is not "
            f"finite at learning rate {lr:.3g}; the update was not applied and no checkpoint was "
            f"written from it (last: {state.manager.latest_checkpoint or 'none'}); lower learning_rate"
        )
    # Each batch counts as a real rank's does: the ranks' sums make the logged means.
    for stream, (images, _, labels), rank_logits, loss in zip(
        loop.streams, batches, logits, losses, strict=True
    ):
        rank_logits = rank_logits.numpy()
        stream.write_back(rank_logits)
        loop.counts += [float(loss), 1, *confusion_counts(rank_logits, labels), len(images)]
    state.step.assign_add(1)
    current += 1
    if on_step is not None:
        on_step(current, state.model)
    return current, lr


def _log_interval(world: _World, loop: _Loop, config: TrainConfig, current: int, lr: float) -> bool:
    """The interval's metrics summed over every rank, logged and printed by rank 0; returns
    whether rank 0's clock says a checkpoint is due (every rank gets the same answer)."""
    # One collective per log interval: sums of all ranks' counts, and rank 0's clock decides
    # for everyone whether a time-based checkpoint is due (ranks must save together).
    clock_due = float(
        world.lead and time.monotonic() - loop.last_save >= config.checkpoint_every_seconds
    )
    hvd, tf = world.hvd, world.tf
    totals = hvd.allreduce(tf.constant([*loop.counts, clock_due], tf.float64), op=hvd.Sum).numpy()
    elapsed = time.monotonic() - loop.interval_start
    summary = {
        "step": current,
        "wall_s": round(time.monotonic() - loop.run_start, 3),
        **summarize(totals[:-1]),
    }
    summary |= {
        "learning_rate": lr,
        "fov_per_s": totals[COUNT_NAMES.index("fovs")] / elapsed,
        "world_size": world.size,
    }
    if world.lead:
        loop.log.write(summary)
        print(
            f"[train] step {current}/{config.max_steps} loss {summary['loss']:.4f} "
            f"f1 {summary['f1']:.3f} acc {summary['accuracy']:.3f} lr {lr:.2e} "
            f"{summary['fov_per_s']:.1f} FOV/s",
            flush=True,
        )
    loop.counts[:] = 0
    loop.interval_start = time.monotonic()
    loop.summary = summary
    return totals[-1] > 0


def _train_until_done(
    world: _World,
    state: _Checkpointed,
    loop: _Loop,
    config: TrainConfig,
    on_step: Callable[[int, object], None] | None,
) -> dict:
    """Steps until `config.max_steps`, logging and checkpointing when due; returns the last
    interval's summary."""
    while int(state.step.numpy()) < config.max_steps:
        current, lr = _train_one_step(world, state, loop, config, on_step)
        final = current >= config.max_steps
        save_due = current % config.checkpoint_every_steps == 0 or final
        if current % config.log_every_steps == 0 or final:
            clock_due = _log_interval(world, loop, config, current, lr)
            save_due = save_due or clock_due
        if save_due:
            _save_checkpoint(world, state, loop)
            loop.last_save = time.monotonic()
    return loop.summary


def _write_summary(
    world: _World,
    state: _Checkpointed,
    config: TrainConfig,
    train_dir: Path,
    summary: dict,
    resumed_from: int,
    worlds: list[tuple[int, int]],
) -> None:
    """Rank 0's end: the summary completed with how the run went, the curves, the summary file."""
    summary |= {
        "resumed_from_step": resumed_from,
        "optimizer_iterations": int(state.optimizer.iterations.numpy()),
        "world_size": world.size,
        "worlds": [list(w) for w in worlds],
        "real_ranks": world.hvd.size(),
        "virtual_ranks": config.virtual_ranks,
        "checkpoint": state.manager.latest_checkpoint,
    }
    if (train_dir / "metrics.csv").exists():
        plot_curves(train_dir / "metrics.csv", train_dir / "curves.png")
    with atomic_path(train_dir / SUMMARY_FILE) as tmp:
        tmp.write_text(json.dumps(summary, indent=2) + "\n")


def run_training(
    inputs: TrainInputs,
    config: TrainConfig,
    on_step: Callable[[int, object], None] | None = None,
    expected_ranks: int | None = None,
) -> dict:
    """Train until `config.max_steps` (resuming if checkpoints exist); returns the final summary.
    `expected_ranks`: the world size the launch asked for (checked at start).

    `on_step(step, model)` runs on every rank after every step (tests use it to compare weights).
    """
    world = _join_world(config, expected_ranks)
    train_dir = Path(inputs.train_dir)
    check_world(config, world.size)
    volume, shards, lineage = _read_training_data(inputs, config, world)
    _prepare_train_dir(world, train_dir, inputs, config, lineage)
    state = _build_checkpointed(world.tf, config, world.size, train_dir)
    restored = _restore_or_start(world, state, inputs, config)
    resumed_from, worlds, cursors = _going_on(world, state, restored)
    streams = _open_streams(volume, shards, config, world, cursors, state.directory, restored)
    train_step = make_train_step(
        state.model, state.optimizer, config.grad_clip, config.virtual_ranks
    )
    loop = _start_loop(streams, train_step, worlds, train_dir, resumed_from, world.lead)
    summary = _train_until_done(world, state, loop, config, on_step)
    if world.lead:
        _write_summary(world, state, config, train_dir, summary, resumed_from, worlds)
    return summary if world.lead else {}
