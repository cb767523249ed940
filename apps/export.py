"""Neuroglancer precomputed layers (image, segmentation with meshes) of the segmented volume."""

from parsl import python_app

from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL])
def export(settings: dict, inputs=(), outputs=()):
    """settings: {"export": ExportConfig}; inputs: staged volume, segmentation.zarr;
    outputs[0]: the precomputed folder."""
    from pipeline.config import from_dict
    from pipeline.export import ExportConfig, export_precomputed
    from pipeline.stamps import run_once
    from pipeline.volumes import read_labels, read_raw

    volume, segmentation_path = (f.filepath for f in inputs)
    folder = outputs[0].filepath

    def work() -> None:
        raw, voxel_size = read_raw(f"{volume}:raw")
        segmentation, _ = read_labels(f"{segmentation_path}:segmentation")
        config = from_dict(ExportConfig, settings["export"])
        export_precomputed(raw, segmentation, voxel_size, folder, config)

    return run_once(settings, [volume, segmentation_path], [folder], work)
