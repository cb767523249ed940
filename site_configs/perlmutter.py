"""NERSC Perlmutter's GPU nodes: Slurm, `srun` with Cray MPICH; 64 cores (2 hardware threads each)
and 4 A100 per node.

    "mpi": MPIExecutor(mpi_launcher="srun") on SlurmProvider(SimpleLauncher); one worker pool on
           the job's first node, and a training task runs `$PARSL_MPI_PREFIX python ...`, i.e.
           `srun --ntasks <ranks> --ntasks-per-node 4 --nodelist <the job's nodes> --nodes <n>
           -c 32 --cpu-bind=cores --gpus-per-task=1 --gpu-bind=none python ...`: one rank per
           A100, each bound to 16 cores (32 hardware threads), every rank seeing its node's four
           A100 and taking the one of its local rank (pipeline.network.devices).
    "cpu": HighThroughputExecutor on SlurmProvider(SrunLauncher): a worker pool per node, and
           each of its 4 workers one A100 of its own (CUDA_VISIBLE_DEVICES), for inference.

Both pools' jobs ask for `#SBATCH --constraint=gpu` (`-C gpu`), `--qos=<qos>` (`-q`), `--account`
(`-A`), `--gpus-per-node=4` and whole nodes (`--exclusive`). NERSC jobs choose their limits by QOS,
not by partition: `--qos debug` (the site's default, as Slurm's on Perlmutter) or `--qos regular`,
checked against `QOSES` before anything is submitted; `--queue` (a partition) is refused.

Before submitting: give `--account` (your NERSC project's GPU account, see `ACCOUNT_NOTE`), and set
`worker_init` to the module loads your venv was made after (a placeholder here: NERSC's TensorFlow
module page was not at hand to check; docs/hpc-sites.md, "Perlmutter"). Make the venv on a file
system the compute nodes mount (home, $CFS, $SCRATCH) after those module loads, with the site's
MPI and the GPU build: `make env MPI=system GPU=1`, so Horovod is built against Cray MPICH, which
`srun` starts as one world with Slurm's default MPI plugin (NERSC's examples give no `--mpi`).

Where each fact comes from is written beside it. Read from NERSC's pages as stored copies: the
GPU-jobs page ("Running Jobs on Perlmutter's GPU nodes", https://docs.nersc.gov/systems/perlmutter/running-jobs/,
a 2021 copy of its source), https://docs.nersc.gov/jobs/policy/ (its opening: debug is the default
QOS, most jobs use regular; its QOS table was not in the stored copy) and
https://docs.nersc.gov/beginner-guide/nodetypesfig (the node types).
"""

from __future__ import annotations

from pathlib import Path

from parsl.config import Config
from parsl.executors import HighThroughputExecutor, MPIExecutor
from parsl.launchers import SimpleLauncher, SrunLauncher
from parsl.providers import SlurmProvider

from pipeline.core.errors import ConfigError
from site_configs import parsl_config, pools
from site_configs.queues import QueueLimit
from site_configs.spec import SiteSpec, check_scheduler

# Perlmutter's QOSes for GPU jobs of whole nodes, and the jobs each takes (checked for both pools'
# jobs: SiteSpec.qos, site_configs.checks.check_qos). The walltimes: debug 30 min, regular 48 h,
# as `sacctmgr show qos` lists them (gpu_debug 00:30:00, gpu_regular 2-00:00:00; quoted in
# https://github.com/doe-iri/iri-facility-api-python/issues/49, 2026). The node counts are NOT
# from a page read here: debug's 8 nodes is NERSC's QOS table as recalled (check
# https://docs.nersc.gov/jobs/policy/), and regular is bounded by the machine's GPU nodes, 1794
# (https://docs.nersc.gov/beginner-guide/nodetypesfig: "1794 Nodes (includes 256 large-memory GPU
# Nodes)"). Left out: shared (part of a node, no --exclusive), interactive (salloc only),
# premium, preempt, overrun and realtime (a QOS not listed here is not checked), and the per-user
# job counts (a pool's blocks beyond them wait in the queue; none is refused for it).
QOSES = (
    QueueLimit("debug", 1, 8, "00:30:00"),
    QueueLimit("regular", 1, 1794, "48:00:00"),
)
# The account: NERSC's GPU page shows `#SBATCH -A <project>`. GPU allocations are charged to the
# project's `_g` account (m1234_g) in what others run: WarpX's Perlmutter GPU profile says "GPU
# projects must end in _g" (github.com/BLAST-WarpX/warpx,
# Tools/machines/perlmutter-nersc/perlmutter_gpu_warpx.profile.example) and 2026 job records name
# accounts such as m3792_g (the issue above). NERSC's own words on the suffix were not found here:
# `sacctmgr show assoc user=$USER format=account` lists the accounts you may charge.
ACCOUNT_NOTE = "your NERSC project's GPU account, e.g. m1234_g (sacctmgr show assoc user=$USER)"

SITE = SiteSpec(
    name="perlmutter",
    scheduler="slurm",  # sbatch / squeue / scancel
    mpi_launcher="srun",  # Parsl's MPI mode reads the hosts from SLURM_NODELIST
    nodes_per_block=2,  # training job size; debug takes up to 8 nodes (QOSES)
    # One rank per A100. GPU page: "each GPU node has 4 GPUs and 64 physical cores with 2 hardware
    # threads"; node types page: 1 AMD EPYC 7763 and 4 NVIDIA A100 per GPU node.
    ranks_per_node=4,
    threads_per_rank=16,  # one TensorFlow thread per physical core of the rank's 16
    cores_per_node=64,  # AMD EPYC 7763
    # Slurm counts hardware threads. GPU page: "the -c value can be given by floor(64 / (tasks per
    # node)) * 2", i.e. -c 32 for 4 ranks per node ({cpus_per_rank}).
    hyperthreads_per_core=2,
    gpus_per_node=4,  # #SBATCH --gpus-per-node=4: no GPU is visible in a job that asks for none
    # Local rank r takes A100 r: NERSC's examples give task r of a node GPU r
    # (--gpu-bind=map_gpu:0,1,2,3, or CUDA_VISIBLE_DEVICES=$SLURM_LOCALID; GPU page). WarpX's
    # script reverses it (CUDA_VISIBLE_DEVICES=3-SLURM_LOCALID, "nvidia-smi topo -m"), which may
    # put a rank nearer its GPU; not taken, not measured here.
    gpu_order="local_rank",
    mpi_tasks_per_block=1,  # one training per job
    max_blocks=1,  # one training job at a time
    # The GPU page's srun options for 4 tasks per node, one GPU each: -c 32 --cpu-bind=cores
    # --gpus-per-task=1 (its "4 nodes, 16 tasks, 16 GPUs" examples; --ntasks-per-node comes from
    # Parsl's MPI mode). --gpu-bind=none keeps what those examples show, "all GPUs visible to all
    # tasks" (each rank then binds itself to one: pipeline.network.devices.bind_to_gpu): Slurm's
    # --gpus-per-task now "will implicitly set --gpu-bind=per_task:<gpus_per_task>, but that can be
    # overridden with an explicit --gpu-bind" (https://slurm.schedmd.com/srun.html#OPT_gpus-per-task),
    # which would show each rank one GPU, as GPU 0. No --mpi: NERSC's examples give none, so Slurm's
    # default plugin on Perlmutter starts Cray MPICH's ranks (cray_shasta, as the issue says; not
    # read in NERSC's pages here: `srun --mpi=list` names the default); --mpi=pmix, the generic
    # Slurm site's, is for OpenMPI builds.
    launcher_options="-c {cpus_per_rank} --cpu-bind=cores --gpus-per-task=1 --gpu-bind=none",
    cpu_nodes_per_block=1,  # inference/preprocessing jobs of one node...
    cpu_workers_per_node=4,  # ...4 single-process tasks, each with an A100 and 16 cores
    cpu_max_blocks=4,  # up to 4 such jobs at once
    cpu_queue=None,  # no partition: the QOS chooses (make_config refuses one)
    cpu_walltime=None,  # the training's walltime
    walltime="00:30:00",  # debug's longest; --qos regular --walltime HH:MM:SS for longer
    queue=None,  # no partition: NERSC jobs choose a QOS (make_config refuses a --queue)
    # Policy page: 'The "debug" QOS is the default QOS on Perlmutter and will be applied to any
    # job for which a QOS is not specified'; 'Most jobs are submitted to the "regular" QOS'.
    qos="debug",
    # GPU page: "To submit a job to the GPU nodes you will need to specify a 'constraint' of gpu
    # ... this constraint directive is required; otherwise, job submission will fail". The
    # 80 GB-A100 nodes: --constraint 'gpu&hbm80g' (WarpX's script; the node types page: 256).
    constraint="gpu",
    queue_limits=QOSES,  # a job its QOS does not take is refused before it is submitted
    account="YOUR_PROJECT",  # ACCOUNT_NOTE; --account: make_config refuses to submit with this
    scheduler_options="",  # extra #SBATCH lines
    # PLACEHOLDER, to replace before submitting (make_config refuses it): the module loads your
    # venv was made after, the same lines as on the login node before `make env MPI=system GPU=1`.
    # NERSC's TensorFlow/Horovod module page was not at hand; the module names WarpX's Perlmutter
    # GPU profile loads (not checked here against NERSC's pages) would be, e.g.:
    #   module load gpu PrgEnv-gnu cray-mpich cudatoolkit craype-accel-nvidia80 cray-python
    worker_init="YOUR_MODULE_LOADS",
    venv=None,  # the venv running the workflow (on home/$CFS/$SCRATCH, seen by the compute nodes)
    retries=1,  # a training killed at walltime resumes from its checkpoint on the retry
    checkpoint_every_seconds=300.0,  # a lost node costs every node at most 5 minutes of steps
    max_idletime=120.0,  # give idle nodes back after 2 minutes
    monitoring=True,  # <run_dir>/monitoring.db on the login node
    resource_monitoring_interval=0.0,  # per-task sampling off: it costs a process per task
)


def check_no_partition(site: SiteSpec) -> None:
    """NERSC jobs choose a QOS, not a partition: a queue given is refused, naming --qos."""
    for name in ("queue", "cpu_queue"):
        if (value := getattr(site, name)) is not None:
            raise ConfigError(
                f"site {site.name!r}: {name} {value!r} would be a Slurm partition, which NERSC "
                f"jobs do not choose: give the QOS with --qos (one of "
                f"{', '.join(dict.fromkeys(q.name for q in site.queue_limits))}) and leave out "
                f"--{name.replace('_', '-')}"
            )


def make_config(run_dir: Path, site: SiteSpec | None = None) -> Config:
    site = site or SITE
    check_scheduler(site, "slurm", "perlmutter")
    check_no_partition(site)
    site.require_submittable()
    # The cpu pool's one task per node gets the node's A100s, which HTEX hands out one per worker.
    gpus = f" --gpus-per-task={site.gpus_per_node}" if site.gpus_per_node else ""
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
                    account=site.account,  # #SBATCH --account= (-A)
                    qos=site.qos,  # #SBATCH --qos= (-q)
                    constraint=site.constraint,  # #SBATCH --constraint= (-C)
                    walltime=site.walltime,
                    nodes_per_block=site.nodes_per_block,
                    scheduler_options=site.scheduler_options,
                    worker_init=pools.worker_init(site),
                    exclusive=True,  # whole nodes: the ranks bind to all cores
                    gpus_per_node=site.gpus_per_node or None,  # #SBATCH --gpus-per-node=4
                    init_blocks=0,  # nodes are requested when a training task is ready
                    min_blocks=0,
                    max_blocks=site.max_blocks,
                ),
            ),
            HighThroughputExecutor(
                label=pools.CPU_LABEL,
                max_workers_per_node=site.cpu_workers_per_node,
                cpu_affinity=site.cpu_affinity,  # each worker on its own CPUs (SiteSpec.cpu_affinity)
                # One A100 per worker (CUDA_VISIBLE_DEVICES): inference blocks run on the GPUs.
                available_accelerators=site.gpus_per_node or None,
                prefetch_capacity=0,  # tasks are long; do not queue them behind busy workers
                **pools.EXECUTOR_SETTINGS,  # our interchange and pools: encrypted, heartbeats, leashed
                provider=SlurmProvider(
                    # One worker pool per node, given all of the node's hardware threads and GPUs
                    # (a job step gets one CPU per task unless told otherwise).
                    launcher=SrunLauncher(
                        overrides=f"--cpus-per-task={site.cpus_per_node} --cpu-bind=cores{gpus}"
                    ),
                    account=site.account,
                    qos=site.qos,
                    constraint=site.constraint,
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
