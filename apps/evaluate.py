"""Score the FFN segmentation and the watershed baseline against the ground truth."""

from parsl import python_app

from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL], cache=True)
def evaluate(watershed: dict, inputs=(), outputs=()):
    """inputs: staged labeled volume, segmentation.h5; outputs[0]: evaluation.json."""
    from pipeline.config import from_dict
    from pipeline.evaluation import evaluate_volume
    from pipeline.metrics import WatershedConfig

    evaluate_volume(
        f"{inputs[0].filepath}:raw", f"{inputs[0].filepath}:labels",
        f"{inputs[1].filepath}:segmentation", from_dict(WatershedConfig, watershed), outputs[0].filepath,
    )  # fmt: skip
    return outputs[0].filepath
