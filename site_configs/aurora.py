"""ALCF Aurora: PBS Pro, Aurora MPICH with Cray PALS `mpiexec`; per node 2 CPUs of 52 cores (2
hardware threads each) and 6 Intel GPUs of 2 tiles each, one Horovod rank per tile (12 per node).

    "mpi": MPIExecutor(mpi_launcher="mpiexec") on PBSProProvider(SimpleLauncher), as on Polaris;
           a training task runs `$PARSL_MPI_PREFIX python ...`, i.e. `mpiexec -n <ranks> -ppn 12
           -hosts <the job's nodes> --cpu-bind verbose,list:2-8:10-16:...:94-100 python ...`, in a
           job that exports the oneCCL and Horovod settings ALCF gives for TensorFlow
           (`TRAINING_ENV`). Rank r of a node takes XPU r, tile r % 2 of GPU r // 2, beside its cores
           (pipeline.network.devices.bind_to_gpu).
    "cpu": HighThroughputExecutor on PBSProProvider(MpiExecLauncher): a worker pool per node, 12
           workers, each with one tile (`available_accelerators`, Parsl sets ZE_AFFINITY_MASK) and 8
           cores (`WORKER_AFFINITY`), as ALCF's Parsl page configures its pool.

Before submitting: set `account` (and `queue` for more than 2 nodes: `QUEUES`), and make the venv
over ALCF's TensorFlow module on a file system the compute nodes mount (home, flare), after the
module loads of `worker_init` (docs/hpc-sites.md, "Aurora"):

    module load tensorflow; module load mpich/opt/develop-git.6037a7a
    make env MPI=system GPU=xpu    # a venv with --system-site-packages: the module's TensorFlow,
                                   # Intel's extension and Intel's Horovod (oneCCL); none built

Every fact below comes from ALCF's documentation (docs.alcf.anl.gov, whose source is the
repository argonne-lcf/user-guides; read at its commit 7d04a3f9, 2026-08-19), the page named
beside it:
    [jobs]   docs.alcf.anl.gov/aurora/running-jobs-aurora/  (docs/aurora/running-jobs-aurora.md)
    [tf]     docs.alcf.anl.gov/aurora/data-science/frameworks/tensorflow/  (.../frameworks/tensorflow.md)
    [ccl]    docs.alcf.anl.gov/aurora/data-science/frameworks/oneCCL/  (.../frameworks/oneCCL.md)
    [python] docs.alcf.anl.gov/aurora/data-science/python/  (docs/aurora/data-science/python.md)
    [parsl]  docs.alcf.anl.gov/aurora/workflows/parsl/  (docs/aurora/workflows/parsl.md)
    [node]   docs.alcf.anl.gov/aurora/  (docs/aurora/index.md, "Aurora Machine Overview")
"""

from __future__ import annotations

import shlex
from pathlib import Path

from parsl.config import Config
from parsl.executors import HighThroughputExecutor, MPIExecutor
from parsl.launchers import MpiExecLauncher, SimpleLauncher
from parsl.providers import PBSProProvider

from pipeline.network.devices import GPU_KIND_ENV
from site_configs import parsl_config, pools
from site_configs.queues import QueueLimit
from site_configs.spec import SiteSpec, check_scheduler

# -- the node [node], [jobs] "MPI rank and thread binding to cores and GPUs" --
# "Each node on Aurora has 2 sockets, each with 1 CPU and 3 PVC GPUs. Each CPU has 52 physical
# cores, with 2 logical processors ... per physical core, for a total of 104 physical cores and 208
# logical processors ... Each GPU has two tiles on it, for a total of 6 GPUs and 12 GPU tiles".
GPUS_PER_NODE = 6
TILES_PER_GPU = 2
TILES_PER_NODE = GPUS_PER_NODE * TILES_PER_GPU  # 12: one rank per tile
CORES_PER_NODE = 104
HARDWARE_THREADS_PER_NODE = 208  # [parsl]: cpus_per_node=208, "Hardware threads per node"
# Cores 0 and 52 (and their second threads, 104 and 156) "have been reserved for system services,
# and are no longer available for user applications" since March 31, 2025 [jobs]: no list below
# holds them.

# -- the queues [jobs] "Queues" --
# prod is a routing queue: it sends a job by its size to small, medium or large, each with its
# own longest walltime; "You cannot submit to these queues directly". Every queue's shortest
# walltime is 5 minutes (not checked here: QueueLimit has no minimum). Left out: visualization
# ("By request only"), the backfill-* queues (prod's, for projects with a negative balance), and
# the counts that only make jobs wait (capacity: "Max of 512 nodes across all jobs ... 2 jobs
# running per user"; all: "a limit of ten (10) jobs running/accruing per-project"). The job counts
# a submission may not pass: debug and debug-scaling "Max 1 job running/accruing/queued per-user";
# capacity "Max 5 jobs queued or running".
QUEUES = (
    QueueLimit("debug", 1, 2, "01:00:00", max_jobs=1),
    QueueLimit("debug-scaling", 2, 256, "01:00:00", max_jobs=1),
    QueueLimit("prod", 256, 1024, "12:00:00"),  # routed to small
    QueueLimit("prod", 1025, 1999, "18:00:00"),  # medium
    QueueLimit("prod", 2000, 10624, "24:00:00"),  # large; 10,624 is the "theoretical max"
    QueueLimit("capacity", 1, 16, "168:00:00", max_jobs=5),  # "7 days (168 hrs)"
)

# -- the jobs --
# [jobs] "Recommended PBSPro options": `#PBS -l place=scatter` and `#PBS -k doe` (besides -A, -N,
# walltime, filesystems and -q, which the provider and scheduler_options write). Aurora's examples
# select nodes alone (`-l select=4`), without Polaris' `system=`; Parsl's PBSProProvider always
# writes `select=N:ncpus=<cpus_per_node>`, and [parsl] gives it cpus_per_node=208 with
# select_options="": `-l select=N:ncpus=208`.
PLACE = "#PBS -l place=scatter"
KEEP = "#PBS -k doe"
SELECT_OPTIONS = ""
# [parsl]: scheduler_options="#PBS -l filesystems=home:flare" ("Change if data/modules located on
# other filesystem"); [jobs]: Flare holds the project directories (/lus/flare/projects).
FILESYSTEMS = "#PBS -l filesystems=home:flare"
# Shell lines every job runs before the venv is activated:
# - [tf] "Provided installation": TensorFlow is in the `tensorflow` module, with the MPICH module it
#   names: `module load tensorflow` and `module load mpich/opt/develop-git.6037a7a`. ("Recent major
#   changes": TensorFlow "now has its own module, separate from the `frameworks` module", which is
#   PyTorch's [python]; before October 2025 it was `module load frameworks`.) [python]: the module
#   loads "a conda environment" with TensorFlow, Intel's extension for it and Horovod, and a venv
#   made with --system-site-packages over it keeps them; load the module before activating it.
# - ZE_FLAT_DEVICE_HIERARCHY=FLAT: each tile a device, 12 per node, as [tf] lists them (XPU:0 to
#   XPU:11: "treating each tile as a separate device. You can set the environment variable
#   ZE_FLAT_DEVICE_HIERARCHY to control this behavior"); [jobs]: "The `frameworks` module sets
#   ZE_FLAT_DEVICE_HIERARCHY=FLAT", FLAT "is mode preferred for AI/ML frameworks". Set here so that
#   the tile numbers below mean one tile whatever the module's default.
# - TMPDIR=/tmp: [parsl] "Known Issues": Parsl's workers may fail with "OSError: AF_UNIX path too
#   long"; "include in the worker_init ... export TMPDIR=/tmp".
WORKER_INIT = "\n".join(
    [
        "module load tensorflow",
        "module load mpich/opt/develop-git.6037a7a",
        "export ZE_FLAT_DEVICE_HIERARCHY=FLAT",
        "export TMPDIR=/tmp",
    ]
)

# -- the training's ranks --
# [tf] "A simple job script" (TensorFlow with Horovod, 12 ranks per node, "if doing rank/tile"):
#   export CPU_BIND="verbose,list:2-8:10-16:18-24:26-32:34-40:42-48:54-60:62-68:70-76:78-84:86-92:94-100"
#   HOROVOD_THREAD_AFFINITY="4,12,20,28,36,44,56,64,72,80,88,96"
#   CCL_WORKER_AFFINITY="1,9,17,25,33,41,53,61,69,77,85,93"
#   mpiexec -np ${NRANKS} -ppn ${NRANKS_PER_NODE} --cpu-bind ${CPU_BIND} python path/to/application.py
# Rank r runs on 7 cores of the 8 at 8r+1 ... 8r+8 (the second socket's from 53), its oneCCL
# worker on the first of them and its Horovod thread on the fourth: ranks 0-5 on socket 0 beside
# GPUs 0-2, ranks 6-11 on socket 1 beside GPUs 3-5 ([jobs]: "ensure socket 0 has 6 ranks and
# socket 1 has 6 ranks"). The job script assigns the two affinities without `export`, which would
# not reach the ranks; [tf] "CPU affinity" says "These bindings should be used along with the
# following oneCCL and Horovod environment variable settings": the training's jobs export them.
CPU_BIND = "verbose,list:2-8:10-16:18-24:26-32:34-40:42-48:54-60:62-68:70-76:78-84:86-92:94-100"
HOROVOD_THREAD_AFFINITY = "4,12,20,28,36,44,56,64,72,80,88,96"
CCL_WORKER_AFFINITY = "1,9,17,25,33,41,53,61,69,77,85,93"
# What the training's jobs export, in the job script's order ([tf] "A simple job script": "This
# is a fix for running over 16 nodes", "CCL setup", "JOB LAUNCH"), then [ccl]'s "Minimal set"
# ("essential for functionality for training workloads, and we have tested up to 1024 nodes")
# where the job script lacks it. Left out: ITEX_FP32_MATH_MODE=TF32 ("Toggle tf32 on (or
# don't)": it changes the training's arithmetic; the run's [train.model] precision decides), and
# CPATH and LIBRARY_PATH (for compiling). The job script names FI_CXI_OFLOW_BUF_SIZE once and
# FI_CXI_OVFLOW_BUF_SIZE once; libfabric's and [ccl]'s name is the first.
TRAINING_ENV: tuple[tuple[str, str], ...] = (
    ("FI_CXI_DEFAULT_CQ_SIZE", "131072"),
    ("FI_CXI_OFLOW_BUF_SIZE", "8388608"),
    ("FI_CXI_CQ_FILL_PERCENT", "20"),
    ("FI_LOG_LEVEL", "warn"),
    ("FI_LOG_PROV", "cxi"),
    ("MPIR_CVAR_ENABLE_GPU", "0"),
    ("CCL_KVS_GET_TIMEOUT", "600"),
    ("LD_LIBRARY_PATH", "$CCL_ROOT/lib:$LD_LIBRARY_PATH"),
    ("CCL_PROCESS_LAUNCHER", "pmix"),
    ("CCL_ATL_TRANSPORT", "mpi"),
    ("CCL_ALLREDUCE", "topo"),
    ("CCL_ALLREDUCE_SCALEOUT", "rabenseifner"),
    ("CCL_BCAST", "double_tree"),
    ("CCL_KVS_MODE", "mpi"),
    ("CCL_CONFIGURATION_PATH", ""),
    ("CCL_CONFIGURATION", "cpu_gpu_dpcpp"),
    ("CCL_KVS_CONNECTION_TIMEOUT", "600"),
    ("CCL_ZE_CACHE_OPEN_IPC_HANDLES_THRESHOLD", "1024"),
    ("CCL_KVS_USE_MPI_RANKS", "1"),
    ("CCL_LOG_LEVEL", "WARN"),
    ("HOROVOD_THREAD_AFFINITY", HOROVOD_THREAD_AFFINITY),
    ("CCL_WORKER_AFFINITY", CCL_WORKER_AFFINITY),
    ("FI_MR_CACHE_MONITOR", "userfaultfd"),  # [ccl] "Minimal set"
    # [jobs] gpu_tile_compact.sh and "Running Multiple MPI Applications on a node": devices in
    # the order of their PCI ids, so that XPU r is tile r % 2 of GPU r // 2.
    ("ZE_ENABLE_PCI_ID_DEVICE_ORDER", "1"),
)
TRAINING_LINES = ("ulimit -c 0",)  # [tf] job script: no core files from a thousand ranks

# -- the cpu pool --
# [parsl] "Parsl Config for a Large Ensemble of Single Tile tasks": one worker per tile
# (max_workers_per_node=12), each given 8 cores and their second threads:
WORKER_AFFINITY = (
    "list:1-8,105-112:9-16,113-120:17-24,121-128:25-32,129-136:33-40,137-144:41-48,145-152"
    ":53-60,157-164:61-68,165-172:69-76,173-180:77-84,181-188:85-92,189-196:93-100,197-204"
)
# [parsl] names the tiles "0.0", "0.1", ... "5.1" (gpu.tile), Level Zero's names when each GPU is
# one device, as in the Aurora PE's default (ZE_FLAT_DEVICE_HIERARCHY=COMPOSITE, [jobs]). Under the
# FLAT hierarchy that worker_init sets (and the frameworks module sets), each tile is a device of
# its own and is named by its number: [tf] "export ZE_AFFINITY_MASK=0 ## Exposing tile 0 on GPU 0",
# and [jobs] binds ranks to tiles under the frameworks module with ZE_AFFINITY_MASK=0 ... 11.
# Parsl gives worker i the i-th name as its ZE_AFFINITY_MASK.
ACCELERATORS = tuple(str(tile) for tile in range(TILES_PER_NODE))
# [parsl]: `address=address_by_interface('hsn0')` "Ensures connections are made over the slingshot
# network"; where this machine has no hsn0 (a dry run elsewhere), Parsl's default: all addresses.
HSN_INTERFACE = "hsn0"

SITE = SiteSpec(
    name="aurora",
    scheduler="pbspro",  # [jobs]: PBSPro
    mpi_launcher="mpiexec",  # [jobs] "Aurora MPICH": mpiexec "from the Cray PALS ... system"
    nodes_per_block=1,  # training job size; debug takes 1-2 nodes, debug-scaling 2-256
    ranks_per_node=TILES_PER_NODE,  # one rank per tile ([tf]: "12 Ranks per node, if doing rank/tile")
    threads_per_rank=7,  # the 7 cores of each rank's CPU_BIND range
    cores_per_node=CORES_PER_NODE,  # 2 x 52
    hyperthreads_per_core=1,  # CPU_BIND lists one thread of each core (1-103, not 104-207)
    gpus_per_node=TILES_PER_NODE,  # the devices TensorFlow lists (FLAT); not asked for in select
    gpu_order="local_rank",  # rank r on XPU r: tile r % 2 of GPU r // 2, on its socket ([jobs])
    gpu_kind="xpu",  # TensorFlow with Intel's extension, Horovod with oneCCL ([tf], [ccl])
    mpi_tasks_per_block=1,  # one training per job
    max_blocks=1,  # one training job at a time (debug, debug-scaling: 1 job per user)
    launcher_options=f"--cpu-bind {CPU_BIND}",
    cpu_nodes_per_block=1,  # inference/preprocessing jobs of one node...
    cpu_workers_per_node=TILES_PER_NODE,  # ...with a worker per tile ([parsl])
    cpu_affinity=WORKER_AFFINITY,  # [parsl]: each worker 8 cores and their second threads
    cpu_max_blocks=2,  # capacity: "2 jobs running per user"
    # The cpu pool's 1-node jobs: capacity (1-16 nodes, <= 168 h). debug would take them too, but
    # holds 1 job per user, the training's; debug-scaling and prod take none of 1 node.
    cpu_queue="capacity",
    cpu_walltime=None,  # the training's walltime
    walltime="01:00:00",  # debug's and debug-scaling's longest
    queue="debug",  # debug (1-2 nodes), debug-scaling (2-256), prod (>= 256), capacity (1-16)
    queue_limits=QUEUES,  # a job its queue does not take is refused before it is submitted
    account="YOUR_ALLOCATION",  # your ALCF project: make_config refuses to submit with this
    scheduler_options=FILESYSTEMS,  # file systems the job needs mounted
    worker_init=WORKER_INIT,  # the TensorFlow module (and its MPICH) the venv was made over
    venv=None,  # the venv running the workflow (on home or flare, seen by the compute nodes)
    retries=1,  # a training killed at walltime resumes from its checkpoint on the retry
    checkpoint_every_seconds=300.0,  # a lost node costs every node at most 5 minutes of steps
    max_idletime=120.0,  # give idle nodes back after 2 minutes
    monitoring=True,  # <run_dir>/monitoring.db on the login node
    resource_monitoring_interval=0.0,  # per-task sampling off: it costs a process per task
)


def training_exports(site: SiteSpec) -> list[str]:
    """The lines the training's jobs run after the venv: no core files, TRAINING_ENV exported,
    and the device kind (`device_kind_export`)."""
    exports = [f"export {name}={_shell_value(value)}" for name, value in TRAINING_ENV]
    return [*TRAINING_LINES, *exports, device_kind_export(site)]


def device_kind_export(site: SiteSpec) -> str:
    """Not ALCF's: the kind of device every process that runs the network must find, in both
    pools' jobs ($FFN_GPU_KIND): a rank, or an inference worker, that finds no XPU (Intel's
    extension not loaded) stops in one line rather than run on the CPU
    (pipeline.network.devices.required_devices)."""
    return f"export {GPU_KIND_ENV}={site.gpu_kind}"


def _shell_value(value: str) -> str:
    """`value` for an export line: as it is where it expands variables ($CCL_ROOT), else quoted."""
    return value if "$" in value else shlex.quote(value)


def login_address() -> str | None:
    """This machine's address on the Slingshot network (hsn0), where the workers connect; None
    (Parsl offers all its addresses) where it has no hsn0."""
    from parsl.addresses import address_by_interface

    try:
        return address_by_interface(HSN_INTERFACE)
    except OSError:
        return None


def make_config(run_dir: Path, site: SiteSpec | None = None) -> Config:
    site = site or SITE
    check_scheduler(site, "pbspro", "aurora")
    site.require_submittable()
    scheduler_options = "\n".join(filter(None, [PLACE, site.scheduler_options, KEEP]))
    address = {"address": address} if (address := login_address()) else {}
    return parsl_config.build_config(
        run_dir,
        site,
        [
            MPIExecutor(
                label=pools.MPI_LABEL,
                mpi_launcher=site.mpi_launcher,  # mpiexec -n .. -ppn .. -hosts <the job's nodes>
                max_workers_per_block=site.mpi_tasks_per_block,  # concurrent trainings per job
                **pools.EXECUTOR_SETTINGS,  # our interchange and pools: encrypted, heartbeats, leashed
                **address,
                provider=PBSProProvider(
                    launcher=SimpleLauncher(),  # MPIExecutor needs it: one pool on the first node
                    account=site.account,
                    queue=site.queue,
                    walltime=site.walltime,
                    nodes_per_block=site.nodes_per_block,
                    cpus_per_node=HARDWARE_THREADS_PER_NODE,
                    select_options=SELECT_OPTIONS,
                    scheduler_options=scheduler_options,
                    worker_init=pools.worker_init(site, *training_exports(site)),
                    init_blocks=0,  # nodes are requested when a training task is ready
                    min_blocks=0,
                    max_blocks=site.max_blocks,
                ),
            ),
            HighThroughputExecutor(
                label=pools.CPU_LABEL,
                max_workers_per_node=site.cpu_workers_per_node,
                cpu_affinity=site.cpu_affinity,  # [parsl]: 8 cores (16 threads) per worker
                available_accelerators=list(ACCELERATORS),  # a tile per worker (ZE_AFFINITY_MASK)
                prefetch_capacity=0,  # tasks are long; do not queue them behind busy workers
                **pools.EXECUTOR_SETTINGS,  # our interchange and pools: encrypted, heartbeats, leashed
                **address,
                provider=PBSProProvider(
                    # One worker pool per node ([parsl]: "Ensures 1 manger per node").
                    launcher=MpiExecLauncher(bind_cmd="--cpu-bind", overrides="--ppn 1"),
                    account=site.account,
                    queue=site.cpu_job_queue,
                    walltime=site.cpu_job_walltime,
                    nodes_per_block=site.cpu_nodes_per_block,
                    cpus_per_node=HARDWARE_THREADS_PER_NODE,
                    select_options=SELECT_OPTIONS,
                    scheduler_options=scheduler_options,
                    worker_init=pools.cpu_worker_init(site, device_kind_export(site)),
                    init_blocks=0,  # requested when the first task is ready
                    min_blocks=0,
                    max_blocks=site.cpu_max_blocks,
                ),
            ),
        ],
    )
