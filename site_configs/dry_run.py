"""`describe(site)`: what a site's Config would do, in a few lines, for `--dry-run`, without a
scheduler or a submission: each pool's executor, provider, launcher, jobs and queues, the
training's launch line as it will run, the worker start-up and the monitoring database.
"""

from __future__ import annotations

from pathlib import Path

from site_configs.launch import expanded_launch_line
from site_configs.pools import CPU_LABEL, CPU_WORKER_ENV, MPI_LABEL, worker_init
from site_configs.queues import describe_queues, queue_sizes
from site_configs.spec import SiteSpec

# The provider and the launcher of the "cpu" pool each scheduler's module uses
# (tests/site_configs/test_site_configs.py checks these against the built configs).
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


def _describe_jobs(site: SiteSpec, queue: str | None, walltime: str) -> str:
    """Where one pool's jobs go: "batch jobs of 01:00:00 in queue debug (1-2 nodes, ...)"."""
    if queue is None:
        where = "the scheduler's default queue"
    else:
        sizes = queue_sizes(site.limits_of(queue)) or "limits not in the site's queue_limits"
        where = f"queue {queue} ({sizes})"
    return f"    batch jobs of {walltime} in {where}"


def describe(site: SiteSpec, run_dir: str | Path | None = None) -> str:
    """A few lines saying what the site's Config would do, without a scheduler or a submission."""
    provider = PROVIDER_FOR[site.scheduler]
    batch = site.scheduler != "local"
    lines = [f"site {site.name}: {provider}"]
    if batch:
        lines += _describe_account_and_queues(site)
    lines += _describe_mpi_pool(site, provider, batch)
    lines += _describe_cpu_pool(site, provider, batch)
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


def _describe_account_and_queues(site: SiteSpec) -> list[str]:
    """A batch site's account and queue (a placeholder flagged), and the queues it lists."""
    lines = []
    for name in ("account", "queue"):
        value = getattr(site, name)
        note = "  <- placeholder: set it before submitting" if name in site.placeholders else ""
        lines.append(f"  {name}: {value if value is not None else '(scheduler default)'}{note}")
    if site.queue_limits:
        lines.append(f"  the site's queues: {describe_queues(site.queue_limits)}")
    return lines


def _describe_mpi_pool(site: SiteSpec, provider: str, batch: bool) -> list[str]:
    """The "mpi" pool: its executor, blocks, jobs, GPUs and the training's launch line."""
    launch = site.mpi_launch()
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
    lines = [
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
    return lines


def _describe_cpu_pool(site: SiteSpec, provider: str, batch: bool) -> list[str]:
    """The "cpu" pool: its executor, blocks, workers, their environment and jobs."""
    lines = [
        f'  executor "{CPU_LABEL}": HighThroughputExecutor ({provider}, '
        f"{CPU_LAUNCHER_FOR[site.scheduler]})",
        f"    {site.cpu_nodes_per_block} node(s) per block, up to {site.cpu_max_blocks} "
        f"block(s), {site.cpu_workers_per_node} worker(s) per node x "
        f"{site.cpu_threads_per_worker} thread(s), "
        + " ".join(f"{k}={v}" for k, v in CPU_WORKER_ENV.items()),
    ]
    if batch:
        lines.append(_describe_jobs(site, site.cpu_job_queue, site.cpu_job_walltime))
    return lines
