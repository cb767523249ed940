"""Shared fixtures and the capability markers: a test marked `mpi` or `browser` is skipped, with
the reason, when this machine lacks the resource instead of failing."""

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

# Keep TensorFlow's start-up chatter out of test output; one thread pool per test process.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

VENV_BIN = Path(sys.executable).parent


def _missing_mpi() -> str | None:
    if shutil.which("mpiexec", path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}") is None:
        return "mpiexec not found (the mpich wheel provides it in the venv)"
    if importlib.util.find_spec("horovod") is None:
        return "horovod is not installed"
    return None


def _missing_browser() -> str | None:
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        return "headless Chromium/chromedriver not installed (apt-get install chromium chromium-driver)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reasons = {"mpi": _missing_mpi(), "browser": _missing_browser()}
    for item in items:
        for marker, reason in reasons.items():
            if reason and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))
