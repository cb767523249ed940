# The two commands a user needs (README): `make demo` runs the workflow on this machine,
# `make test` runs lint + every test. For development, `make test-quick` runs lint + the tests not
# marked slow or mpi. All create or reuse .venv first (tools/setup_env.sh).
VENV ?= .venv
# Set-up flavours (tools/setup_env.sh): MPI=wheel|system, GPU=0|1, recorded in the venv. No default
# here: MPI/GPU not given means the venv's own flavour (wheel, 0 for a new venv), so a plain
# `make test` keeps a venv made with `make env MPI=system`. DRY_RUN=1 only prints the plan.
DRY_RUN ?= 0
BIN := $(abspath $(VENV))/bin
# The venv's bin/ first on PATH: mpiexec (mpich wheel), horovodrun and Parsl's interchange live there.
RUN := PATH="$(BIN):$$PATH"

.PHONY: demo test test-quick env lint format lock clean-venv

env:
	@VENV=$(VENV) MPI=$(MPI) GPU=$(GPU) DRY_RUN=$(DRY_RUN) bash tools/setup_env.sh

demo: env
	$(RUN) python workflow.py --site local $(ARGS)

# Two test processes (pytest-xdist): most of a test's time is a started process importing
# TensorFlow or waiting on one, so two share 2 cores well; a class or module stays on one process
# (its fixtures are made once), handed out in the order conftest.py sorts them (longest first).
# TEST_WORKERS=0 runs them in this process. PYTEST_ARGS: more pytest arguments (a -k, a path).
TEST_WORKERS ?= 2
PYTEST := $(RUN) python -m pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

# Lint, then every test: none is skipped for time, only those whose resource this machine lacks
# (`mpi`: mpiexec or horovod; `browser`: headless Chromium), each with the reason. What CI runs.
test: env lint
	$(PYTEST) $(PYTEST_ARGS)

# For development: lint, then the tests not marked `slow` or `mpi` (no Horovod ranks, no whole
# workflow runs), in the same two processes. Not a substitute for `make test` before a commit.
test-quick: env lint
	$(PYTEST) -m "not slow and not mpi" $(PYTEST_ARGS)

lint: env
	$(RUN) ruff check .
	$(RUN) ruff format --check .

format: env
	$(RUN) ruff check --fix .
	$(RUN) ruff format .

# Re-resolve requirements.lock from pyproject's direct pins (run by hand, then review the diff):
# installs the package with the extras the lock holds into the venv (what a changed pin needs, the
# rest kept) and freezes it, less Horovod (built by setup_env.sh), sorted by name, the lock's header
# comments kept. The lock is the default flavour's (tools/setup_env.sh derives the others from it):
# the venv must be MPI=wheel GPU=0 (else VENV=).
LOCK_EXTRAS := cpu,mpi-wheel,test
lock: env
	@grep -qx 'MPI=wheel GPU=0' $(VENV)/.setup-flavour || { echo "make lock: requirements.lock is written in the MPI=wheel GPU=0 flavour, $(VENV) is $$(cat $(VENV)/.setup-flavour): give another VENV=" >&2; exit 2; }
	$(RUN) python -m pip install -q --no-build-isolation -e '.[$(LOCK_EXTRAS)]'
	{ grep '^#' requirements.lock; $(RUN) python -m pip freeze --exclude-editable | grep -v -i -E '^horovod( @|==)' \
	  | $(RUN) python -c "import sys; sys.stdout.writelines(sorted(sys.stdin, key=str.lower))"; } > requirements.lock.new
	mv requirements.lock.new requirements.lock

clean-venv:
	rm -rf $(VENV)
