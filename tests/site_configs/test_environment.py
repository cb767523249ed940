"""A venv's set-up flavour sticks, names the MPI it was built with, and is checked against the site.

tools/setup_env.sh runs here with stand-in MPIs and an nvcc on PATH (scripts that print what the
real tools print) and a fake venv in tmp_path, mostly as a dry run (DRY_RUN=1 changes nothing).
PATH holds only the stand-ins and the system's bin folders: not this venv's bin/ (the mpich
wheel's mpicxx) nor this machine's nvcc. site_configs.environment reads the record a set-up
writes at its end; the workflow describes it on every run and checks it against the site.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from pipeline.core.errors import ConfigError
from site_configs import local, polaris, slurm
from site_configs.environment import (
    RECORD_NAME,
    EnvironmentRecord,
    check_environment,
    describe_environment,
    parse_check_build,
    read_environment,
    write_environment,
)

ROOT = Path(__file__).parents[2]
SYSTEM_BIN = "/usr/bin:/bin"
# What the set-up reads from its environment besides PATH: none may leak in from the caller (a
# `make test MPI=system` passes its MPI= down through MAKEFLAGS).
SETUP_INPUTS = (
    "VENV MPI GPU DRY_RUN PYTHON HOROVOD_CUDA_HOME CUDA_HOME HOROVOD_NCCL_HOME PE_ENV "
    "CRAY_MPICH_VERSION MAKEFLAGS MAKELEVEL MFLAGS"
).split()


def stand_in(bin_dir: Path, name: str, output: str = "") -> Path:
    """An executable `bin_dir/name` that prints `output`, whatever its arguments."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / name
    script.write_text(f"#!/bin/sh\ncat <<'EOF'\n{output}\nEOF\n")
    script.chmod(0o755)
    return script


def stand_in_mpich(prefix: Path, version: str, custom: str = "") -> Path:
    """An MPICH installation's mpicxx and mpichversion (the real one's first and last lines)."""
    stand_in(prefix / "bin", "mpicxx")
    stand_in(
        prefix / "bin",
        "mpichversion",
        f"MPICH Version:      {version}\nMPICH Device:       ch4:ofi\n"
        f"MPICH Custom Information:\t{custom}",
    )
    return prefix / "bin"


def stand_in_nvcc(cuda_home: Path, release: str) -> Path:
    stand_in(
        cuda_home / "bin",
        "nvcc",
        f"nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release {release}, "
        f"V{release}.140",
    )
    return cuda_home / "bin"


def fake_venv(folder: Path, flavour: str | None = None, dists: tuple[str, ...] = ()) -> Path:
    """A venv holding only its set-up flavour record and/or packages' dist-info folders (a venv
    made before flavours were recorded)."""
    folder.mkdir()
    if flavour is not None:
        (folder / ".setup-flavour").write_text(flavour + "\n")
    for dist in dists:
        (folder / "lib/python3.11/site-packages" / f"{dist}.dist-info").mkdir(parents=True)
    return folder


def run(command: list[str], *bins: Path, **settings: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in SETUP_INPUTS}
    env["PATH"] = os.pathsep.join([*map(str, bins), SYSTEM_BIN])
    return subprocess.run(
        command, cwd=ROOT, env=env | settings, capture_output=True, text=True, timeout=60
    )


def setup(venv: Path, *bins: Path, **settings: str) -> subprocess.CompletedProcess:
    """tools/setup_env.sh for `venv`, with `bins` and the system's bin folders on PATH."""
    return run(["bash", "tools/setup_env.sh"], *bins, VENV=str(venv), **settings)


def cache_dir(stdout: str) -> str:
    (line,) = [x for x in stdout.splitlines() if "horovod wheel cache:" in x]
    return line.split("horovod wheel cache: ")[1]


# -- the set-up flavour sticks to the venv --
@pytest.mark.parametrize(
    "recorded, dists, asked, wanted",
    [
        ("MPI=system GPU=0", (), {"MPI": "wheel"}, "MPI=wheel GPU=0"),
        ("MPI=wheel GPU=0", (), {"GPU": "1"}, "MPI=wheel GPU=1"),
        # A venv from before flavours were recorded: the mpich wheel and tensorflow-cpu in it.
        (None, ("mpich-5.0.2", "tensorflow_cpu-2.15.1"), {"MPI": "system"}, "MPI=system GPU=0"),
    ],
)
def test_make_env_of_another_flavour_than_the_venvs_is_refused(
    tmp_path, recorded, dists, asked, wanted
):
    venv = fake_venv(tmp_path / "venv", recorded, dists)
    before = sorted(venv.rglob("*"))
    # PYTHON=false: a set-up that went on would fail at once, making the venv, not install.
    done = setup(venv, PYTHON="false", **asked)
    had = recorded or "MPI=wheel GPU=0"
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"[setup] {venv} was made with {had}, not {wanted}: make clean-venv first, or give "
        "another VENV="
    ]
    assert sorted(venv.rglob("*")) == before


def test_make_env_without_mpi_or_gpu_keeps_the_venvs_flavour(tmp_path):
    venv = fake_venv(tmp_path / "venv", "MPI=system GPU=0")
    mpich = stand_in_mpich(tmp_path / "mpich", "4.1.2")
    done = run(["make", "--no-print-directory", "env", f"VENV={venv}", "DRY_RUN=1"], mpich)
    assert done.returncode == 0, done.stderr
    assert "flavour MPI=system GPU=0 (the venv's: MPI=system GPU=0)" in done.stdout
    assert "install mpich==" not in done.stdout  # the plain `make env` of `make test`/`make demo`


def test_a_new_venv_gets_the_wheel_and_the_cpu_build(tmp_path):
    out = setup(tmp_path / "new", DRY_RUN="1").stdout
    assert "flavour MPI=wheel GPU=0 (the venv's: none yet, a new venv)" in out
    assert "install mpich==" in out and "install tensorflow-cpu==" in out
    assert not (tmp_path / "new").exists()


def test_venvs_in_two_places_do_not_share_a_wheel_built_against_the_mpich_wheel(tmp_path):
    """Horovod's library finds the mpich wheel's libmpi through RUNPATH <venv>/lib: a clone's
    venv given the first venv's build loaded the first venv's MPI (and broke without it)."""
    first, second = (cache_dir(setup(tmp_path / n, DRY_RUN="1").stdout) for n in ("a", "b"))
    assert first != second and "-mpich-wheel-" in first
    assert cache_dir(setup(tmp_path / "a", DRY_RUN="1").stdout) == first  # a venv made again


# -- MPI=system: the site's MPI builds Horovod, and names its cached wheel --
def test_the_sites_mpi_is_named_and_gets_a_wheel_cache_of_its_own(tmp_path):
    mpich = stand_in_mpich(tmp_path / "mpich-4.1.2", "4.1.2")
    same_release_elsewhere = stand_in_mpich(tmp_path / "other/mpich-4.1.2", "4.1.2")
    openmpi = tmp_path / "openmpi/bin"
    stand_in(openmpi, "mpicxx")
    stand_in(openmpi, "ompi_info", "Open MPI v4.1.5\n\nhttp://www.open-mpi.org/community/help/")
    caches = []
    for bin_dir, name in [
        (mpich, "MPICH 4.1.2"),
        (same_release_elsewhere, "MPICH 4.1.2"),
        (openmpi, "Open MPI v4.1.5"),
    ]:
        done = setup(tmp_path / "venv", bin_dir, MPI="system", DRY_RUN="1")
        assert done.returncode == 0, done.stderr
        assert f"MPI from PATH: {name} ({bin_dir}/mpicxx)" in done.stdout
        assert f"MPI_HOME={bin_dir.parent}" in done.stdout  # FindMPI looks there first
        assert "install mpich" not in done.stdout
        caches.append(cache_dir(done.stdout))
    assert "horovod-0.28.1-tf2.15.1-system-mpi-MPICH-4.1.2-" in caches[0]
    assert "system-mpi-Open-MPI-v4.1.5-" in caches[2]
    assert len(set(caches)) == 3


def test_a_cray_pe_builds_through_its_cc_wrapper(tmp_path):
    cray = tmp_path / "craype/bin"
    stand_in(cray, "CC", "-I/opt/cray/pe/mpich/8.1.28/ofi/gnu/12.3/include")
    cray_pe = {"PE_ENV": "GNU", "CRAY_MPICH_VERSION": "8.1.28"}
    done = setup(tmp_path / "venv", cray, MPI="system", DRY_RUN="1", **cray_pe)
    assert done.returncode == 0, done.stderr
    assert f"MPI from PATH: Cray MPICH 8.1.28 ({cray}/CC)" in done.stdout
    assert "CC=cc CXX=CC" in done.stdout
    assert "system-mpi-Cray-MPICH-8.1.28-" in cache_dir(done.stdout)


@pytest.mark.parametrize(
    "wheel_on_path, expected",
    [
        (False, "no mpicxx (nor a Cray PE's CC) on PATH; load the site's MPI module first"),
        # An activated venv of the wheel flavour: its mpicxx is no site's MPI.
        (True, "is the mpich PyPI wheel's (a venv on PATH?)"),
    ],
)
def test_mpi_system_without_the_sites_mpi_is_refused_in_one_line(tmp_path, wheel_on_path, expected):
    pypi = "https://pypi.org/p/mpich/5.0.2/"  # the wheel's `mpichversion` says where it is from
    bins = [stand_in_mpich(tmp_path / "wheel-venv", "5.0.2", pypi)] if wheel_on_path else []
    done = setup(tmp_path / "venv", *bins, MPI="system", DRY_RUN="1")
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith("[setup] MPI=system: ") and expected in line


# -- GPU=1: CUDA and NCCL located --
@pytest.mark.parametrize(
    "release, expected",
    [
        (
            None,
            "[setup] GPU=1: no nvcc on PATH (nor HOROVOD_CUDA_HOME, CUDA_HOME); load the site's CUDA 12 module first",
        ),
        (
            "13.0",
            "is CUDA 13.0; TensorFlow 2.15.1 and its NCCL wheel are CUDA 12: name a CUDA 12 "
            "toolkit for the build, HOROVOD_CUDA_HOME=<a CUDA 12 toolkit>, or load a CUDA 12 module",
        ),
    ],
)
def test_gpu_without_a_cuda_12_nvcc_is_refused_in_one_line(tmp_path, release, expected):
    if release is None and shutil.which("nvcc", path=SYSTEM_BIN):
        pytest.skip(f"an nvcc in {SYSTEM_BIN}")
    bins = [stand_in_nvcc(tmp_path / "cuda", release)] if release else []
    done = setup(tmp_path / "venv", *bins, GPU="1", DRY_RUN="1")
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert expected in line


def test_gpu_finds_cuda_and_the_nccl_of_tensorflows_wheel(tmp_path):
    cuda = stand_in_nvcc(tmp_path / "cuda-12.2", "12.2").parent
    venv = tmp_path / "venv"
    done = setup(venv, cuda / "bin", GPU="1", DRY_RUN="1")
    assert done.returncode == 0, done.stderr
    nccl = venv / "lib/python3.11/site-packages/nvidia/nccl"
    assert f"CUDA: {cuda} (nvcc release 12.2)" in done.stdout
    assert f"NCCL: {nccl} (the nvidia-nccl-cu12 wheel of tensorflow[and-cuda])" in done.stdout
    # The wheel has lib/libnccl.so.2 only, no static library: Horovod links it shared.
    flags = f"HOROVOD_NCCL_LINK=SHARED HOROVOD_NCCL_HOME={nccl} HOROVOD_GPU_OPERATIONS=NCCL"
    assert f"{flags} HOROVOD_CUDA_HOME={cuda}" in done.stdout
    assert "-cuda12.2-" in cache_dir(done.stdout)


def test_polaris_conda_modules_cuda_13_is_refused_naming_the_cuda_12_toolkits_beside_it(tmp_path):
    """ALCF's conda module on Polaris sets CUDA_HOME to a CUDA 13 toolkit beside CUDA 12 ones
    (/soft/compilers/cudatoolkit/cuda-13.0.x, cuda-12.x.y); the set-up names those to build with,
    and goes on with the one named while CUDA_HOME stays the module's."""
    toolkits = tmp_path / "soft/compilers/cudatoolkit"
    module_cuda = stand_in_nvcc(toolkits / "cuda-13.0.48", "13.0").parent
    for release in ("12.2.91", "12.4.1", "12.9.0"):
        stand_in_nvcc(toolkits / f"cuda-{release}", release.rsplit(".", 1)[0])
    (toolkits / "cuda-12.0-docs").mkdir()  # no nvcc: not a toolkit
    venv = tmp_path / "venv"
    refused = setup(venv, GPU="1", MPI="wheel", DRY_RUN="1", CUDA_HOME=str(module_cuda))
    assert refused.returncode == 2
    (line,) = refused.stderr.splitlines()
    newest, others = toolkits / "cuda-12.9.0", f"{toolkits}/cuda-12.4.1 {toolkits}/cuda-12.2.91"
    assert line.endswith(f"HOROVOD_CUDA_HOME={newest} (or {others}), or load a CUDA 12 module"), (
        line
    )
    named = toolkits / "cuda-12.4.1"
    done = setup(
        venv,
        GPU="1",
        MPI="wheel",
        DRY_RUN="1",
        CUDA_HOME=str(module_cuda),
        HOROVOD_CUDA_HOME=str(named),
    )
    assert done.returncode == 0, done.stderr
    assert f"CUDA: {named} (nvcc release 12.4)" in done.stdout
    assert f"HOROVOD_CUDA_HOME={named}" in done.stdout


def test_gpu_takes_the_users_nccl_home(tmp_path):
    cuda = stand_in_nvcc(tmp_path / "cuda-12.2", "12.2")
    nccl = tmp_path / "nccl"
    (nccl / "include").mkdir(parents=True)
    (nccl / "include/nccl.h").write_text("#define NCCL_MAJOR 2\n")
    done = setup(tmp_path / "venv", cuda, GPU="1", DRY_RUN="1", HOROVOD_NCCL_HOME=str(nccl))
    assert done.returncode == 0, done.stderr
    assert f"NCCL: {nccl} (HOROVOD_NCCL_HOME)" in done.stdout
    assert "HOROVOD_NCCL_LINK" not in done.stdout  # the site's NCCL: Horovod's default linking


# -- the record of a venv, read, described and checked against the site --
def record(venv: Path, gpu: bool = False, nccl: bool = False) -> EnvironmentRecord:
    return EnvironmentRecord(
        venv=venv,
        mpi_flavour="system" if gpu else "wheel",
        gpu=gpu,
        mpi="Cray MPICH 8.1.28" if gpu else "MPICH 5.0.2",
        mpi_wrapper="/opt/cray/pe/craype/2.7.30/bin/CC" if gpu else f"{venv}/bin/mpicxx",
        mpi_id="1a2b3c4d",
        tensorflow_package="tensorflow" if gpu else "tensorflow-cpu",
        tensorflow_version="2.15.1",
        tensorflow_cuda_build=gpu,
        cuda_version="12.2" if gpu else None,
        horovod_version="0.28.1",
        horovod_controllers=("MPI", "Gloo"),
        horovod_operations=("NCCL", "MPI", "Gloo") if nccl else ("MPI", "Gloo"),
    )


def test_a_record_reads_back_and_says_what_the_venv_holds_in_one_line(tmp_path):
    cpu = record(tmp_path)
    write_environment(cpu)
    assert read_environment(tmp_path) == cpu
    assert describe_environment(cpu) == (
        f"venv {tmp_path}: TensorFlow 2.15.1 (CPU build), MPI: MPICH 5.0.2 (mpich wheel), "
        "Horovod 0.28.1: controllers MPI, Gloo; operations MPI, Gloo"
    )
    gpu = record(tmp_path, gpu=True, nccl=True)
    assert describe_environment(gpu) == (
        f"venv {tmp_path}: TensorFlow 2.15.1 (CUDA 12.2 build), MPI: Cray MPICH 8.1.28 "
        "(/opt/cray/pe/craype/2.7.30/bin/CC), Horovod 0.28.1: controllers MPI, Gloo; "
        "operations NCCL, MPI, Gloo"
    )


def test_a_missing_record_is_said_with_the_command_that_makes_it(tmp_path):
    assert read_environment(tmp_path) is None
    assert read_environment(None) is None  # a system Python: no venv
    line = describe_environment(None)
    assert RECORD_NAME in line and "`make env`" in line and "\n" not in line


@pytest.mark.parametrize(
    "text", ['{"mpi_flavour": "wheel", "gpu": fa', '{"mpi_flavour": "wheel"}', "[]"]
)
def test_a_corrupt_record_is_a_config_error_naming_the_file(tmp_path, text):
    (tmp_path / RECORD_NAME).write_text(text)
    with pytest.raises(ConfigError, match="make env") as error:
        read_environment(tmp_path)
    assert str(tmp_path / RECORD_NAME) in str(error.value) and "\n" not in str(error.value)


def test_a_record_with_a_wrong_type_is_a_config_error(tmp_path):
    write_environment(record(tmp_path))
    path = tmp_path / RECORD_NAME
    path.write_text(
        path.read_text().replace('"tensorflow_cuda_build": false', '"tensorflow_cuda_build": "no"')
    )
    with pytest.raises(ConfigError, match="tensorflow_cuda_build"):
        read_environment(tmp_path)


def test_the_set_up_reads_horovods_check_build():
    # `horovodrun --check-build` of a GPU build (horovod/runner/launch.py, check_build).
    text = (
        "Horovod v0.28.1:\n\nAvailable Frameworks:\n    [X] TensorFlow\n    [ ] PyTorch\n"
        "    [ ] MXNet\n\nAvailable Controllers:\n    [X] MPI\n    [X] Gloo\n\n"
        "Available Tensor Operations:\n    [X] NCCL\n    [ ] DDL\n    [ ] CCL\n    [X] MPI\n"
        "    [X] Gloo\n"
    )
    assert parse_check_build(text) == ("0.28.1", ("MPI", "Gloo"), ("NCCL", "MPI", "Gloo"))


def test_a_gpu_site_refuses_a_cpu_only_tensorflow_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as error:
        check_environment(polaris.SITE, record(tmp_path))
    message = str(error.value)
    assert "site 'polaris' has 4 GPU(s) per node" in message and "CPU-only build" in message
    assert "make env MPI=system GPU=1" in message and "\n" not in message


def test_a_gpu_site_refuses_a_horovod_without_nccl(tmp_path):
    with pytest.raises(ConfigError, match="Horovod 0.28.1 has no NCCL operations"):
        check_environment(polaris.SITE, record(tmp_path, gpu=True, nccl=False))


def test_a_gpu_site_takes_a_cuda_build_with_nccl(tmp_path):
    assert check_environment(polaris.SITE, record(tmp_path, gpu=True, nccl=True)) is None


def test_a_batch_site_with_the_mpich_wheel_is_warned_not_refused(tmp_path):
    warning = check_environment(slurm.SITE, record(tmp_path))
    assert (
        warning.startswith("warning: site 'slurm' submits batch jobs")
        and "make env MPI=system" in warning
    )
    assert (
        check_environment(local.SITE, record(tmp_path)) is None
    )  # this machine: the wheel is right


# -- the workflow: every run and dry run says what the venv holds; a GPU site refuses a CPU one --
def gpu_site_module(folder: Path, venv: Path) -> Path:
    """A user's site module: Polaris with a real account and `venv` as the venv its jobs use."""
    module = folder / "gpu_site.py"
    module.write_text(
        "import dataclasses\nfrom site_configs.polaris import SITE as POLARIS, make_config\n"
        f"SITE = dataclasses.replace(POLARIS, account='abc123', venv={str(venv)!r})\n"
    )
    return module


def test_a_gpu_sites_run_with_a_cpu_only_venv_is_refused_before_anything_is_submitted(tmp_path):
    from workflow_runs import TINY, workflow

    venv = tmp_path / "venv"
    venv.mkdir()
    write_environment(record(venv))
    site = gpu_site_module(tmp_path, venv)
    run_dir = tmp_path / "run"
    dry = workflow(
        "--site", str(site), "--config", str(TINY), "--run-dir", str(run_dir), "--dry-run"
    )
    assert f"venv {venv}: TensorFlow 2.15.1 (CPU build), MPI: MPICH 5.0.2" in dry.stdout
    assert "a run would be refused: site 'polaris' has 4 GPU(s) per node" in dry.stdout
    done = workflow("--site", str(site), "--config", str(TINY), "--run-dir", str(run_dir), expect=2)
    assert "CPU-only build" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not run_dir.exists()  # no job asked for, nothing written
    write_environment(record(venv, gpu=True, nccl=True))  # the venv the site needs
    dry = workflow(
        "--site", str(site), "--config", str(TINY), "--run-dir", str(run_dir), "--dry-run"
    )
    assert "TensorFlow 2.15.1 (CUDA 12.2 build)" in dry.stdout and "refused" not in dry.stdout
