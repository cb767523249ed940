"""Partitions and seed coordinates of the training volume."""

from parsl import python_app

from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL], cache=True)
def preprocess(partitions: dict, inputs=(), outputs=()):
    """inputs[0]: staged training volume; outputs: partitions.h5, coordinates.npz."""
    from pipeline.config import from_dict
    from pipeline.partitions import PartitionConfig, coordinates_complete, preprocess

    partitions_out, coordinates_out = (f.filepath for f in outputs)
    if not coordinates_complete(coordinates_out):
        config = from_dict(PartitionConfig, partitions)
        preprocess(
            f"{inputs[0].filepath}:labels", partitions_out, coordinates_out, config, name="train"
        )
    return coordinates_out
