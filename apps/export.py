"""Neuroglancer precomputed layers (image, segmentation with meshes) of the segmented volume, as
small tasks (pipeline.export): one begins the export, one per region writes every scale of both
layers, one per igneous meshing task meshes, and the last one checks what they wrote, adds the
manifests and segment properties and writes the completeness record. No task holds more than
a region (`ExportConfig.task_voxels` per axis), whatever the volume's size.

Each task's settings: {"export": ExportConfig, "shape": volume zyx, "region": "z0:z1, ..." or
"mesh": index}; `folder` is the export's folder (an argument, so a moved run stays up to date)."""

from parsl import python_app

from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL])
def begin_export(settings: dict, folder: str, inputs=(), outputs=()):
    """inputs: staged volume, the segmentation's full resolution (the stitching's, in `folder`);
    outputs[0]: the voxel size the export was begun with (.json). Empties the rest of `folder`
    and writes both layers' info."""
    import json

    from pipeline.atomic import atomic_path
    from pipeline.config import from_dict
    from pipeline.export import ExportConfig, begin_export
    from pipeline.stamps import run_once

    volume = inputs[0].filepath
    output = outputs[0].filepath

    def work() -> None:
        voxel_size = _voxel_size(volume)
        config = from_dict(ExportConfig, settings["export"])
        begin_export(folder, tuple(settings["shape"]), voxel_size, config)
        with atomic_path(output) as tmp:
            tmp.write_text(json.dumps({"voxel_size_nm": voxel_size}))
        # No content digest: a new (empty) export must make every later export task run again.

    return run_once(settings, [f.filepath for f in inputs], [output], work)


@python_app(executors=[CPU_LABEL])
def export_region(settings: dict, folder: str, inputs=(), outputs=()):
    """inputs: the begun export's record, staged volume, the segmentation's full resolution;
    outputs[0]: the region's record (.npz: its segments' voxel counts, the files it wrote)."""
    from pipeline.config import from_dict
    from pipeline.export import ExportConfig, save_region_record, write_region
    from pipeline.roi import Roi
    from pipeline.stamps import run_once

    volume = inputs[1].filepath
    output = outputs[0].filepath

    def work() -> None:
        region = Roi.parse(settings["region"])
        config = from_dict(ExportConfig, settings["export"])
        raw, labels = _read_region(volume, folder, region)
        save_region_record(output, region, write_region(folder, region, raw, labels, config))

    return run_once(settings, [f.filepath for f in inputs], [output], work)


@python_app(executors=[CPU_LABEL])
def export_meshes(settings: dict, folder: str, inputs=(), outputs=()):
    """inputs: the begun export's record, then the segmentation's full resolution (all it
    meshes); outputs[0]: the mesh fragments igneous's meshing task `settings["mesh"]` wrote
    (.json)."""
    import json

    from pipeline.atomic import atomic_path
    from pipeline.config import from_dict
    from pipeline.export import ExportConfig, mesh_part
    from pipeline.stamps import run_once

    output = outputs[0].filepath

    def work() -> None:
        files = mesh_part(folder, from_dict(ExportConfig, settings["export"]), settings["mesh"])
        with atomic_path(output) as tmp:
            tmp.write_text(json.dumps(files))

    return run_once(settings, [f.filepath for f in inputs], [output], work)


@python_app(executors=[CPU_LABEL])
def finish_export(settings: dict, folder: str, inputs=(), outputs=()):
    """inputs: staged volume, the segmentation's full resolution, every region's record, then
    every meshing task's record (settings["regions"] of them); outputs[0]: the export's folder.
    Rewrites what was lost or damaged since its task wrote it, then the manifests, the segment
    properties and the record `export.json`."""
    import json
    from pathlib import Path

    from pipeline.config import from_dict
    from pipeline.export import ExportConfig, finish_export, load_region_record, repair_export
    from pipeline.stamps import run_once

    paths = [f.filepath for f in inputs]
    volume = paths[0]
    count = settings["regions"]

    def work() -> None:
        config, shape = from_dict(ExportConfig, settings["export"]), tuple(settings["shape"])
        voxel_size = _voxel_size(volume)
        # Records are read one at a time: their lists of files are not held together.
        regions = (load_region_record(p) for p in paths[2 : 2 + count])
        meshes = (json.loads(Path(p).read_text()) for p in paths[2 + count :])
        repaired, counts = repair_export(
            folder, regions, meshes, lambda roi: _read_region(volume, folder, roi),
            shape, voxel_size, config,
        )  # fmt: skip
        finish_export(folder, counts, shape, voxel_size, config, repaired)

    return run_once(settings, paths, [outputs[0].filepath], work)


def _voxel_size(volume: str) -> tuple[float, float, float]:
    from pipeline.staging import read_staged

    return read_staged(volume).voxel_size_nm


def _read_region(volume: str, folder: str, region):
    """The staged image and the stitched segmentation (in the export `folder`) within `region`
    (a Roi)."""
    from pipeline.export import segmentation_spec
    from pipeline.staging import read_staged
    from pipeline.volumes import label_ids, open_volume, read_raw

    staged = read_staged(volume)
    raw, _ = read_raw(staged.raw, staged.voxel_size_nm, region.slices)
    spec = segmentation_spec(folder)
    with open_volume(spec) as array:
        return raw, label_ids(array[region.slices], spec)
