"""Which workflow a process works for, and whether that workflow still owns the run dir.

A workflow that takes a run dir (`pipeline.run.run_lock.hold`) puts an `Owner` into its
environment (`OWNER_ENV`), so every process it starts inherits it: Parsl's interchanges, its
monitoring processes, the worker pools (batch jobs get it through `worker_init`), the tasks and
the training ranks. Such a process is *lost* when the run dir's lock record names another
workflow (the lock has passed: a new workflow took the run), or, on the workflow's own host, when
that workflow process is gone. `leash()` is how a task or rank works on the run dir: it refuses to
start when lost, holds the run's tasks lock shared while it works (a new workflow waits for it
before planning anything), and stops its process within `PERIOD` s of being lost, so two
workflows never write into one run dir, even with the watchdog killed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

import psutil

from pipeline.core.errors import RunDirTaken

OWNER_ENV = "FFN_RUN_OWNER"
PERIOD = 5.0  # seconds between two looks at the owner: one small read per look
EXIT_LOST = 75  # the exit status of a process stopped by its leash (EX_TEMPFAIL)
_SAME_START = 0.05  # seconds: two start times closer than this are one process's


@dataclass(frozen=True)
class Owner:
    """The workflow process that holds a run dir: who, and where its records are."""

    pid: int
    created: float  # its start time (psutil's clock): a reused pid is not the owner
    host: str
    lock: str  # the run dir's lock file; its record names the holder now
    tasks_lock: str  # held shared by every task and rank working for the holder

    def to_env(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Owner | None:
        """The owner in the environment, or None (a process started outside a workflow)."""
        text = (os.environ if environ is None else environ).get(OWNER_ENV)
        if not text:
            return None
        try:
            return cls(**json.loads(text))
        except (ValueError, TypeError):
            return None

    def named_by(self, record: dict) -> bool:
        """Whether a lock record is this owner's."""
        return (
            record.get("pid") == self.pid
            and record.get("host") == self.host
            and abs(float(record.get("created", 0)) - self.created) < _SAME_START
        )

    def describe(self) -> str:
        return f"workflow pid {self.pid} on {self.host}"


def process_start(pid: int) -> float:
    return psutil.Process(pid).create_time()


def same_process(pid: int, created: float | None) -> psutil.Process | None:
    """The process `pid` if it is the one started at `created` (None: any) and not a zombie."""
    try:
        process = psutil.Process(pid)
        if created is not None and abs(process.create_time() - created) > _SAME_START:
            return None
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process
    except psutil.Error:
        return None


def is_running(pid: int, created: float) -> bool:
    """Whether process `pid` is alive and is the one started at `created`."""
    return same_process(pid, created) is not None


def working_processes() -> Iterator[tuple[psutil.Process, Owner]]:
    """The processes on this host (this user's: others' environments cannot be read), but this
    one, whose environment names the workflow they work for, with it."""
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            owner = Owner.from_env(process.environ())
            if owner is not None and process.pid != os.getpid():
                yield process, owner


def read_record(path: str | Path) -> dict:
    """A lock file's record ({} when it is missing or being written)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def why_lost(owner: Owner) -> str | None:
    """Why a process working for `owner` must stop, or None while the owner holds the run."""
    record = read_record(owner.lock)
    if record and not owner.named_by(record):
        return (
            f"the run dir passed from {owner.describe()} to workflow pid {record.get('pid')} on "
            f"{record.get('host')}"
        )
    if owner.host == socket.gethostname() and not is_running(owner.pid, owner.created):
        return f"{owner.describe()}, whose run this is, is gone"
    return None


def lock_shared(path: str | Path) -> IO[str] | None:
    """Hold `path` shared for as long as the handle is open; None where the file system has no
    flock (a lock then cannot be shared between hosts either, and the record decides)."""
    handle = open(path, "a+")  # noqa: SIM115  (held open while the caller works)
    try:
        fcntl.flock(handle, fcntl.LOCK_SH)
    except OSError:
        handle.close()
        return None
    return handle


def _stop_process(reason: str) -> None:
    """Stop this process and what it started: a lost process writes nothing more."""
    with contextlib.suppress(OSError, ValueError):  # stderr may be a closed pipe by now
        print(f"error: {reason}: process {os.getpid()} stops", file=sys.stderr, flush=True)
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    os._exit(EXIT_LOST)


def _watch(owner: Owner, period: float, done: threading.Event) -> None:
    while not done.wait(period):
        if reason := why_lost(owner):
            _stop_process(reason)


def watch_owner(owner: Owner | None = None, period: float = PERIOD) -> threading.Event | None:
    """Stop this process within `period` s of its owner being lost (for the whole life of a
    process: an interchange, a monitoring process). Set the returned event to stop watching.
    None without an owner in the environment."""
    owner = owner or Owner.from_env()
    if owner is None:
        return None
    done = threading.Event()
    threading.Thread(target=_watch, args=(owner, period, done), daemon=True).start()
    return done


@contextlib.contextmanager
def leash(what: str, period: float = PERIOD) -> Iterator[None]:
    """Work on the run dir for the workflow in the environment (none: no leash): refuse to start
    (RunDirTaken) when it is lost, hold the run's tasks lock shared meanwhile, and stop this
    process within `period` s when it is lost during the work. `what`: the work, for the error."""
    owner = Owner.from_env()
    if owner is None:
        yield
        return
    if reason := why_lost(owner):
        raise RunDirTaken(f"{what} does not start: {reason}")
    handle = lock_shared(owner.tasks_lock)
    done = watch_owner(owner, period)
    try:
        yield
    finally:
        done.set()
        if handle is not None:
            handle.close()
