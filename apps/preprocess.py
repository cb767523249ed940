"""Partitions and seed coordinates of the training volume."""

from parsl import python_app

from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL])
def preprocess(settings: dict, inputs=(), outputs=()):
    """settings: {"partitions": PartitionConfig}; inputs[0]: staged training volume;
    outputs: partitions.h5, coordinates.npz."""
    from pipeline.core.config_io import from_dict
    from pipeline.core.stamps import run_once
    from pipeline.preprocess.partitions import PartitionConfig, preprocess

    partitions_out, coordinates_out = (f.filepath for f in outputs)
    config = from_dict(PartitionConfig, settings["partitions"])

    def work() -> None:
        labels = f"{inputs[0].filepath}:labels"
        preprocess(labels, partitions_out, coordinates_out, config, name="train")

    return run_once(settings, [inputs[0].filepath], [partitions_out, coordinates_out], work)
