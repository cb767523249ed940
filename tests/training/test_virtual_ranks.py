"""Virtual ranks (`virtual_ranks`, issue 33): a process that stands for V ranks makes the update V
real Horovod ranks make, so a machine with fewer cores than ranks can train as a larger world.

Every run here trains configs/tiny.toml's small FFN through the real command line on the session's
synthetic volume, and the tests compare what the runs leave on disk: checkpoints, metrics.csv,
train_summary.json.
"""

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from test_distributed import mpiexec
from test_train import ROOT, train, train_command

from pipeline.core.errors import ConfigError
from pipeline.training.train_config import TrainConfig, load_train_config
from pipeline.training.train_metrics import read_metrics

RUN = (
    "--model-features",
    "8",  # configs/tiny.toml's model (train_command gives its FOV, deltas and depth)
    "--batch-size",
    "2",
    "--deterministic",
    # One thread per rank, real or virtual: each rank's kernels then add up in the same order.
    "--intra-op-threads",
    "1",
    "--inter-op-threads",
    "1",
    # Below the seed's background: every example walks its whole canvas, so at each checkpoint
    # each rank has examples in flight that a resume must go on with.
    "--examples-move-threshold",
    "0.04",
    "--log-every-steps",
    "4",
    "--checkpoint-every-steps",
    "4",
)
# Two runs that agree "to float tolerance". The mean of two ranks' float32 gradients does not
# depend on which is added first, so 2 virtual and 2 real ranks agree to the bit here; this leaves
# room only for another order of summation (another MPI, more threads, more ranks): rounding of
# ~1e-7 grown over a few Adam steps, whose updates are ~1e-3 each. Two worlds that differ lie
# ~1e-3 apart (a world of one from one of two after 20 steps: up to 9e-3, median 7e-4).
SAME = {"rtol": 1e-5, "atol": 1e-6}
STREAMS = ["rank-0-of-2.npz", "rank-1-of-2.npz"]  # a world of 2: a stream per rank, real or not


def checkpoint_variables(train_dir: Path) -> dict[str, np.ndarray]:
    """The network's weights and Adam's state in the run's last checkpoint, by name."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(summary_of(train_dir)["checkpoint"])
    names = sorted(reader.get_variable_to_shape_map())
    return {n: reader.get_tensor(n) for n in names if n.startswith(("model/", "optimizer/"))}


def weights(train_dir: Path) -> np.ndarray:
    """The network's weights in the run's last checkpoint, as one vector."""
    variables = checkpoint_variables(train_dir)
    return np.concatenate([v.ravel() for n, v in variables.items() if n.startswith("model/")])


def summary_of(train_dir: Path) -> dict:
    return json.loads((train_dir / "train_summary.json").read_text())


def ranks_of(train_dir: Path) -> tuple[int, int, int]:
    summary = summary_of(train_dir)
    return summary["world_size"], summary["real_ranks"], summary["virtual_ranks"]


def streams_at(train_dir: Path, checkpoint: str) -> list[str]:
    return sorted(
        p.name for p in (train_dir / "checkpoints" / "streams" / checkpoint).glob("rank-*")
    )


@pytest.mark.mpi
@pytest.mark.slow
class TestTwoVirtualRanksAreTwoRealRanks:
    """20 steps of one process standing for 2 ranks against 2 real Horovod ranks (mpiexec -n 2),
    the same settings otherwise."""

    @pytest.fixture(scope="class")
    def two_virtual_ranks(self, training_data, tmp_path_factory) -> Path:
        run = tmp_path_factory.mktemp("virtual") / "train"
        train(training_data, run, "--max-steps", "20", "--virtual-ranks", "2", *RUN)
        return run

    @pytest.fixture(scope="class")
    def two_real_ranks(self, training_data, tmp_path_factory) -> Path:
        run = tmp_path_factory.mktemp("real") / "train"
        command = train_command(training_data, run, "--max-steps", "20", *RUN)
        done = mpiexec(2, *command[1:])  # mpiexec adds the python
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return run

    def test_they_end_with_the_same_weights(
        self, two_virtual_ranks, two_real_ranks, training_data, tmp_path
    ):
        virtual, real = (
            checkpoint_variables(two_virtual_ranks),
            checkpoint_variables(two_real_ranks),
        )
        assert virtual.keys() == real.keys() and len(virtual) > 10
        for name, value in virtual.items():
            np.testing.assert_allclose(value, real[name], **SAME, err_msg=name)

        # The comparison can fail: a world of one, the same settings otherwise, ends elsewhere.
        train(training_data, tmp_path, "--max-steps", "20", *RUN)
        assert ranks_of(tmp_path) == (1, 1, 1)
        assert not np.allclose(weights(tmp_path), weights(two_virtual_ranks), **SAME)

    def test_they_log_the_same_metrics(self, two_virtual_ranks, two_real_ranks):
        # Each virtual rank's loss and voxel counts are summed as Horovod sums the real ranks'.
        virtual = read_metrics(two_virtual_ranks / "metrics.csv")
        real = read_metrics(two_real_ranks / "metrics.csv")
        np.testing.assert_array_equal(virtual["step"], [4, 8, 12, 16, 20])
        for name in ("loss", "accuracy", "precision", "recall", "f1", "object_fraction"):
            np.testing.assert_allclose(virtual[name], real[name], rtol=SAME["rtol"], err_msg=name)

    def test_the_summary_says_which_ranks_were_real(self, two_virtual_ranks, two_real_ranks):
        assert ranks_of(two_virtual_ranks) == (2, 1, 2)  # world size, real ranks, virtual ranks
        assert ranks_of(two_real_ranks) == (2, 2, 1)
        # A virtual rank keeps its data stream as the real rank of its index does.
        assert streams_at(two_virtual_ranks, "ckpt-20") == STREAMS
        assert streams_at(two_real_ranks, "ckpt-20") == STREAMS


def test_the_learning_rate_scales_with_the_virtual_world(training_data, tmp_path):
    base = 0.001
    flags = ("--learning-rate", str(base), "--lr-policy", "linear_warmup", "--warmup-steps", "2")
    flags += ("--max-steps", "4", "--log-every-steps", "1", "--virtual-ranks", "4")
    train(training_data, tmp_path, *RUN, *flags)
    # Goyal's ramp from base to base x 4 over 2 steps, then base x 4: a world of 4.
    rates = read_metrics(tmp_path / "metrics.csv")["learning_rate"]
    np.testing.assert_allclose(rates, [base, 2.5 * base, 4 * base, 4 * base], rtol=1e-5)
    assert ranks_of(tmp_path) == (4, 1, 4)


@pytest.mark.slow
class TestResume:
    """A run of 2 virtual ranks stopped at its checkpoint of step 4 and started again, against the
    same run uninterrupted."""

    @pytest.fixture(scope="class")
    def uninterrupted(self, training_data, tmp_path_factory) -> Path:
        run = tmp_path_factory.mktemp("uninterrupted") / "train"
        train(training_data, run, "--max-steps", "12", "--virtual-ranks", "2", *RUN)
        return run

    @pytest.fixture(scope="class")
    def stopped(self, training_data, tmp_path_factory) -> Path:
        run = tmp_path_factory.mktemp("stopped") / "train"
        train(training_data, run, "--max-steps", "4", "--virtual-ranks", "2", *RUN)
        assert streams_at(run, "ckpt-4") == STREAMS
        return run

    def test_it_goes_on_to_the_uninterrupted_runs_weights(
        self, training_data, stopped, uninterrupted, tmp_path
    ):
        run = Path(shutil.copytree(stopped, tmp_path / "run"))
        done = train(training_data, run, "--max-steps", "12", "--virtual-ranks", "2", *RUN)

        assert "ckpt-4 at step 4" in done.stdout
        expected = checkpoint_variables(uninterrupted)
        for name, value in checkpoint_variables(run).items():
            np.testing.assert_array_equal(value, expected[name], err_msg=name)
        np.testing.assert_array_equal(
            read_metrics(run / "metrics.csv")["loss"],
            read_metrics(uninterrupted / "metrics.csv")["loss"],
        )

    def test_without_the_second_virtual_ranks_stream_it_would_not(
        self, training_data, stopped, uninterrupted, tmp_path
    ):
        # What the test above relies on: virtual rank 1's examples in flight are restored.
        run = Path(shutil.copytree(stopped, tmp_path / "run"))
        (run / "checkpoints" / "streams" / "ckpt-4" / STREAMS[1]).unlink()
        train(training_data, run, "--max-steps", "12", "--virtual-ranks", "2", *RUN)
        assert not np.allclose(weights(run), weights(uninterrupted), **SAME)

    def test_another_virtual_rank_count_goes_on_in_another_world(
        self, training_data, stopped, tmp_path
    ):
        run = Path(shutil.copytree(stopped, tmp_path / "run"))
        done = train(training_data, run, "--max-steps", "6", "--virtual-ranks", "3", *RUN)
        assert "going on at 3 rank(s) (was 2)" in done.stdout, done.stdout
        assert ranks_of(run) == (3, 1, 3) and summary_of(run)["resumed_from_step"] == 4
        assert summary_of(run)["worlds"] == [[0, 2], [4, 3]]
        # Each of the 3 ranks wrote its stream at step 6 (none of the 2-rank world's is kept).
        assert streams_at(run, "ckpt-6") == [f"rank-{r}-of-3.npz" for r in range(3)]


class TestBadSettings:
    @pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
    def test_virtual_ranks_must_be_an_integer_of_at_least_one(self, value):
        with pytest.raises(ConfigError, match=r"^virtual_ranks must be an integer >= 1, got"):
            TrainConfig(virtual_ranks=value)

    @pytest.mark.parametrize("text", ["virtual_ranks = 0", "virtual_ranks = 1.5"])
    def test_a_config_file_names_the_setting_in_one_line(self, tmp_path, text):
        path = tmp_path / "train.toml"
        path.write_text(text + "\n")
        with pytest.raises(ConfigError, match="virtual_ranks") as error:
            load_train_config(path)
        assert len(str(error.value).splitlines()) == 1

    def test_the_command_line_stops_with_one_error_line(self, training_data, tmp_path):
        done = subprocess.run(
            train_command(training_data, tmp_path, "--virtual-ranks", "0"),
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert done.returncode == 2
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert errors == ["error: virtual_ranks must be an integer >= 1, got 0"], done.stderr
        assert not (tmp_path / "checkpoints").exists()
