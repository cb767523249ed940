"""`SiteSpec`, the settings of one site (checked when built: site_configs.checks), with the values
derived from them; `for_run`, a site as one run changes it; and `check_scheduler`, a site module's
refusal of another scheduler's site.
"""

from __future__ import annotations

import dataclasses
import string
from dataclasses import dataclass
from typing import Literal

from pipeline.core.errors import ConfigError
from pipeline.network.devices import GpuKind, GpuOrder
from site_configs.affinity import threads_per_worker
from site_configs.checks import check_site
from site_configs.launch import LAUNCHER_OPTION_FIELDS, MPILaunch, mpi_launch
from site_configs.queues import QueueLimit

Scheduler = Literal["local", "pbspro", "cobalt", "slurm"]
MpiLauncher = Literal["mpiexec", "srun", "aprun"]

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
    # What the GPUs are (pipeline.network.devices): "cuda", NVIDIA's (TensorFlow's CUDA build,
    # Horovod with NCCL), or "xpu", Intel's, each tile a device TensorFlow lists as "XPU" (Intel's
    # extension for TensorFlow, Horovod with oneCCL: Aurora). The venv is checked for it
    # (site_configs.environment.check_environment).
    gpu_kind: GpuKind = "cuda"
    mpi_tasks_per_block: int = 1  # multi-rank tasks one block runs at once (each on its own nodes)
    max_blocks: int = 1  # batch jobs of the mpi pool alive at once
    launcher_options: str = ""  # extra launcher flags for every multi-rank task; may use the
    # fields {ranks_per_node} {threads_per_rank} {cpus_per_rank} {hyperthreads_per_core}
    # {cores_per_node}

    # -- "cpu" pool: single-process tasks --
    cpu_nodes_per_block: int = 1  # nodes in one batch job of the cpu pool
    cpu_workers_per_node: int = 1  # concurrent tasks per node (each gets cpus_per_node / this)
    cpu_max_blocks: int = 1  # batch jobs of the cpu pool alive at once
    # Where Parsl puts each worker of a node (site_configs.affinity): "block" (the CPUs the pool
    # may use, split in order; OMP_NUM_THREADS their count), or "list:" and each worker's CPUs
    # (ALCF's: each worker on the cores nearest its GPU, and their second hardware threads).
    cpu_affinity: str = "block"
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
    # Slurm only (sbatch --qos, --constraint; any other scheduler refuses them): the quality of
    # service both pools' jobs ask for, and the node features they need. NERSC chooses a job's
    # limits by its QOS, not its partition (Perlmutter: `-q regular`, `-C gpu`), so a site whose
    # `queue_limits` name QOSes (site_configs/perlmutter.py) has each job checked against its QOS.
    qos: str | None = None  # None = the scheduler's default (Perlmutter's: debug)
    constraint: str | None = None  # e.g. "gpu", "gpu&hbm80g"; None = any node
    # The site's queues and the jobs each accepts: a job that its queue does not accept is refused
    # when the SiteSpec is built, naming the queues that would take it, not by qsub half-way into
    # a run. A queue not listed here (a reservation, a user's partition) is not checked. On a
    # Slurm site the entries may name QOSes: a job is checked against those of its `qos` too.
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
        check_site(self)  # site_configs.checks: ConfigError naming the first broken rule

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
        """Threads a task of the cpu pool uses: its OMP_NUM_THREADS, which Parsl sets to the
        count of the worker's CPUs (`cpu_affinity`)."""
        return threads_per_worker(self.cpu_affinity, self.cpu_workers_per_node, self.cpus_per_node)

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
        worlds, e.g. one rank of a node that holds two): site_configs.launch.mpi_launch."""
        return mpi_launch(self, num_nodes, ranks_per_node)

    def require_submittable(self) -> None:
        """Refuse to build a Config that would submit with a placeholder still in it."""
        if self.placeholders:
            settings = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.placeholders)
            raise ConfigError(
                f"site {self.name!r}: {settings} still a placeholder; set your own value "
                f"(SITE in site_configs/{self.name}.py or dataclasses.replace) before submitting "
                "(--dry-run describes the site as it is)"
            )


def for_run(
    site: SiteSpec,
    *,
    train_nodes: int = 0,
    account: str | None = None,
    queue: str | None = None,
    walltime: str | None = None,
    cpu_queue: str | None = None,
    cpu_walltime: str | None = None,
    qos: str | None = None,
    constraint: str | None = None,
) -> SiteSpec:
    """The site as a run uses it: training jobs of exactly the nodes the training uses (a job of
    `train_nodes` x `mpi_tasks_per_block` nodes; 0: the site's nodes_per_block), and the account,
    queues, walltimes, QOS and constraint given (None: the site's). One replace, so one check of
    all the changes together: a run of 128 nodes fits only with the queue (or QOS) that takes it,
    which neither change passes alone."""
    asked = {
        "train_nodes": train_nodes or None,
        "account": account,
        "queue": queue,
        "walltime": walltime,
        "cpu_queue": cpu_queue,
        "cpu_walltime": cpu_walltime,
        "qos": qos,
        "constraint": constraint,
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


def check_scheduler(site: SiteSpec, scheduler: str, module: str) -> None:
    """Refuse a site of another scheduler than the one `site_configs.<module>` builds for."""
    if site.scheduler != scheduler:
        raise ConfigError(
            f"site {site.name!r} has scheduler {site.scheduler!r}; site_configs.{module} "
            f"builds {scheduler!r} configs"
        )
