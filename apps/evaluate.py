"""Score the FFN segmentation and the watershed baseline against the ground truth."""

from parsl import python_app

from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL])
def evaluate(settings: dict, folder: str, inputs=(), outputs=()):
    """settings: {"watershed": WatershedConfig}; inputs: staged labeled volume, the
    segmentation's full resolution (in the export `folder`); outputs[0]: evaluation.json."""
    from pipeline.config import from_dict
    from pipeline.evaluation import evaluate_volume
    from pipeline.export import segmentation_spec
    from pipeline.metrics import WatershedConfig
    from pipeline.staging import read_staged
    from pipeline.stamps import run_once

    volume, segmentation = (f.filepath for f in inputs)
    output = outputs[0].filepath

    def work() -> None:
        staged = read_staged(volume)
        evaluate_volume(
            staged.raw, staged.labels, segmentation_spec(folder),
            from_dict(WatershedConfig, settings["watershed"]), output, staged.scored,
            staged.voxel_size_nm,
        )  # fmt: skip

    return run_once(settings, [volume, segmentation], [output], work)
