"""The export's steps: the Neuroglancer precomputed layers, region by region, their meshes and
their skeletons."""

from __future__ import annotations

import apps.export
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
from apps.plan.resolved import RunPlan
from apps.plan.step import Step, task_step
from pipeline.core import config_io
from pipeline.core.stamps import STAMPED_INSIDE_SUFFIX


def export_steps(plan: RunPlan) -> list[Step]:
    """One task begins the export, one per region writes every scale (sharded: and meshes it,
    then one plans the mesh shards and a task per few shards merges them; unsharded: one per
    igneous meshing task meshes), with skeletons one per region skeletonizes it, one plans their
    shards and a task per few shards merges them, the last checks and sums up (apps/export.py).
    Each task's record is in the export's folder."""
    config, paths = plan.config, plan.paths
    from pipeline.export.folder_layout import HERE
    from pipeline.export.layers import (
        RECORDS_DIR,
        export_regions,
        export_tasks,
        mesh_shards,
        skeleton_shards,
        task_record_path,
    )

    shape = plan.eval_shape
    export = config_io.to_dict(config.export)
    # Only the last task publishes, and only its settings name a destination other than the
    # default: one changed runs it alone, and a run made before there were any stays up to date.
    base = {"export": {k: v for k, v in export.items() if k != "destination"}, "shape": list(shape)}
    # The layers and meshes do not depend on the skeletons: turned on or off (or a run made
    # before they were), only the skeletons' tasks and the last run.
    layers = {**base, "export": {k: v for k, v in base["export"].items() if k != "skeletons"}}
    segmented = {
        "volume": paths.eval_volume,
        "segmentation": plan.full_resolution(paths.precomputed),
    }
    # In the export's folder: a folder lost whole (its records with it) begins again.
    begun = paths.precomputed / RECORDS_DIR / f"begun{STAMPED_INSIDE_SUFFIX}"
    folder = str(paths.precomputed)  # an argument, not a setting: a moved run stays up to date
    chunks, voxel_size = config.blocks.chunks, plan.voxel_size
    regions = export_regions(shape, voxel_size, config.export, chunks)
    tasks = export_tasks(shape, voxel_size, config.export, chunks)
    records = {
        kind: [task_record_path(paths.precomputed, kind, k) for k in range(count)]
        for kind, count in tasks.items()
    }
    files = BeginExport(**segmented, begun=begun)
    steps = [task_step("export[begin]", layers, files, apps.export.begin_export, folder)]
    for k, (region, record) in enumerate(zip(regions, records["region"], strict=True)):
        steps.append(task_step(f"export[region {k}]", {**layers, "region": str(region), "index": k},
                               ExportRegion(begun=begun, **segmented, record=record),
                               apps.export.export_region, folder))  # fmt: skip
    # Unsharded meshing reads only the full resolution: it need not wait for the regions' scales.
    for j, mesh in enumerate(records["mesh"]):
        files = ExportMeshes(begun=begun, segmentation=segmented["segmentation"], record=mesh)
        steps.append(task_step(f"export[mesh {j}]", {**layers, "mesh": j}, files, apps.export.export_meshes,
                               folder))  # fmt: skip
    shards = mesh_shards(tasks["region"])
    for planned in records["plan"]:  # the mesh shards, from the regions' fragments
        files = PlanMeshes(regions=tuple(records["region"]), plan=planned)
        steps.append(task_step("export[mesh plan]", {**layers, "shards": shards}, files, apps.export.plan_meshes,
                               folder))  # fmt: skip
    for j, merge in enumerate(records["merge"]):
        merging = {**layers, "merge": j, "merges": tasks["merge"]}
        files = MergeMeshes(plan=tuple(records["plan"]), record=merge)
        steps.append(
            task_step(f"export[mesh merge {j}]", merging, files, apps.export.merge_meshes, folder)
        )
    # Skeletons read only the full resolution: they need not wait for the regions' scales.
    for k, record in enumerate(records["skeleton"]):  # a region each
        files = ExportSkeletons(begun=begun, segmentation=segmented["segmentation"], record=record)
        steps.append(task_step(f"export[skeleton {k}]", {**base, "region": str(regions[k]), "index": k},
                               files, apps.export.export_skeletons, folder))  # fmt: skip
    for planned in records["skeleton_plan"]:
        files = PlanSkeletons(skeletons=tuple(records["skeleton"]), plan=planned)
        planning = {**base, "shards": skeleton_shards(tasks["skeleton"])}
        steps.append(task_step("export[skeleton plan]", planning, files, apps.export.plan_skeletons,
                               folder))  # fmt: skip
    for j, merge in enumerate(records["skeleton_merge"]):
        merging = {**base, "merge": j, "merges": tasks["skeleton_merge"]}
        files = MergeSkeletons(plan=tuple(records["skeleton_plan"]), record=merge)
        steps.append(task_step(f"export[skeleton merge {j}]", merging, files,
                               apps.export.merge_skeletons, folder))  # fmt: skip
    every = tuple(record for kind in records.values() for record in kind)
    files = FinishExport(**segmented, records=every, export=paths.precomputed)
    finish = {**base, "tasks": tasks}
    if config.export.destination != HERE:
        finish["export"] = export
    steps.append(task_step("export", finish, files, apps.export.finish_export, folder))
    return steps
