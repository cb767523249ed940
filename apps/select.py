"""Pick the best of the last checkpoints on a held-out volume."""

from parsl import python_app

from apps.contracts import SelectCheckpoint
from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL])
def select_checkpoint(settings: dict, io: SelectCheckpoint, inputs=(), outputs=()):
    """settings: {"selection": SelectionConfig}."""
    from pipeline.core.config_io import from_dict
    from pipeline.core.stamps import run_once
    from pipeline.data.volumes import read_volume_pair
    from pipeline.selection.checkpoints import SelectionConfig, select_checkpoint, selection_token

    def work() -> str:
        volume = read_volume_pair(f"{io.scored_on}:raw", f"{io.scored_on}:labels")
        config = from_dict(SelectionConfig, settings["selection"])
        select_checkpoint(io.train_summary.parent, volume, config, str(io.selection))
        return selection_token(str(io.selection))

    return run_once(settings, io.inputs(), io.outputs(), work)
