"""Running the planned steps through Parsl: its start with SIGINT and SIGHUP held, the submission,
a line per task's start and end and per block's progress, and an orderly stop on SIGINT, SIGTERM or
SIGHUP (a dropped login session), exit 128 + the signal's number."""

from __future__ import annotations

import concurrent.futures
import contextlib
import signal
import sys
import time
from collections.abc import Iterator
from multiprocessing import resource_tracker
from pathlib import Path
from typing import TYPE_CHECKING

from apps.plan.describe import _progress_of, describe_progress, progress_seen_before
from apps.plan.step import Step, build_dag, executor_labels
from pipeline.run.run_layout import RunPaths
from site_configs.teardown import tell

if TYPE_CHECKING:
    from site_configs.spec import SiteSpec


def _watch(futures: dict[str, object], paths: RunPaths, progress_files: dict[str, Path]) -> None:
    """Print each task's start and end, training progress and each running block's progress
    (every minute), until every task is done."""
    reported: dict[str, str] = {}
    progress_seen = progress_seen_before(progress_files.values())
    # The log is appended to by every run: show only lines this run adds.
    last_train_line, started = _last_train_line(paths.train_log), time.monotonic()
    while True:
        for name, future in futures.items():
            state = future.task_record["status"].name
            if reported.get(name) == state:
                continue
            reported[name] = state
            elapsed = f"{time.monotonic() - started:6.0f} s"
            if state in ("launched", "running"):
                _say(f"{elapsed} {name} started")
            elif state == "exec_done":
                note = " (found up to date)" if future.result() == "up to date" else ""
                _say(f"{elapsed} {name} finished{note}")
            elif state in ("failed", "dep_fail"):
                _say(f"{elapsed} {name} {state.replace('_', ' ')}")
        training = reported.get("train") in ("launched", "running")
        line = _last_train_line(paths.train_log) if training else ""
        if line and line != last_train_line:
            _say(f"         {line}")
            last_train_line = line
        for name, path in progress_files.items():
            if name in futures and reported.get(name) in ("launched", "running"):
                if record := _progress_of(path, progress_seen):
                    _say(f"         {describe_progress(name, record)}")
        pending = [f for f in futures.values() if not f.done()]
        if not pending:
            return
        # A second between reports, cut short when the last task ends.
        concurrent.futures.wait(pending, timeout=1)


def _say(text: str) -> None:
    tell(f"[workflow {time.strftime('%H:%M:%S')}] {text}", sys.stdout)


def _last_train_line(log: Path) -> str:
    if not log.is_file():
        return ""
    lines = [
        line for line in log.read_text(errors="replace").splitlines() if line.startswith("[train]")
    ]
    return lines[-1] if lines else ""


# The signals that stop the workflow in order: Ctrl-C; `kill`, `timeout` or a batch system; a
# dropped login session (the shell, hung up, sends SIGHUP to each of its jobs' process groups).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Those a terminal sends to the whole process group: held back from the processes Parsl starts.
TERMINAL_SIGNALS = {signal.SIGINT, signal.SIGHUP}


class Stopped(Exception):
    """SIGINT, SIGTERM or SIGHUP reached the workflow: its workers are stopped and it exits."""


def _stop(signum: int, frame) -> None:
    for sig in STOP_SIGNALS:  # a second signal must not cut the shutdown short
        if signal.getsignal(sig) is _stop:
            signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signal.Signals(signum).name)


def _handle_stop_signals() -> dict[signal.Signals, object]:
    """`_stop` for each of STOP_SIGNALS, except SIGHUP where this process was started ignoring
    it (`nohup`: it goes on as asked); the handlers before. SIGINT and SIGTERM always stop it in
    order, also where a parent left them ignored (a script's background job, a test runner's
    worker): a stop asked for must not be taken for none."""
    return {
        sig: signal.signal(sig, _stop)
        for sig in STOP_SIGNALS
        if sig != signal.SIGHUP or signal.getsignal(sig) is not signal.SIG_IGN
    }


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """Hold SIGINT and SIGHUP back from the processes and threads Parsl starts meanwhile: they
    inherit the mask. A terminal's Ctrl-C reaches the whole foreground process group, and a
    dropped login session's SIGHUP each job's; Parsl's interchange and monitoring processes died
    of them (its cleanup then waited forever on the dead interchange, its monitoring database
    lost the run's end). Held, they reach this process alone (after the start, not lost), which
    stops them in order."""
    # multiprocessing unblocks SIGINT when it starts its resource tracker: started first here,
    # with SIGHUP held (the tracker must outlive the stop: this process unregisters at its exit).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, TERMINAL_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, TERMINAL_SIGNALS)


def execute(
    steps: list[Step], reasons: dict[str, str | None], site, spec: SiteSpec, paths: RunPaths
) -> int:
    """Run the planned tasks through Parsl; on SIGINT/SIGTERM/SIGHUP stop every worker of the run."""
    import parsl

    from pipeline.run.watchdog import start as start_watchdog
    from site_configs.parsl_config import only_executors
    from site_configs.teardown import child_pids, shutdown, stop_failed_start

    previous = _handle_stop_signals()
    dfk, ours = None, child_pids()  # processes this one had before Parsl: not Parsl's to stop
    try:
        try:
            config = site.make_config(paths.root, spec)
            start_watchdog(
                paths.root
            )  # ends the run if this process is killed (pipeline.run.watchdog)
            with _sigint_held():
                dfk = parsl.load(only_executors(config, executor_labels(steps, reasons)))
        except Exception:
            # A Ctrl-C held back during Parsl's start arrives once `dfk` is set: `shutdown` below.
            if dfk is None:
                stop_failed_start(ours)
            raise
        from pipeline.inference.blocks import block_progress_path

        futures = build_dag(steps, reasons)
        progress = {
            s.task.name: block_progress_path(s.task.outputs[0])
            for s in steps
            if s.task.stage == "infer"
        }
        _watch(futures, paths, progress)
    except Stopped as stop:
        _say(f"stopped by {stop}: workers shut down; go on later with --resume")
        return 128 + getattr(signal, str(stop)).value
    finally:
        for sig in previous:  # a second signal must not cut the shutdown short
            signal.signal(sig, signal.SIG_IGN)
        if dfk is not None:
            shutdown(dfk, ours)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    failed = {
        n: f.exception() for n, f in futures.items() if f.task_record["status"].name == "failed"
    }
    for name, exc in failed.items():
        tell(f"[workflow] {name} failed: {exc}", sys.stderr)
    if failed:
        tell(f"[workflow] Parsl's logs: {paths.runinfo}", sys.stderr)
        return 1
    return 0
