"""What a venv holds, as its set-up recorded it, checked against the site a run goes to.

tools/setup_env.sh ends a successful set-up by writing `<venv>/ffn-environment.json`
(`RECORD_NAME`): the set-up flavour (MPI wheel|system, GPU 0|1|xpu), the MPI Horovod was built
with, TensorFlow's package, version and build (CPU or CUDA, from TensorFlow's own build info, and
the version of Intel's extension for TensorFlow where it is installed: the XPU flavour), and
Horovod's version with the controllers and tensor operations `horovodrun --check-build` marks.
The workflow, on every run and dry run (reading imports no TensorFlow: it takes milliseconds):

    record = read_environment(venv_path(site))  # EnvironmentRecord, or None: no venv, no record
    print(describe_environment(record))         # one line: TensorFlow (CPU/CUDA), MPI, Horovod
    warning = check_environment(site, record)   # ConfigError (one line) if the venv cannot serve
                                                # the site; a warning line for a risk, else None

A site's GPUs are NVIDIA's (`SiteSpec.gpu_kind` "cuda": TensorFlow's CUDA build, Horovod with
NCCL) or Intel's ("xpu", Aurora: TensorFlow with Intel's extension, which lists each tile as an
XPU device, and Intel's Horovod with oneCCL, "CCL" among its operations).

The set-up's side: `python -m site_configs.environment --write VENV --mpi-flavour ... <
check-build output` (`main`) parses the check-build output (`parse_check_build`), asks TensorFlow
how it was built and writes the record atomically (`write_environment`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from pipeline.core.atomic import atomic_path
from pipeline.core.errors import ConfigError, first_line
from pipeline.network.devices import GPU_KINDS, XPU_EXTENSION
from site_configs.spec import SiteSpec

RECORD_NAME = "ffn-environment.json"
_REMAKE = "run `make env` for that venv (VENV=...) to write it again"
_GPU_FIX = (
    "make a GPU venv on the site: `make clean-venv` (or another VENV=) then "
    "`make env MPI=system GPU=1`"
)
_XPU_FIX = (
    "make an XPU venv on the site: `make clean-venv` (or another VENV=), load the site's "
    "TensorFlow module (Aurora: module load tensorflow; module load "
    "mpich/opt/develop-git.6037a7a), then `make env MPI=system GPU=xpu`"
)
# Fields a record may lack: records written before they were added read them as None.
_ADDED_FIELDS = {"xpu_extension_version"}

# The type of each field of EnvironmentRecord: a record read back from JSON is checked with it.
_TYPES = {
    "venv": Path,
    "mpi_flavour": str,
    "gpu": bool,
    "mpi": str,
    "mpi_wrapper": str,
    "mpi_id": str,
    "tensorflow_package": str,
    "tensorflow_version": str,
    "tensorflow_cuda_build": bool,
    "cuda_version": (str, type(None)),
    "horovod_version": str,
    "horovod_controllers": tuple,
    "horovod_operations": tuple,
    "xpu_extension_version": (str, type(None)),
}


@dataclass(frozen=True)
class EnvironmentRecord:
    """One venv's record: the fields of its JSON file, and `venv`, the folder it was read from."""

    venv: Path
    mpi_flavour: str  # "wheel": the mpich PyPI wheel's MPI; "system": the site's (MPI=system)
    gpu: bool  # set up with GPU=1 or GPU=xpu
    mpi: str  # the MPI Horovod was built with: "MPICH 5.0.2", "Open MPI v4.1.5", ...
    mpi_wrapper: str  # its compiler wrapper (mpicxx, or a Cray PE's CC)
    mpi_id: str  # short hash of the MPI's identity, as in the Horovod wheel's cache folder name
    tensorflow_package: str  # "tensorflow-cpu" or "tensorflow" (GPU=1: tensorflow[and-cuda])
    tensorflow_version: str
    tensorflow_cuda_build: bool  # TensorFlow's build info `is_cuda_build`
    cuda_version: str | None  # the CUDA a CUDA build was made for; None for a CPU build
    horovod_version: str
    horovod_controllers: tuple[str, ...]  # e.g. ("MPI", "Gloo")
    horovod_operations: tuple[str, ...]  # tensor operations, e.g. ("NCCL", "MPI", "Gloo")
    # The version of Intel's extension for TensorFlow (intel_extension_for_tensorflow, GPU=xpu),
    # with which TensorFlow lists Intel GPU tiles as XPU devices; None where it is not installed.
    xpu_extension_version: str | None = None

    def __post_init__(self) -> None:
        if self.mpi_flavour not in ("wheel", "system"):
            raise ConfigError(f"mpi_flavour must be 'wheel' or 'system', got {self.mpi_flavour!r}")
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, _TYPES[field.name]) or (
                isinstance(value, tuple) and not all(isinstance(x, str) for x in value)
            ):
                raise ConfigError(f"{field.name} has a wrong type: {value!r}")


def read_environment(venv: Path | None) -> EnvironmentRecord | None:
    """The record of `venv`; None when there is no venv (a system Python) or it has no record
    (made before set-ups wrote one, or not by tools/setup_env.sh). A record that cannot be read
    raises ConfigError."""
    if venv is None:
        return None
    path = Path(venv) / RECORD_NAME
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: unreadable ({first_line(exc)}); {_REMAKE}") from None
    fields = {f.name for f in dataclasses.fields(EnvironmentRecord)} - {"venv"}
    if not isinstance(data, dict) or not fields - _ADDED_FIELDS <= set(data) <= fields:
        raise ConfigError(f"{path}: not an environment record (fields {sorted(fields)}); {_REMAKE}")
    lists = {k: tuple(v) for k, v in data.items() if isinstance(v, list)}
    try:
        return EnvironmentRecord(venv=Path(venv), **{**data, **lists})
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}; {_REMAKE}") from None


def describe_environment(record: EnvironmentRecord | None) -> str:
    """One line for the run's log and its dry run: TensorFlow's build, the MPI, Horovod's parts."""
    if record is None:
        return (
            f"venv: no {RECORD_NAME}, so its TensorFlow build, MPI and Horovod are unknown and "
            "not checked against the site: `make env` (VENV=<the venv>) records them"
        )
    if record.tensorflow_cuda_build:
        build = f"CUDA {record.cuda_version} build"
    elif record.xpu_extension_version is not None:
        build = f"XPU: Intel's extension {record.xpu_extension_version}"
    else:
        build = "CPU build"
    source = "mpich wheel" if record.mpi_flavour == "wheel" else record.mpi_wrapper
    return (
        f"venv {record.venv}: TensorFlow {record.tensorflow_version} ({build}), "
        f"MPI: {record.mpi} ({source}), Horovod {record.horovod_version}: controllers "
        f"{', '.join(record.horovod_controllers)}; operations {', '.join(record.horovod_operations)}"
    )


def check_environment(site: SiteSpec, record: EnvironmentRecord | None) -> str | None:
    """Refuse (ConfigError, one line naming the fix) a venv that cannot serve `site`: the site
    wants NVIDIA GPUs and the venv's TensorFlow is not the CUDA build or its Horovod has no NCCL,
    or it wants Intel GPUs (gpu_kind "xpu") and the venv's TensorFlow has no Intel extension or
    its Horovod no oneCCL (training would run on the CPUs). Return a warning line for a risk that
    need not stop the run: a batch site with the mpich wheel's MPI (the site's launcher may not
    start its ranks as one job), a GPU site with an unrecorded venv; None when there is nothing
    to say."""
    if site.gpu_kind not in GPU_KINDS:
        raise ConfigError(
            f"site {site.name!r}: gpu_kind {site.gpu_kind!r} is not one of {', '.join(GPU_KINDS)}"
        )
    xpu = site.gpu_kind == "xpu"
    if site.gpus_per_node > 0 and record is None:
        return (
            f"warning: site {site.name!r} wants {'XPUs' if xpu else 'GPUs'}, but the venv's "
            "TensorFlow build is not recorded: `make env` (VENV=<the venv>) records it"
        )
    if site.gpus_per_node > 0 and (lacks := (_xpu_lack if xpu else _gpu_lack)(record)):
        devices = "Intel GPU tile(s) (XPU)" if xpu else "GPU(s)"
        raise ConfigError(
            f"site {site.name!r} has {site.gpus_per_node} {devices} per node, but in venv "
            f"{record.venv} {lacks}: {_XPU_FIX if xpu else _GPU_FIX}"
        )
    if site.scheduler != "local" and record is not None and record.mpi_flavour == "wheel":
        return (
            f"warning: site {site.name!r} submits batch jobs, but venv {record.venv} has the mpich "
            f"wheel's MPI ({record.mpi}), which the site's launcher may start as 1-rank jobs: "
            "make the venv on the site with `make env MPI=system`"
        )
    return None


def _gpu_lack(record: EnvironmentRecord) -> str | None:
    """What the venv lacks for training on GPUs, or None."""
    if not record.tensorflow_cuda_build and record.xpu_extension_version is not None:
        return (
            f"TensorFlow {record.tensorflow_version} is not a CUDA build: it has Intel's "
            f"extension {record.xpu_extension_version}, for Intel GPUs (XPU)"
        )
    if not record.tensorflow_cuda_build:
        return (
            f"TensorFlow {record.tensorflow_version} is a CPU-only build "
            f"({record.tensorflow_package})"
        )
    if "NCCL" not in record.horovod_operations:
        return f"Horovod {record.horovod_version} has no NCCL operations"
    return None


def _xpu_lack(record: EnvironmentRecord) -> str | None:
    """What the venv lacks for training on Intel GPU tiles, or None."""
    if record.xpu_extension_version is None:
        build = f"CUDA {record.cuda_version} build" if record.tensorflow_cuda_build else "CPU build"
        return (
            f"TensorFlow {record.tensorflow_version} ({record.tensorflow_package}, {build}) has "
            f"no Intel extension ({XPU_EXTENSION}), so it lists no XPU"
        )
    if "CCL" not in record.horovod_operations:
        return f"Horovod {record.horovod_version} has no oneCCL (CCL) operations"
    return None


# -- the set-up's side --
def parse_check_build(text: str) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """Horovod's version, controllers and tensor operations from `horovodrun --check-build`
    (a "Horovod v0.28.1:" line, then sections of "[X] name" / "[ ] name" lines)."""
    version, section = "", ""
    marked: dict[str, list[str]] = {}
    for line in (raw.strip() for raw in text.splitlines()):
        if line.startswith("Horovod v") and line.endswith(":"):
            version = line[len("Horovod v") : -1]
        elif line.endswith(":"):
            section = line[:-1]
        elif line.startswith("[X]"):
            marked.setdefault(section, []).append(line[3:].strip())
    controllers = tuple(marked.get("Available Controllers", ()))
    operations = tuple(marked.get("Available Tensor Operations", ()))
    if not version or not controllers:
        raise ConfigError(f"not the output of `horovodrun --check-build`: {text[:200]!r}")
    return version, controllers, operations


def write_environment(record: EnvironmentRecord) -> Path:
    """Write `record` into its venv, atomically (a reader sees the old record or the new one)."""
    data = {k: v for k, v in dataclasses.asdict(record).items() if k != "venv"}
    path = record.venv / RECORD_NAME
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2) + "\n")
    return path


def _tensorflow_build() -> tuple[str, str, bool, str | None]:
    """The installed TensorFlow's package, version, whether it is a CUDA build and for which
    CUDA. Imports TensorFlow (seconds): for the set-up only, never on the workflow's path."""
    import tensorflow as tf

    info = tf.sysconfig.get_build_info()
    cuda = bool(info.get("is_cuda_build"))
    try:  # GPU=1 installs `tensorflow` (its and-cuda extra), GPU=0 `tensorflow-cpu`
        package = metadata.distribution("tensorflow-cpu").metadata["Name"]
    except metadata.PackageNotFoundError:
        package = "tensorflow"
    return package, tf.__version__, cuda, info.get("cuda_version") if cuda else None


def _xpu_extension_version() -> str | None:
    """The installed version of Intel's extension for TensorFlow, from its package's metadata:
    importing it fails where there is no Intel GPU (a login node); None where it is not."""
    try:
        return metadata.version(XPU_EXTENSION)
    except metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Record a venv's environment (tools/setup_env.sh, at the end of a set-up); "
        "`horovodrun --check-build` output on stdin."
    )
    parser.add_argument("--write", type=Path, required=True, metavar="VENV")
    parser.add_argument("--mpi-flavour", choices=("wheel", "system"), required=True)
    parser.add_argument("--gpu", choices=("0", "1", "xpu"), required=True)
    parser.add_argument("--mpi", required=True)
    parser.add_argument("--mpi-wrapper", required=True)
    parser.add_argument("--mpi-id", required=True)
    args = parser.parse_args(argv)
    horovod_version, controllers, operations = parse_check_build(sys.stdin.read())
    package, version, cuda_build, cuda_version = _tensorflow_build()
    extension = _xpu_extension_version()
    if args.gpu == "xpu" and (extension is None or "CCL" not in operations):
        lacks = f"no {XPU_EXTENSION}" if extension is None else "Horovod without CCL operations"
        print(
            f"[setup] GPU=xpu, but the venv's Python has {lacks} (Horovod {horovod_version}: "
            f"operations {', '.join(operations)}): load the site's TensorFlow module for Intel "
            "GPUs before `make env`",
            file=sys.stderr,
        )
        return 1
    record = EnvironmentRecord(
        venv=args.write.resolve(),
        mpi_flavour=args.mpi_flavour,
        gpu=args.gpu != "0",
        mpi=args.mpi,
        mpi_wrapper=args.mpi_wrapper,
        mpi_id=args.mpi_id,
        tensorflow_package=package,
        tensorflow_version=version,
        tensorflow_cuda_build=cuda_build,
        cuda_version=cuda_version,
        horovod_version=horovod_version,
        horovod_controllers=controllers,
        horovod_operations=operations,
        xpu_extension_version=extension,
    )
    print(f"[setup] recorded in {write_environment(record)}: {describe_environment(record)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
