"""ALCF Theta (Dong et al., SC'19): Cobalt and Cray `aprun`; KNL nodes, 64 cores x 4 threads.

Parsl's MPI mode does not know Cobalt, so this site uses the classic pattern (see cobalt.py):

    "mpi": HighThroughputExecutor on CobaltProvider(SimpleLauncher): the worker pool runs on the
           job's MOM node and a training task runs its own
           `aprun -n <ranks> -N 1 -d 64 -j 1 --cc depth -e OMP_NUM_THREADS=64 python ...`
           (`SITE.mpi_launch(num_nodes).prefix`); ALPS puts the ranks on the job's compute nodes.
    "cpu": HighThroughputExecutor on CobaltProvider(AprunLauncher): a worker pool per KNL node.

Theta was retired at the end of 2023; this module documents how the workflow ran there and is a
template for other Cobalt/ALPS machines (`RETIRED`, the line the dry run prints, left out of a
copy). Set `account` before submitting.
"""

from __future__ import annotations

from pathlib import Path

from parsl.config import Config
from parsl.executors import HighThroughputExecutor
from parsl.launchers import AprunLauncher, SimpleLauncher

from site_configs import parsl_config, pools
from site_configs.cobalt import CobaltProvider
from site_configs.queues import QueueLimit
from site_configs.spec import SiteSpec, check_scheduler

# A site module's `RETIRED` (optional): one line the dry run prints, that its machine is gone.
RETIRED = (
    "Theta was retired by ALCF at the end of 2023: this site is the SC'19 setup, kept as a "
    "template for other Cobalt/ALPS machines"
)

# Theta's KNL queues, from ALCF's "Job and Queue Scheduling for Theta" (argonne-lcf/user-guides,
# docs/theta/queueing-and-running-jobs/job-and-queue-scheduling.md). default's longest walltime
# grows with the job's size; its minimum of 128 nodes is charged for smaller jobs, so a smaller
# job is refused here rather than charged for 128 nodes. Its largest job: 4,100 nodes (the docs'
# last note; 4,392 nodes in all). Left out: 1 running job per user in the debug queues.
QUEUES = (
    QueueLimit("debug-cache-quad", 1, 8, "01:00:00"),
    QueueLimit("debug-flat-quad", 1, 8, "01:00:00"),
    QueueLimit("default", 128, 255, "03:00:00"),
    QueueLimit("default", 256, 383, "06:00:00"),
    QueueLimit("default", 384, 639, "09:00:00"),
    QueueLimit("default", 640, 801, "12:00:00"),
    QueueLimit("default", 802, 4100, "24:00:00"),
)

SITE = SiteSpec(
    name="theta",
    scheduler="cobalt",  # Theta runs Cobalt
    mpi_launcher="aprun",  # ALPS: the only way from the MOM node onto the compute nodes
    nodes_per_block=8,  # training job size (debug-cache-quad allows up to 8 nodes, 1 h)
    ranks_per_node=1,  # one Horovod rank per KNL node, as in Dong et al. (scaling counted in nodes)
    threads_per_rank=64,  # one TensorFlow thread per core
    cores_per_node=64,  # Xeon Phi 7230
    hyperthreads_per_core=1,  # aprun -j 1: TensorFlow on KNL gained little from hyperthreads
    mpi_tasks_per_block=1,  # one training per job (ALPS could run more on disjoint nodes)
    max_blocks=1,  # one training job at a time
    # Binding for every aprun of a training task: -d = hardware threads per rank; depth binding;
    # OMP_NUM_THREADS set on the compute nodes explicitly.
    launcher_options=(
        "-d {cpus_per_rank} -j {hyperthreads_per_core} --cc depth"
        " -e OMP_NUM_THREADS={threads_per_rank}"
    ),
    cpu_nodes_per_block=2,  # inference/preprocessing jobs of 2 nodes...
    cpu_workers_per_node=16,  # ...16 single-process tasks per node, 4 cores each
    cpu_max_blocks=4,  # up to 4 such jobs at once
    cpu_queue=None,  # the training's queue; with default (128+ nodes): a debug queue
    cpu_walltime=None,  # the training's walltime
    walltime="01:00:00",  # debug queue maximum
    queue="debug-cache-quad",  # debug-cache-quad | debug-flat-quad | default (128+ nodes)
    queue_limits=QUEUES,  # a job its queue does not take is refused before it is submitted
    account="YOUR_ALLOCATION",  # your ALCF project: make_config refuses to submit with this
    scheduler_options="#COBALT --attrs filesystems=home,grand",  # file systems the job needs
    worker_init="module load miniconda-3",  # Python the venv was made with
    venv=None,  # the venv running the workflow (on home/grand, seen by MOM and compute nodes)
    retries=1,  # a training killed at walltime resumes from its checkpoint on the retry
    checkpoint_every_seconds=300.0,  # a lost node costs every node at most 5 minutes of steps
    max_idletime=120.0,  # give idle nodes back after 2 minutes
    monitoring=True,  # <run_dir>/monitoring.db on the login node
    resource_monitoring_interval=0.0,  # per-task sampling off: it costs a process per task
)


def make_config(run_dir: Path, site: SiteSpec | None = None) -> Config:
    site = site or SITE
    check_scheduler(site, "cobalt", "theta")
    site.require_submittable()
    return parsl_config.build_config(
        run_dir,
        site,
        [
            HighThroughputExecutor(
                label=pools.MPI_LABEL,
                # Workers only wait for aprun, on a shared MOM node: one per concurrent training.
                max_workers_per_node=site.mpi_tasks_per_block,
                cores_per_worker=1e-6,  # do not limit them by the MOM node's core count
                **pools.EXECUTOR_SETTINGS,  # our interchange and pools: encrypted, heartbeats, leashed
                provider=CobaltProvider(
                    launcher=SimpleLauncher(),  # one pool, on the MOM node where the script runs
                    account=site.account,
                    queue=site.queue,
                    walltime=site.walltime,
                    nodes_per_block=site.nodes_per_block,  # compute nodes aprun may use
                    scheduler_options=site.scheduler_options,
                    worker_init=pools.worker_init(site),
                    init_blocks=0,  # nodes are requested when a training task is ready
                    min_blocks=0,
                    max_blocks=site.max_blocks,
                ),
            ),
            HighThroughputExecutor(
                label=pools.CPU_LABEL,
                max_workers_per_node=site.cpu_workers_per_node,
                cpu_affinity=site.cpu_affinity,  # each worker on its own CPUs (SiteSpec.cpu_affinity)
                prefetch_capacity=0,  # tasks are long; do not queue them behind busy workers
                **pools.EXECUTOR_SETTINGS,  # our interchange and pools: encrypted, heartbeats, leashed
                provider=CobaltProvider(
                    # One worker pool per compute node, given all its hardware threads.
                    launcher=AprunLauncher(
                        overrides=(
                            f"-d {site.cpus_per_node} -j {site.hyperthreads_per_core} --cc depth"
                        )
                    ),
                    account=site.account,
                    queue=site.cpu_job_queue,
                    walltime=site.cpu_job_walltime,
                    nodes_per_block=site.cpu_nodes_per_block,
                    scheduler_options=site.scheduler_options,
                    worker_init=pools.cpu_worker_init(site),
                    init_blocks=0,  # requested when the first task is ready
                    min_blocks=0,
                    max_blocks=site.cpu_max_blocks,
                ),
            ),
        ],
    )
