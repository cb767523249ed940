"""The set-up script's flavours (tools/setup_env.sh), by their dry run: what each would install
and how Horovod would be built. The default flavour is the one every other test runs in."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def dry_run(**flavour: str) -> subprocess.CompletedProcess:
    env = os.environ | {"DRY_RUN": "1", "VENV": "/nonexistent/venv"} | flavour
    return subprocess.run(
        ["bash", "tools/setup_env.sh"], cwd=ROOT, env=env, capture_output=True, text=True
    )


def test_the_default_takes_mpi_from_the_mpich_wheel_and_tensorflow_for_the_cpu():
    out = dry_run().stdout
    assert "install mpich==" in out and "install tensorflow-cpu==2.15.1" in out
    assert "HOROVOD_WITH_MPI=1" in out and "NCCL" not in out
    assert not Path("/nonexistent/venv").exists()  # a dry run creates nothing


def test_the_sites_mpi_leaves_the_mpich_wheel_out():
    out = dry_run(MPI="system").stdout
    assert "mpich" not in out.replace(
        "system-mpi", ""
    )  # no wheel that would shadow the site's mpiexec
    assert "MPI from PATH" in out and "horovod-0.28.1-tf2.15.1-system-mpi" in out


def test_gpu_nodes_get_tensorflows_cuda_build_and_nccl_allreduce():
    out = dry_run(GPU="1").stdout
    assert "install tensorflow[and-cuda]==2.15.1" in out and "tensorflow-cpu" not in out
    assert "HOROVOD_GPU_OPERATIONS=NCCL" in out


@pytest.mark.parametrize("flavour", [{"MPI": "openmpi"}, {"GPU": "yes"}])
def test_an_unknown_flavour_is_refused(flavour):
    done = dry_run(**flavour)
    assert done.returncode == 2 and "must be" in done.stderr
