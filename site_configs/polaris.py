"""ALCF Polaris: PBS Pro, Cray PALS `mpiexec`; 32 cores (2 hardware threads each), 4 A100 per node.

    "mpi": MPIExecutor(mpi_launcher="mpiexec") on PBSProProvider(SimpleLauncher); one worker pool
           on the job's first node, and a training task runs `$PARSL_MPI_PREFIX python ...`, i.e.
           `mpiexec -n <ranks> -ppn 4 -hosts <the job's nodes> --cpu-bind depth --depth=8 ...`.
    "cpu": HighThroughputExecutor on PBSProProvider(MpiExecLauncher): a worker pool per node.

Before submitting: set `account` (and `queue` for runs bigger than debug allows: `QUEUES`), and
create the venv on a file system the compute nodes mount (home, eagle) with the site's MPI and the
GPU build, after the same module loads as `worker_init`: `HOROVOD_CUDA_HOME=<a CUDA 12 toolkit>
make env MPI=system GPU=1` (the conda module's CUDA_HOME is CUDA 13; docs/hpc-sites.md). Local rank
r of a node takes A100 3-r (`gpu_order="reverse"`, pipeline.network.devices); each worker of the
"cpu" pool gets one A100 of its own (CUDA_VISIBLE_DEVICES) and the 8 cores nearest it, for inference.
"""

from __future__ import annotations

from pathlib import Path

from parsl.config import Config
from parsl.executors import HighThroughputExecutor, MPIExecutor
from parsl.launchers import MpiExecLauncher, SimpleLauncher
from parsl.providers import PBSProProvider

from site_configs import parsl_config, pools
from site_configs.queues import QueueLimit
from site_configs.spec import SiteSpec, check_scheduler

# Polaris' queues, from ALCF's "Running Jobs on Polaris" (docs.alcf.anl.gov/polaris/running-jobs/).
# prod is a routing queue: it sends a job by its size to small, medium or large, each with its own
# longest walltime (10 to 496 nodes in all). The job counts a submission may not pass: debug-scaling
# "max 1 job running/accruing/queued per-user", preemptable "Max 20 jobs running/accruing/queued
# per-project" (killed when demand jobs need the nodes), capacity "Max 2 jobs queued or running".
# Left out: demand (by request only), and the counts that only make jobs wait (debug: 24 nodes in
# use by the queue; prod: 10 jobs running per project; capacity: 1 job running per user).
QUEUES = (
    QueueLimit("debug", 1, 2, "01:00:00"),
    QueueLimit("debug-scaling", 1, 10, "01:00:00", max_jobs=1),
    QueueLimit("prod", 10, 24, "03:00:00"),  # routed to small
    QueueLimit("prod", 25, 99, "06:00:00"),  # medium
    QueueLimit("prod", 100, 496, "24:00:00"),  # large
    QueueLimit("preemptable", 1, 10, "72:00:00", max_jobs=20),
    QueueLimit("capacity", 1, 4, "168:00:00", max_jobs=2),
)
# As ALCF's Polaris job scripts ask: `-l select=N:system=polaris` (the machine the nodes come
# from; ALCF's qsub2pbs leaves `system` for the user to fill in) and `-l place=scatter` (each
# chunk of the select on a node of its own).
SELECT_SYSTEM = "system=polaris"
PLACE = "#PBS -l place=scatter"

# ALCF's "Parsl on Polaris" (docs.alcf.anl.gov/polaris/workflows/parsl/), "optimal binding of
# threads to GPUs on a Polaris node": worker i, which Parsl gives A100 i (CUDA_VISIBLE_DEVICES),
# on the 8 cores nearest that GPU and their second hardware threads (GPU 0 is nearest cores
# 24-31: the order `gpu_order="reverse"` gives the training's ranks). 16 threads a worker.
WORKER_AFFINITY = "list:24-31,56-63:16-23,48-55:8-15,40-47:0-7,32-39"
# The same page's launcher for the worker pool: one per node, given the whole node. PALS
# `mpiexec --cpu-bind none` (what MpiExecLauncher puts before these) leaves the pool unbound, so
# each worker's list above holds; `--depth` then reserves every hardware thread of the node.
POOL_LAUNCHER_OPTIONS = "--depth=64 --ppn 1"

SITE = SiteSpec(
    name="polaris",
    scheduler="pbspro",  # Polaris runs PBS Pro
    mpi_launcher="mpiexec",  # Cray PALS mpiexec; Parsl's MPI mode reads the hosts from PBS_NODEFILE
    nodes_per_block=2,  # training job size; debug queue allows up to 2 nodes, debug-scaling 10
    ranks_per_node=4,  # one rank per A100 / per 8 cores
    threads_per_rank=8,  # 32 cores / 4 ranks
    cores_per_node=32,  # AMD EPYC Milan 7543P
    hyperthreads_per_core=1,  # one thread per core: TensorFlow gains little from SMT
    gpus_per_node=4,  # asked for with select ngpus=4 (whole nodes are allocated anyway)
    gpu_order="reverse",  # local rank r on GPU 3-r: ALCF's set_affinity_gpu_polaris.sh (NUMA)
    mpi_tasks_per_block=1,  # one training per job; raise with nodes_per_block for sweeps
    max_blocks=1,  # one training job at a time
    launcher_options="--cpu-bind depth --depth={cpus_per_rank}",  # ALCF: bind ranks by depth
    cpu_nodes_per_block=1,  # inference/preprocessing jobs of one node...
    cpu_workers_per_node=4,  # ...with 4 single-process tasks, one per A100...
    cpu_affinity=WORKER_AFFINITY,  # ...each on the 8 cores nearest its A100 (16 threads)
    cpu_max_blocks=4,  # up to 4 such jobs at once
    cpu_queue=None,  # the training's queue; with prod (10+ nodes): debug or preemptable
    cpu_walltime=None,  # the training's walltime
    walltime="01:00:00",  # debug queue maximum; prod allows longer
    queue="debug",  # debug (<= 2 nodes, 1 h), debug-scaling (<= 10 nodes), prod, preemptable
    queue_limits=QUEUES,  # a job its queue does not take is refused before it is submitted
    account="YOUR_ALLOCATION",  # your ALCF project: make_config refuses to submit with this
    scheduler_options="#PBS -l filesystems=home:eagle",  # file systems the job needs mounted
    # The Python 3.11 the venv was made with, and Cray MPICH: Horovod was built against it
    # (make env MPI=system), so its PALS mpiexec starts the ranks as one world.
    # TMPDIR=/tmp: ALCF's Parsl page, "Known Issues": Parsl in a single-node job fails with
    # "OSError: AF_UNIX path too long" without it.
    worker_init="module use /soft/modulefiles; module load conda; module load cray-mpich; "
    "export TMPDIR=/tmp",
    venv=None,  # the venv running the workflow (on home/eagle, seen by the compute nodes)
    retries=1,  # a training killed at walltime resumes from its checkpoint on the retry
    checkpoint_every_seconds=300.0,  # a lost node costs every node at most 5 minutes of steps
    max_idletime=120.0,  # give idle nodes back after 2 minutes
    monitoring=True,  # <run_dir>/monitoring.db on the login node
    resource_monitoring_interval=0.0,  # per-task sampling off: it costs a process per task
)


def make_config(run_dir: Path, site: SiteSpec | None = None) -> Config:
    site = site or SITE
    check_scheduler(site, "pbspro", "polaris")
    site.require_submittable()
    # -l select=N:ncpus=64:ngpus=4:system=polaris. PBS counts both hardware threads of a core as
    # ncpus (64 per Polaris node, as in parsl/configs/polaris.py).
    ncpus = 2 * site.cores_per_node
    gpus = [f"ngpus={site.gpus_per_node}"] if site.gpus_per_node else []
    select = ":".join([*gpus, SELECT_SYSTEM])
    scheduler_options = "\n".join(filter(None, [PLACE, site.scheduler_options]))
    return parsl_config.build_config(
        run_dir,
        site,
        [
            MPIExecutor(
                label=pools.MPI_LABEL,
                mpi_launcher=site.mpi_launcher,  # mpiexec -n .. -ppn .. -hosts <the job's nodes>
                max_workers_per_block=site.mpi_tasks_per_block,  # concurrent trainings per job
                **pools.EXECUTOR_SETTINGS,  # our interchange and pools: encrypted, heartbeats, leashed
                # address: left to Parsl, which offers all of the login node's addresses
                provider=PBSProProvider(
                    launcher=SimpleLauncher(),  # MPIExecutor needs it: one pool on the first node
                    account=site.account,
                    queue=site.queue,
                    walltime=site.walltime,
                    nodes_per_block=site.nodes_per_block,
                    cpus_per_node=ncpus,
                    select_options=select,
                    scheduler_options=scheduler_options,
                    worker_init=pools.worker_init(site),
                    init_blocks=0,  # nodes are requested when a training task is ready
                    min_blocks=0,
                    max_blocks=site.max_blocks,
                ),
            ),
            HighThroughputExecutor(
                label=pools.CPU_LABEL,
                max_workers_per_node=site.cpu_workers_per_node,
                cpu_affinity=site.cpu_affinity,  # each worker on its GPU's cores (above)
                # One A100 per worker (CUDA_VISIBLE_DEVICES): inference blocks run on the GPUs.
                available_accelerators=site.gpus_per_node or None,
                prefetch_capacity=0,  # tasks are long; do not queue them behind busy workers
                **pools.EXECUTOR_SETTINGS,  # our interchange and pools: encrypted, heartbeats, leashed
                provider=PBSProProvider(
                    # One worker pool per node, as ALCF's Parsl page starts it (above).
                    launcher=MpiExecLauncher(
                        bind_cmd="--cpu-bind", overrides=POOL_LAUNCHER_OPTIONS
                    ),
                    account=site.account,
                    queue=site.cpu_job_queue,
                    walltime=site.cpu_job_walltime,
                    nodes_per_block=site.cpu_nodes_per_block,
                    cpus_per_node=ncpus,
                    select_options=select,
                    scheduler_options=scheduler_options,
                    worker_init=pools.cpu_worker_init(site),
                    init_blocks=0,  # requested when the first task is ready
                    min_blocks=0,
                    max_blocks=site.cpu_max_blocks,
                ),
            ),
        ],
    )
