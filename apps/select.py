"""Pick the best of the last checkpoints on the held-out volume."""

from parsl import python_app

from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL], cache=True)
def select_checkpoint(train_dir: str, selection: dict, inputs=(), outputs=()):
    """inputs: train_summary.json, the labeled volume to score on; outputs[0]: selection.json."""
    from pipeline.config import from_dict
    from pipeline.selection import SelectionConfig, select_checkpoint, selection_done
    from pipeline.volumes import read_volume_pair

    volume_path, output = inputs[1].filepath, outputs[0].filepath
    config = from_dict(SelectionConfig, selection)
    if not selection_done(output, train_dir, config):
        volume = read_volume_pair(f"{volume_path}:raw", f"{volume_path}:labels")
        select_checkpoint(train_dir, volume, config, output)
    return output
