"""One workflow process per run directory, and who that process is.

`hold(run_dir)` takes an exclusive `flock` on `<run_dir>/workflow.lock` for the life of the
workflow process and writes into it who holds it (pid, host, start, command). A second workflow
on the same run dir is refused at once, naming the first: two processes training into one
`train/` and writing each other's stamps would make the stamps lie. The kernel drops the lock
when the holder dies however it dies (kill -9 included), so a lock is never left stale; the
record stays behind and says who ran last.

`holder(run_dir)` is what `status` reads: whether a workflow holds the run dir now. From another
host (a login node of the same cluster) a lock on a shared file system may not be visible, so
the answer then is the record and the host it names.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from pipeline.core.errors import FFNError

LOCK_NAME = "workflow.lock"


class RunDirBusy(FFNError):
    """Another workflow process holds the run directory."""


@dataclass(frozen=True)
class Holder:
    """Who holds (or last held) a run dir's lock, and whether it is held now."""

    pid: int
    host: str
    started: str  # local time, as the holder wrote it
    command: str
    held: bool  # a process holds the lock now (False: the record of a workflow that ended)
    here: bool  # the holder ran on this host, so `held` was checked, not assumed

    def describe(self) -> str:
        who = f"pid {self.pid} on {self.host}, started {self.started}"
        if not self.here:
            return (
                f"last started by {who}: another host, so whether it still runs is not known here"
            )
        if self.held:
            return f"a workflow is running: {who} ({self.command})"
        return f"no workflow is running (the last one, {who}, has ended)"


def _lock(handle: IO[str], exclusive: bool) -> bool:
    """Take the lock without waiting; False when another process has it."""
    try:
        fcntl.flock(handle, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _read_record(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def hold(run_dir: Path) -> IO[str]:
    """Lock `run_dir` for this process; keep the returned handle open while the workflow runs.
    Raises RunDirBusy, naming the holder, when another workflow has it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    handle = open(path, "a+")  # noqa: SIM115  (held open for the process's life)
    if not _lock(handle, exclusive=True):
        handle.close()
        record = _read_record(path)
        raise RunDirBusy(
            f"{run_dir} is in use by another workflow (pid {record.get('pid', '?')} on "
            f"{record.get('host', '?')}, started {record.get('started', '?')}): wait for it to "
            "end, or stop it (kill its pid), then --resume"
        )
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
    }
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps(record) + "\n")
    handle.flush()
    return handle


def holder(run_dir: Path) -> Holder | None:
    """Who holds the run dir's lock now, or held it last; None when no workflow ever ran there."""
    path = run_dir / LOCK_NAME
    record = _read_record(path)
    if not record:
        return None
    here = record.get("host") == socket.gethostname()
    held = True
    if here:
        with open(path) as handle:
            free = _lock(handle, exclusive=False)
            if free:
                with contextlib.suppress(OSError):
                    fcntl.flock(handle, fcntl.LOCK_UN)
            held = not free
    return Holder(
        pid=int(record.get("pid", 0)),
        host=str(record.get("host", "?")),
        started=str(record.get("started", "?")),
        command=str(record.get("command", "")),
        held=held,
        here=here,
    )
