"""A Parsl provider for the Cobalt scheduler (ALCF Theta), which current Parsl no longer ships.

It follows Parsl's `ClusterProvider` interface like the PBS and Slurm providers: `submit` writes a
job script and runs `qsub`, `_status` parses `qstat`, `cancel` runs `qdel`.

How multi-rank tasks run on a Cobalt site (and why not Parsl's MPI mode): the job script of a
Cobalt job runs on a shared service ("MOM") node, not on the compute nodes, and only `aprun`
reaches those. Parsl's MPI mode (`MPIExecutor`) finds a block's nodes from `PBS_NODEFILE` or
`SLURM_NODELIST`, which Cobalt does not set, and would need its own node bookkeeping. We use the
classic Theta pattern instead: the "mpi" pool uses this provider with `SimpleLauncher`, so one
worker pool starts on the MOM node; a training task there runs
`aprun -n <ranks> -N <ranks/node> -d <cpus/rank> -j <hyperthreads> --cc depth ... python ...`
(`SiteSpec.mpi_launch`), and ALPS places the ranks on free compute nodes of the job. The "cpu"
pool uses `AprunLauncher` so its worker pools run on the compute nodes themselves.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import stat
import time

from parsl.jobs.states import JobState, JobStatus
from parsl.launchers import AprunLauncher
from parsl.launchers.base import Launcher
from parsl.providers.cluster_provider import ClusterProvider
from parsl.providers.errors import SubmitException
from parsl.utils import RepresentationMixin, wtime_to_minutes

logger = logging.getLogger(__name__)

# Cobalt job states (qstat "State" column) as Parsl job states.
translate_table = {
    "QUEUED": JobState.PENDING,
    "STARTING": JobState.PENDING,
    "RUNNING": JobState.RUNNING,
    "EXITING": JobState.COMPLETED,
    "KILLING": JobState.CANCELLED,
    "USER_HOLD": JobState.HELD,
    "ADMIN_HOLD": JobState.HELD,
    "DEP_HOLD": JobState.HELD,
    "MAXRUN_HOLD": JobState.HELD,
}

# The job script. Cobalt runs it on a MOM node; options are given on the qsub command line, and
# `scheduler_options` may add '#COBALT' lines (e.g. --attrs filesystems=home,grand).
template_string = """#!/bin/bash
${scheduler_options}

${worker_init}

echo "Cobalt job $$COBALT_JOBID on $$COBALT_JOBSIZE node(s): $$COBALT_PARTNAME"

export JOBNAME="${jobname}"

${user_script}
"""


class CobaltProvider(ClusterProvider, RepresentationMixin):
    """Cobalt Execution Provider: `qsub` to submit, `qstat` for status, `qdel` to cancel.

    Parameters
    ----------
    account : str
        Project the job is charged to (qsub -A).
    queue : str
        Queue to submit to (qsub -q), e.g. debug-cache-quad or default on Theta.
    scheduler_options : str
        Lines added at the top of the job script ('#COBALT ...').
    worker_init : str
        Shell commands run before the worker pool starts (module loads, venv activation).
    nodes_per_block : int
        Nodes of one job (qsub -n).
    init_blocks, min_blocks, max_blocks, parallelism :
        As for every Parsl provider.
    walltime : str
        HH:MM:SS of each job (qsub -t, in minutes).
    launcher : Launcher
        `AprunLauncher` to start a worker pool on every compute node, `SimpleLauncher` to start
        one on the MOM node (whose tasks then call aprun themselves).
    cmd_timeout : int
        Seconds to wait for qsub/qstat/qdel.
    """

    def __init__(
        self,
        account: str | None = None,
        queue: str | None = None,
        scheduler_options: str = "",
        worker_init: str = "",
        nodes_per_block: int = 1,
        init_blocks: int = 0,
        min_blocks: int = 0,
        max_blocks: int = 1,
        parallelism: float = 1,
        walltime: str = "00:10:00",
        launcher: Launcher | None = None,
        cmd_timeout: int = 60,
    ):
        launcher = launcher if launcher is not None else AprunLauncher()
        super().__init__(
            "cobalt",
            nodes_per_block,
            init_blocks,
            min_blocks,
            max_blocks,
            parallelism,
            walltime,
            launcher,
            cmd_timeout=cmd_timeout,
        )
        self.account = account
        self.queue = queue
        self.scheduler_options = scheduler_options
        self.worker_init = worker_init

    def submit(self, command: str, tasks_per_node: int, job_name: str = "parsl.cobalt") -> str:
        """Write the job script and qsub it; returns Cobalt's job id."""
        job_name = f"{job_name}.{time.time()}"
        assert self.script_dir, "Expected script_dir to be set"
        prefix = os.path.abspath(os.path.join(self.script_dir, job_name))
        script_path = prefix + ".submit"
        # Cobalt writes <prefix>.output, <prefix>.error and <prefix>.cobaltlog (qsub -O).
        stdout_path, stderr_path = prefix + ".output", prefix + ".error"

        job_config = {
            "scheduler_options": self.scheduler_options,
            "worker_init": self.worker_init,
            "user_script": self.launcher(
                command, tasks_per_node, self.nodes_per_block, self.script_dir
            ),
        }
        logger.debug("Writing Cobalt submit script %s", script_path)
        self._write_submit_script(template_string, script_path, job_name, job_config)
        # Cobalt runs the script itself, so it must be executable.
        os.chmod(script_path, os.stat(script_path).st_mode | stat.S_IXUSR | stat.S_IXGRP)

        words = [
            "qsub",
            "-n",
            str(self.nodes_per_block),
            "-t",
            str(wtime_to_minutes(self.walltime)),
        ]
        if self.queue:
            words += ["-q", self.queue]
        if self.account:
            words += ["-A", self.account]
        words += ["-O", prefix, script_path]
        launch_cmd = shlex.join(words)
        retcode, stdout, stderr = self.execute_wait(launch_cmd)
        # qsub may print notices ("Job routed to queue ...") before the id, which is a number.
        ids = [line.strip() for line in stdout.splitlines() if re.fullmatch(r"\d+", line.strip())]
        if retcode != 0 or not ids:
            logger.error("%r failed: %s STDOUT:%s STDERR:%s", launch_cmd, retcode, stdout, stderr)
            raise SubmitException(
                job_name,
                f"Submit command {launch_cmd!r} failed or printed no job id",
                stdout=stdout,
                stderr=stderr,
                retcode=retcode,
            )
        job_id = ids[-1]
        self.resources[job_id] = {
            "job_id": job_id,
            "status": JobStatus(JobState.PENDING),
            "job_stdout_path": stdout_path,
            "job_stderr_path": stderr_path,
        }
        return job_id

    def _status(self) -> None:
        """Update every job's state from `qstat -u <user>`; a job qstat no longer lists is done."""
        retcode, stdout, stderr = self.execute_wait('qstat -u "${USER:-$(id -un)}"')
        if retcode != 0:
            logger.warning("qstat failed (%s): %s %s", retcode, stdout.strip(), stderr.strip())
            return
        states: dict[str, str] = {}
        state_column = None
        for line in stdout.splitlines():
            words = line.split()
            if not words or line.startswith("="):
                continue
            if words[0].upper() == "JOBID":  # header: find the State column
                upper = [w.upper() for w in words]
                state_column = upper.index("STATE") if "STATE" in upper else None
                continue
            if state_column is not None and len(words) > state_column:
                states[words[0]] = words[state_column].upper()
        for job_id, job in self.resources.items():
            if job["status"].terminal:
                continue
            state = states.get(job_id)
            parsl_state = (
                JobState.COMPLETED
                if state is None
                else translate_table.get(state, JobState.UNKNOWN)
            )
            job["status"] = JobStatus(
                parsl_state,
                stdout_path=job["job_stdout_path"],
                stderr_path=job["job_stderr_path"],
            )

    def cancel(self, job_ids: list[str]) -> list[bool]:
        """qdel the jobs; all True, or all False when qdel failed."""
        if not job_ids:
            return []
        retcode, stdout, stderr = self.execute_wait(shlex.join(["qdel", *job_ids]))
        if retcode != 0:
            logger.warning("qdel failed (%s): %s %s", retcode, stdout.strip(), stderr.strip())
            return [False for _ in job_ids]
        for job_id in job_ids:
            self.resources[job_id]["status"] = JobStatus(JobState.CANCELLED)
        return [True for _ in job_ids]

    @property
    def status_polling_interval(self) -> int:
        return 60
