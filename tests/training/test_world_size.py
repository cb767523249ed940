"""Training that goes on at another world size (2 ranks -> 1, 1 -> 2) and after one of its ranks
is killed: real Horovod ranks, real checkpoints, a real kill -9."""

import json
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import processes
import pytest
from test_distributed import mpiexec
from test_train import run_cli, train, train_command
from workflow_runs import ROOT, tiny_variant

from pipeline.training.train_metrics import last_metrics, read_metrics
from pipeline.training.trainer import local_ranks

BASE = 0.001
# A ramp short enough to see in 8 steps; a checkpoint at step 4, where the world changes.
FLAGS = ("--learning-rate", str(BASE), "--lr-policy", "linear_warmup", "--warmup-steps", "4")
FLAGS += ("--log-every-steps", "2", "--checkpoint-every-steps", "4", "--deterministic")


def summary_of(train_dir: Path) -> dict:
    return json.loads((train_dir / "train_summary.json").read_text())


def checkpoint_weights(checkpoint: Path) -> list[np.ndarray]:
    import tensorflow as tf

    reader = tf.train.load_checkpoint(str(checkpoint))
    names = [n for n in reader.get_variable_to_shape_map() if n.startswith("model/")]
    return [reader.get_tensor(n) for n in names]


def files_of(train_dir: Path) -> dict[str, tuple[int, int]]:
    """Every file under the checkpoints folder with its size and mtime."""
    return {
        str(p.relative_to(train_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted((train_dir / "checkpoints").rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def two_ranks_at_4(training_data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("two_ranks") / "train"
    done = mpiexec(2, *train_command(training_data, run, "--max-steps", "4", *FLAGS)[1:])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def one_rank_at_4(training_data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("one_rank") / "train"
    train(training_data, run, "--max-steps", "4", *FLAGS)
    return run


@pytest.mark.mpi
@pytest.mark.slow
class TestAnotherWorldSize:
    def test_two_ranks_go_on_as_one(self, training_data, two_ranks_at_4, tmp_path):
        run = Path(shutil.copytree(two_ranks_at_4, tmp_path / "train"))
        done = train(training_data, run, "--max-steps", "8", *FLAGS)

        assert "going on at 1 rank(s) (was 2)" in done.stdout, done.stdout
        summary = summary_of(run)
        assert (summary["step"], summary["resumed_from_step"]) == (8, 4)
        assert summary["worlds"] == [[0, 2], [4, 1]] and summary["world_size"] == 1
        # Adam's state carried over: its step counter counts the 2-rank world's 4 steps too.
        assert summary["optimizer_iterations"] == 8
        assert not (run / "set_aside").exists()
        metrics = read_metrics(run / "metrics.csv")
        assert metrics["world_size"].tolist() == [2, 2, 1, 1]
        # A smaller world takes its lower rate at once: base x 1.
        np.testing.assert_allclose(metrics["learning_rate"][2:], [BASE, BASE], rtol=1e-5)
        assert all(np.isfinite(w).all() for w in checkpoint_weights(run / "checkpoints/ckpt-8"))
        assert (run / "curves.png").stat().st_size > 10_000

    def test_one_rank_goes_on_as_two_with_a_new_warm_up(
        self, training_data, one_rank_at_4, tmp_path
    ):
        run = Path(shutil.copytree(one_rank_at_4, tmp_path / "train"))
        done = mpiexec(2, *train_command(training_data, run, "--max-steps", "8", *FLAGS)[1:])

        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        assert "going on at 2 rank(s) (was 1)" in done.stdout, done.stdout
        summary = summary_of(run)
        assert summary["worlds"] == [[0, 1], [4, 2]] and summary["optimizer_iterations"] == 8
        metrics = read_metrics(run / "metrics.csv")
        assert metrics["world_size"].tolist() == [1, 1, 2, 2]
        # Rows of steps 6 and 8 log the rates of steps 5 and 7 (0-based): a ramp from the one
        # rank's base to 2 x base over 4 steps from step 4.
        np.testing.assert_allclose(metrics["learning_rate"][2:], [1.25 * BASE, 1.75 * BASE], 1e-5)
        streams = run / "checkpoints" / "streams" / "ckpt-8"
        assert sorted(p.name for p in streams.glob("rank-*")) == [
            "rank-0-of-2.npz",
            "rank-1-of-2.npz",
        ]
        assert all(np.isfinite(w).all() for w in checkpoint_weights(run / "checkpoints/ckpt-8"))


@pytest.mark.slow
class TestWorldsThatCannotGoOn:
    """One line, exit 2, and the checkpoints as they were."""

    def test_more_ranks_than_coordinates(self, training_data, one_rank_at_4, tmp_path):
        run = Path(shutil.copytree(one_rank_at_4, tmp_path / "train"))
        before = files_of(run)
        too_many = str(len(training_data["coords"]) + 1)
        done = run_cli(training_data, run, "--max-steps", "8", *FLAGS, "--virtual-ranks", too_many)

        assert done.returncode == 2
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and f"cannot give each of {too_many} ranks one" in errors[0]
        assert files_of(run) == before and not (run / "set_aside").exists()

    def test_a_rate_that_is_not_finite_at_the_new_size(
        self, training_data, one_rank_at_4, tmp_path
    ):
        run = Path(shutil.copytree(one_rank_at_4, tmp_path / "train"))
        before = files_of(run)
        flags = ("--learning-rate", "1e308", "--lr-policy", "linear", "--virtual-ranks", "2")
        done = run_cli(training_data, run, "--max-steps", "8", *flags)

        assert done.returncode == 2
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, done.stderr[-2000:]
        assert "gives a learning rate of inf at 2 ranks" in errors[0]
        assert files_of(run) == before and not (run / "set_aside").exists()


def last_logged_step(train_dir: Path) -> int:
    try:
        return int((last_metrics(train_dir / "metrics.csv") or {}).get("step", 0))
    except ValueError:  # a row half-written
        return 0


@pytest.mark.mpi
@pytest.mark.slow
def test_a_rank_killed_at_a_random_step_costs_at_most_one_checkpoint_interval(tiny_run, tmp_path):
    """The workflow's retry goes on from the last checkpoint, and as the run is deterministic,
    ends with the undisturbed run's (tiny_run's) weights and selection."""
    # The tiny run's training, logged every step so the kill can land at any step.
    config = tiny_variant(tmp_path, "killed", {"log_every_steps = 10": "log_every_steps = 1"})
    run_dir = tmp_path / "run"
    train_dir = run_dir / "train"
    kill_at = random.Random().randint(12, 27)  # between the checkpoints of 10 and 30
    command = [sys.executable, "workflow.py", "--config", str(config), "--run-dir", str(run_dir)]
    command += ["--stages", "stage", "preprocess", "train", "select"]
    with processes.started(command, cwd=ROOT) as run:
        killed, killed_after = None, None
        deadline = time.monotonic() + 900
        while killed is None and run.poll() is None and time.monotonic() < deadline:
            if last_logged_step(train_dir) >= kill_at:
                ranks = local_ranks(train_dir)
                if len(ranks) == 2:
                    killed = random.choice(ranks)
                    killed.kill()
                    killed_after = last_logged_step(train_dir)
            time.sleep(0.02)
        assert killed is not None, f"no rank to kill at step {kill_at} (the run ended first?)"
        killed.wait(timeout=30)  # the fault happened: the rank is gone, mid-training
        out, _ = run.communicate(timeout=900)
    assert run.returncode == 0, out[-3000:]

    log = (train_dir / "train.log").read_text()
    assert log.count("[train] 2 rank(s)") == 2, log[-3000:]  # the launch, and the retry's
    assert log.count("[train] done") == 1 and killed_after < 30  # the first did not finish
    summary = summary_of(train_dir)
    resumed = summary["resumed_from_step"]
    assert f"resuming from {train_dir}/checkpoints/ckpt-{resumed} at step {resumed}" in log
    assert summary["step"] == 30  # the planned step count
    assert 0 <= killed_after - resumed <= 10, (killed_after, resumed)  # one checkpoint interval
    selection = json.loads((run_dir / "selection.json").read_text())
    undisturbed = json.loads((tiny_run / "selection.json").read_text())
    assert selection["step"] == undisturbed["step"]
    assert selection["score"] == pytest.approx(undisturbed["score"], rel=1e-6)
    weights = checkpoint_weights(run_dir / selection["checkpoint"])
    assert all(np.isfinite(w).all() for w in weights)
