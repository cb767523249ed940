#!/usr/bin/env bash
# Create or reuse the project's virtual environment (.venv) and make it match requirements.lock.
# Fast when nothing changed: a stamp file holds the hash of the inputs that shaped the venv.
# Horovod 0.28.1 is built from source against the pinned TensorFlow with MPI (the mpich wheel's
# mpicxx) and Gloo; the wheel is cached outside the repo so a second set-up does not rebuild it.
set -euo pipefail
export TF_CPP_MIN_LOG_LEVEL=2  # TensorFlow imports below would print start-up notices
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3.11}
HOROVOD_VERSION=0.28.1
WHEEL_CACHE=${FFN_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ffn-workflow/wheels}
STAMP="$VENV/.setup-stamp"
want=$(cat requirements.lock tools/setup_env.sh pyproject.toml | sha256sum | cut -d' ' -f1)

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[setup] creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
# The venv's bin/ first: the Horovod build must find mpicxx from the mpich wheel, not a system MPI.
export PATH="$PWD/$VENV/bin:$PATH"
# This machine's pip config names local mirror folders that may be absent; their warnings are noise.
pip() {
  "$VENV/bin/python" -m pip --disable-pip-version-check "$@" 2> >(grep -v 'neither a file nor a directory' >&2)
}

echo "[setup] installing pinned packages (requirements.lock)"
# setuptools<70: Horovod 0.28.1's setup.py still uses APIs removed later.
pip install -q --upgrade 'pip==26.3' 'setuptools==69.5.1' 'wheel==0.48.0'
pip install -q -r requirements.lock

tf_version=$("$VENV/bin/python" -c 'import tensorflow as tf; print(tf.__version__)' 2>/dev/null)
wheel_dir="$WHEEL_CACHE/horovod-$HOROVOD_VERSION-tf$tf_version-mpich"
if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
  echo "[setup] building horovod==$HOROVOD_VERSION against TensorFlow $tf_version (about 3 minutes on 2 cores)"
  mkdir -p "$wheel_dir.tmp"
  # CMAKE_POLICY_VERSION_MINIMUM: Horovod's bundled gloo declares an old cmake minimum.
  HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
    HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
    CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS="-j$(nproc)" \
    pip wheel -q --no-build-isolation --no-deps --no-cache-dir -w "$wheel_dir.tmp" "horovod==$HOROVOD_VERSION"
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
echo "$want" > "$STAMP"
echo "[setup] environment ready in $VENV"
