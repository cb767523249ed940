"""A run's watchdog: when the workflow process dies without its shutdown (kill -9, a login node's
session dropped, out of memory), nothing of its run goes on computing or living.

The workflow starts it (`start(run_dir)`) before Parsl starts anything, as
`python -m pipeline.cli.watchdog --run-dir RUN ...`, in a session of its own, so a signal to the
workflow's process group or the loss of its terminal does not reach it, and its command line names
the run dir (`pgrep -af RUN` finds it). Every `PERIOD` seconds, while the workflow lives, it
records the workflow's descendants started since (pid and start time, so a reused pid is never
taken for one of them), and those of the run's local worker blocks, which Parsl's LocalProvider
detaches from the workflow: the workflow appends each block it submits to `runinfo/jobs.jsonl`
(`record_job`), a local block by its pid and process group, a batch job by the command that
cancels it (qdel/scancel).

When the workflow is gone it freezes (SIGSTOP) every recorded process still alive and their
descendants, so none starts or detaches another, cancels the run's batch jobs, then SIGTERM, and
SIGKILL for what is still there `GRACE` seconds later; what it did goes to
`runinfo/watchdog.log`. On a normal end the workflow's `stop()` (from
`site_configs.teardown.shutdown`) writes "stop" to the watchdog's stdin and it exits, killing nothing.

The watchdog may itself be killed (kill -9 of every python process, the OOM killer): the workflow
notices within `PERIOD` s and starts another (`Watchdog.keep`), which records the same processes
(those started since the first). At the end it also finds, by their environment, every process on
this host working for the workflow (`pipeline.core.owner`), wherever it was reparented.

Plain Python and psutil: no Parsl, no TensorFlow, so it starts in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from pipeline.core.owner import same_process, working_processes
from pipeline.run.run_layout import LAYOUT, RunPaths

PERIOD = 1.0  # seconds between two looks at the workflow and its processes
GRACE = 3.0  # seconds between SIGTERM and SIGKILL of the run's processes
CANCEL_TIMEOUT = 30  # seconds a qdel/scancel may take
JOBS_NAME = Path(LAYOUT["jobs"]).name  # in the run's runinfo/: the blocks the workflow submitted
LOG_NAME = Path(LAYOUT["watchdog_log"]).name  # in the run's runinfo/: what the watchdog did
STOP = b"stop\n"
_ROOT = Path(__file__).resolve().parents[2]


def jobs_path(run_dir: str | Path) -> Path:
    return RunPaths(Path(run_dir).resolve()).jobs


def _started(pid: int) -> float:
    return psutil.Process(pid).create_time()


def record_job(run_dir: str | Path, entry: dict) -> None:
    """Append one submitted block to the run's jobs file, tagged with this (the workflow's)
    process: {"kind": "local", "pid", "created", "pgid"} or {"kind": "batch", "cancel": argv}.
    One short append per block, flushed at once: a block submitted just before a kill -9 is
    there for the watchdog."""
    path = jobs_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"workflow": os.getpid(), "workflow_started": _started(os.getpid()), **entry})
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def local_block(pid: int) -> dict:
    """The jobs-file entry of a block LocalProvider started as process `pid`."""
    try:
        return {"kind": "local", "pid": pid, "created": _started(pid), "pgid": os.getpgid(pid)}
    except (psutil.Error, ProcessLookupError):
        return {"kind": "local", "pid": pid, "created": None, "pgid": None}


# -- the workflow's side --
@dataclass
class Watchdog:
    """The handle the workflow keeps of its watchdog, which it starts again if it dies."""

    process: subprocess.Popen
    run_dir: Path
    command: list[str]  # how it was started: a new one starts the same way
    _stopping: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def pid(self) -> int:
        return self.process.pid

    def keep(self) -> None:
        """Start a new watchdog whenever this one dies, until `stop` (a thread's loop)."""
        while not self._stopping.wait(PERIOD):
            with self._lock:
                if self._stopping.is_set() or (code := self.process.poll()) is None:
                    continue
                dead = self.process.pid
                self.process = _launch(self.command, self.run_dir)
            with contextlib.suppress(OSError, ValueError):  # the terminal may be gone
                print(
                    f"the run's watchdog (pid {dead}) ended ({_ended(code)}): pid "
                    f"{self.process.pid} watches the run now",
                    file=sys.stderr,
                    flush=True,
                )

    def stop(self, timeout: float = 10.0) -> None:
        """A normal end: the watchdog exits and kills nothing."""
        with self._lock:
            self._stopping.set()
        if self.process.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.process.stdin.write(STOP)
                self.process.stdin.flush()
        with contextlib.suppress(OSError, ValueError):
            self.process.stdin.close()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        with contextlib.suppress(ValueError):
            _RUNNING.remove(self)


def _ended(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit {returncode}"


_RUNNING: list[Watchdog] = []


def running() -> list[Watchdog]:
    """The watchdogs this process started and has not stopped."""
    return list(_RUNNING)


def stop_all() -> None:
    for watchdog in running():
        watchdog.stop()


def _launch(command: list[str], run_dir: Path) -> subprocess.Popen:
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))
    }
    with open(RunPaths(run_dir).watchdog_log, "ab") as log:
        return subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # not in the workflow's process group or terminal session
            cwd=str(_ROOT),
            env=env,
        )


def start(run_dir: str | Path) -> Watchdog:
    """Start the watchdog of the run in `run_dir` for this process; call before Parsl starts
    anything (it records only processes started after it)."""
    run_dir = Path(run_dir).resolve()
    RunPaths(run_dir).runinfo.mkdir(parents=True, exist_ok=True)
    me = psutil.Process()
    # The processes this one has now are not the run's (a program may run the workflow beside
    # processes of its own); only what it starts from now on is.
    spare = ",".join(str(p.pid) for p in me.children(recursive=True))
    command = [
        sys.executable,
        "-m",
        "pipeline.cli.watchdog",
        "--run-dir",
        str(run_dir),
        "--pid",
        str(me.pid),
        "--started",
        repr(me.create_time()),
        f"--spare={spare}",
    ]
    process = _launch(command, run_dir)
    # A watchdog started again records what this first one would have: what was started since
    # it (its start time, on psutil's clock as the processes' start times).
    since = psutil.Process(process.pid).create_time()
    watchdog = Watchdog(process, run_dir, [*command, "--since", repr(since)])
    threading.Thread(target=watchdog.keep, name="watchdog-keeper", daemon=True).start()
    _RUNNING.append(watchdog)
    return watchdog


# -- the watchdog's side --
def _say(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} [watchdog {os.getpid()}] {message}", flush=True)


@dataclass
class Run:
    """What the watchdog knows of the run: its processes and batch jobs."""

    run_dir: Path
    workflow: int
    workflow_started: float
    since: float  # processes started before are not the run's (the caller's own)
    spare: set[int] = field(default_factory=set)  # the workflow's processes from before
    processes: dict[int, float] = field(default_factory=dict)  # pid: start time
    groups: dict[int, tuple[int, float]] = field(default_factory=dict)  # pgid: (pid, created)
    cancels: list[list[str]] = field(default_factory=list)
    _jobs_read: int = 0  # bytes of the jobs file already read

    def alive(self) -> bool:
        return same_process(self.workflow, self.workflow_started) is not None

    def _add(self, process: psutil.Process) -> None:
        if process.pid == os.getpid() or process.pid in self.processes or process.pid in self.spare:
            return
        with contextlib.suppress(psutil.Error):
            created = process.create_time()
            if created >= self.since:
                self.processes[process.pid] = created

    def read_jobs(self) -> None:
        path = jobs_path(self.run_dir)
        try:
            with open(path, "rb") as handle:
                handle.seek(self._jobs_read)
                data = handle.read()
        except OSError:
            return
        complete = data[: data.rfind(b"\n") + 1]  # a line being written is read next time
        self._jobs_read += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("workflow") != self.workflow or (
                abs(entry.get("workflow_started", 0) - self.workflow_started) > 0.05
            ):
                continue  # an earlier workflow's block
            if entry.get("kind") == "local" and entry.get("pid"):
                created = entry.get("created")
                if created is not None:
                    self.processes.setdefault(entry["pid"], created)
                    if entry.get("pgid"):
                        self.groups[entry["pgid"]] = (entry["pid"], created)
            elif entry.get("kind") == "batch" and entry.get("cancel"):
                self.cancels.append([str(a) for a in entry["cancel"]])

    def record(self) -> None:
        """Add the processes started since the last look: the workflow's descendants and the
        descendants of every recorded process still alive (a detached local block's pool)."""
        self.read_jobs()
        roots = [self.workflow, *(p.pid for p in self.live())]
        if same_process(self.workflow, self.workflow_started) is None:
            roots.remove(self.workflow)
        for process in _descendants(roots):
            self._add(process)

    def working_for_it(self) -> list[psutil.Process]:
        """The processes on this host whose environment names the workflow as their owner
        (pipeline.core.owner): the run's, wherever they were reparented."""
        return [
            process
            for process, owner in working_processes()
            if owner.pid == self.workflow and abs(owner.created - self.workflow_started) <= 0.05
        ]

    def live(self) -> list[psutil.Process]:
        return [p for pid, t in self.processes.items() if (p := same_process(pid, t)) is not None]

    def _groups(self) -> set[int]:
        """The process groups of the run's local blocks whose leader pid is still theirs."""
        return {g for g, (pid, t) in self.groups.items() if same_process(pid, t) is not None}

    def end(self) -> None:
        """Stop every process of the run and cancel its batch jobs."""
        self.read_jobs()
        groups = self._groups()
        # Freeze first, then look again: a frozen process starts no other, and none of its
        # children can detach before it is recorded.
        frozen: dict[int, psutil.Process] = {}
        for process in self.working_for_it():
            with contextlib.suppress(psutil.Error):
                self.processes.setdefault(process.pid, process.create_time())
        for _ in range(20):
            for process in _descendants([*frozen, *(p.pid for p in self.live())]):
                self._add(process)
            for process in _group_members(groups):
                self._add(process)
            fresh = [p for p in self.live() if p.pid not in frozen]
            if not fresh:
                break
            for process in fresh:
                with contextlib.suppress(psutil.Error):
                    process.suspend()
                frozen[process.pid] = process
        for argv in self.cancels:
            try:
                done = subprocess.run(
                    argv, capture_output=True, text=True, timeout=CANCEL_TIMEOUT, check=False
                )
                _say(f"{' '.join(argv)}: exit {done.returncode} {done.stderr.strip()[:200]}")
            except (OSError, subprocess.TimeoutExpired) as exc:
                _say(f"{' '.join(argv)} failed: {exc}")
        targets = list(frozen.values())
        for process in targets:
            _say(f"stopping {process.pid}: {_command(process)}")
        alive = terminate_then_kill(targets, GRACE, frozen=True)
        for process in [*self.live(), *_group_members(groups)]:  # started since: no grace now
            with contextlib.suppress(psutil.Error):
                process.kill()
        _say(
            f"stopped {len(targets)} process(es) of the run, {len(alive)} of them with SIGKILL; "
            f"{len(self.cancels)} batch job cancel(s)"
        )


def terminate_then_kill(
    processes: list[psutil.Process], grace: float, frozen: bool = False
) -> list[psutil.Process]:
    """SIGTERM to each of `processes` (SIGCONT after it, when they were `frozen` with SIGSTOP,
    so each can act on it), SIGKILL to those still there `grace` seconds later; returns those."""
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.terminate()
        if frozen:
            with contextlib.suppress(psutil.Error):
                process.resume()
    _, alive = psutil.wait_procs(processes, timeout=grace)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    return alive


def _descendants(roots: list[int]) -> list[psutil.Process]:
    """Every live descendant of the processes `roots`, from one look at the process table."""
    children: dict[int, list[psutil.Process]] = {}
    for process in psutil.process_iter(["ppid"]):
        children.setdefault(process.info["ppid"], []).append(process)
    found, todo, seen = [], list(roots), set(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child.pid not in seen:
                seen.add(child.pid)
                found.append(child)
                todo.append(child.pid)
    return found


def _group_members(groups: set[int]) -> list[psutil.Process]:
    if not groups:
        return []
    members = []
    for process in psutil.process_iter():
        with contextlib.suppress(OSError):  # ProcessLookupError: gone meanwhile
            if os.getpgid(process.pid) in groups and process.pid != os.getpid():
                members.append(process)
    return members


def _command(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())[:200]
    except psutil.Error:
        return "?"


def watch(run: Run, stdin_fd: int = 0, period: float = PERIOD) -> int:
    """The watchdog's loop: 0 after a "stop" (the workflow ended normally), 1 after it ended
    the run of a workflow that died."""
    listening = True
    received = b""
    while True:
        if listening:
            ready, _, _ = select.select([stdin_fd], [], [], period)
            if ready:
                chunk = os.read(stdin_fd, 64)
                received += chunk
                if STOP.strip() in received:
                    return 0
                if not chunk:  # the pipe closed: the workflow is gone, or closed it
                    listening = False
        else:
            time.sleep(period)
        if not run.alive():
            _say(f"workflow pid {run.workflow} is gone: stopping the run in {run.run_dir}")
            run.end()
            return 1
        run.record()


def serve(
    run_dir: Path,
    pid: int,
    started: float,
    spare: set[int],
    period: float = PERIOD,
    since: float | None = None,
) -> int:
    """What the watchdog process does (`python -m pipeline.cli.watchdog`): watch workflow `pid`
    (started at `started`) until it stops the watchdog (0) or is gone and its run is ended (1).
    `since`: the run's processes are those started since (None: since this one started)."""
    # Signals of the workflow's terminal and group do not reach this session; a SIGTERM sent to
    # this process itself (a user's `kill`, the workflow's shutdown) ends it without a cleanup.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # What the workflow starts from now on, on psutil's clock as the processes' start times.
    first = since is None
    since = psutil.Process().create_time() if since is None else since
    run = Run(run_dir.resolve(), pid, started, since, spare=spare)
    _say(f"watching workflow pid {pid} of {run.run_dir}" + ("" if first else " (started again)"))
    return watch(run, period=period)
