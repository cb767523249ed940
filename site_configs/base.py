"""What every site shares: the `SiteSpec` settings, the MPI launch contract for the training app,
`describe()` for `--dry-run`, and the one helper that turns executors into a Parsl `Config` with the
same run dir, retry rule and monitoring database on every site, and `shutdown()` of a run's workers.

A site module (`site_configs/local.py`, ...) only says how its scheduler gets nodes: it builds two
executors from a `SiteSpec` and hands them to `build_config`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import re
import shlex
import shutil
import string
import sys
import threading
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psutil
from parsl.config import Config
from parsl.executors.base import ParslExecutor
from parsl.executors.high_throughput.mpi_prefix_composer import compose_all
from parsl.logconfigs.file import FileLogging

from pipeline.core.errors import ConfigError, FFNError
from pipeline.network.devices import GPU_ORDER_ENV, GPU_ORDERS, GpuOrder
from pipeline.run import watchdog
from pipeline.run.code_copy import copy_code, worker_exports

# The two executor labels every site provides; apps pick one with `executors=[...]`.
MPI_LABEL = "mpi"  # multi-rank tasks (Horovod training), one batch job per block
CPU_LABEL = "cpu"  # single-process tasks (staging, preprocessing, inference blocks, evaluation)

PARSL_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")  # SiteSpec.parsl_log_level

# A setting that contains this is a placeholder the user must replace before submitting.
PLACEHOLDER_PREFIX = "YOUR_"
_MAY_HOLD_PLACEHOLDERS = (
    "account",
    "queue",
    "cpu_queue",
    "venv",
    "worker_init",
    "scheduler_options",
)


def _interchange_cmd() -> str:
    """HTEX starts its interchange as `interchange.py` looked up on PATH; naming the script beside
    the running interpreter (the venv's bin/) removes that dependency on the caller's PATH. A
    string, not a list: MPIExecutor's type check accepts only a string, and Popen runs it."""
    beside = Path(sys.executable).parent / "interchange.py"
    return str(beside) if beside.is_file() else shutil.which("interchange.py") or "interchange.py"


INTERCHANGE_CMD = _interchange_cmd()

# Given to every pool's executor. A worker pool whose interchange is gone (its workflow killed:
# the watchdog, pipeline.run.watchdog, ends the interchange at once) stops its workers after
# `heartbeat_threshold` seconds without a word from it; Parsl's default, 120 s (heartbeats every
# 30 s), let a pool on a node the watchdog cannot reach compute on for 2 minutes. Heartbeats
# every 10 s, three missed: the interchange likewise gives up on a silent pool after 30 s.
HEARTBEATS = {"heartbeat_period": 10, "heartbeat_threshold": 30}

Scheduler = Literal["local", "pbspro", "cobalt", "slurm"]
MpiLauncher = Literal["mpiexec", "srun", "aprun"]

# Which MPI launchers each scheduler can use. Parsl's MPI mode (MPIExecutor) finds a block's nodes
# from PBS_NODEFILE or SLURM_NODELIST only; Cobalt sites use aprun directly (see cobalt.py).
LAUNCHERS_FOR = {
    "local": ("mpiexec",),
    "pbspro": ("mpiexec",),
    "slurm": ("srun", "mpiexec"),
    "cobalt": ("aprun",),
}
# For describe(): the provider and the launcher of the "cpu" pool each scheduler's module uses
# (tests/test_site_configs.py checks these against the built configs).
PROVIDER_FOR = {
    "local": "LocalProvider",
    "pbspro": "PBSProProvider",
    "cobalt": "CobaltProvider",
    "slurm": "SlurmProvider",
}
CPU_LAUNCHER_FOR = {
    "local": "SingleNodeLauncher",
    "pbspro": "MpiExecLauncher",
    "cobalt": "AprunLauncher",
    "slurm": "SrunLauncher",
}
# Fields that `launcher_options` may use, e.g. "--cpu-bind depth --depth={cpus_per_rank}".
LAUNCHER_OPTION_FIELDS = (
    "ranks_per_node",
    "threads_per_rank",
    "cpus_per_rank",
    "hyperthreads_per_core",
    "cores_per_node",
)
_WALLTIME = re.compile(r"^\d{1,4}:[0-5]\d:[0-5]\d$")
# What MPILaunch.prefix holds where Parsl's MPI mode composes the launcher line for the task.
MPI_PREFIX = "$PARSL_MPI_PREFIX"


def _nodes(count: int) -> str:
    return f"{count} node" if count == 1 else f"{count} nodes"


def walltime_seconds(walltime: str) -> int:
    hours, minutes, seconds = map(int, walltime.split(":"))
    return 3600 * hours + 60 * minutes + seconds


@dataclass(frozen=True)
class QueueLimit:
    """What one batch queue accepts: jobs of `min_nodes` to `max_nodes` nodes for up to
    `max_walltime`. A routing queue whose longest walltime depends on the job's size (Polaris'
    prod) has one entry per size range, all under its name."""

    name: str  # as qsub -q / sbatch --partition takes it
    min_nodes: int
    max_nodes: int
    max_walltime: str  # HH:MM:SS

    def __post_init__(self) -> None:
        where = f"queue limit {self.name!r}"
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigError(f"{where}: name must be a non-empty string")
        for value in (self.min_nodes, self.max_nodes):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{where}: node counts must be whole numbers >= 1, got {value!r}")
        if self.min_nodes > self.max_nodes:
            raise ConfigError(f"{where}: min_nodes {self.min_nodes} > max_nodes {self.max_nodes}")
        if not isinstance(self.max_walltime, str) or not _WALLTIME.match(self.max_walltime):
            raise ConfigError(f"{where}: max_walltime {self.max_walltime!r} is not HH:MM:SS")

    @property
    def size(self) -> str:
        """Its sizes as "1-2 nodes, <= 01:00:00"."""
        return f"{self.min_nodes}-{self.max_nodes} nodes, <= {self.max_walltime}"

    def allows(self, nodes: int, walltime: str) -> bool:
        return self.min_nodes <= nodes <= self.max_nodes and walltime_seconds(
            walltime
        ) <= walltime_seconds(self.max_walltime)


def _sizes(limits: Iterable[QueueLimit]) -> str:
    return "; ".join(limit.size for limit in limits)


def describe_queues(limits: Iterable[QueueLimit]) -> str:
    """The queues as "debug (1-2 nodes, <= 01:00:00), prod (10-24 nodes, ...; 25-99 nodes, ...)"."""
    limits = tuple(limits)
    names = dict.fromkeys(limit.name for limit in limits)
    return ", ".join(f"{n} ({_sizes(q for q in limits if q.name == n)})" for n in names)


@dataclass(frozen=True)
class SiteSpec:
    """The settings of one site. Frozen and checked when built; change one with
    `dataclasses.replace(site, account="abc123")`, which checks again.

    Two pools of workers: the "mpi" pool runs multi-rank tasks (training), `nodes_per_block` nodes
    per batch job; the "cpu" pool runs single-process tasks, `cpu_workers_per_node` per node.
    """

    name: str  # shown by describe() and used as the monitoring workflow name
    scheduler: Scheduler  # which provider the site module uses: local | pbspro | cobalt | slurm
    mpi_launcher: MpiLauncher  # what starts the ranks of a multi-rank task: mpiexec | srun | aprun

    # -- "mpi" pool: Horovod training --
    nodes_per_block: int = 1  # nodes in one batch job; one training task never spans two jobs
    ranks_per_node: int = 1  # Horovod ranks on each node
    threads_per_rank: int = 1  # OMP_NUM_THREADS and TensorFlow intra-op threads of each rank
    cores_per_node: int = 1  # physical cores of a compute node
    hyperthreads_per_core: int = 1  # hardware threads per core a rank may use (aprun -j, srun -c)
    gpus_per_node: int = 0  # requested from the scheduler (PBS ngpus, sbatch --gpus-per-node)
    # Which GPU each rank of a node takes (pipeline.network.devices): "local_rank" (GPU r) or "reverse"
    # (GPU n-1-r, ALCF's advice for Polaris' NUMA layout). Exported to the ranks as $FFN_GPU_ORDER.
    gpu_order: GpuOrder = "local_rank"
    mpi_tasks_per_block: int = 1  # multi-rank tasks one block runs at once (each on its own nodes)
    max_blocks: int = 1  # batch jobs of the mpi pool alive at once
    launcher_options: str = ""  # extra launcher flags for every multi-rank task; may use the
    # fields {ranks_per_node} {threads_per_rank} {cpus_per_rank} {hyperthreads_per_core}
    # {cores_per_node}

    # -- "cpu" pool: single-process tasks --
    cpu_nodes_per_block: int = 1  # nodes in one batch job of the cpu pool
    cpu_workers_per_node: int = 1  # concurrent tasks per node (each gets cpus_per_node / this)
    cpu_max_blocks: int = 1  # batch jobs of the cpu pool alive at once
    # Queue and walltime of the cpu pool's jobs; None: the training's `queue` and `walltime`.
    # Their own, because the pools' jobs differ: Polaris' prod takes no job under 10 nodes, so a
    # training there sends its 1-node cpu jobs to another queue; and a long training need not make
    # every inference job ask for (and wait in the queue for) as long. None, not a copy on each
    # site, so a site or a user that sets one walltime (or queue) still sets it for both pools.
    cpu_queue: str | None = None
    cpu_walltime: str | None = None

    # -- batch jobs (ignored by the local site) --
    walltime: str = "01:00:00"  # HH:MM:SS of the training's batch jobs (and the cpu pool's: above)
    queue: str | None = None  # PBS/Cobalt queue or Slurm partition; None = the scheduler's default
    # The site's queues and the jobs each accepts: a job that its queue does not accept is refused
    # when the SiteSpec is built, naming the queues that would take it, not by qsub half-way into
    # a run. A queue not listed here (a reservation, a user's partition) is not checked.
    queue_limits: tuple[QueueLimit, ...] = ()
    account: str | None = None  # allocation charged; None = the scheduler's default
    scheduler_options: str = ""  # extra '#PBS' / '#COBALT' / '#SBATCH' lines for every job
    worker_init: str = ""  # shell lines run before the venv is activated (module loads)
    venv: str | None = None  # virtual environment the workers activate; None = the one running now

    # -- workflow-wide --
    # Parsl retries of a failed task: a lost worker or a killed rank costs a retry, not the run
    # (training resumes from its checkpoint, a block from its inference state). A pipeline error
    # (bad input or settings, a diverged training) is not retried: it would fail the same way.
    retries: int = 2
    # Most seconds between a training's checkpoints (caps [train] checkpoint_every_seconds; None:
    # the run's own): a lost rank or node costs every rank the steps since the last checkpoint.
    checkpoint_every_seconds: float | None = None
    max_idletime: float = 120.0  # seconds a block may sit idle before it is given back
    # Seconds between Parsl's scaling decisions: a task that finds no block waits up to this
    # long for one to be asked for. Each decision asks the interchange how many tasks wait.
    strategy_period: float = 5.0
    monitoring: bool = True  # task states and timings into <run_dir>/monitoring.db
    resource_monitoring_interval: float = 0.0  # per-task CPU/memory sampling in s; 0 = off
    # Level of Parsl's logs (runinfo/*/parsl.log, the interchange's, the workers'). Parsl's own
    # default, DEBUG, wrote 11.6 MB of parsl.log for the 405 tasks of a 512^3 bench/scale.py run
    # (tens of GB for the millions of tasks of a 10^12 voxel volume) and 4.1 s of the submitting
    # process's CPU; INFO 1.9 MB and 3.1-3.2 s. INFO keeps every task's launch, state, failure.
    parsl_log_level: str = "INFO"

    def __post_init__(self) -> None:
        where = f"site {self.name!r}"
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name or ""):
            raise ConfigError(f"site name {self.name!r}: use letters, digits, '_', '-', '.'")
        if self.scheduler not in LAUNCHERS_FOR:
            raise ConfigError(
                f"{where}: scheduler {self.scheduler!r} is not one of {sorted(LAUNCHERS_FOR)}"
            )
        if self.mpi_launcher not in LAUNCHERS_FOR[self.scheduler]:
            raise ConfigError(
                f"{where}: mpi_launcher {self.mpi_launcher!r} does not work with scheduler "
                f"{self.scheduler!r}; use one of {list(LAUNCHERS_FOR[self.scheduler])}"
            )
        for name in (
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
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{where}: {name} must be a whole number >= 1, got {value!r}")
        for name in ("gpus_per_node", "retries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{where}: {name} must be a whole number >= 0, got {value!r}")
        if self.hyperthreads_per_core > 4:
            raise ConfigError(f"{where}: hyperthreads_per_core {self.hyperthreads_per_core} > 4")
        if self.ranks_per_node > self.cpus_per_node:
            raise ConfigError(
                f"{where}: ranks_per_node {self.ranks_per_node} > {self.cpus_per_node} hardware "
                "threads per node (cores_per_node x hyperthreads_per_core)"
            )
        if self.threads_per_rank > self.cpus_per_rank:
            raise ConfigError(
                f"{where}: threads_per_rank {self.threads_per_rank} > {self.cpus_per_rank} "
                f"hardware threads each of {self.ranks_per_node} ranks gets on a "
                f"{self.cores_per_node}-core node (x{self.hyperthreads_per_core})"
            )
        if self.cpu_workers_per_node > self.cpus_per_node:
            raise ConfigError(
                f"{where}: cpu_workers_per_node {self.cpu_workers_per_node} > "
                f"{self.cpus_per_node} hardware threads per node"
            )
        if self.mpi_tasks_per_block > self.nodes_per_block:
            raise ConfigError(
                f"{where}: mpi_tasks_per_block {self.mpi_tasks_per_block} > nodes_per_block "
                f"{self.nodes_per_block}: each multi-rank task needs at least one node of its own"
            )
        if self.scheduler == "local" and (self.nodes_per_block, self.cpu_nodes_per_block) != (1, 1):
            raise ConfigError(f"{where}: the local scheduler has one node; set nodes_per_block=1")
        for name in ("walltime", "cpu_walltime"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and _WALLTIME.match(value)):
                raise ConfigError(f"{where}: {name} {value!r} is not HH:MM:SS")
        if self.gpu_order not in GPU_ORDERS:
            raise ConfigError(
                f"{where}: gpu_order {self.gpu_order!r} is not one of {', '.join(GPU_ORDERS)}"
            )
        interval = self.checkpoint_every_seconds
        if interval is not None and (
            isinstance(interval, bool)
            or not isinstance(interval, int | float)
            or not 0 < interval < float("inf")
        ):
            raise ConfigError(f"{where}: checkpoint_every_seconds must be > 0 seconds or None")
        if self.max_idletime < 0 or self.resource_monitoring_interval < 0:
            raise ConfigError(
                f"{where}: max_idletime and resource_monitoring_interval must be >= 0"
            )
        if self.parsl_log_level not in PARSL_LOG_LEVELS:
            raise ConfigError(
                f"{where}: parsl_log_level {self.parsl_log_level!r} is not one of "
                f"{', '.join(PARSL_LOG_LEVELS)}"
            )
        period = self.strategy_period
        if isinstance(period, bool) or not isinstance(period, int | float) or not 0 < period <= 600:
            raise ConfigError(f"{where}: strategy_period must be in (0, 600] s")
        for name in ("queue", "cpu_queue", "account", "venv"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(f"{where}: {name} must be a non-empty string or None")
        try:
            self.format_launcher_options()
        except (KeyError, IndexError, ValueError, AttributeError) as err:
            raise ConfigError(
                f"{where}: launcher_options {self.launcher_options!r} uses an unknown field "
                f"{err}; known: {', '.join('{' + f + '}' for f in LAUNCHER_OPTION_FIELDS)}"
            ) from None
        self._check_queues()

    def _check_queues(self) -> None:
        """Each pool's jobs (nodes, walltime) must be ones its queue accepts."""
        limits = self.queue_limits
        if not isinstance(limits, tuple) or not all(isinstance(q, QueueLimit) for q in limits):
            raise ConfigError(f"site {self.name!r}: queue_limits must be a tuple of QueueLimit")
        self._check_job("training", self.queue, self.nodes_per_block, self.walltime)
        self._check_job("cpu", self.cpu_job_queue, self.cpu_nodes_per_block, self.cpu_job_walltime)

    def _check_job(self, pool: str, queue: str | None, nodes: int, walltime: str) -> None:
        known = self.limits_of(queue)
        if not known or any(limit.allows(nodes, walltime) for limit in known):
            return
        fit = [limit for limit in self.queue_limits if limit.allows(nodes, walltime)]
        # The workflow's options for this pool's jobs (its size: --train-nodes, training only).
        flag = "--" if pool == "training" else "--cpu-"
        if any(limit.min_nodes <= nodes <= limit.max_nodes for limit in known):
            advice = f"a shorter {flag}walltime or another {flag}queue"
        elif pool == "training":
            advice = "another --queue, or --train-nodes that the queue takes"
        else:
            advice = "another --cpu-queue"
        raise ConfigError(
            f"site {self.name!r}: a {pool} job of {_nodes(nodes)} for {walltime} does not fit "
            f"queue {queue!r} ({_sizes(known)}); queues that fit: "
            f"{describe_queues(fit) or 'none'}; give {advice}"
        )

    # -- derived values --
    @property
    def placeholders(self) -> tuple[str, ...]:
        """Settings that still hold a "YOUR_..." placeholder."""
        return tuple(
            name
            for name in _MAY_HOLD_PLACEHOLDERS
            if PLACEHOLDER_PREFIX in (getattr(self, name) or "")
        )

    @property
    def cpu_job_queue(self) -> str | None:
        """The queue of the cpu pool's jobs: `cpu_queue`, else the training's."""
        return self.cpu_queue or self.queue

    @property
    def cpu_job_walltime(self) -> str:
        """The walltime of the cpu pool's jobs: `cpu_walltime`, else the training's."""
        return self.cpu_walltime or self.walltime

    def limits_of(self, queue: str | None) -> tuple[QueueLimit, ...]:
        """The entries of `queue_limits` for this queue; () when the site does not know it."""
        return tuple(limit for limit in self.queue_limits if limit.name == queue)

    @property
    def cpus_per_node(self) -> int:
        """Hardware threads a node offers to the launcher."""
        return self.cores_per_node * self.hyperthreads_per_core

    @property
    def cpus_per_rank(self) -> int:
        """Hardware threads reserved for each rank (aprun -d, mpiexec --depth, srun -c)."""
        return self.cpus_per_node // self.ranks_per_node

    @property
    def cpu_threads_per_worker(self) -> int:
        """Threads a task of the cpu pool should use (also its OMP_NUM_THREADS there)."""
        return max(1, self.cpus_per_node // self.cpu_workers_per_node)

    @property
    def nodes_per_mpi_task(self) -> int:
        """Nodes of one multi-rank task when a block runs `mpi_tasks_per_block` at once."""
        return self.nodes_per_block // self.mpi_tasks_per_block

    def format_launcher_options(self) -> str:
        values = {name: getattr(self, name) for name in LAUNCHER_OPTION_FIELDS}
        return string.Formatter().vformat(self.launcher_options, (), values).strip()

    # -- the contract with the training app --
    def mpi_launch(
        self, num_nodes: int | None = None, ranks_per_node: int | None = None
    ) -> MPILaunch:
        """How to start one multi-rank task on `num_nodes` nodes (default: `nodes_per_mpi_task`)
        with `ranks_per_node` ranks on each (default: the site's; fewer for a study's small
        worlds, e.g. one rank of a node that holds two)."""
        nodes = self.nodes_per_mpi_task if num_nodes is None else num_nodes
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise ConfigError(f"site {self.name!r}: num_nodes must be >= 1, got {nodes!r}")
        per_node = self.ranks_per_node if ranks_per_node is None else ranks_per_node
        if not 1 <= per_node <= self.ranks_per_node:
            raise ConfigError(
                f"site {self.name!r}: ranks_per_node must be in 1..{self.ranks_per_node}, got {per_node}"
            )
        if nodes > self.nodes_per_block:
            raise ConfigError(
                f"site {self.name!r}: a task on {nodes} nodes does not fit in a block of "
                f"{self.nodes_per_block} (a task cannot span blocks); raise nodes_per_block"
            )
        ranks = nodes * per_node
        options = self.format_launcher_options()
        # The launchers pass the launching shell's environment on to every rank.
        env = {"OMP_NUM_THREADS": str(self.threads_per_rank), GPU_ORDER_ENV: self.gpu_order}
        if self.scheduler == "cobalt":
            # Classic Theta pattern: the worker runs on the MOM node and calls aprun itself; ALPS
            # places the ranks on free nodes of the job, so no node list and no resource spec.
            prefix = f"aprun -n {ranks} -N {per_node} {options}".strip()
            spec: dict[str, int | str] = {}
        else:
            # Parsl's MPI mode composes $PARSL_MPI_PREFIX from this spec and the block's nodes.
            prefix = MPI_PREFIX
            spec = {"num_nodes": nodes, "ranks_per_node": per_node, "num_ranks": ranks}
            if options:
                spec["launcher_options"] = options
        return MPILaunch(
            executor=MPI_LABEL,
            prefix=prefix,
            resource_specification=spec,
            env=env,
            num_nodes=nodes,
            num_ranks=ranks,
            ranks_per_node=per_node,
            threads_per_rank=self.threads_per_rank,
        )

    def require_submittable(self) -> None:
        """Refuse to build a Config that would submit with a placeholder still in it."""
        if self.placeholders:
            settings = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.placeholders)
            raise ConfigError(
                f"site {self.name!r}: {settings} still a placeholder; set your own value "
                f"(SITE in site_configs/{self.name}.py or dataclasses.replace) before submitting "
                "(--dry-run describes the site as it is)"
            )


@dataclass(frozen=True)
class MPILaunch:
    """How the training app starts its ranks on this site. The same code works everywhere:

    launch = site.mpi_launch(num_nodes)
    @bash_app(executors=[launch.executor])
    def train(..., parsl_resource_specification=None): return launch.command("python -m ...")
    train(..., parsl_resource_specification=launch.resource_specification)
    """

    executor: str  # label of the executor to run on ("mpi")
    prefix: str  # put before the program: "$PARSL_MPI_PREFIX" or "aprun -n ... --cc depth"
    resource_specification: dict  # pass as parsl_resource_specification= ({} where unused)
    env: dict  # exported before the launch (OMP_NUM_THREADS, FFN_GPU_ORDER)
    num_nodes: int
    num_ranks: int
    ranks_per_node: int
    threads_per_rank: int  # give the program as its intra-op threads too

    def command(self, program: str) -> str:
        """The full shell line: exports, launcher prefix, program (already shell-quoted)."""
        exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in self.env.items())
        return f"{exports}{self.prefix} {program}"


def for_run(
    site: SiteSpec,
    *,
    train_nodes: int = 0,
    account: str | None = None,
    queue: str | None = None,
    walltime: str | None = None,
    cpu_queue: str | None = None,
    cpu_walltime: str | None = None,
) -> SiteSpec:
    """The site as a run uses it: training jobs of exactly the nodes the training uses (a job of
    `train_nodes` x `mpi_tasks_per_block` nodes; 0: the site's nodes_per_block), and the account,
    queues and walltimes given (None: the site's). One replace, so one check of all the changes
    together: a run of 128 nodes fits only with the queue that takes it, which neither change
    passes alone."""
    asked = {
        "train_nodes": train_nodes or None,
        "account": account,
        "queue": queue,
        "walltime": walltime,
        "cpu_queue": cpu_queue,
        "cpu_walltime": cpu_walltime,
    }
    asked = {name: value for name, value in asked.items() if value is not None}
    if not asked:
        return site
    changes = {name: value for name, value in asked.items() if name != "train_nodes"}
    if train_nodes:
        changes["nodes_per_block"] = train_nodes * site.mpi_tasks_per_block
    try:
        return dataclasses.replace(site, **changes)
    except ConfigError as exc:
        # What the run asked for, since the site's message names its own settings
        # (nodes_per_block where the user gave train_nodes).
        context = ", ".join(f"{name} {value}" for name, value in asked.items())
        raise ConfigError(f"{context}: {exc}") from None


# -- shared pieces of every site's Config --
def venv_path(site: SiteSpec) -> Path | None:
    """The virtual environment workers activate: the site's, or the one running this code."""
    if site.venv:
        return Path(site.venv)
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix)
    return None


def worker_init(site: SiteSpec, *extra: str) -> str:
    """Shell lines every batch job runs before Parsl starts a worker pool: the site's module
    loads, then the venv (its bin/ holds process_worker_pool.py, python, and locally mpiexec)."""
    lines = [site.worker_init.strip()] if site.worker_init.strip() else []
    venv = venv_path(site)
    if venv is not None:
        lines.append(f"source {shlex.quote(str(venv))}/bin/activate")
    else:  # a system Python: its bin/ on PATH is the best we can do
        lines.append(f'export PATH={shlex.quote(str(Path(sys.executable).parent))}:"$PATH"')
    lines.extend(extra)
    return "\n".join(lines)


# Set in every cpu worker's environment. glibc gives each thread that meets a busy allocator
# an arena of its own (up to 8 per core); cloud-volume's and igneous's I/O threads made such
# arenas in the workers, and memory freed in pieces across them is more than `malloc_trim` can
# hand back: over 9 meshing tasks in one process the memory held between tasks rose 3-5 MiB
# (0.4 MiB with one arena; after 5 tasks two arenas held what one did), and the last tasks of a
# 1024^3 run began 19 MiB above the 256^3 run's (14 with two arenas). Two: the main thread's,
# one the I/O threads share. The training pool keeps glibc's default: TensorFlow's threads
# allocate in parallel.
CPU_WORKER_ENV = {"MALLOC_ARENA_MAX": "2"}


def cpu_worker_init(site: SiteSpec) -> str:
    """`worker_init` for a pool of the cpu executor: the site's lines, then `CPU_WORKER_ENV`."""
    return worker_init(site, *(f"export {k}={v}" for k, v in CPU_WORKER_ENV.items()))


def monitoring_db(run_dir: str | Path) -> Path:
    return Path(run_dir).resolve() / "monitoring.db"


def runinfo_dir(run_dir: str | Path) -> Path:
    return Path(run_dir).resolve() / "runinfo"


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
        initialize_logging=FileLogging(level=getattr(logging, site.parsl_log_level)),
    )


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
        jobs = list(getattr(executor, "blocks_to_job_id", {}).values())
        provider = getattr(executor, "provider", None)
        if provider is not None and jobs:
            try:
                provider.cancel(jobs)
            except Exception as exc:  # noqa: BLE001  (the cleanup below must still run)
                print(
                    f"[workflow] could not cancel {executor.label} blocks: {exc}", file=sys.stderr
                )
    _parsl_cleanup(dfk)
    _stop(started)
    watchdog.stop_all()


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
            print(
                f"[workflow] Parsl's cleanup had not ended {CLEANUP_AFTER_INTERCHANGE_S:.0f} s "
                f"after the interchange of {', '.join(ended)} ended: the run's processes are "
                "stopped without it",
                file=sys.stderr,
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


def check_scheduler(site: SiteSpec, scheduler: str, module: str) -> None:
    if site.scheduler != scheduler:
        raise ConfigError(
            f"site {site.name!r} has scheduler {site.scheduler!r}; site_configs.{module} "
            f"builds {scheduler!r} configs"
        )


# -- --dry-run --
def expanded_launch_line(site: SiteSpec, launch: MPILaunch, command: str) -> str:
    """`command` (a `launch.command(...)` line) as it runs in a job whose nodes are <node0>,
    <node1>, ...: $PARSL_MPI_PREFIX replaced by what Parsl's MPI mode composes from the resource
    specification and the job's nodes. A Cobalt site's aprun line is complete already."""
    if launch.prefix != MPI_PREFIX:
        return command
    hosts = [f"<node{i}>" for i in range(launch.num_nodes)]
    spec = {k: str(v) for k, v in launch.resource_specification.items()}
    composed = compose_all(site.mpi_launcher, spec, hosts)["PARSL_MPI_PREFIX"].strip()
    return command.replace(MPI_PREFIX, composed)


def _describe_jobs(site: SiteSpec, queue: str | None, walltime: str) -> str:
    """Where one pool's jobs go: "batch jobs of 01:00:00 in queue debug (1-2 nodes, ...)"."""
    if queue is None:
        where = "the scheduler's default queue"
    else:
        sizes = _sizes(site.limits_of(queue)) or "limits not in the site's queue_limits"
        where = f"queue {queue} ({sizes})"
    return f"    batch jobs of {walltime} in {where}"


def describe(site: SiteSpec, run_dir: str | Path | None = None) -> str:
    """A few lines saying what the site's Config would do, without a scheduler or a submission."""
    launch = site.mpi_launch()
    provider = PROVIDER_FOR[site.scheduler]
    batch = site.scheduler != "local"
    lines = [f"site {site.name}: {provider}"]
    if batch:
        for name in ("account", "queue"):
            value = getattr(site, name)
            note = "  <- placeholder: set it before submitting" if name in site.placeholders else ""
            lines.append(f"  {name}: {value if value is not None else '(scheduler default)'}{note}")
        if site.queue_limits:
            lines.append(f"  the site's queues: {describe_queues(site.queue_limits)}")
    if site.scheduler == "cobalt":
        mpi_exec = (
            f"HighThroughputExecutor, {site.mpi_tasks_per_block} worker(s) on the job's MOM node "
            f"that call aprun ({provider}, SimpleLauncher)"
        )
    else:
        mpi_exec = (
            f"MPIExecutor(mpi_launcher={site.mpi_launcher!r}, "
            f"max_workers_per_block={site.mpi_tasks_per_block}) ({provider}, SimpleLauncher)"
        )
    line = expanded_launch_line(site, launch, launch.command("python -m pipeline.cli.train ..."))
    lines += [
        f'  executor "{MPI_LABEL}": {mpi_exec}',
        f"    {site.nodes_per_block} node(s) per block, up to {site.max_blocks} block(s); "
        f"{site.ranks_per_node} rank(s) per node x {site.threads_per_rank} thread(s), "
        f"{site.cpus_per_rank} hardware thread(s) per rank",
    ]
    if batch:
        lines.append(_describe_jobs(site, site.queue, site.walltime))
    if site.gpus_per_node:
        lines.append(f"    {site.gpus_per_node} GPU(s) per node, GPU order {site.gpu_order}")
    lines.append(f"    training on {launch.num_nodes} node(s): {line}")
    if launch.resource_specification:
        lines.append(f"    parsl_resource_specification={launch.resource_specification}")
    lines += [
        f'  executor "{CPU_LABEL}": HighThroughputExecutor ({provider}, '
        f"{CPU_LAUNCHER_FOR[site.scheduler]})",
        f"    {site.cpu_nodes_per_block} node(s) per block, up to {site.cpu_max_blocks} "
        f"block(s), {site.cpu_workers_per_node} worker(s) per node x "
        f"{site.cpu_threads_per_worker} thread(s), "
        + " ".join(f"{k}={v}" for k, v in CPU_WORKER_ENV.items()),
    ]
    if batch:
        lines.append(_describe_jobs(site, site.cpu_job_queue, site.cpu_job_walltime))
    lines += [
        "  worker_init:",
        *[f"    {x}" for x in worker_init(site).splitlines()],
    ]
    if batch and site.scheduler_options.strip():
        lines += [
            "  scheduler_options:",
            *[f"    {x}" for x in site.scheduler_options.splitlines()],
        ]
    where = Path(run_dir).resolve() if run_dir is not None else Path("<run_dir>")
    lines.append(
        "  monitoring: " + (f"sqlite:///{where / 'monitoring.db'}" if site.monitoring else "off")
    )
    return "\n".join(lines)
