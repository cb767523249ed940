"""The set-up script's flavours (tools/setup_env.sh), by their dry run: what each would install
and how Horovod would be built. The default flavour is the one every other test runs in."""

import os
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).parents[2]


def dry_run(**flavour: str) -> subprocess.CompletedProcess:
    env = os.environ | {"DRY_RUN": "1", "VENV": "/nonexistent/venv"} | flavour
    return subprocess.run(
        ["bash", "tools/setup_env.sh"], cwd=ROOT, env=env, capture_output=True, text=True
    )


def test_the_default_takes_mpi_from_the_mpich_wheel_and_tensorflow_for_the_cpu():
    out = dry_run().stdout
    assert "install mpich==" in out and "install tensorflow-cpu==2.15.1" in out
    assert "install ffn-workflow[cpu,mpi-wheel,test]" in out  # the extras, by pyproject's names
    assert "HOROVOD_WITH_MPI=1" in out and "NCCL" not in out
    assert not Path("/nonexistent/venv").exists()  # a dry run creates nothing


def test_the_sites_mpi_leaves_the_mpich_wheel_out():
    out = dry_run(MPI="system").stdout
    assert "mpich" not in out.replace(
        "system-mpi", ""
    )  # no wheel that would shadow the site's mpiexec
    assert "MPI from PATH" in out and "horovod-0.28.1-tf2.15.1-system-mpi" in out
    assert "install ffn-workflow[cpu,test]" in out


def test_gpu_nodes_get_tensorflows_cuda_build_and_nccl_allreduce():
    out = dry_run(GPU="1").stdout
    assert "install tensorflow[and-cuda]==2.15.1" in out and "tensorflow-cpu" not in out
    assert "HOROVOD_GPU_OPERATIONS=NCCL" in out
    assert "install ffn-workflow[gpu,mpi-wheel,test]" in out


@pytest.mark.parametrize("flavour", [{"MPI": "openmpi"}, {"GPU": "yes"}])
def test_an_unknown_flavour_is_refused(flavour):
    done = dry_run(**flavour)
    assert done.returncode == 2 and "must be" in done.stderr


def pyproject_requirements() -> tuple[list[Requirement], dict[str, list[Requirement]]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    return (
        [Requirement(line) for line in project["dependencies"]],
        {extra: [Requirement(line) for line in lines] for extra, lines in extras.items()},
    )


def test_what_depends_on_the_machine_or_the_tests_is_an_extra_not_a_dependency():
    # `pip install -e .` on an HPC site brings neither a CPU TensorFlow nor a second MPI.
    dependencies, extras = pyproject_requirements()
    names = {canonicalize_name(requirement.name) for requirement in dependencies}
    assert not names & {"tensorflow", "tensorflow-cpu", "mpich", "selenium"}
    pins = {extra: {str(r) for r in requirements} for extra, requirements in extras.items()}
    assert pins["cpu"] == {"tensorflow-cpu==2.15.1"}
    assert pins["gpu"] == {"tensorflow[and-cuda]==2.15.1"}
    assert pins["mpi-wheel"] == {"mpich==5.0.2"}
    assert {"selenium==4.51.0", "pytest==9.2.0"} <= pins["test"]


def test_the_lock_pins_the_dependencies_and_the_default_flavours_extras_as_pyproject_does():
    # setup_env.sh installs the lock, then the package with --no-deps: the lock must hold them all.
    dependencies, extras = pyproject_requirements()
    lock = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            lock[canonicalize_name(name)] = version
    for requirement in [*dependencies, *extras["cpu"], *extras["mpi-wheel"], *extras["test"]]:
        held = lock.get(canonicalize_name(requirement.name))
        assert held is not None and requirement.specifier.contains(held), (str(requirement), held)
