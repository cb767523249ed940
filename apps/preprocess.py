"""Partitions and seed coordinates of the training volume."""

from parsl import python_app

from apps.contracts import Preprocess
from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL])
def preprocess(settings: dict, io: Preprocess, inputs=(), outputs=()):
    """settings: {"partitions": PartitionConfig}."""
    from pipeline.core.config_io import from_dict
    from pipeline.core.stamps import run_once
    from pipeline.preprocess.partitions import PartitionConfig, preprocess

    config = from_dict(PartitionConfig, settings["partitions"])

    def work() -> None:
        labels = f"{io.train_volume}:labels"
        preprocess(labels, io.partitions, io.coordinates, config, name="train")

    return run_once(settings, io.inputs(), io.outputs(), work)
