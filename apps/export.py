"""Neuroglancer precomputed layers (image, segmentation with meshes) of the segmented volume."""

from parsl import python_app

from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL], cache=True)
def export(export: dict, inputs=(), outputs=()):
    """inputs: staged volume, segmentation.h5; outputs[0]: the precomputed folder."""
    from pipeline.config import from_dict
    from pipeline.export import ExportConfig, export_complete, export_precomputed
    from pipeline.volumes import read_labels, read_raw

    folder = outputs[0].filepath
    if not export_complete(folder):
        raw, voxel_size = read_raw(f"{inputs[0].filepath}:raw")
        segmentation, _ = read_labels(f"{inputs[1].filepath}:segmentation")
        export_precomputed(raw, segmentation, voxel_size, folder, from_dict(ExportConfig, export))
    return folder
