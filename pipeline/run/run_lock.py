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

The lock is handed down: `hand_down` puts the holder (`pipeline.core.owner.Owner`) into the
workflow's environment, so every process of the run knows whose it is; tasks and ranks stop when
their workflow is gone or the run dir has passed to another (`owner.leash`). A new holder ends
what an earlier workflow left running on this host (`run_processes`), and waits for the tasks of
one on other hosts to let go of the run's tasks lock, before it plans anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

import psutil

from pipeline.core.errors import RunDirBusy
from pipeline.core.owner import (
    OWNER_ENV,
    Owner,
    is_running,
    process_start,
    read_record,
    working_processes,
)
from pipeline.run.run_layout import RunPaths
from pipeline.run.watchdog import terminate_then_kill

LOCK_NAME = "workflow.lock"
TASKS_LOCK_NAME = "tasks.lock"  # in runinfo/: held shared by the tasks and ranks of the holder
GRACE = 3.0  # seconds between SIGTERM and SIGKILL of what an earlier workflow left running
# How long a new holder waits for the tasks of an earlier workflow on other hosts to stop: they
# look at the lock record every owner.PERIOD seconds.
TASKS_WAIT = 30.0


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


def owner_of(run_dir: Path, record: dict) -> Owner:
    """The `Owner` a lock record names."""
    return Owner(
        pid=int(record.get("pid", 0)),
        created=float(record.get("created", 0)),
        host=str(record.get("host", "?")),
        lock=str(run_dir / LOCK_NAME),
        tasks_lock=str(RunPaths(run_dir).runinfo / TASKS_LOCK_NAME),
    )


def hold(run_dir: Path) -> IO[str]:
    """Lock `run_dir` for this process; keep the returned handle open while the workflow runs.
    Raises RunDirBusy, naming the holder, when another workflow has it, or when the tasks of an
    earlier one on another host do not let go of it."""
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    handle = open(path, "a+")  # noqa: SIM115  (held open for the process's life)
    if not _lock(handle, exclusive=True):
        handle.close()
        record = read_record(path)
        raise RunDirBusy(
            f"{run_dir} is in use by another workflow (pid {record.get('pid', '?')} on "
            f"{record.get('host', '?')}, started {record.get('started', '?')}): wait for it to "
            "end, or stop it (kill its pid), then --resume"
        )
    record = {
        "pid": os.getpid(),
        "created": process_start(os.getpid()),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
    }
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps(record) + "\n")
    handle.flush()
    # From here the record names this process: what an earlier workflow left stops by itself.
    _end_leftovers(run_dir, owner_of(run_dir, record))
    _wait_for_tasks(owner_of(run_dir, record))
    return handle


def hand_down(run_dir: Path) -> Owner:
    """Put this process, the run dir's holder, into its environment: every process it starts
    from now on (Parsl's, the tasks, the ranks) works for it, and knows it."""
    run_dir = run_dir.resolve()
    owner = owner_of(run_dir, read_record(run_dir / LOCK_NAME))
    if owner.pid != os.getpid():
        raise RunDirBusy(f"{run_dir}: this process does not hold it ({owner.describe()} does)")
    os.environ[OWNER_ENV] = owner.to_env()
    return owner


def run_processes(run_dir: Path) -> list[tuple[psutil.Process, Owner]]:
    """The processes on this host working for a workflow of `run_dir` (their environment names
    it: `hand_down`), with that workflow. Only this user's processes can be read."""
    lock = str(run_dir.resolve() / LOCK_NAME)
    return [(process, owner) for process, owner in working_processes() if owner.lock == lock]


def describe_processes(found: list[tuple[psutil.Process, Owner]]) -> str:
    """'9 processes (2 HTEX interchange, 2 process_worker_pool, ...)'."""
    kinds: dict[str, int] = {}
    for process, _ in found:
        kinds[_kind(process)] = kinds.get(_kind(process), 0) + 1
    listed = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items(), key=lambda k: -k[1]))
    return f"{len(found)} process{'es' if len(found) != 1 else ''} ({listed})"


def _kind(process: psutil.Process) -> str:
    """A short name for a process of a run: Parsl's title ("HTEX interchange"), the module or
    script Python runs ("train", "ffn-worker-pool"), or the program ("mpiexec", "bash")."""
    try:
        words = process.cmdline()
    except psutil.Error:
        return "?"
    if not words:
        return "?"
    if words[0].startswith("parsl: "):  # Parsl's processes set their title
        return words[0].removeprefix("parsl: ")
    program = Path(words[0]).name
    if not program.startswith("python"):
        return program
    arguments = [w for w in words[1:] if not w.startswith("-") or w in ("-m", "-c")]
    if arguments[:1] == ["-m"] and len(arguments) > 1:
        return arguments[1].rsplit(".", 1)[-1]
    if arguments[:1] == ["-c"]:
        return "python worker"  # multiprocessing's children: Parsl's workers
    return Path(arguments[0]).name if arguments else program


def _end_leftovers(run_dir: Path, owner: Owner) -> None:
    """End the processes earlier workflows of `run_dir` left running on this host (their
    workflow and its watchdog killed): they would go on writing into the run."""
    left = [(p, o) for p, o in run_processes(run_dir) if not owner.named_by(asdict(o))]
    if not left:
        return
    gone = sorted({o.describe() for _, o in left if not is_running(o.pid, o.created)})
    print(
        f"ending {describe_processes(left)} left running by {', '.join(gone) or 'a workflow'}",
        file=sys.stderr,
        flush=True,
    )
    psutil.wait_procs(terminate_then_kill([p for p, _ in left], GRACE), timeout=GRACE)


def _wait_for_tasks(owner: Owner, timeout: float = TASKS_WAIT) -> None:
    """Wait until no task of an earlier workflow holds the run's tasks lock (on another host it
    stops once it reads the new record), or refuse the run dir."""
    path = Path(owner.tasks_lock)
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    with open(path, "a+") as handle:
        while not _lock(handle, exclusive=True):
            if time.monotonic() > deadline:
                raise RunDirBusy(
                    f"tasks of an earlier workflow still work on {owner.lock.rsplit('/', 1)[0]} "
                    f"({path} is held) {timeout:.0f} s after this workflow took it: find them "
                    f"(`fuser {path}` on each node) and stop them, then --resume"
                )
            time.sleep(0.5)
        fcntl.flock(handle, fcntl.LOCK_UN)


def holder(run_dir: Path) -> Holder | None:
    """Who holds the run dir's lock now, or held it last; None when no workflow ever ran there."""
    path = run_dir / LOCK_NAME
    record = read_record(path)
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
