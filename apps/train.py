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
    from pipeline.core.errors import StageFailed
    from pipeline.core.stamps import run_once
    from pipeline.training.launch_output import run_logged

    def work() -> None:
        # Unbuffered: a write the disk refuses is dropped, not kept to fail again at close.
        with open(log, "ab", buffering=0) as out:  # the log goes on across runs
            returncode, output = run_logged(command, out)
        if returncode != 0:
            raise StageFailed.from_output("training", returncode, output, log)

    return run_once(settings, io.inputs(), io.outputs(), work)
