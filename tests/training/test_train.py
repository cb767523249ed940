"""Training one rank through the real CLI: it learns, it resumes after being killed, it repeats."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import processes
import pytest

from pipeline.core.errors import ConfigError
from pipeline.training.train_config import TrainConfig
from pipeline.training.train_metrics import read_metrics

ROOT = Path(__file__).parents[2]
SMALL_MODEL_FLAGS = [
    "--model-fov-shape-zyx",
    "9",
    "17",
    "17",
    "--model-deltas-zyx",
    "2",
    "4",
    "4",
    "--model-depth",
    "3",
    "--model-features",
    "16",
]


def train_command(data: dict, train_dir: Path, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pipeline.cli.train",
        "--raw",
        data["raw"],
        "--labels",
        data["labels"],
        "--coordinates",
        data["coordinates"],
        "--train-dir",
        str(train_dir),
        *SMALL_MODEL_FLAGS,
        *flags,
    ]


def train(data: dict, train_dir: Path, *flags: str) -> subprocess.CompletedProcess:
    done = processes.run(train_command(data, train_dir, *flags), cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_one_rank_learns_the_object_masks(training_data, tmp_path):
    # The fixed policy keeps every FOV centred on its coordinate, so the object share of the FOVs
    # stays near the balanced 0.5 and a constant prediction scores poorly: a clear yardstick.
    train(
        training_data,
        tmp_path,
        "--max-steps",
        "250",
        "--log-every-steps",
        "50",
        "--model-depth",
        "5",
        "--examples-fov-policy",
        "fixed",
    )
    m = read_metrics(tmp_path / "metrics.csv")
    last = slice(-2, None)  # the last 100 steps, 400 FOVs
    f = m["object_fraction"][last].mean()
    f1, accuracy = m["f1"][last].mean(), m["accuracy"][last].mean()
    # A constant prediction scores accuracy max(f, 1 - f) and at best F1 2f / (1 + f).
    assert accuracy > max(f, 1 - f) + 0.15, m
    assert f1 > max(0.6, 2 * f / (1 + f) + 0.05), m
    assert f1 > m["f1"][0] + 0.1 and m["loss"][last].mean() < m["loss"][0] - 0.2, m
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert summary["step"] == 250 and summary["world_size"] == 1
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["config"]["model"]["fov_shape_zyx"] == [9, 17, 17]  # the resolved config is kept


@pytest.mark.slow
def test_killed_run_resumes_from_its_last_checkpoint(training_data, tmp_path):
    flags = ("--max-steps", "40", "--log-every-steps", "2", "--checkpoint-every-steps", "6")
    process = subprocess.Popen(
        train_command(training_data, tmp_path, *flags),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    # A save is complete once the manager's state file names it (index and data come first).
    state = tmp_path / "checkpoints" / "checkpoint"

    def saved() -> str:
        return state.read_text() if state.is_file() else ""

    deadline = time.monotonic() + 600
    while '"ckpt-12"' not in saved() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (tmp_path / "train_summary.json").exists()
    before = read_metrics(tmp_path / "metrics.csv")
    last_checkpoint = int(saved().splitlines()[0].rpartition("-")[2].strip('"'))
    assert 12 <= last_checkpoint < 40

    resumed = train(training_data, tmp_path, *flags)

    assert f"at step {last_checkpoint}" in resumed.stdout
    after = read_metrics(tmp_path / "metrics.csv")
    assert after["step"].tolist() == list(range(2, 41, 2))  # continues; no step logged twice
    kept = before["step"] <= last_checkpoint
    np.testing.assert_array_equal(after["loss"][: kept.sum()], before["loss"][kept])
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert summary["step"] == 40 and summary["resumed_from_step"] == last_checkpoint
    # Adam's state came back too: its step counter (bias correction) counts the steps before the kill.
    assert summary["optimizer_iterations"] == 40


@pytest.mark.slow
def test_same_seed_gives_the_same_loss_curve(training_data, eight_steps, tmp_path):
    train(training_data, tmp_path / "same", "--max-steps", "8", *SHORT)
    train(training_data, tmp_path / "other", "--max-steps", "8", *SHORT, "--seed", "5")
    a, b, c = (
        read_metrics(d / "metrics.csv")["loss"]
        for d in (eight_steps, tmp_path / "same", tmp_path / "other")
    )
    np.testing.assert_allclose(a, b, rtol=1e-6)  # documented tolerance: float32 summation order
    assert not np.allclose(a, c, rtol=1e-3)


def test_bad_settings_fail_with_one_line(training_data, tmp_path):
    done = subprocess.run(
        train_command(training_data, tmp_path, "--lr-policy", "cubic"),
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("error: lr_policy must be one of")


def test_threads_can_be_set_per_rank(training_data, tmp_path):
    env = {**os.environ}
    train(
        training_data,
        tmp_path,
        "--max-steps",
        "2",
        "--intra-op-threads",
        "1",
        "--inter-op-threads",
        "1",
    )
    assert json.loads((tmp_path / "config.json").read_text())["config"]["intra_op_threads"] == 1
    assert env == os.environ


@pytest.mark.slow
@pytest.mark.parametrize("start", ["checkpoint", "shipped-folder"])
def test_fine_tuning_starts_from_given_weights_with_a_fresh_optimizer(
    training_data, eight_steps, tmp_path, start
):
    from pipeline.inference.flood_fill import predictor_from_checkpoint
    from pipeline.selection.released_models import ship_checkpoint

    source = eight_steps / "checkpoints" / "ckpt-4"
    if start == "shipped-folder":  # as models/demo-synthetic was made: the weights only
        shipped = ship_checkpoint(source, tmp_path / "shipped")
        images, seeds = np.random.default_rng(0).normal(size=(2, 1, 9, 17, 17, 1)).astype("f4")
        np.testing.assert_array_equal(
            predictor_from_checkpoint(shipped)(images, seeds),
            predictor_from_checkpoint(source)(images, seeds),
        )
        size = lambda prefix: Path(f"{prefix}.data-00000-of-00001").stat().st_size  # noqa: E731
        assert size(shipped) < size(source) / 2  # no optimizer state
        source = tmp_path / "shipped"
    done = train(training_data, tmp_path / "tuned", "--max-steps", "3", "--init-from", str(source))
    assert "[train] initialised weights from" in done.stdout
    summary = json.loads((tmp_path / "tuned" / "train_summary.json").read_text())
    assert summary["step"] == 3 and summary["optimizer_iterations"] == 3  # Adam starts afresh
    # The starting weights are kept as ckpt-0 for selection to weigh against the fine-tune.
    images, seeds = np.random.default_rng(1).normal(size=(2, 1, 9, 17, 17, 1)).astype("f4")
    np.testing.assert_array_equal(
        predictor_from_checkpoint(tmp_path / "tuned" / "checkpoints" / "ckpt-0")(images, seeds),
        predictor_from_checkpoint(eight_steps / "checkpoints" / "ckpt-4")(images, seeds),
    )


@pytest.mark.parametrize(
    "settings",
    [{"lr_decay_factor": 0.0}, {"lr_decay_factor": 1.5}, {"lr_decay_every_steps": -1}],
)
def test_a_bad_learning_rate_decay_is_refused(settings):
    with pytest.raises(ConfigError, match="lr_decay_every_steps must be >= 0 and lr_decay_factor"):
        TrainConfig(**settings)


def run_cli(data: dict, train_dir: Path, *flags: str) -> subprocess.CompletedProcess:
    return processes.run(train_command(data, train_dir, *flags), cwd=ROOT, timeout=600)


SHORT = ("--log-every-steps", "2", "--checkpoint-every-steps", "4", "--deterministic")


@pytest.fixture(scope="module")
def eight_steps(training_data, tmp_path_factory) -> Path:
    """One deterministic run of 8 steps (checkpoints 4 and 8) that tests copy and go on from."""
    run = tmp_path_factory.mktemp("eight_steps")
    train(training_data, run, "--max-steps", "8", *SHORT)
    return run


def copy_of(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def test_a_diverging_training_stops_at_once_and_writes_no_checkpoint(training_data, tmp_path):
    done = run_cli(training_data, tmp_path, "--learning-rate", "1e30", "--max-steps", "30", *SHORT)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "not finite at learning rate 1e+30" in errors[0], done.stderr[
        -2000:
    ]
    assert "Traceback" not in done.stderr
    assert not list(tmp_path.glob("checkpoints/ckpt-*"))  # nothing saved from a diverged state
    assert not (tmp_path / "train_summary.json").exists()


@pytest.mark.slow
def test_an_unreadable_checkpoint_is_set_aside_and_the_one_before_used(
    training_data, eight_steps, tmp_path
):
    run = copy_of(eight_steps, tmp_path / "run")
    data = next((run / "checkpoints").glob("ckpt-8.data-*"))
    data.write_bytes(data.read_bytes()[:100])  # truncated, as by a full disk or a killed copy

    resumed = train(training_data, run, "--max-steps", "8", *SHORT)

    assert f"{run}/checkpoints/ckpt-8: cannot be read" in resumed.stdout
    assert (
        run / "checkpoints" / "unreadable" / data.name
    ).stat().st_size == 100  # kept, not deleted
    assert "resuming from" in resumed.stdout and "ckpt-4 at step 4" in resumed.stdout
    np.testing.assert_array_equal(  # steps 5 to 8 again, as the uninterrupted run made them
        read_metrics(run / "metrics.csv")["loss"], read_metrics(eight_steps / "metrics.csv")["loss"]
    )

    for data in (run / "checkpoints").glob("ckpt-*.data-*"):  # now every checkpoint
        data.write_bytes(data.read_bytes()[:100])
    failed = run_cli(training_data, run, "--max-steps", "16", *SHORT)
    assert failed.returncode == 2
    assert "error: no readable checkpoint in" in failed.stderr and "Traceback" not in failed.stderr


@pytest.mark.slow
def test_only_bookkeeping_changes_go_on_from_the_checkpoints(training_data, eight_steps, tmp_path):
    run = copy_of(eight_steps, tmp_path / "run")
    more = train(training_data, run, "--max-steps", "10", *SHORT)
    assert "ckpt-8 at step 8" in more.stdout

    other = train(training_data, run, "--max-steps", "8", "--learning-rate", "0.002", *SHORT)
    assert (
        "starting again: the earlier run cannot be gone on from (settings changed: learning_rate)"
        in other.stdout
    )
    (earlier,) = (run / "set_aside").iterdir()
    assert (earlier / "checkpoints" / "ckpt-10.index").is_file() and (
        earlier / "metrics.csv"
    ).is_file()
    assert read_metrics(run / "metrics.csv")["step"].tolist() == [2, 4, 6, 8]  # from step 0


@pytest.mark.slow
def test_a_run_from_when_the_world_size_was_in_the_lineage_goes_on(
    training_data, eight_steps, tmp_path
):
    """Runs recorded the world size among their lineage's settings (their checkpoints' digest);
    they go on, as runs recorded now."""
    from pipeline.core.stamps import digest, digest_arrays, digest_files
    from pipeline.data.volumes import read_volume_pair

    run = copy_of(eight_steps, tmp_path / "run")
    record = json.loads((run / "config.json").read_text())
    volume = read_volume_pair(training_data["raw"], training_data["labels"])
    data = [
        digest_arrays({"raw": volume.raw, "labels": volume.labels}),
        digest_files([training_data["coordinates"]]),
    ]
    then = record["lineage_settings"] | {"world_size": 1}
    record |= {"lineage": digest([then, data]), "lineage_settings": then}
    (run / "config.json").write_text(json.dumps(record))

    more = train(training_data, run, "--max-steps", "10", *SHORT)
    assert "ckpt-8 at step 8" in more.stdout and not (run / "set_aside").exists()


@pytest.mark.slow
def test_sgd_with_momentum_trains_anew_with_one_slot_per_weight(
    training_data, eight_steps, tmp_path
):
    import tensorflow as tf

    def optimizer_slots(run: Path) -> int:
        names = [n for n, _ in tf.train.list_variables(str(run / "checkpoints"))]
        return sum(n.startswith("optimizer/_variables/") for n in names)

    adam_slots = optimizer_slots(eight_steps)
    run = copy_of(eight_steps, tmp_path / "run")
    done = train(training_data, run, "--max-steps", "8", "--optimizer", "sgd_momentum", *SHORT)
    assert "settings changed: momentum, optimizer" in done.stdout, done.stdout
    assert read_metrics(run / "metrics.csv")["step"].tolist() == [2, 4, 6, 8]  # from step 0
    # Adam keeps two moments per weight, momentum SGD one (each beside the step counter).
    weights = (adam_slots - 1) // 2
    assert optimizer_slots(run) == 1 + weights and weights > 0


def test_ranks_that_are_not_one_world_stop_at_once(training_data, tmp_path):
    # One process told that the launch started two: what a wheel-built MPICH under srun or aprun
    # does, each rank alone in a world of one.
    done = run_cli(training_data, tmp_path, "--expected-ranks", "2", "--max-steps", "2")
    assert done.returncode == 2
    assert "error: Horovod sees 1 rank(s) but the launch started 2" in done.stderr
    assert not (tmp_path / "checkpoints").exists()
