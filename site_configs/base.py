"""Kept for site modules written against it: every name `site_configs.base` held before it was
split by what each part does, re-exported from where it now lives, so `from site_configs.base
import SiteSpec` (or `base.build_config(...)`) in a user's own site module still works. New code
imports from the modules themselves:

    spec          SiteSpec, its derived values, for_run, check_scheduler
    checks        the checks a SiteSpec passes when built
    queues        QueueLimit, walltimes, describe_queues, the check that jobs fit their queue
    launch        MPILaunch, the MPI launch line of the training app, expanded_launch_line
    pools         the executor labels, interchange command, heartbeats, worker_init
    parsl_config  build_config, only_executors, retry_cost
    teardown      shutdown, stop_failed_start, child_pids
    dry_run       describe (for --dry-run)
"""

from __future__ import annotations

from site_configs.checks import PARSL_LOG_LEVELS
from site_configs.dry_run import CPU_LAUNCHER_FOR, PROVIDER_FOR, describe
from site_configs.launch import (
    LAUNCHER_OPTION_FIELDS,
    LAUNCHERS_FOR,
    MPI_PREFIX,
    MPILaunch,
    expanded_launch_line,
)
from site_configs.parsl_config import (
    _record_submissions,  # noqa: F401  (tests/run/test_watchdog.py records a job with it)
    build_config,
    monitoring_db,
    only_executors,
    retry_cost,
    runinfo_dir,
)
from site_configs.pools import (
    CPU_LABEL,
    CPU_WORKER_ENV,
    HEARTBEATS,
    INTERCHANGE_CMD,
    MPI_LABEL,
    cpu_worker_init,
    venv_path,
    worker_init,
)
from site_configs.queues import QueueLimit, describe_queues, walltime_seconds
from site_configs.spec import (
    PLACEHOLDER_PREFIX,
    MpiLauncher,
    Scheduler,
    SiteSpec,
    check_scheduler,
    for_run,
)
from site_configs.teardown import (
    CLEANUP_AFTER_INTERCHANGE_S,
    child_pids,
    shutdown,
    stop_failed_start,
)

__all__ = [
    "CLEANUP_AFTER_INTERCHANGE_S",
    "CPU_LABEL",
    "CPU_LAUNCHER_FOR",
    "CPU_WORKER_ENV",
    "HEARTBEATS",
    "INTERCHANGE_CMD",
    "LAUNCHERS_FOR",
    "LAUNCHER_OPTION_FIELDS",
    "MPILaunch",
    "MPI_LABEL",
    "MPI_PREFIX",
    "MpiLauncher",
    "PARSL_LOG_LEVELS",
    "PLACEHOLDER_PREFIX",
    "PROVIDER_FOR",
    "QueueLimit",
    "Scheduler",
    "SiteSpec",
    "build_config",
    "check_scheduler",
    "child_pids",
    "cpu_worker_init",
    "describe",
    "describe_queues",
    "expanded_launch_line",
    "for_run",
    "monitoring_db",
    "only_executors",
    "retry_cost",
    "runinfo_dir",
    "shutdown",
    "stop_failed_start",
    "venv_path",
    "walltime_seconds",
    "worker_init",
]
