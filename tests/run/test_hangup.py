"""A dropped login session (issue 57, point 8) stops the workflow in order, as SIGTERM does: its
terminal gone, the shell sends SIGHUP to each of its jobs' process groups, and the workflow
cancels its workers, lets Parsl's cleanup record the run's end in monitoring.db and exits 129
(128 + SIGHUP), not dying on a print to the terminal that is gone; `--resume` goes on. Before,
SIGHUP killed it at once (the run's watchdog ended what it left; Parsl recorded no end).

The fault is injected for real: the workflow writes to a pseudo-terminal, which is closed (every
write then fails with EIO, as on a hung-up terminal), and SIGHUP goes to its process group.
"""

import os
import select
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import processes
import psutil
import pytest
from processes import alive, describe, family, gone_within, naming, wait_until
from workflow_runs import ROOT, TINY, workflow

from pipeline.run.run_layout import RunPaths

STOP_LIMIT_S = 60  # from the hang-up to the workflow's exit, its workers and Parsl stopped


class Terminal:
    """A pseudo-terminal the workflow writes to, read as a terminal would until it hangs up."""

    def __init__(self) -> None:
        self.master, self.slave = os.openpty()
        self.output = bytearray()
        self._closing = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._closing.is_set():
            if select.select([self.master], [], [], 0.2)[0]:
                try:
                    self.output += os.read(self.master, 65536)
                except OSError:  # every writer gone
                    return

    def text(self) -> str:
        return self.output.decode(errors="replace")

    def hang_up(self) -> None:
        """Close the terminal: a write to it fails with EIO from now on (ssh's connection lost)."""
        self._closing.set()
        self._reader.join()
        os.close(self.master)


def training_ranks(run_dir: Path) -> list[psutil.Process]:
    ranks = []
    for p in naming(str(run_dir)):
        try:
            line = p.cmdline()
        except psutil.NoSuchProcess:  # ended (a zombie, say) since it was listed
            continue
        if "pipeline.cli.train" in " ".join(line) and "mpiexec" not in line[0]:
            ranks.append(p)
    return ranks


def sighup_default() -> None:
    """SIGHUP at its default in the child, as a login shell starts a job: a suite run under
    `nohup` would otherwise hand its ignored SIGHUP down (and the workflow keeps it ignored)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def run_ends(run_dir: Path) -> list[tuple[str, str | None]]:
    """Each Parsl run of `run_dir` in monitoring.db: when it began, when it ended (None: never
    recorded, as when the workflow was killed)."""
    with sqlite3.connect(run_dir / "monitoring.db") as db:
        return db.execute(
            "SELECT time_began, time_completed FROM workflow ORDER BY time_began"
        ).fetchall()


@pytest.mark.mpi
@pytest.mark.slow  # a tiny run hung up while training, then resumed: about 2-3 min on 2 cores
def test_a_dropped_login_session_stops_the_workflow_in_order_and_a_resume_goes_on(tmp_path):
    run_dir = tmp_path / "hung_up"
    command = [sys.executable, "workflow.py", "--config", str(TINY), "--run-dir", str(run_dir)]
    terminal = Terminal()
    tty = {"stdin": terminal.slave, "stdout": terminal.slave, "stderr": terminal.slave}
    with processes.started(command, cwd=ROOT, preexec_fn=sighup_default, **tty) as process:
        os.close(terminal.slave)  # the workflow's own copies stay: it is the terminal's last writer
        took = wait_until(
            lambda: len(training_ranks(run_dir)) == 2 or process.poll() is not None, 600
        )
        assert len(training_ranks(run_dir)) == 2, (
            f"should be training ({took} s): {terminal.text()[-3000:]}"
        )
        time.sleep(1)  # the pools, interchanges, monitoring: all up
        run = family(process.pid) + naming(str(run_dir))
        names = " ".join(" ".join(p.cmdline()) for p in run if alive(p))
        for service in ("interchange", "worker-pool", "parsl: monitoring", "mpiexec", "watchdog"):
            assert service in names, f"{service} should be running: {describe(run)}"

        terminal.hang_up()
        os.killpg(process.pid, signal.SIGHUP)  # what the hung-up shell sends each of its jobs
        began = time.monotonic()
        try:
            process.wait(timeout=STOP_LIMIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {STOP_LIMIT_S} s after the hang-up: {describe(run)}")
        took = time.monotonic() - began
    # 129 only comes from the orderly stop (the signal's default action leaves -1, killed by it).
    assert process.returncode == 128 + signal.SIGHUP, (process.returncode, terminal.text()[-3000:])
    # Nothing of the run is left: the workflow stopped it before it exited, not its watchdog.
    gone_within(run, run_dir, 10)
    assert "is gone: stopping the run" not in RunPaths(run_dir).watchdog_log.read_text()
    # Parsl's cleanup ran to its end: the monitoring database holds the run's end time.
    ((_, ended),) = run_ends(run_dir)
    assert ended is not None, (
        f"monitoring.db has no end for the hung-up run (stopped in {took:.0f} s)"
    )

    out = workflow("--config", str(TINY), "--run-dir", str(run_dir), "--resume").stdout
    assert "train      0/1 up to date" in out, out[-3000:]  # stopped mid-training: it goes on
    assert (run_dir / "evaluation.json").is_file()
    assert all(end is not None for _, end in run_ends(run_dir))
    assert naming(str(run_dir)) == []


# The workflow's stop-signal handling alone, in a process of its own: each check prints one word.
HANDLERS = textwrap.dedent(
    """
    import os, signal, sys
    from apps import execute
    from site_configs.teardown import tell

    previous = execute._handle_stop_signals()
    print(" ".join(sorted(s.name for s in previous)), flush=True)
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        print("not stopped", flush=True)
    except execute.Stopped as stop:
        # A second signal during the stop is ignored; the stop goes on.
        os.kill(os.getpid(), signal.SIGTERM)
        tell(f"stopped by {stop}")
    sys.exit(128 + signal.SIGHUP)
    """
)


def test_sighup_stops_the_workflow_once_and_nohup_keeps_it_ignored():
    done = processes.run(
        [sys.executable, "-c", HANDLERS], cwd=ROOT, timeout=120, preexec_fn=sighup_default
    )
    assert done.returncode == 129, done.stdout + done.stderr
    assert done.stdout.splitlines() == ["SIGHUP SIGINT SIGTERM", "stopped by SIGHUP"], done.stdout
    # Started by `nohup` (SIGHUP ignored), the workflow leaves SIGHUP ignored: it goes on.
    nohup = processes.run(["nohup", sys.executable, "-c", HANDLERS], cwd=ROOT, timeout=120)
    assert nohup.stdout.splitlines() == ["SIGINT SIGTERM", "not stopped"], (
        nohup.stdout + nohup.stderr
    )


# Prints to a terminal that is gone: the process goes on and exits with its own status.
GONE = textwrap.dedent(
    """
    import sys, time
    from site_configs.teardown import tell

    time.sleep(1)  # the test hangs the terminal up meanwhile
    tell("to a terminal that is gone")
    tell("again", sys.stderr)
    tell("and again")
    open(sys.argv[1], "w").write("went on")
    sys.exit(129)
    """
)


def test_a_print_to_a_terminal_that_is_gone_does_not_stop_the_workflow(tmp_path):
    terminal = Terminal()
    tty = {"stdout": terminal.slave, "stderr": terminal.slave}
    with processes.started(
        [sys.executable, "-c", GONE, str(tmp_path / "went_on")], cwd=ROOT, **tty
    ) as process:
        os.close(terminal.slave)
        terminal.hang_up()
        process.wait(timeout=60)
    assert process.returncode == 129  # not 120 (Python's failed flush at exit), not a traceback
    assert (tmp_path / "went_on").read_text() == "went on"
