"""Neuroglancer precomputed layers (image, segmentation with meshes and skeletons) of the segmented
volume, as small tasks (pipeline.export.layers): one begins the export, one per region writes every
scale of both layers (sharded: and meshes the region, then one plans the mesh shards and a task per
few shards merges them; unsharded: one per igneous meshing task meshes), with skeletons one per
region skeletonizes it, then one plans the skeleton shards and a task per few shards merges
them, and the last one checks what they wrote, adds the segment properties and writes the
summary. Each task records what it wrote in the export's folder. No task holds more than a
region (`ExportConfig.task_voxels` per axis) or a shard's meshes or skeletons, whatever the
volume's size.

Each task's settings: {"export": ExportConfig, "shape": volume zyx, "region": "z0:z1, ..." with
"index", or "mesh": index, or "shards" (a plan), or "merge": index with "merges": count, or
"tasks": {kind: count} (the last)};
`folder` is the export's folder (an argument, so a moved run stays up to date)."""

from parsl import python_app

from apps.contracts import (
    BeginExport,
    ExportMeshes,
    ExportRegion,
    ExportSkeletons,
    FinishExport,
    MergeMeshes,
    MergeSkeletons,
    PlanMeshes,
    PlanSkeletons,
)
from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL])
def begin_export(settings: dict, folder: str, io: BeginExport, inputs=(), outputs=()):
    """Records the voxel size the export was begun with (a `.record`); empties the rest of
    `folder` (the segmentation's full resolution, the stitching's, stays) and writes both
    layers' info."""
    import json

    from pipeline.core.atomic import atomic_path
    from pipeline.core.config_io import from_dict
    from pipeline.core.stamps import run_once
    from pipeline.export.layers import ExportConfig, begin_export

    def work() -> None:
        voxel_size = _voxel_size(str(io.volume))
        config = from_dict(ExportConfig, settings["export"])
        begin_export(folder, tuple(settings["shape"]), voxel_size, config)
        with atomic_path(io.begun) as tmp:
            tmp.write_text(json.dumps({"voxel_size_nm": voxel_size}))
        # No content digest: a new (empty) export must make every later export task run again.

    # Keyed on what the volume and the layer are, not their voxels: a changed voxel does not
    # empty the export.
    return run_once(settings, io.inputs(), io.outputs(), work, io.parts(settings))


@python_app(executors=[CPU_LABEL])
def export_region(settings: dict, folder: str, io: ExportRegion, inputs=(), outputs=()):
    """Region task `settings["index"]`; its record holds its segments' voxel counts and the
    files it wrote (every scale, and sharded, its meshes' fragments)."""
    from pipeline.core.config_io import from_dict
    from pipeline.core.roi import Roi
    from pipeline.core.stamps import run_once
    from pipeline.export.layers import ExportConfig, region_step, save_region_record

    def work() -> None:
        region = Roi.parse(settings["region"])
        config = from_dict(ExportConfig, settings["export"])
        read = lambda roi: _read_region(str(io.volume), folder, roi)  # noqa: E731
        save_region_record(
            io.record, region, region_step(folder, settings["index"], region, read, config)
        )

    # Keyed on the region's voxels: a region changed elsewhere keeps it.
    return run_once(settings, io.inputs(), io.outputs(), work, io.parts(settings))


@python_app(executors=[CPU_LABEL])
def export_meshes(settings: dict, folder: str, io: ExportMeshes, inputs=(), outputs=()):
    """Unsharded exports' meshing of the full resolution (all it reads): igneous's meshing task
    `settings["mesh"]`; its record holds the legacy fragments it wrote."""
    from pipeline.core.config_io import from_dict
    from pipeline.core.stamps import run_once
    from pipeline.export.layers import ExportConfig, mesh_part, save_files_record

    def work() -> None:
        config = from_dict(ExportConfig, settings["export"])
        save_files_record(io.record, mesh_part(folder, config, settings["mesh"]))

    return run_once(settings, io.inputs(), io.outputs(), work)


@python_app(executors=[CPU_LABEL])
def plan_meshes(settings: dict, folder: str, io: PlanMeshes, inputs=(), outputs=()):
    """The sharded meshes' plan, from the regions' fragments: which segments each of about
    `settings["shards"]` mesh shards holds, and where their fragments are."""
    from pipeline.core.stamps import run_once
    from pipeline.export.layers import plan_meshes, recorded_files, save_files_record

    def work() -> None:
        regions = (recorded_files(p) for p in io.regions)
        save_files_record(io.plan, plan_meshes(folder, regions, settings["shards"]))

    return run_once(settings, io.inputs(), io.outputs(), work)


@python_app(executors=[CPU_LABEL])
def merge_meshes(settings: dict, folder: str, io: MergeMeshes, inputs=(), outputs=()):
    """Merge task `settings["merge"]` (of `settings["merges"]`) of the mesh shards; the regions'
    fragments it reads are the plan's."""
    from pipeline.core.config_io import from_dict
    from pipeline.core.stamps import run_once
    from pipeline.export.layers import ExportConfig, merge_part, save_files_record

    def work() -> None:
        config = from_dict(ExportConfig, settings["export"])
        merged = merge_part(folder, config, settings["merge"], settings["merges"])
        save_files_record(io.record, merged)

    return run_once(settings, io.inputs(), io.outputs(), work)


@python_app(executors=[CPU_LABEL])
def export_skeletons(settings: dict, folder: str, io: ExportSkeletons, inputs=(), outputs=()):
    """Skeleton task `settings["index"]`: igneous's SkeletonTask of its region of the full
    resolution (all it reads); its record holds the skeletons' pieces it wrote."""
    from pipeline.core.roi import Roi
    from pipeline.core.stamps import run_once
    from pipeline.export.layers import save_files_record, skeleton_part

    def work() -> None:
        region = Roi.parse(settings["region"])
        save_files_record(io.record, skeleton_part(folder, settings["index"], region))

    # Keyed on the voxels it reads: a region changed elsewhere keeps it.
    return run_once(settings, io.inputs(), io.outputs(), work, io.parts(settings))


@python_app(executors=[CPU_LABEL])
def plan_skeletons(settings: dict, folder: str, io: PlanSkeletons, inputs=(), outputs=()):
    """The skeletons' plan, from the skeleton tasks' pieces: which segments each of about
    `settings["shards"]` shards holds, and where their pieces are; the skeleton info."""
    from pipeline.core.config_io import from_dict
    from pipeline.core.stamps import run_once
    from pipeline.export.layers import (
        ExportConfig,
        plan_skeletons,
        recorded_files,
        save_files_record,
    )

    def work() -> None:
        sharded = from_dict(ExportConfig, settings["export"]).sharded
        pieces = (recorded_files(p) for p in io.skeletons)
        save_files_record(io.plan, plan_skeletons(folder, pieces, settings["shards"], sharded))

    return run_once(settings, io.inputs(), io.outputs(), work)


@python_app(executors=[CPU_LABEL])
def merge_skeletons(settings: dict, folder: str, io: MergeSkeletons, inputs=(), outputs=()):
    """Merge task `settings["merge"]` (of `settings["merges"]`) of the skeleton shards; the
    pieces it reads are the plan's."""
    from pipeline.core.stamps import run_once
    from pipeline.export.layers import merge_skeleton_part, save_files_record

    def work() -> None:
        merged = merge_skeleton_part(folder, settings["merge"], settings["merges"])
        save_files_record(io.record, merged)

    return run_once(settings, io.inputs(), io.outputs(), work)


@python_app(executors=[CPU_LABEL])
def finish_export(settings: dict, folder: str, io: FinishExport, inputs=(), outputs=()):
    """Rewrites what was lost or damaged since its task wrote it (records in `folder`,
    `settings["tasks"]` of each kind), then the manifests, the segment properties and the
    summary `export.json`; publishes the export to `[export] destination` unless that is
    `file://` (pipeline.export.destination)."""
    from pipeline.core.config_io import from_dict
    from pipeline.core.stamps import run_once
    from pipeline.export.destination import publish
    from pipeline.export.folder_layout import HERE
    from pipeline.export.layers import ExportConfig, finish_export, repair_export

    volume = str(io.volume)

    def work() -> None:
        config, shape = from_dict(ExportConfig, settings["export"]), tuple(settings["shape"])
        voxel_size, tasks = _voxel_size(volume), settings["tasks"]
        repaired, counts = repair_export(
            folder, tasks, lambda roi: _read_region(volume, folder, roi), shape, voxel_size,
            config,
        )  # fmt: skip
        finish_export(folder, counts, shape, voxel_size, config, tasks, repaired)
        if config.destination != HERE:
            publish(folder, config.destination)

    return run_once(settings, io.inputs(), io.outputs(), work)


def _voxel_size(volume: str) -> tuple[float, float, float]:
    from pipeline.data.staging import read_staged

    return read_staged(volume).voxel_size_nm


def _read_region(volume: str, folder: str, region):
    """The staged image and the stitched segmentation (in the export `folder`) within `region`
    (a Roi)."""
    from pipeline.data.staging import read_staged
    from pipeline.data.volumes import label_ids, open_volume, read_raw
    from pipeline.export.layers import segmentation_spec

    staged = read_staged(volume)
    raw, _ = read_raw(staged.raw, staged.voxel_size_nm, region.slices)
    spec = segmentation_spec(folder)
    with open_volume(spec) as array:
        return raw, label_ids(array[region.slices], spec)
