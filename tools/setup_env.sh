#!/usr/bin/env bash
# Create or reuse the project's virtual environment (.venv) and make it match requirements.lock.
# Fast when nothing changed: a stamp file holds the hash of the inputs that shaped the venv.
# Horovod 0.28.1 is built from source against the pinned TensorFlow with MPI and Gloo; the wheel
# is cached outside the repo so a second set-up does not rebuild it.
#
#   MPI=wheel  (default) MPI from the `mpich` PyPI wheel (its mpicxx builds Horovod, its mpiexec
#              launches the ranks): for this machine, the `local` site.
#   MPI=system the machine's own MPI, found on PATH (`module load cray-mpich`, `module load
#              openmpi`, ...): no mpich wheel in the venv, so the site's mpiexec/srun/aprun
#              starts the ranks and Horovod speaks that MPI. Load the same modules in the site's
#              worker_init.
#   GPU=1      TensorFlow 2.15.1's CUDA build (tensorflow[and-cuda]) and Horovod with NCCL
#              allreduce, for GPU nodes; default GPU=0: tensorflow-cpu.
#   DRY_RUN=1  print what would be installed and built, change nothing.
set -euo pipefail
export TF_CPP_MIN_LOG_LEVEL=2  # TensorFlow imports below would print start-up notices
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3.11}
MPI=${MPI:-wheel}
GPU=${GPU:-0}
DRY_RUN=${DRY_RUN:-0}
HOROVOD_VERSION=0.28.1
TF_VERSION=2.15.1
WHEEL_CACHE=${FFN_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ffn-workflow/wheels}
STAMP="$VENV/.setup-stamp"

case "$MPI" in wheel | system) ;; *) echo "[setup] MPI must be wheel or system, got '$MPI'" >&2; exit 2 ;; esac
case "$GPU" in 0 | 1) ;; *) echo "[setup] GPU must be 0 or 1, got '$GPU'" >&2; exit 2 ;; esac

# What differs between the flavours: the lock's TensorFlow and mpich lines, Horovod's build flags.
requirements=$(cat requirements.lock)
build_flags=(HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1
  HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1)
if [[ $MPI == system ]]; then
  requirements=$(grep -v -i '^mpich==' <<<"$requirements")
  if [[ $DRY_RUN != 1 ]] && ! command -v mpicxx >/dev/null; then
    echo "[setup] MPI=system: no mpicxx on PATH; load the site's MPI module first (e.g. module load cray-mpich)" >&2
    exit 2
  fi
fi
if [[ $GPU == 1 ]]; then
  requirements=$(sed "s/^tensorflow-cpu==.*/tensorflow[and-cuda]==$TF_VERSION/" <<<"$requirements")
  build_flags+=(HOROVOD_GPU_OPERATIONS=NCCL)
fi
flavour="$([[ $MPI == wheel ]] && echo mpich || echo system-mpi)$([[ $GPU == 1 ]] && echo -cuda || true)"
want=$( (cat tools/setup_env.sh pyproject.toml; echo "$requirements"; echo "$flavour") | sha256sum | cut -d' ' -f1)
wheel_dir="$WHEEL_CACHE/horovod-$HOROVOD_VERSION-tf$TF_VERSION-$flavour"

if [[ $DRY_RUN == 1 ]]; then
  echo "[setup] dry run: venv $VENV, Python $PYTHON, MPI=$MPI, GPU=$GPU"
  grep -i -E '^(tensorflow|mpich)' <<<"$requirements" | sed 's/^/[setup]   install /'
  [[ $MPI == system ]] && echo "[setup]   MPI from PATH: $(command -v mpicxx || echo 'mpicxx (load the module first)')"
  echo "[setup]   build horovod==$HOROVOD_VERSION with ${build_flags[*]}"
  echo "[setup]   horovod wheel cache: $wheel_dir"
  exit 0
fi

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[setup] creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
# The venv's bin/ first: with MPI=wheel the Horovod build must find mpicxx from the mpich wheel.
export PATH="$PWD/$VENV/bin:$PATH"
# This machine's pip config names local mirror folders that may be absent; their warnings are noise.
pip() {
  "$VENV/bin/python" -m pip --disable-pip-version-check "$@" 2> >(grep -v 'neither a file nor a directory' >&2)
}

echo "[setup] installing pinned packages (requirements.lock, MPI=$MPI, GPU=$GPU)"
# setuptools<70: Horovod 0.28.1's setup.py still uses APIs removed later.
pip install -q --upgrade 'pip==26.3' 'setuptools==69.5.1' 'wheel==0.48.0'
pip install -q -r <(echo "$requirements")

if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
  echo "[setup] building horovod==$HOROVOD_VERSION against TensorFlow $TF_VERSION (3 to 15 minutes on 2 cores, once: the wheel is cached)"
  mkdir -p "$wheel_dir.tmp"
  # CMAKE_POLICY_VERSION_MINIMUM: Horovod's bundled gloo declares an old cmake minimum.
  env "${build_flags[@]}" CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS="-j$(nproc)" \
    "$VENV/bin/python" -m pip --disable-pip-version-check wheel -q --no-build-isolation --no-deps \
    --no-cache-dir -w "$wheel_dir.tmp" "horovod==$HOROVOD_VERSION"
  rm -rf "$wheel_dir" && mv "$wheel_dir.tmp" "$wheel_dir"
fi
pip install -q --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
pip install -q --no-deps --no-build-isolation -e .

build_info=$("$VENV/bin/horovodrun" --check-build)
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
echo "$want" > "$STAMP"
echo "[setup] environment ready in $VENV ($flavour)"
