"""The processes tests start (workflows, mpiexec and its ranks, training runs): bounded by each
test's own time limit, and never left running. A timed-out `mpiexec` killed alone leaves its ranks
busy-polling both cores, and every later test then crawls: that turned one slow CI test into a
suite that did not finish in 90 minutes."""

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

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


# -- looking for a run's processes --
def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def naming(text: str) -> list[psutil.Process]:
    """Live processes whose command line holds `text` (not this test's)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if p.pid != os.getpid() and text in " ".join(p.info["cmdline"] or []) and alive(p):
            found.append(p)
    return found


def family(pid: int, *blocks: int) -> list[psutil.Process]:
    """`pid`'s descendants, and the run's local `blocks` with their process groups, now."""
    members = psutil.Process(pid).children(recursive=True)
    groups = set()
    for block in blocks:
        with_children = [psutil.Process(block), *psutil.Process(block).children(recursive=True)]
        members += [p for p in with_children if p not in members]
        groups.add(os.getpgid(block))
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) in groups and p not in members:
                members.append(p)
        except OSError:
            continue
    return members


def kill_all(processes_: list[psutil.Process]) -> None:
    for p in processes_:
        if alive(p):
            with contextlib.suppress(psutil.Error):
                p.kill()


def wait_until(condition, timeout: float) -> float:
    """Seconds `condition()` took to hold, or fail past `timeout`."""
    began = time.monotonic()
    while not condition():
        if time.monotonic() - began > timeout:
            return float("inf")
        time.sleep(0.2)
    return time.monotonic() - began


def describe(processes_: list[psutil.Process]) -> list[str]:
    out = []
    for p in processes_:
        try:
            out.append(f"{p.pid}: {' '.join(p.cmdline())[:150]}")
        except psutil.Error:
            continue
    return out


def gone_within(run: list[psutil.Process], run_dir: Path, limit: float) -> None:
    """Every process of `run`, and every one naming the run dir, ends within `limit` s (what a
    failed test finds is killed, not left running)."""
    try:
        took = wait_until(
            lambda: not any(alive(p) for p in run) and not naming(str(run_dir)), limit
        )
        left = describe([p for p in run if alive(p)] + naming(str(run_dir)))
        assert took <= limit, f"still running {limit} s after the kill: {left}"
    finally:
        kill_all(run + naming(str(run_dir)))


def training_ranks(run_dir: Path) -> list[psutil.Process]:
    """The training ranks of the run in `run_dir` (not their mpiexec), by the command lines
    `naming` read: a rank gone since is not asked again (it may be a zombie by then)."""
    return [
        p
        for p in naming(str(run_dir))
        if "pipeline.cli.train" in " ".join(p.info["cmdline"])
        and "mpiexec" not in p.info["cmdline"][0]
    ]
