#!/usr/bin/env bash
# Create or reuse the project's virtual environment (.venv) and make it match requirements.lock.
# The lock pins the package's dependencies and its extras (pyproject.toml) in the default flavour
# (cpu, mpi-wheel, test); each flavour takes its own from it: tensorflow-cpu or the CUDA build, the
# mpich wheel or none. The package itself then goes in with --no-deps, its versions the lock's.
# Fast when nothing changed: a stamp file holds the hash of the inputs that shaped the venv.
# Horovod 0.28.1 is built from source against the pinned TensorFlow with MPI and Gloo; the wheel
# is cached outside the repo under a name that says which MPI (and CUDA) it was built with, so a
# second set-up does not rebuild it and another MPI (another cluster sharing the home directory,
# another module) never reuses it.
#
# A venv has one flavour, recorded in it ($VENV/.setup-flavour) before anything is installed:
#   MPI=wheel  MPI from the `mpich` PyPI wheel (its mpicxx builds Horovod, its mpiexec launches
#              the ranks): for this machine, the `local` site. Default for a new venv.
#   MPI=system the machine's own MPI, found on PATH (`module load cray-mpich`, `module load
#              openmpi`, ...): its mpicxx, or on a Cray PE the CC wrapper, builds Horovod; no
#              mpich wheel in the venv, so the site's mpiexec/srun/aprun starts the ranks and
#              Horovod speaks that MPI. Load the same modules in the site's worker_init.
#   GPU=1      TensorFlow 2.15.1's CUDA build (tensorflow[and-cuda]) and Horovod with NCCL
#              allreduce, for GPU nodes: needs a CUDA 12 nvcc (the site's CUDA module, or
#              HOROVOD_CUDA_HOME=<a CUDA 12 toolkit> where the modules set another: the CUDA 13
#              CUDA_HOME of ALCF's conda module on Polaris; only the build uses it); NCCL is
#              $HOROVOD_NCCL_HOME if set, else the nvidia-nccl-cu12 wheel TensorFlow brings.
#              GPU=0 (default for a new venv): tensorflow-cpu.
#   GPU=xpu    Intel GPUs (Aurora): the venv is made over the Python of the site's TensorFlow
#              module, with --system-site-packages, so that it keeps the module's TensorFlow,
#              Intel's extension for it (intel_extension_for_tensorflow: the tiles are XPU
#              devices) and Intel's Horovod (oneCCL allreduce); nothing is built, tensorflow-cpu
#              is not installed, the rest of the lock is (a pin the module holds at another
#              version goes into the venv, in front of the module's). Load the module first, as
#              the site's worker_init does (Aurora, docs.alcf.anl.gov/aurora/data-science/python/:
#              `module load tensorflow; module load mpich/opt/develop-git.6037a7a`); its python3
#              (PYTHON=) must be 3.11. Goes with MPI=system (the default with GPU=xpu): the
#              module's Horovod speaks the site's MPI.
# MPI= or GPU= not given: the venv's recorded flavour. Given and not the venv's: refused, in one
# line (`make clean-venv` first, or another VENV=).
#   DRY_RUN=1  print the flavour, the MPI, CUDA and NCCL found, what would be installed and built
#              and the wheel's cache folder; change nothing. Exit code 2 if the set-up would refuse.
# A set-up that succeeds records what it built in $VENV/ffn-environment.json
# (site_configs/environment.py: the workflow checks the venv against the site with it).
set -euo pipefail
export TF_CPP_MIN_LOG_LEVEL=2  # TensorFlow imports below would print start-up notices
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
[[ $VENV == /* ]] || VENV="$PWD/$VENV"  # absolute: it goes into PATH and the records
PYTHON_GIVEN=${PYTHON:-}
MPI_GIVEN=${MPI:-}
GPU_GIVEN=${GPU:-}
DRY_RUN=${DRY_RUN:-0}
HOROVOD_VERSION=0.28.1
TF_VERSION=2.15.1
WHEEL_CACHE=${FFN_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ffn-workflow/wheels}
STAMP="$VENV/.setup-stamp"
FLAVOUR_FILE="$VENV/.setup-flavour"
SITE_PACKAGES="$VENV/lib/python3.11/site-packages"  # pyproject: requires-python ==3.11.*

case "$MPI_GIVEN" in "" | wheel | system) ;; *) echo "[setup] MPI must be wheel or system, got '$MPI_GIVEN'" >&2; exit 2 ;; esac
case "$GPU_GIVEN" in "" | 0 | 1 | xpu) ;; *) echo "[setup] GPU must be 0, 1 or xpu, got '$GPU_GIVEN'" >&2; exit 2 ;; esac

# Why the set-up cannot go on: it stops at once. A dry run keeps the first reason and prints its
# whole plan before it, so one look shows everything found and missing.
refusal=""
refuse() {
  if [[ $DRY_RUN == 1 ]]; then
    refusal=${refusal:-$1}
  else
    echo "[setup] $1" >&2
    exit 2
  fi
}

hash8() { sha256sum <<<"$1" | cut -c1-8; }

# The flavour the venv was made with: its record, or for a venv made before flavours were
# recorded, what it holds (the mpich wheel or not; tensorflow-cpu or TensorFlow's CUDA build).
# Nothing for a venv that holds no TensorFlow yet: any flavour may fill it.
recorded_flavour() {
  if [[ -f $FLAVOUR_FILE ]]; then
    cat "$FLAVOUR_FILE"
    return
  fi
  local mpi=system gpu
  compgen -G "$SITE_PACKAGES/mpich-*.dist-info" >/dev/null && mpi=wheel
  if compgen -G "$SITE_PACKAGES/tensorflow_cpu-*.dist-info" >/dev/null; then
    gpu=0
  elif compgen -G "$SITE_PACKAGES/tensorflow-[0-9]*.dist-info" >/dev/null; then
    gpu=1
  else
    return 0
  fi
  echo "MPI=$mpi GPU=$gpu"
}

# The site's MPI as Horovod's CMake (FindMPI) would find it: an mpicxx on PATH, or on a Cray PE
# (PE_ENV set) the CC wrapper, which compiles MPI code with no wrapper of its own. Sets mpi_name
# (for people), mpi_detail (what tells two installations apart: hashed into the cache name),
# mpi_wrapper, and the build variables that pin FindMPI to this MPI.
find_system_mpi() {
  local bin
  if mpi_wrapper=$(command -v mpicxx); then
    bin=$(dirname "$(readlink -f "$mpi_wrapper")")
    if [[ -x $bin/mpichversion ]]; then
      mpi_detail=$("$bin/mpichversion")
      mpi_name="MPICH $(sed -n 's/^MPICH Version:[[:space:]]*//p' <<<"$mpi_detail")"
    elif [[ -x $bin/ompi_info ]]; then
      mpi_detail=$("$bin/ompi_info" --version)
      mpi_name=$(head -1 <<<"$mpi_detail")
    else
      mpi_detail="" mpi_name="MPI at $(dirname "$bin")"
    fi
    # The path too: the same MPI release installed elsewhere is another library to link.
    mpi_detail="$bin"$'\n'"$mpi_detail"
    if [[ $mpi_detail == *pypi.org/p/mpich* ]]; then
      refuse "MPI=system: $mpi_wrapper is the mpich PyPI wheel's (a venv on PATH?); deactivate it and load the site's MPI module"
    fi
    # FindMPI looks in MPI_HOME first for mpiexec and the wrappers: the build takes this MPI.
    build_flags+=("MPI_HOME=$(dirname "$bin")")
  elif [[ -n ${PE_ENV:-} ]] && mpi_wrapper=$(command -v CC); then
    if [[ -z ${CRAY_MPICH_VERSION:-} ]]; then
      refuse "MPI=system: a Cray PE without cray-mpich (CRAY_MPICH_VERSION unset); module load cray-mpich first"
    fi
    mpi_name="Cray MPICH ${CRAY_MPICH_VERSION:-(no cray-mpich)}"
    # What FindMPI asks the Cray wrapper (the MPI's include and library flags), and where it is.
    mpi_detail="$(readlink -f "$mpi_wrapper") ${CRAY_MPICH_VERSION:-}"$'\n'
    mpi_detail+=$("$mpi_wrapper" --cray-print-opts=cflags && "$mpi_wrapper" --cray-print-opts=libs)
    # The Cray wrappers as CMake's compilers: FindMPI then finds that they build MPI code as is.
    build_flags+=(CC=cc CXX=CC)
  else
    mpi_wrapper="" mpi_detail="" mpi_name=""
    refuse "MPI=system: no mpicxx (nor a Cray PE's CC) on PATH; load the site's MPI module first (e.g. module load cray-mpich)"
  fi
}

# The CUDA toolkit Horovod's CMake compiles with ($HOROVOD_CUDA_HOME/bin/nvcc): HOROVOD_CUDA_HOME
# or CUDA_HOME (what sites' CUDA modules set) if set, else the one of the nvcc on PATH.
find_cuda() {
  local nvcc
  cuda_home=${HOROVOD_CUDA_HOME:-${CUDA_HOME:-}}
  if [[ -z $cuda_home ]] && nvcc=$(command -v nvcc); then
    cuda_home=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
  fi
  if [[ -z $cuda_home || ! -x $cuda_home/bin/nvcc ]]; then
    cuda_home="" cuda_release=""
    refuse "GPU=1: no nvcc on PATH (nor HOROVOD_CUDA_HOME, CUDA_HOME); load the site's CUDA 12 module first"
    return
  fi
  cuda_release=$(nvcc_release "$cuda_home")
  if [[ $cuda_release != 12.* ]]; then
    refuse "GPU=1: $cuda_home/bin/nvcc is CUDA ${cuda_release:-of no known release}; TensorFlow $TF_VERSION and its NCCL wheel are CUDA 12: name a CUDA 12 toolkit for the build, HOROVOD_CUDA_HOME=$(cuda_12_beside "$cuda_home"), or load a CUDA 12 module"
  fi
}

nvcc_release() {
  "$1/bin/nvcc" --version | sed -n 's/.*release \([0-9][0-9.]*\),.*/\1/p'
}

# The CUDA 12 toolkits in the folder of another CUDA's (ALCF's conda module on Polaris sets
# CUDA_HOME to a CUDA 13 toolkit in /soft/compilers/cudatoolkit, beside CUDA 12 ones), newest
# first, for the refusal to name: "<path> (or <path>...)", or "<a CUDA 12 toolkit>".
cuda_12_beside() {
  local found=() toolkit
  for toolkit in "$(dirname "$1")"/*; do
    [[ -x $toolkit/bin/nvcc && $(nvcc_release "$toolkit") == 12.* ]] && found+=("$toolkit")
  done
  if ((${#found[@]} == 0)); then
    echo "<a CUDA 12 toolkit>"
    return
  fi
  mapfile -t found < <(printf '%s\n' "${found[@]}" | sort -rV)
  echo "${found[0]}${found[1]:+ (or ${found[*]:1})}"
}

# NCCL for Horovod's FindNCCL (HOROVOD_NCCL_HOME: nccl.h in include/, libnccl in lib/): the
# user's HOROVOD_NCCL_HOME (a site's NCCL module), else the nvidia-nccl-cu12 wheel of
# tensorflow[and-cuda], which ships include/nccl.h and lib/libnccl.so.2 only (no static library):
# linked shared, through the libnccl.so that link_wheel_nccl adds.
find_nccl() {
  if [[ -n ${HOROVOD_NCCL_HOME:-} ]]; then
    nccl_home=$HOROVOD_NCCL_HOME nccl_from="HOROVOD_NCCL_HOME"
    [[ -f $nccl_home/include/nccl.h ]] || refuse "GPU=1: HOROVOD_NCCL_HOME=$nccl_home has no include/nccl.h"
  else
    nccl_home="$SITE_PACKAGES/nvidia/nccl" nccl_from="the nvidia-nccl-cu12 wheel of tensorflow[and-cuda]"
    build_flags+=(HOROVOD_NCCL_LINK=SHARED)
  fi
  build_flags+=("HOROVOD_NCCL_HOME=$nccl_home")
}

# FindNCCL looks for libnccl.so (what a system NCCL's -dev package adds beside libnccl.so.2); the
# link sits in the wheel's lib/, so the RUNPATH the build records names the folder of libnccl.so.2.
link_wheel_nccl() {
  if [[ ! -f $nccl_home/include/nccl.h || ! -f $nccl_home/lib/libnccl.so.2 ]]; then
    echo "[setup] GPU=1: $nccl_home lacks include/nccl.h or lib/libnccl.so.2 (the nvidia-nccl-cu12 wheel changed?); set HOROVOD_NCCL_HOME" >&2
    exit 1
  fi
  ln -sfn libnccl.so.2 "$nccl_home/lib/libnccl.so"
}

# What the Python of the site's TensorFlow module holds, for GPU=xpu, without importing anything
# (Intel's extension fails to import where there is no Intel GPU, as on Aurora's login nodes):
# its version, and TensorFlow's, Intel's extension's and Horovod's distribution and version ("" for
# one it lacks). Sets module_python, module_tensorflow, module_extension, module_horovod.
probe_module_python() {
  local probe
  module_python="" module_tensorflow="" module_extension="" module_horovod=""
  if ! command -v "$PYTHON" >/dev/null; then
    refuse "GPU=xpu: no $PYTHON on PATH; load the site's TensorFlow module first (Aurora: module load tensorflow)"
    return
  fi
  probe=$("$PYTHON" -c '
import sys
from importlib import metadata, util
def dist(top):
    if util.find_spec(top) is None:
        return ""
    for name in metadata.packages_distributions().get(top) or [top]:
        try:
            return metadata.metadata(name)["Name"] + " " + metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return top + " (version unknown)"
print("python=%d.%d" % sys.version_info[:2])
for key, top in [("tensorflow", "tensorflow"), ("extension", "intel_extension_for_tensorflow"), ("horovod", "horovod")]:
    print(key + "=" + dist(top))
') || probe=""
  module_python=$(sed -n 's/^python=//p' <<<"$probe")
  module_tensorflow=$(sed -n 's/^tensorflow=//p' <<<"$probe")
  module_extension=$(sed -n 's/^extension=//p' <<<"$probe")
  module_horovod=$(sed -n 's/^horovod=//p' <<<"$probe")
  local where
  where=$(command -v "$PYTHON")
  if [[ $module_python != 3.11 ]]; then
    refuse "GPU=xpu: $where is Python ${module_python:-of no known version}; the project needs 3.11 (pyproject.toml): load the site's TensorFlow module of Python 3.11, or give PYTHON="
  elif [[ -z $module_tensorflow ]]; then
    refuse "GPU=xpu: $where has no TensorFlow; load the site's TensorFlow module first (Aurora: module load tensorflow)"
  elif [[ -z $module_extension ]]; then
    refuse "GPU=xpu: the TensorFlow of $where ($module_tensorflow) has no Intel extension (intel_extension_for_tensorflow), so it lists no XPU: load the site's TensorFlow module for Intel GPUs"
  elif [[ -z $module_horovod ]]; then
    refuse "GPU=xpu: $where has no Horovod (Intel's, with oneCCL); load the site's TensorFlow module that holds it"
  fi
}

had=$(recorded_flavour)
had_mpi="" had_gpu=""
if [[ -n $had ]]; then
  if [[ ! $had =~ ^MPI=(wheel|system)\ GPU=([01]|xpu)$ ]]; then
    echo "[setup] $FLAVOUR_FILE holds '$had', not 'MPI=wheel|system GPU=0|1|xpu'; make clean-venv first" >&2
    exit 2
  fi
  had_mpi=${BASH_REMATCH[1]} had_gpu=${BASH_REMATCH[2]}
fi
GPU=${GPU_GIVEN:-${had_gpu:-0}}
# A new venv: the mpich wheel, but the site's MPI with GPU=xpu (the module's Horovod speaks it).
new_mpi=wheel
[[ $GPU == xpu ]] && new_mpi=system
MPI=${MPI_GIVEN:-${had_mpi:-$new_mpi}}
# The venv's Python: 3.11 from PATH, or with GPU=xpu the python3 of the site's TensorFlow module.
if [[ $GPU == xpu ]]; then
  PYTHON=${PYTHON_GIVEN:-python3}
else
  PYTHON=${PYTHON_GIVEN:-python3.11}
fi
if [[ -n $had && "MPI=$MPI GPU=$GPU" != "$had" ]]; then
  refuse "$VENV was made with $had, not MPI=$MPI GPU=$GPU: make clean-venv first, or give another VENV="
fi

# What differs between the flavours: the lock's TensorFlow and mpich lines, Horovod's build flags.
requirements=$(cat requirements.lock)
build_flags=(HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1
  HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1)
if [[ $MPI == wheel ]]; then
  mpich_pin=$(grep -i '^mpich==' <<<"$requirements")
  # The venv's bin/ is first on PATH during the build: FindMPI takes the wheel's mpiexec and mpicxx.
  # The wheel's libmpi is found through the RUNPATH the build records, <venv>/lib: a wheel built
  # for one venv is another's only where that venv is, so its place names the cache too.
  mpi_name="MPICH ${mpich_pin#*==}" mpi_wrapper="$VENV/bin/mpicxx"
  mpi_detail="$mpich_pin"$'\n'"$(realpath -m "$VENV")"
  mpi_tag="mpich-wheel-${mpich_pin#*==}"
else
  requirements=$(grep -v -i '^mpich==' <<<"$requirements")
  find_system_mpi
  mpi_tag="system-mpi-${mpi_name//[^A-Za-z0-9.]/-}"
fi
mpi_id=$(hash8 "$mpi_detail")
cache_name="$mpi_tag-$mpi_id"
if [[ $GPU == xpu ]]; then
  [[ $MPI == system ]] || refuse "GPU=xpu: the TensorFlow module's Horovod speaks the site's MPI, not the mpich wheel's; use MPI=system"
  # TensorFlow, Intel's extension and Horovod are the module's: none from the lock, none built.
  requirements=$(grep -v -i '^tensorflow-cpu==' <<<"$requirements")
  probe_module_python
fi
if [[ $GPU == 1 ]]; then
  requirements=$(sed "s/^tensorflow-cpu==.*/tensorflow[and-cuda]==$TF_VERSION/" <<<"$requirements")
  find_cuda
  find_nccl
  build_flags+=(HOROVOD_GPU_OPERATIONS=NCCL "HOROVOD_CUDA_HOME=$cuda_home")
  # NCCL's folder too: a build from the wheel's NCCL records that venv's folder in its RUNPATH.
  cache_name+="-cuda$cuda_release-$(hash8 "$cuda_home $cuda_release $nccl_home")"
fi
wheel_dir="$WHEEL_CACHE/horovod-$HOROVOD_VERSION-tf$TF_VERSION-$cache_name"
# The package's extras (pyproject.toml) this flavour installs, for people: the lines above chose them.
extras=cpu
[[ $GPU == 1 ]] && extras=gpu
[[ $GPU == xpu ]] && extras=""  # TensorFlow is the module's
[[ $MPI == wheel ]] && extras+=,mpi-wheel
extras+=,test
extras=${extras#,}
want=$( (cat tools/setup_env.sh pyproject.toml; echo "$requirements"; echo "MPI=$MPI GPU=$GPU $wheel_dir") | sha256sum | cut -d' ' -f1)

if [[ $DRY_RUN == 1 ]]; then
  echo "[setup] dry run: venv $VENV, Python $PYTHON"
  echo "[setup]   flavour MPI=$MPI GPU=$GPU (the venv's: ${had:-none yet, a new venv})"
  echo "[setup]   install ffn-workflow[$extras] at requirements.lock's versions, among them:"
  grep -i -E '^(tensorflow|mpich)' <<<"$requirements" | sed 's/^/[setup]   install /'
  if [[ $MPI == wheel ]]; then
    echo "[setup]   MPI: $mpi_name (the wheel's $mpi_wrapper)"
  else
    echo "[setup]   MPI from PATH: ${mpi_name:-none found}${mpi_wrapper:+ ($mpi_wrapper)}"
  fi
  if [[ $GPU == 1 ]]; then
    echo "[setup]   CUDA: ${cuda_home:-none found}${cuda_release:+ (nvcc release $cuda_release)}"
    echo "[setup]   NCCL: $nccl_home ($nccl_from)"
  fi
  if [[ $GPU == xpu ]]; then
    echo "[setup]   the venv over $(command -v "$PYTHON" || echo "$PYTHON") (Python ${module_python:-?}, --system-site-packages): the site's TensorFlow module"
    echo "[setup]   from the module: TensorFlow: ${module_tensorflow:-none}; Intel's extension: ${module_extension:-none}; Horovod: ${module_horovod:-none}"
    echo "[setup]   build nothing: the module's Horovod allreduces with oneCCL (checked: horovodrun --check-build shows CCL)"
  else
    echo "[setup]   build horovod==$HOROVOD_VERSION with ${build_flags[*]}"
  fi
  if [[ $GPU == xpu ]]; then
    :
  elif [[ -n $mpi_name ]]; then
    echo "[setup]   horovod wheel cache: $wheel_dir"
  else
    echo "[setup]   horovod wheel cache: $WHEEL_CACHE/horovod-$HOROVOD_VERSION-tf$TF_VERSION-system-mpi-<MPI>-<hash> (named after the MPI found)"
  fi
  echo "[setup]   records: $FLAVOUR_FILE (before installing), $VENV/ffn-environment.json (when done)"
  if [[ -n $refusal ]]; then
    echo "[setup] $refusal" >&2
    exit 2
  fi
  exit 0
fi

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[setup] creating $VENV with $($PYTHON --version)"
  if [[ $GPU == xpu ]]; then  # the module's packages stay visible in the venv
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
# Before anything is installed: a set-up stopped half-way still knows the venv's flavour.
echo "MPI=$MPI GPU=$GPU" >"$FLAVOUR_FILE"
# The venv's bin/ first: with MPI=wheel the Horovod build must find mpicxx from the mpich wheel.
export PATH="$VENV/bin:$PATH"
# This machine's pip config names local mirror folders that may be absent; their warnings are noise.
pip() {
  "$VENV/bin/python" -m pip --disable-pip-version-check "$@" 2> >(grep -v 'neither a file nor a directory' >&2)
}

echo "[setup] installing pinned packages (requirements.lock, MPI=$MPI, GPU=$GPU: extras $extras)"
# setuptools<70: Horovod 0.28.1's setup.py still uses APIs removed later.
pip install -q --upgrade 'pip==26.3' 'setuptools==69.5.1' 'wheel==0.48.0'
pip install -q -r <(echo "$requirements")
# With the wheel in the venv (a dependency that pulled it in), its mpicxx would build Horovod and
# its mpiexec come first on PATH after `activate`: the leak MPI=system exists to prevent.
if [[ $MPI == system ]] && compgen -G "$SITE_PACKAGES/mpich-*.dist-info" >/dev/null; then
  echo "[setup] MPI=system, but the mpich wheel got into $VENV (which package requires it?)" >&2
  exit 1
fi
if [[ $GPU == 1 && $nccl_home == "$SITE_PACKAGES/nvidia/nccl" ]]; then
  link_wheel_nccl
fi

if [[ $GPU == xpu ]]; then
  :  # Horovod is the module's (Intel's, with oneCCL)
elif ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
  echo "[setup] building horovod==$HOROVOD_VERSION against TensorFlow $TF_VERSION and $mpi_name (3 to 15 minutes on 2 cores, once: the wheel is cached)"
  mkdir -p "$wheel_dir.tmp"
  # CMAKE_POLICY_VERSION_MINIMUM: Horovod's bundled gloo declares an old cmake minimum.
  env "${build_flags[@]}" CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS="-j$(nproc)" \
    "$VENV/bin/python" -m pip --disable-pip-version-check wheel -q --no-build-isolation --no-deps \
    --no-cache-dir -w "$wheel_dir.tmp" "horovod==$HOROVOD_VERSION"
  rm -rf "$wheel_dir" && mv "$wheel_dir.tmp" "$wheel_dir"
fi
[[ $GPU == xpu ]] || pip install -q --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
pip install -q --no-deps --no-build-isolation -e .
# The package went in without its dependencies: the lock must have brought them all, at its pins.
if ! problems=$(pip check); then
  echo "$problems" >&2
  echo "[setup] the packages of requirements.lock do not satisfy pyproject.toml's (or each other's) requirements: update the lock (make lock)" >&2
  exit 1
fi

if [[ $GPU == xpu ]]; then  # the module's horovodrun is not in the venv's bin/
  build_info=$("$VENV/bin/python" -c 'import sys; from horovod.runner.launch import run_commandline; sys.argv[1:] = ["--check-build"]; run_commandline()')
else
  build_info=$("$VENV/bin/horovodrun" --check-build)
fi
if ! grep -q '\[X\] MPI' <<<"$build_info" || ! grep -q '\[X\] Gloo' <<<"$build_info"; then
  echo "[setup] horovod lacks MPI or Gloo support:" >&2
  echo "$build_info" >&2
  exit 1
fi
if [[ $GPU == 1 ]] && ! grep -q '\[X\] NCCL' <<<"$build_info"; then
  echo "[setup] GPU=1 but horovod was built without NCCL:" >&2
  echo "$build_info" >&2
  exit 1
fi
"$VENV/bin/python" -m site_configs.environment --write "$VENV" --mpi-flavour "$MPI" --gpu "$GPU" \
  --mpi "$mpi_name" --mpi-wrapper "$mpi_wrapper" --mpi-id "$mpi_id" <<<"$build_info"
echo "$want" >"$STAMP"
echo "[setup] environment ready in $VENV (MPI=$MPI GPU=$GPU: $mpi_name)"
