"""The processes tests start (workflows, mpiexec and its ranks, training runs): bounded by the
suite's time budget, and never left running. A timed-out `mpiexec` killed alone leaves its ranks
busy-polling both cores, and every later test then crawls: that turned one slow CI test into a
suite that did not finish in 90 minutes."""

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence

import psutil
import pytest

# Minutes after which the suite starts no further test: on a machine several times slower than
# usual (CI has been: importing TensorFlow took minutes) it then still ends, set-up and a Horovod
# build included, within the 20 minutes CI is meant to take, and the summary lists what was left
# out. Tests that launch ranks or whole workflows stop at half of it (the longest runs about 5
# minutes on a slow 2-core machine), and no process a test starts outlives the budget. 0: none.
BUDGET_MINUTES = float(os.environ.get("FFN_TEST_BUDGET_MIN", "10"))
SUITE_STARTED = time.monotonic()
# How long a stopped process tree gets between SIGTERM (the workflow cancels its Parsl blocks on
# it) and SIGKILL.
GRACE_S = 20


def minutes_spent() -> float:
    return (time.monotonic() - SUITE_STARTED) / 60


def seconds_left() -> float:
    """Seconds until the suite's budget is spent (infinite without a budget)."""
    if not BUDGET_MINUTES:
        return float("inf")
    return max(BUDGET_MINUTES * 60 - (time.monotonic() - SUITE_STARTED), 1.0)


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
    """`subprocess.run(command, capture_output=True, text=True)` that past `timeout` seconds, or
    past the suite's budget, stops the whole process tree and fails the test with its output."""
    limit = min(timeout, seconds_left())
    with started(command, stderr=subprocess.PIPE, **popen_args) as process:
        try:
            out, err = process.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            stop_tree(process)
            out, err = process.communicate()
            pytest.fail(
                f"{' '.join(map(str, command))[:300]} still running after {limit:.0f} s "
                f"(suite at {minutes_spent():.1f} min): stopped it and all it started\n"
                f"stdout tail:\n{out[-2000:]}\nstderr tail:\n{err[-3000:]}"
            )
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)
