"""The checks a `SiteSpec` passes when built (`check_site`, from `SiteSpec.__post_init__`): one
small function per kind of setting, run in order, the first broken rule raised as a ConfigError
that names the site and the setting.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from pipeline.core.errors import ConfigError
from pipeline.network.devices import GPU_ORDERS
from site_configs.affinity import worker_cpus
from site_configs.launch import LAUNCHER_OPTION_FIELDS, LAUNCHERS_FOR
from site_configs.queues import check_fit, check_queues, is_walltime

if TYPE_CHECKING:
    from site_configs.spec import SiteSpec

PARSL_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")  # SiteSpec.parsl_log_level

# Settings that are whole numbers >= 1, and those that may be 0.
_AT_LEAST_ONE = (
    "nodes_per_block",
    "ranks_per_node",
    "threads_per_rank",
    "cores_per_node",
    "hyperthreads_per_core",
    "mpi_tasks_per_block",
    "max_blocks",
    "cpu_nodes_per_block",
    "cpu_workers_per_node",
    "cpu_max_blocks",
)
_AT_LEAST_ZERO = ("gpus_per_node", "retries")


def _where(site: SiteSpec) -> str:
    return f"site {site.name!r}"


def _is_count(value: object, least: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= least


def _is_seconds(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float)


def check_name(site: SiteSpec) -> None:
    """A name that can be part of a file name and of the monitoring workflow's."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", site.name or ""):
        raise ConfigError(f"site name {site.name!r}: use letters, digits, '_', '-', '.'")


def check_launcher(site: SiteSpec) -> None:
    """A known scheduler, and an MPI launcher that works with it."""
    if site.scheduler not in LAUNCHERS_FOR:
        raise ConfigError(
            f"{_where(site)}: scheduler {site.scheduler!r} is not one of {sorted(LAUNCHERS_FOR)}"
        )
    if site.mpi_launcher not in LAUNCHERS_FOR[site.scheduler]:
        raise ConfigError(
            f"{_where(site)}: mpi_launcher {site.mpi_launcher!r} does not work with scheduler "
            f"{site.scheduler!r}; use one of {list(LAUNCHERS_FOR[site.scheduler])}"
        )


def check_counts(site: SiteSpec) -> None:
    """Node, rank, thread, worker and block counts are whole numbers; at most 4 hyperthreads."""
    for least, names in ((1, _AT_LEAST_ONE), (0, _AT_LEAST_ZERO)):
        for name in names:
            value = getattr(site, name)
            if not _is_count(value, least):
                raise ConfigError(
                    f"{_where(site)}: {name} must be a whole number >= {least}, got {value!r}"
                )
    if site.hyperthreads_per_core > 4:
        raise ConfigError(f"{_where(site)}: hyperthreads_per_core {site.hyperthreads_per_core} > 4")


def check_nodes(site: SiteSpec) -> None:
    """Each pool's ranks, threads and workers fit the hardware threads of a node; each multi-rank
    task has a node of its own; the local scheduler has one node."""
    where = _where(site)
    if site.ranks_per_node > site.cpus_per_node:
        raise ConfigError(
            f"{where}: ranks_per_node {site.ranks_per_node} > {site.cpus_per_node} hardware "
            "threads per node (cores_per_node x hyperthreads_per_core)"
        )
    if site.threads_per_rank > site.cpus_per_rank:
        raise ConfigError(
            f"{where}: threads_per_rank {site.threads_per_rank} > {site.cpus_per_rank} "
            f"hardware threads each of {site.ranks_per_node} ranks gets on a "
            f"{site.cores_per_node}-core node (x{site.hyperthreads_per_core})"
        )
    if site.cpu_workers_per_node > site.cpus_per_node:
        raise ConfigError(
            f"{where}: cpu_workers_per_node {site.cpu_workers_per_node} > "
            f"{site.cpus_per_node} hardware threads per node"
        )
    if site.mpi_tasks_per_block > site.nodes_per_block:
        raise ConfigError(
            f"{where}: mpi_tasks_per_block {site.mpi_tasks_per_block} > nodes_per_block "
            f"{site.nodes_per_block}: each multi-rank task needs at least one node of its own"
        )
    if site.scheduler == "local" and (site.nodes_per_block, site.cpu_nodes_per_block) != (1, 1):
        raise ConfigError(f"{where}: the local scheduler has one node; set nodes_per_block=1")


def check_cpu_affinity(site: SiteSpec) -> None:
    """`cpu_affinity` is one Parsl takes, with a list of CPUs for each worker of a node."""
    try:
        worker_cpus(site.cpu_affinity, site.cpu_workers_per_node)
    except ConfigError as err:
        raise ConfigError(f"{_where(site)}: {err}") from None


def check_walltimes(site: SiteSpec) -> None:
    """Both pools' walltimes are HH:MM:SS (the cpu pool's may be None: the training's)."""
    for name in ("walltime", "cpu_walltime"):
        value = getattr(site, name)
        if value is not None and not is_walltime(value):
            raise ConfigError(f"{_where(site)}: {name} {value!r} is not HH:MM:SS")


def check_gpu_order(site: SiteSpec) -> None:
    if site.gpu_order not in GPU_ORDERS:
        raise ConfigError(
            f"{_where(site)}: gpu_order {site.gpu_order!r} is not one of {', '.join(GPU_ORDERS)}"
        )


def check_workflow_settings(site: SiteSpec) -> None:
    """The checkpoint cap, idle time, resource sampling, Parsl's log level and scaling period."""
    where = _where(site)
    interval = site.checkpoint_every_seconds
    if interval is not None and (not _is_seconds(interval) or not 0 < interval < float("inf")):
        raise ConfigError(f"{where}: checkpoint_every_seconds must be > 0 seconds or None")
    if site.max_idletime < 0 or site.resource_monitoring_interval < 0:
        raise ConfigError(f"{where}: max_idletime and resource_monitoring_interval must be >= 0")
    if site.parsl_log_level not in PARSL_LOG_LEVELS:
        raise ConfigError(
            f"{where}: parsl_log_level {site.parsl_log_level!r} is not one of "
            f"{', '.join(PARSL_LOG_LEVELS)}"
        )
    period = site.strategy_period
    if not _is_seconds(period) or not 0 < period <= 600:
        raise ConfigError(f"{where}: strategy_period must be in (0, 600] s")


def check_names_given(site: SiteSpec) -> None:
    """Queues, account, QOS, constraint and venv: a name, or None for the scheduler's default (the
    running venv)."""
    for name in ("queue", "cpu_queue", "account", "qos", "constraint", "venv"):
        value = getattr(site, name)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ConfigError(f"{_where(site)}: {name} must be a non-empty string or None")


# What a scheduler takes as an account, a queue (PBS's `queue@server`) or a Slurm partition. Parsl's
# providers put these into the submit command, which a shell runs (`qsub ... -A ACCOUNT`): anything
# else (`;`, `$`, spaces, quotes) could run as a command of its own.
_WORD = r"[A-Za-z0-9][A-Za-z0-9_.+@-]*"
_SCHEDULER_WORD = re.compile(_WORD)
# A Slurm constraint: node features joined by AND (&) and OR (|), as Perlmutter's `gpu&hbm80g`.
# It reaches only the job script's `#SBATCH --constraint=` line, where `&` and `|` are sbatch's.
_CONSTRAINT = re.compile(rf"{_WORD}(?:[&|]{_WORD})*")


def check_scheduler_words(site: SiteSpec) -> None:
    """Account, queues and QOS are plain scheduler words, and the constraint features joined by &
    and |, however they were given (site module, --account/--queue/--qos/--constraint,
    $FFN_ACCOUNT/$FFN_QUEUE, a run's site.json)."""
    for name in ("account", "queue", "cpu_queue", "qos"):
        value = getattr(site, name)
        if isinstance(value, str) and not _SCHEDULER_WORD.fullmatch(value):
            raise ConfigError(
                f"{_where(site)}: {name} {value!r} is not a scheduler name (letters, digits and "
                "_ . + @ -): it would reach the submit command's shell"
            )
    value = site.constraint
    if isinstance(value, str) and not _CONSTRAINT.fullmatch(value):
        raise ConfigError(
            f"{_where(site)}: constraint {value!r} is not a scheduler name (node features of "
            "letters, digits and _ . + @ -, joined by & or |): it would reach the job script"
        )


def check_slurm_only(site: SiteSpec) -> None:
    """A QOS and a constraint are Slurm's (sbatch --qos, --constraint): another scheduler's site
    refuses them rather than submit without them."""
    if site.scheduler == "slurm":
        return
    for name in ("qos", "constraint"):
        if (value := getattr(site, name)) is not None:
            raise ConfigError(
                f"{_where(site)}: {name} {value!r} is Slurm's (sbatch --{name}) and this site's "
                f"scheduler is {site.scheduler}: leave out --{name}, and choose the jobs' queue "
                "with --queue"
            )


def check_qos(site: SiteSpec) -> None:
    """Each pool's jobs (nodes, walltime) fit the limits the site lists for their QOS, as
    check_queues does for their queue: a QOS the site does not list is not checked."""
    known = site.limits_of(site.qos)
    if not known:
        return
    # Where the site's table names QOSes, a queue (a Slurm partition) of the same name is one
    # given with the wrong option: sbatch would be sent it as --partition.
    for name in ("queue", "cpu_queue"):
        if (value := getattr(site, name)) is not None and site.limits_of(value):
            qoses = ", ".join(dict.fromkeys(limit.name for limit in site.queue_limits))
            raise ConfigError(
                f"{_where(site)}: {name} {value!r} is one of the site's QOSes ({qoses}), not a "
                f"Slurm partition: give it with --qos and leave out --{name.replace('_', '-')}"
            )
    jobs = (
        ("training", site.nodes_per_block, site.walltime),
        ("cpu", site.cpu_nodes_per_block, site.cpu_job_walltime),
    )
    for pool, nodes, walltime in jobs:
        check_fit(site, pool, site.qos, known, nodes, walltime, kind="QOS")


def check_launcher_options(site: SiteSpec) -> None:
    """`launcher_options` uses only the fields it may (`LAUNCHER_OPTION_FIELDS`)."""
    try:
        site.format_launcher_options()
    except (KeyError, IndexError, ValueError, AttributeError) as err:
        raise ConfigError(
            f"{_where(site)}: launcher_options {site.launcher_options!r} uses an unknown field "
            f"{err}; known: {', '.join('{' + f + '}' for f in LAUNCHER_OPTION_FIELDS)}"
        ) from None


# In the order they run: a later check may rely on an earlier one (the node checks on counts).
CHECKS = (
    check_name,
    check_launcher,
    check_counts,
    check_nodes,
    check_cpu_affinity,
    check_walltimes,
    check_gpu_order,
    check_workflow_settings,
    check_names_given,
    check_scheduler_words,
    check_slurm_only,
    check_launcher_options,
    check_queues,  # each pool's jobs fit their queue (site_configs.queues)
    check_qos,  # ... and their QOS, where the site lists its QOSes' limits
)


def check_site(site: SiteSpec) -> None:
    """Every check of `CHECKS`, in order: the first broken rule raises its ConfigError."""
    for check in CHECKS:
        check(site)
