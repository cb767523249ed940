"""Stopping a run's processes: `shutdown` (the end of every run, or a Ctrl-C: the blocks
cancelled, Parsl cleaned up within a bound, what outlives it killed, the watchdog told to exit),
`stop_failed_start` (after `parsl.load` raised), and `child_pids`, the processes both spare;
`tell`, a print that a terminal gone (a dropped login session) does not stop.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

import psutil

from pipeline.run import watchdog


def tell(text: str, stream=None) -> None:
    """Print `text` to `stream` (default stdout), unless its terminal is gone: a hung-up terminal
    (a dropped login session) fails every write with EIO, a closed pipe with EPIPE. Such a stream
    writes to /dev/null from then on, so the stop that follows goes on, and Python's flush of its
    streams at exit does not turn the workflow's exit status into 120."""
    stream = stream or sys.stdout
    try:
        print(text, file=stream, flush=True)
    except OSError:
        with contextlib.suppress(OSError, ValueError):  # no file descriptor: nothing to redirect
            fd = stream.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)
            stream.flush()  # what the failed write left in the buffer


def _is_resource_tracker(process: psutil.Process, parent: int) -> bool:
    try:
        return process.ppid() == parent and "resource_tracker" in " ".join(process.cmdline())
    except psutil.Error:
        return False


def child_pids() -> frozenset[int]:
    """This process's children now: what `shutdown` and `stop_failed_start` must spare when
    taken before `parsl.load` (a program may run the workflow beside processes of its own)."""
    return frozenset(p.pid for p in psutil.Process().children(recursive=True))


def shutdown(dfk, spare: frozenset[int] = frozenset()) -> None:
    """Stop the run's workers, then Parsl. `dfk.cleanup()` alone stops the interchange but lets
    worker pools finish their tasks (on this machine, minutes of full CPU after a Ctrl-C), so the
    blocks are cancelled first (LocalProvider kills the block's process group; a batch provider
    deletes the job), and any process this one started that outlives the cleanup is killed,
    except those in `spare` (`child_pids()` before `parsl.load`). Last, the run's watchdog
    (`pipeline.run.watchdog`) exits, killing nothing."""
    started = _started_processes(spare)
    for executor in dfk.executors.values():
        _record_block_states(executor)
        jobs = list(getattr(executor, "blocks_to_job_id", {}).values())
        provider = getattr(executor, "provider", None)
        if provider is not None and jobs:
            try:
                provider.cancel(jobs)
            except Exception as exc:  # noqa: BLE001  (the cleanup below must still run)
                tell(f"[workflow] could not cancel {executor.label} blocks: {exc}", sys.stderr)
    _parsl_cleanup(dfk)
    _stop(started)
    watchdog.stop_all()


def _record_block_states(executor) -> None:
    """Put the blocks' states as the scheduler gives them now into monitoring.db, before they are
    cancelled. Parsl polls a batch provider once a minute (PBS Pro's, Slurm's, Cobalt's: 60 s),
    so a block that ran for less was recorded PENDING only, and the run's node-hours
    (pipeline.run.run_cost, charged from RUNNING) left it out. The provider is asked, not the
    executor, whose status() asks the interchange too and waits forever for one that is gone."""
    provider = getattr(executor, "provider", None)
    blocks = dict(getattr(executor, "blocks_to_job_id", {}))
    if provider is None or not blocks:
        return
    try:
        now = dict(zip(blocks, provider.status(list(blocks.values())), strict=True))
        before = executor.status_facade
        changed = {b: s for b, s in now.items() if b not in before or before[b].state != s.state}
        if changed:
            executor.send_monitoring_info(changed)
    except Exception:  # noqa: BLE001  (a record missed must not keep the blocks from their cancel)
        return


# How long Parsl's cleanup may go on once an interchange has ended: a healthy one stops the
# interchanges itself and ends its last steps (pipes, monitoring) within seconds.
CLEANUP_AFTER_INTERCHANGE_S = 20.0


def _parsl_cleanup(dfk) -> None:
    """`dfk.cleanup()`, given up if it cannot end: it asks each interchange for its workers and
    waits for the answer without a timeout, forever if the interchange died first (a SIGTERM to
    the whole process group, as `timeout` or a batch system sends, reaches the interchanges too).
    What it leaves running, `shutdown` stops all the same."""
    failures: list[BaseException] = []

    def cleanup() -> None:
        try:
            dfk.cleanup()
        except BaseException as exc:  # noqa: BLE001  (raised again in the caller's thread)
            failures.append(exc)

    thread = threading.Thread(target=cleanup, name="parsl-cleanup", daemon=True)
    thread.start()
    ended_at = None
    while thread.is_alive():
        thread.join(0.2)
        if ended_at is None and (ended := _ended_interchanges(dfk)):
            ended_at = time.monotonic()
        if ended_at is not None and time.monotonic() - ended_at > CLEANUP_AFTER_INTERCHANGE_S:
            tell(
                f"[workflow] Parsl's cleanup had not ended {CLEANUP_AFTER_INTERCHANGE_S:.0f} s "
                f"after the interchange of {', '.join(ended)} ended: the run's processes are "
                "stopped without it",
                sys.stderr,
            )
            return
    if failures:
        raise failures[0]


def _ended_interchanges(dfk) -> list[str]:
    """Labels of the executors whose local interchange process has exited."""
    return [
        label
        for label, executor in dfk.executors.items()
        if (process := getattr(executor, "interchange_proc", None)) is not None
        and process.poll() is not None
    ]


def stop_failed_start(spare: frozenset[int] = frozenset()) -> None:
    """After `parsl.load` raised: stop what it had started (interchanges, monitoring), which
    nothing else would stop and which would keep this process from exiting; not `spare`."""
    _stop(_started_processes(spare))
    watchdog.stop_all()


def _started_processes(spare: frozenset[int]) -> list[psutil.Process]:
    me = psutil.Process()
    # Not this process's own multiprocessing helper: it must outlive the cleanup; nor the
    # watchdog, which is stopped last (it ends the run if this process dies meanwhile).
    spare = spare | {w.pid for w in watchdog.running()}
    return [
        p
        for p in me.children(recursive=True)
        if p.pid not in spare and not _is_resource_tracker(p, me.pid)
    ]


def _stop(processes: list[psutil.Process]) -> None:
    alive = [p for p in processes if p.is_running()]
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(alive, timeout=10)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
