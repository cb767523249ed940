"""Two real Horovod ranks (mpiexec from the venv's MPICH) training together."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import processes
import pytest
from test_train import SHORT, train_command

from pipeline.training.train_metrics import read_metrics

WORKER = Path(__file__).parents[1] / "mpi_worker.py"


def mpiexec(ranks: int, *args: str, timeout: float = 1000) -> subprocess.CompletedProcess:
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{venv_bin}{os.pathsep}{os.environ['PATH']}"}
    # One thread per rank: 2 ranks on 2 cores, as a node would be split between ranks.
    env |= {"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1"}
    return processes.run(
        ["mpiexec", "-n", str(ranks), sys.executable, *args],
        env=env,
        timeout=timeout,
        cwd=Path(__file__).parents[2],
    )


@pytest.fixture(scope="module")
def two_rank_run(training_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("mpi_out")
    done = mpiexec(
        2,
        str(WORKER),
        "--raw",
        training_data["raw"],
        "--labels",
        training_data["labels"],
        "--coordinates",
        training_data["coordinates"],
        "--train-dir",
        str(out / "train"),
        "--out",
        str(out),
        "--steps",
        "4",
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return ranks, out


@pytest.mark.mpi
class TestTwoRanks:
    def test_both_ranks_are_in_one_world(self, two_rank_run):
        ranks, _ = two_rank_run
        assert [(r["rank"], r["size"]) for r in ranks] == [(0, 2), (1, 2)]

    def test_weights_identical_on_both_ranks_after_every_step(self, two_rank_run):
        ranks, _ = two_rank_run
        assert len(ranks[0]["digests"]) == 4
        assert ranks[0]["digests"] == ranks[1]["digests"]
        assert len(set(ranks[0]["digests"])) == 4  # the weights really changed at every step

    def test_averaged_gradient_is_the_mean_of_the_ranks_gradients(self, two_rank_run):
        ranks, _ = two_rank_run
        for r in ranks:
            grads = r["gradients"]
            assert grads["local_grads_differ_across_ranks"]
            assert grads["max_abs_diff_to_mean"] <= 1e-6 * max(grads["grad_scale"], 1.0)

    def test_shards_are_disjoint_and_cover_the_coordinates(self, two_rank_run, training_data):
        ranks, _ = two_rank_run
        all_coords = training_data["coords"]
        shard0, shard1 = (np.array(r["shard"]) for r in ranks)
        assert len(shard0) + len(shard1) == len(all_coords)
        # Rank r takes rows r, r + 2, ...: disjoint by position, together every row once.
        np.testing.assert_array_equal(shard0, all_coords[0::2])
        np.testing.assert_array_equal(shard1, all_coords[1::2])

    def test_rank_zero_wrote_metrics_and_config_for_the_world(self, two_rank_run):
        _, out = two_rank_run
        config = json.loads((out / "train" / "config.json").read_text())
        assert config["world_size"] == 2
        lines = (out / "train" / "metrics.csv").read_text().splitlines()
        assert len(lines) == 1 + 4  # header + a row per step (log_every_steps=1)


@pytest.mark.mpi
@pytest.mark.slow
def test_two_ranks_resume_from_the_checkpoint_before_an_unreadable_one_exactly(
    training_data, tmp_path
):
    # A move threshold below the seed's background makes every example walk its whole canvas from
    # the first step on, so examples are in flight at ckpt-4: the resumed ranks must go on with them.
    flags = ("--max-steps", "8", *SHORT, "--examples-move-threshold", "0.04")
    command = train_command(training_data, tmp_path, *flags)[1:]  # mpiexec adds the python
    first = mpiexec(2, *command)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    uninterrupted = read_metrics(tmp_path / "metrics.csv")["loss"]
    streams = tmp_path / "checkpoints" / "streams"
    assert sorted(p.name for p in (streams / "ckpt-4").glob("rank-*")) == [
        "rank-0-of-2.npz",
        "rank-1-of-2.npz",
    ]
    data = next((tmp_path / "checkpoints").glob("ckpt-8.data-*"))
    data.write_bytes(data.read_bytes()[:100])

    resumed = mpiexec(2, *command)

    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert (tmp_path / "checkpoints" / "unreadable" / data.name).is_file()
    assert "ckpt-4 at step 4" in resumed.stdout
    np.testing.assert_array_equal(read_metrics(tmp_path / "metrics.csv")["loss"], uninterrupted)
