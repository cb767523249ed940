# The two commands a user needs (README): `make demo` runs the workflow on this machine,
# `make test` runs lint + tests. Both create or reuse .venv first (tools/setup_env.sh).
VENV ?= .venv
# Set-up flavours (tools/setup_env.sh): MPI=wheel|system, GPU=0|1, recorded in the venv. No default
# here: MPI/GPU not given means the venv's own flavour (wheel, 0 for a new venv), so a plain
# `make test` keeps a venv made with `make env MPI=system`. DRY_RUN=1 only prints the plan.
DRY_RUN ?= 0
BIN := $(abspath $(VENV))/bin
# The venv's bin/ first on PATH: mpiexec (mpich wheel), horovodrun and Parsl's interchange live there.
RUN := PATH="$(BIN):$$PATH"

.PHONY: demo test env lint format lock clean-venv

env:
	@VENV=$(VENV) MPI=$(MPI) GPU=$(GPU) DRY_RUN=$(DRY_RUN) bash tools/setup_env.sh

demo: env
	$(RUN) python workflow.py --site local $(ARGS)

# Two test processes (pytest-xdist): most of a test's time is a started process importing
# TensorFlow or waiting on one, so two share 2 cores well; a class or module stays on one process
# (its fixtures are made once), handed out in the order conftest.py sorts them (longest first).
# TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2

test: env lint
	$(RUN) python -m pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS)

lint: env
	$(RUN) ruff check .
	$(RUN) ruff format --check .

format: env
	$(RUN) ruff check --fix .
	$(RUN) ruff format .

# Re-resolve requirements.lock from pyproject's direct pins (run by hand, then review the diff).
lock: env
	$(RUN) python -m pip freeze --exclude-editable | grep -v -i '^horovod==' > requirements.lock.new
	mv requirements.lock.new requirements.lock

clean-venv:
	rm -rf $(VENV)
