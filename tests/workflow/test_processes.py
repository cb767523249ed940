"""The tests' own launcher (tests/processes.py): a process that runs past its time is stopped with
everything it started, as a workflow's Parsl workers and ranks, which live in sessions of their own."""

import sys

import processes
import psutil
import pytest

# A parent that starts a child in a session of its own (as Parsl's LocalProvider starts a block),
# with its output elsewhere, then waits: killing the parent alone would leave the child running.
PARENT = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", sys.argv[1]],
                 start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print("child started", flush=True)
time.sleep(600)
"""


def test_a_process_past_its_time_is_stopped_with_all_it_started(tmp_path):
    tag = str(tmp_path / "child-of-this-test")

    def children() -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["cmdline"]) if tag in (p.info["cmdline"] or [])]

    with pytest.raises(pytest.fail.Exception, match="(?s)still running after 5 s.*child started"):
        processes.run([sys.executable, "-c", PARENT, tag], timeout=5)
    assert children() == []


def test_a_process_within_its_time_returns_its_output():
    done = processes.run([sys.executable, "-c", "print('out'); exit(3)"], timeout=60)
    assert (done.returncode, done.stdout) == (3, "out\n")
