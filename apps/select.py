"""Pick the best of the last checkpoints on a held-out volume."""

from parsl import python_app

from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL])
def select_checkpoint(settings: dict, inputs=(), outputs=()):
    """settings: {"selection": SelectionConfig}; inputs: train_summary.json, the labeled volume
    to score on; outputs[0]: selection.json."""
    from pathlib import Path

    from pipeline.core.config_io import from_dict
    from pipeline.core.stamps import run_once
    from pipeline.data.volumes import read_volume_pair
    from pipeline.selection.checkpoints import SelectionConfig, select_checkpoint, selection_token

    summary, volume_path = (f.filepath for f in inputs)
    output = outputs[0].filepath

    def work() -> str:
        volume = read_volume_pair(f"{volume_path}:raw", f"{volume_path}:labels")
        config = from_dict(SelectionConfig, settings["selection"])
        select_checkpoint(Path(summary).parent, volume, config, output)
        return selection_token(output)

    return run_once(settings, [summary, volume_path], [output], work)
