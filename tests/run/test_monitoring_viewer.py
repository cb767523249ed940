"""Parsl's monitoring viewer (`parsl-visualize`) runs from the venv on a run's monitoring.db and
serves its pages: the workflows, the run's tasks, its resource use (docs/hpc-sites.md,
"Watching from a login node")."""

import shutil
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import processes
import pytest


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def page(url: str, timeout: float = 60) -> tuple[int, str]:
    """(status, text) of `url`, waiting for the server to answer."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.fixture
def viewer(tiny_run, tmp_path):
    """(the viewer's address, the run's id, its process): parsl-visualize on a copy of the
    tiny run's monitoring.db, as docs/hpc-sites.md starts it."""
    database = tmp_path / "monitoring.db"
    shutil.copy2(tiny_run / "monitoring.db", database)
    (run_id,) = sqlite3.connect(database).execute("SELECT run_id FROM workflow").fetchone()
    port = free_port()
    command = [
        str(Path(sys.executable).with_name("parsl-visualize")),
        *("--listen", "127.0.0.1", "--port", str(port), f"sqlite:///{database}"),
    ]
    with processes.started(command, cwd=tmp_path, stdout=subprocess.PIPE) as server:
        yield f"http://127.0.0.1:{port}", run_id, server


def test_parsl_visualize_serves_a_runs_monitoring_database(viewer):
    address, run_id, server = viewer
    status, text = page(f"{address}/")
    assert status == 200 and f"workflow/{run_id}/" in text, text[-2000:]
    status, text = page(f"{address}/workflow/{run_id}/")
    assert status == 200 and "train" in text, text[-2000:]
    status, _ = page(f"{address}/workflow/{run_id}/resource_usage")
    assert status == 200
    assert server.poll() is None, server.stdout.read()


@pytest.mark.skipif(shutil.which("dot") is None, reason="the task graph needs Graphviz's dot")
def test_parsl_visualize_draws_the_task_graph_where_graphviz_is_installed(viewer):
    address, run_id, _ = viewer
    status, _ = page(f"{address}/workflow/{run_id}/dag_group_by_apps")
    assert status == 200
