"""The Parsl `Config` of every site: `build_config`, the one place the run dir, retries
(`retry_cost`), monitoring, Parsl's logging (`RunDirLogging`) and the code the workers import are
set; each block a provider submits recorded for the run's watchdog; and `only_executors`, a Config
cut down to the pools a run uses.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Callable, Collection
from pathlib import Path

from parsl.config import Config
from parsl.executors.base import ParslExecutor
from parsl.logconfigs.file import FileLogging

from pipeline.core.errors import ConfigError, FFNError
from pipeline.run import watchdog
from pipeline.run.code_copy import copy_code, worker_exports
from pipeline.run.run_layout import RunPaths
from site_configs.spec import SiteSpec


def monitoring_db(run_dir: str | Path) -> Path:
    return RunPaths(Path(run_dir).resolve()).monitoring_db


def runinfo_dir(run_dir: str | Path) -> Path:
    return RunPaths(Path(run_dir).resolve()).runinfo


def build_config(run_dir: str | Path, site: SiteSpec, executors: list[ParslExecutor]) -> Config:
    """The one place the run dir, retries, monitoring and the code workers import are set, for
    every site."""
    runinfo = runinfo_dir(run_dir)
    monitoring = None
    if site.monitoring:
        try:
            from parsl.monitoring import MonitoringHub
            from parsl.monitoring.db_manager import dbm_starter  # noqa: F401  (needs sqlalchemy)
        except ImportError as err:
            raise ConfigError(
                f"site {site.name!r}: monitoring needs sqlalchemy ({err}); "
                "pip install 'parsl[monitoring]' or set monitoring=False"
            ) from None
        monitoring = MonitoringHub(
            logging_endpoint=f"sqlite:///{monitoring_db(run_dir)}",  # one DB per run dir
            workflow_name=f"ffn-{site.name}",
            # Per-task sampling costs a process per task; off unless asked for.
            resource_monitoring_enabled=site.resource_monitoring_interval > 0,
            resource_monitoring_interval=site.resource_monitoring_interval,
        )
    code = copy_code(run_dir)
    for executor in executors:
        _record_submissions(run_dir, executor)
        _import_code_from(code, executor)
    # No app cache: the workflow submits only the tasks whose stamps (pipeline.core.stamps) say they
    # must run, and each task checks its stamp again on the worker.
    return Config(
        executors=executors,
        run_dir=str(runinfo),  # parsl.log and per-run folders 000/, 001/, ...
        monitoring=monitoring,
        # Blocks out for waiting tasks, all in after max_idletime without tasks. Not
        # "htex_auto_scale": with blocks=0 its scale-in also kills blocks whose workers have not
        # registered yet, i.e. a block just started for a waiting task (parsl 2026.10.26).
        strategy="simple",
        strategy_period=site.strategy_period,
        max_idletime=site.max_idletime,
        retries=site.retries,
        retry_handler=retry_cost,
        usage_tracking=0,  # no usage reports from compute allocations
        # Passed on by Parsl to the interchange, the monitoring database and the workers.
        initialize_logging=RunDirLogging(level=getattr(logging, site.parsl_log_level)),
    )


class RunDirLogging(FileLogging):
    """Parsl's FileLogging (each Parsl process logs into a file of its own under the run's
    runinfo/), except for a record the file cannot take (a full disk or quota where the run dir
    is): Python's handler prints a traceback per record on the process's stderr, which for the
    workflow, its interchanges and its monitoring database is the user's console (10,330 lines
    in one run whose disk filled). Here the record is dropped, and the workflow's own process
    says so once, in one line. Parsl passes this object, pickled, to every process it starts;
    they import it from here (the project is installed in the venv, workers import the run's
    copy of the code)."""

    def initialize_logging(self, *, log_dir: Path, log_name: str) -> Callable[[], None]:
        log_dir.mkdir(exist_ok=True, parents=True)
        # "parsl": the workflow's own log (the DataFlowKernel's); others go unsaid.
        handler = _DroppingFileHandler(log_dir / f"{log_name}.log", say=log_name == "parsl")
        handler.setLevel(self.level)
        handler.setFormatter(logging.Formatter(self.format_string, datefmt="%Y-%m-%d %H:%M:%S"))
        # As FileLogging: Parsl's records, and those of concurrent.futures, whose callbacks'
        # exceptions are logged and then dropped.
        loggers = [logging.getLogger("parsl"), logging.getLogger("concurrent.futures")]
        for logger in loggers:
            level = logger.level
            logger.setLevel(self.level if level == logging.NOTSET else min(level, self.level))
            logger.addHandler(handler)

        def uninitialize() -> None:
            for logger in loggers:
                logger.removeHandler(handler)

        return uninitialize


class _DroppingFileHandler(logging.FileHandler):
    """A FileHandler that drops a record its file cannot take (an OSError), with one line on
    stderr the first time when `say`; any other error in a record is reported as Python does."""

    def __init__(self, filename: Path, say: bool):
        super().__init__(filename)
        self.say, self.dropped = say, False

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            super().handleError(record)
            return
        if self.say and not self.dropped:
            reason = error.strerror or str(error)
            print(
                f"[workflow] Parsl's log {self.baseFilename} cannot be written ({reason}): "
                "Parsl's log records are dropped while it cannot",
                file=sys.stderr,
                flush=True,
            )
        self.dropped = True


def _import_code_from(code: Path, executor: ParslExecutor) -> None:
    """Every block of `executor` imports the run's copy of the code (pipeline.run.code_copy), not
    the checkout as it is when the block starts: its provider's script runs these lines last."""
    provider = getattr(executor, "provider", None)
    if provider is None:  # a thread pool: its tasks run in the workflow process
        return
    provider.worker_init = "\n".join(filter(None, [provider.worker_init, *worker_exports(code)]))


# How a batch job of each provider is cancelled, for the watchdog (as the provider's cancel does).
_CANCEL_COMMAND = {
    "PBSProProvider": ["qdel"],
    "TorqueProvider": ["qdel"],
    "CobaltProvider": ["qdel"],
    "SlurmProvider": ["scancel"],
}


def _job_entry(provider, job_id: str) -> dict:
    """What the watchdog needs to end one block: a local block's process, a batch job's cancel."""
    name = type(provider).__name__
    if name == "LocalProvider":
        return watchdog.local_block(int(job_id))
    command = _CANCEL_COMMAND.get(name)
    if command is None:
        return {"kind": "batch", "provider": name, "job": job_id, "cancel": None}
    if name == "SlurmProvider" and getattr(provider, "clusters", None):
        command = [*command, f"--clusters={provider.clusters}"]
    return {"kind": "batch", "provider": name, "job": job_id, "cancel": [*command, job_id]}


def _record_submissions(run_dir: str | Path, executor: ParslExecutor) -> None:
    """Every block `executor`'s provider submits is appended to the run's runinfo/jobs.jsonl the
    moment it is submitted: the watchdog ends it if the workflow dies without its shutdown."""
    provider = getattr(executor, "provider", None)
    if provider is None or getattr(provider, "_ffn_records_jobs", False):
        return
    submit = provider.submit

    def submit_and_record(*args, **kwargs):
        job_id = submit(*args, **kwargs)
        if job_id is not None:
            try:
                watchdog.record_job(run_dir, _job_entry(provider, str(job_id)))
            except (OSError, ValueError) as exc:
                print(f"[workflow] could not record block {job_id}: {exc}", file=sys.stderr)
        return job_id

    provider.submit = submit_and_record
    provider._ffn_records_jobs = True


def only_executors(config: Config, labels: Collection[str]) -> Config:
    """`config` with only the executors labelled `labels` (those the run's tasks use): a run
    that does not train (inference with a given model, a resume after training) starts no "mpi"
    pool's interchange, which took 1.5 s of `parsl.load` and polls while it idles."""
    kept = [e for e in config.executors if e.label in labels]
    if not kept:
        raise ConfigError(f"no executor labelled {sorted(labels)} in the site's config")
    # Every setting Config takes is an attribute of the same name (Parsl's own repr relies on it).
    settings = {name: getattr(config, name) for name in inspect.signature(Config).parameters}
    return Config(**{**settings, "executors": kept})


def retry_cost(exception: Exception, task_record: dict) -> float:
    """Parsl's retry budget spent by a failure: all of it for a pipeline error that would
    happen again (FFNError, or StageFailed with retryable False), one try for anything else."""
    if isinstance(exception, FFNError) and not getattr(exception, "retryable", False):
        return float("inf")
    return 1.0
