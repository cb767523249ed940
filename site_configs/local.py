"""This machine: worker pools as local processes, training ranks through the venv's MPICH mpiexec.

"mpi": MPIExecutor(mpi_launcher="mpiexec") on LocalProvider(SimpleLauncher); a training task
       runs `$PARSL_MPI_PREFIX python -m pipeline.cli.train ...`, i.e.
       `mpiexec -n 2 -ppn 2 -hosts localhost python -m pipeline.cli.train ...`.
"cpu": HighThroughputExecutor on LocalProvider, one worker per core.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from parsl.config import Config
from parsl.executors import HighThroughputExecutor, MPIExecutor
from parsl.launchers import SimpleLauncher
from parsl.providers import LocalProvider

from site_configs import parsl_config, pools
from site_configs.spec import SiteSpec, check_scheduler

# The CPUs this process may use (taskset, a container's or a batch job's cpuset), not the
# machine's: Parsl's block affinity gives each worker its own, and a worker left with none fails
# to start, again and again, while the run waits.
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

SITE = SiteSpec(
    name="local",
    scheduler="local",  # processes on this machine, no batch scheduler
    mpi_launcher="mpiexec",  # .venv/bin/mpiexec (mpich wheel), the MPI Horovod was built with
    nodes_per_block=1,  # one machine
    ranks_per_node=2,  # the 2-rank demo training
    threads_per_rank=max(1, _CORES // 2),  # the cores split between the ranks (1 each on 2 cores)
    cores_per_node=max(2, _CORES),  # at least 2 so the 2-rank demo also runs on 1 core (slowly)
    mpi_tasks_per_block=1,  # one training at a time
    max_blocks=1,  # one pool of MPI workers
    cpu_workers_per_node=_CORES,  # one single-process task per core
    cpu_max_blocks=1,  # one local pool
    retries=2,  # a lost worker's task runs again (training resumes from its checkpoint)
    monitoring=True,  # task states and timings into <run_dir>/monitoring.db
    resource_monitoring_interval=0.0,  # no per-task sampling process on a 2-core machine
    # Local blocks start in about 2 s: with Parsl's 5 s between scaling decisions the first
    # task of a run waited up to 5 s more for its pool to be asked for.
    strategy_period=0.5,
)


def make_config(run_dir: Path, site: SiteSpec | None = None) -> Config:
    site = site or SITE
    check_scheduler(site, "local", "local")
    site.require_submittable()
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    # Parsl's MPI mode reads a block's hosts from PBS_NODEFILE (or Slurm's SLURM_NODELIST) and
    # refuses to start without one: give it a node file that names this machine.
    nodefile = run_dir / "localhost.nodes"
    nodefile.write_text("localhost\n")
    return parsl_config.build_config(
        run_dir,
        site,
        [
            MPIExecutor(
                label=pools.MPI_LABEL,
                mpi_launcher=site.mpi_launcher,  # mpiexec -n .. -ppn .. -hosts localhost
                max_workers_per_block=site.mpi_tasks_per_block,  # concurrent trainings
                address="127.0.0.1",  # workers are on this machine
                **pools.EXECUTOR_SETTINGS,  # our interchange and pools: encrypted, heartbeats, leashed
                provider=LocalProvider(
                    launcher=SimpleLauncher(),  # MPIExecutor needs it: one pool per block
                    nodes_per_block=1,
                    init_blocks=0,  # started when the first training task arrives
                    min_blocks=0,
                    max_blocks=site.max_blocks,
                    worker_init=pools.worker_init(
                        site, f"export PBS_NODEFILE={shlex.quote(str(nodefile))}"
                    ),
                ),
            ),
            HighThroughputExecutor(
                label=pools.CPU_LABEL,
                max_workers_per_node=site.cpu_workers_per_node,  # one task per core
                cpu_affinity=site.cpu_affinity,  # each worker on its own CPUs (SiteSpec.cpu_affinity)
                address="127.0.0.1",
                **pools.EXECUTOR_SETTINGS,  # our interchange and pools: encrypted, heartbeats, leashed
                provider=LocalProvider(
                    init_blocks=0,  # started by the first task
                    min_blocks=0,
                    max_blocks=site.cpu_max_blocks,
                    worker_init=pools.cpu_worker_init(site),
                ),
            ),
        ],
    )
