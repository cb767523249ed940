"""A Slurm cluster with `srun` (a CPU cluster of 2-socket 64-core AMD EPYC nodes: 128 cores x 2
threads); for NERSC Perlmutter's GPU nodes use `--site perlmutter` (site_configs/perlmutter.py).

    "mpi": MPIExecutor(mpi_launcher="srun") on SlurmProvider(SimpleLauncher); one worker pool on
           the job's first node, and a training task runs `$PARSL_MPI_PREFIX python ...`, i.e.
           `srun --ntasks <ranks> --ntasks-per-node 4 --nodelist <the job's nodes> --nodes <n>
           --cpus-per-task=64 --cpu-bind=cores --mpi=pmix python ...`.
    "cpu": HighThroughputExecutor on SlurmProvider(SrunLauncher): a worker pool per node.

Before submitting set `account` and `queue` (the partition), with `--account`/`--queue`, and, where
the cluster asks for them, `--qos` and `--constraint` (both pools' `#SBATCH --qos=`/`--constraint=`).

`srun --mpi=pmix` is the default here: it starts the ranks of a Horovod built against OpenMPI (or
another PMIx MPI) as one world. Change it in `launcher_options` to what the cluster's MPI takes
(`srun --mpi=list` names the plugins; the `make env MPI=system` venv's Horovod is built against
the MPI module loaded): with Cray MPICH (HPE Cray EX machines, Perlmutter among them)
`--mpi=cray_shasta`, or leave `--mpi` out where that is Slurm's default; with MPICH built for
PMI-2, `--mpi=pmi2`. A Horovod whose MPI does not take the plugin starts each rank as a world of
its own, which every training refuses at start, in one line (pipeline.network.devices).
"""

from __future__ import annotations

from pathlib import Path

from parsl.config import Config
from parsl.executors import HighThroughputExecutor, MPIExecutor
from parsl.launchers import SimpleLauncher, SrunLauncher
from parsl.providers import SlurmProvider

from site_configs import parsl_config, pools
from site_configs.spec import SiteSpec, check_scheduler

SITE = SiteSpec(
    name="slurm",
    scheduler="slurm",  # sbatch / squeue / scancel
    mpi_launcher="srun",  # Parsl's MPI mode reads the hosts from SLURM_NODELIST
    nodes_per_block=2,  # training job size
    ranks_per_node=4,  # one rank per NUMA domain pair on a 2-socket EPYC node
    threads_per_rank=32,  # one TensorFlow thread per physical core
    cores_per_node=128,  # 2 x AMD EPYC 7763
    hyperthreads_per_core=2,  # Slurm counts hardware threads: -c = 2 x cores per rank
    mpi_tasks_per_block=1,  # one training per job
    max_blocks=1,  # one training job at a time
    # Bind each rank to its cores, and PMIx to start the ranks as one world under an OpenMPI (or
    # other PMIx) build of Horovod. Change --mpi to the cluster's MPI: Cray MPICH takes
    # --mpi=cray_shasta (or no --mpi where Slurm defaults to it: --site perlmutter), an MPICH
    # built for PMI-2 --mpi=pmi2 (`srun --mpi=list` names them; module docstring).
    launcher_options="--cpus-per-task={cpus_per_rank} --cpu-bind=cores --mpi=pmix",
    cpu_nodes_per_block=1,  # inference/preprocessing jobs of one node...
    cpu_workers_per_node=32,  # ...32 single-process tasks of 4 cores each
    cpu_max_blocks=4,  # up to 4 such jobs at once
    cpu_queue=None,  # the training's partition
    cpu_walltime=None,  # the training's walltime
    walltime="00:30:00",  # short jobs start sooner; raise for long trainings
    queue="YOUR_PARTITION",  # partition; None: the cluster's default partition
    qos=None,  # sbatch --qos (--qos): None = the account's default QOS
    constraint=None,  # sbatch --constraint (--constraint): None = any node of the partition
    # None known: partitions differ from cluster to cluster. Add yours, as
    # (QueueLimit(name, min_nodes, max_nodes, "HH:MM:SS"), ...) from `scontrol show partition`
    # (MinNodes, MaxNodes, MaxTime), to have a job that does not fit refused before submitting.
    queue_limits=(),
    account="YOUR_ALLOCATION",  # your allocation: make_config refuses to submit with this
    scheduler_options="",  # extra #SBATCH lines (memory, licenses, ...)
    # e.g. "module load python openmpi": the venv's Python, and the MPI Horovod was built
    # against (make env MPI=system), so srun starts the ranks as one world
    worker_init="",
    venv=None,  # the venv running the workflow (on a file system the compute nodes mount)
    retries=1,  # a training killed at walltime resumes from its checkpoint on the retry
    checkpoint_every_seconds=300.0,  # a lost node costs every node at most 5 minutes of steps
    max_idletime=120.0,  # give idle nodes back after 2 minutes
    monitoring=True,  # <run_dir>/monitoring.db on the login node
    resource_monitoring_interval=0.0,  # per-task sampling off: it costs a process per task
)


def make_config(run_dir: Path, site: SiteSpec | None = None) -> Config:
    site = site or SITE
    check_scheduler(site, "slurm", "slurm")
    site.require_submittable()
    return parsl_config.build_config(
        run_dir,
        site,
        [
            MPIExecutor(
                label=pools.MPI_LABEL,
                mpi_launcher=site.mpi_launcher,  # srun --ntasks .. --nodelist <the job's nodes>
                max_workers_per_block=site.mpi_tasks_per_block,  # concurrent trainings per job
                **pools.EXECUTOR_SETTINGS,  # our interchange and pools: encrypted, heartbeats, leashed
                provider=SlurmProvider(
                    launcher=SimpleLauncher(),  # MPIExecutor needs it: one pool on the first node
                    partition=site.queue,
                    account=site.account,
                    qos=site.qos,  # #SBATCH --qos=
                    constraint=site.constraint,  # #SBATCH --constraint=
                    walltime=site.walltime,
                    nodes_per_block=site.nodes_per_block,
                    scheduler_options=site.scheduler_options,
                    worker_init=pools.worker_init(site),
                    exclusive=True,  # whole nodes: the ranks bind to all cores
                    gpus_per_node=site.gpus_per_node or None,  # GRES: no GPU visible unless asked
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
                provider=SlurmProvider(
                    # One worker pool per node, given all of the node's hardware threads (a job
                    # step gets one CPU per task unless told otherwise).
                    launcher=SrunLauncher(
                        overrides=f"--cpus-per-task={site.cpus_per_node} --cpu-bind=cores"
                    ),
                    partition=site.cpu_job_queue,
                    account=site.account,
                    qos=site.qos,  # #SBATCH --qos=
                    constraint=site.constraint,  # #SBATCH --constraint=
                    walltime=site.cpu_job_walltime,
                    nodes_per_block=site.cpu_nodes_per_block,
                    scheduler_options=site.scheduler_options,
                    worker_init=pools.cpu_worker_init(site),
                    exclusive=True,
                    gpus_per_node=site.gpus_per_node or None,
                    init_blocks=0,  # requested when the first task is ready
                    min_blocks=0,
                    max_blocks=site.cpu_max_blocks,
                ),
            ),
        ],
    )
