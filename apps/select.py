"""Pick the best of the last checkpoints on a held-out volume."""

from parsl import python_app

from apps.contracts import SelectCheckpoint
from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL])
def select_checkpoint(settings: dict, io: SelectCheckpoint, inputs=(), outputs=()):
    """settings: {"selection": SelectionConfig, "partitions": {"min_object_voxels": ...}}."""
    from pipeline.core.config_io import from_dict
    from pipeline.core.stamps import run_once
    from pipeline.data.volumes import read_volume_pair
    from pipeline.selection.checkpoints import (
        SelectionConfig,
        checkpoint_files,
        chosen_checkpoint,
        select_checkpoint,
        selection_token,
    )

    def work() -> str:
        volume = read_volume_pair(f"{io.scored_on}:raw", f"{io.scored_on}:labels")
        config = from_dict(SelectionConfig, settings["selection"])
        select_checkpoint(
            io.train_summary.parent,
            volume,
            config,
            str(io.selection),
            min_object_voxels=settings["partitions"]["min_object_voxels"],
        )
        return selection_token(str(io.selection))

    # The chosen checkpoint's files (size, mtime) in the stamp: one damaged since (cut short)
    # runs the selection again, which sets it aside; they leave the task's identity and token as
    # they were, so a run selected before they were recorded stays up to date.
    def chosen_files() -> list:
        return checkpoint_files(chosen_checkpoint(io.selection))

    return run_once(settings, io.inputs(), io.outputs(), work, checked=chosen_files)
