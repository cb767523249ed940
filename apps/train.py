"""Multi-rank Horovod training, started by the site's MPI launcher (site_configs.MPILaunch)."""

from parsl import bash_app

from site_configs import MPI_LABEL


@bash_app(executors=[MPI_LABEL], cache=True)
def train(
    command: str, inputs=(), outputs=(), stdout=None, stderr=None, parsl_resource_specification=None
):
    """`command` is the launcher line built by the workflow; it resumes from the train dir's
    latest checkpoint if one exists. outputs[0]: train_summary.json."""
    return command
