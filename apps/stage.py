"""Stage an input volume into the run directory (synthetic data or the user's files)."""

from parsl import python_app

from apps.contracts import StageVolume
from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL])
def stage_volume(settings: dict, io: StageVolume, inputs=(), outputs=()):
    """settings: pipeline.data.staging.role_settings."""
    from pipeline.core.stamps import run_once
    from pipeline.data.staging import stage_role

    work = lambda: stage_role(io.staged, settings)  # noqa: E731
    return run_once(settings, io.inputs(), io.outputs(), work)
