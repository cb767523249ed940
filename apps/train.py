"""Multi-rank Horovod training, started by the site's MPI launcher (site_configs.MPILaunch)."""

from parsl import python_app

from apps.contracts import Train
from site_configs import MPI_LABEL


@python_app(executors=[MPI_LABEL])
def train(
    settings: dict,
    command: str,
    log: str,
    io: Train,
    inputs=(),
    outputs=(),
    parsl_resource_specification=None,
):
    """settings: {"train": TrainConfig, "ranks": N, "init_from": path}; `command` is the launch
    line built by the workflow (it resumes from the train dir's latest checkpoint of the same
    lineage); its output is appended to `log`."""
    import subprocess

    from pipeline.core.errors import StageFailed
    from pipeline.core.stamps import run_once

    def work() -> None:
        with open(log, "ab") as out:
            begun = out.tell()  # the log goes on across runs: this launch's part starts here
            # Same process group as the worker: cancelling the worker's block stops the ranks.
            done = subprocess.run(
                command, shell=True, executable="/bin/bash", stdout=out, stderr=subprocess.STDOUT
            )
        if done.returncode != 0:
            raise StageFailed.from_log("training", done.returncode, log, since=begun)

    return run_once(settings, io.inputs(), io.outputs(), work)
