"""Score the FFN segmentation and the watershed baseline against the ground truth."""

from parsl import python_app

from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL])
def evaluate(settings: dict, inputs=(), outputs=()):
    """settings: {"watershed": WatershedConfig}; inputs: staged labeled volume,
    segmentation.zarr; outputs[0]: evaluation.json."""
    from pipeline.config import from_dict
    from pipeline.evaluation import evaluate_volume
    from pipeline.metrics import WatershedConfig
    from pipeline.staging import scored_part
    from pipeline.stamps import run_once

    volume, segmentation = (f.filepath for f in inputs)
    output = outputs[0].filepath

    def work() -> None:
        evaluate_volume(
            f"{volume}:raw", f"{volume}:labels", f"{segmentation}:segmentation",
            from_dict(WatershedConfig, settings["watershed"]), output, scored_part(volume),
        )  # fmt: skip

    return run_once(settings, [volume, segmentation], [output], work)
