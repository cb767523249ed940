"""Stage an input volume into the run directory (synthetic data or the user's files)."""

from parsl import python_app

from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL])
def stage_volume(settings: dict, inputs=(), outputs=()):
    """settings: pipeline.data.staging.role_settings; inputs: the user's files; outputs[0]: the
    staged .h5 (raw and, if known, labels)."""
    from pipeline.core.stamps import run_once
    from pipeline.data.staging import stage_role

    path = outputs[0].filepath
    return run_once(
        settings, [f.filepath for f in inputs], [path], lambda: stage_role(path, settings)
    )
