"""The processes tests start (workflows, mpiexec and its ranks, training runs): bounded by each
test's own time limit, and never left running. A timed-out `mpiexec` killed alone leaves its ranks
busy-polling both cores, and every later test then crawls: that turned one slow CI test into a
suite that did not finish in 90 minutes."""

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator, Sequence

import psutil
import pytest

# How long a stopped process tree gets between SIGTERM (the workflow cancels its Parsl blocks on
# it) and SIGKILL.
GRACE_S = 20


def stop_tree(process: subprocess.Popen) -> None:
    """Stops `process` and everything it started, the ranks of an `mpiexec` included."""
    try:
        root = psutil.Process(process.pid)
        family = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        family = []
    for member in family:
        try:
            member.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(family, timeout=GRACE_S)
    for member in alive:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    try:  # what was started during the grace period, in the session `run` gave the process
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@contextlib.contextmanager
def started(command: Sequence[str], **popen_args: object) -> Iterator[subprocess.Popen]:
    """`command` in a session of its own, its output (stdout and stderr merged unless
    `popen_args` say otherwise) as text; whatever still runs when the block ends, by an error or
    not, is stopped with all it started."""
    options = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True} | popen_args
    with subprocess.Popen(list(command), start_new_session=True, **options) as process:
        try:
            yield process
        finally:
            if process.poll() is None:
                stop_tree(process)


def run(
    command: Sequence[str], *, timeout: float, **popen_args: object
) -> subprocess.CompletedProcess:
    """`subprocess.run(command, capture_output=True, text=True)` that past `timeout` seconds
    stops the whole process tree and fails the test with its output."""
    with started(command, stderr=subprocess.PIPE, **popen_args) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_tree(process)
            out, err = process.communicate()
            pytest.fail(
                f"{' '.join(map(str, command))[:300]} still running after {timeout:.0f} s: "
                f"stopped it and all it started\n"
                f"stdout tail:\n{out[-2000:]}\nstderr tail:\n{err[-3000:]}"
            )
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)
