"""The export's steps: the Neuroglancer precomputed layers, region by region, and their meshes."""

from __future__ import annotations

import apps.export
from apps.contracts import (
    BeginExport,
    ExportMeshes,
    ExportRegion,
    FinishExport,
    MergeMeshes,
    PlanMeshes,
)
from apps.plan.resolved import RunPlan
from apps.plan.step import Step, task_step
from pipeline.core import config_io
from pipeline.core.stamps import STAMPED_INSIDE_SUFFIX


def export_steps(plan: RunPlan) -> list[Step]:
    """One task begins the export, one per region writes every scale (sharded: and meshes it,
    then one plans the mesh shards and a task per shard merges it; unsharded: one per igneous
    meshing task meshes), the last checks and sums up (apps/export.py). Each task's record is
    in the export's folder."""
    config, paths = plan.config, plan.paths
    from pipeline.export.layers import (
        RECORDS_DIR,
        export_regions,
        export_tasks,
        mesh_shards,
        task_record_path,
    )

    shape = plan.eval_shape
    base = {"export": config_io.to_dict(config.export), "shape": list(shape)}
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
    steps = [task_step("export[begin]", base, files, apps.export.begin_export, folder)]
    for k, (region, record) in enumerate(zip(regions, records["region"], strict=True)):
        steps.append(task_step(f"export[region {k}]", {**base, "region": str(region), "index": k},
                               ExportRegion(begun=begun, **segmented, record=record),
                               apps.export.export_region, folder))  # fmt: skip
    # Unsharded meshing reads only the full resolution: it need not wait for the regions' scales.
    for j, mesh in enumerate(records["mesh"]):
        files = ExportMeshes(begun=begun, segmentation=segmented["segmentation"], record=mesh)
        steps.append(task_step(f"export[mesh {j}]", {**base, "mesh": j}, files, apps.export.export_meshes,
                               folder))  # fmt: skip
    shards = mesh_shards(tasks["region"])
    for planned in records["plan"]:  # the mesh shards, from the regions' fragments
        files = PlanMeshes(regions=tuple(records["region"]), plan=planned)
        steps.append(task_step("export[mesh plan]", {**base, "shards": shards}, files, apps.export.plan_meshes,
                               folder))  # fmt: skip
    for j, merge in enumerate(records["merge"]):
        merging = {**base, "merge": j, "merges": tasks["merge"]}
        files = MergeMeshes(plan=tuple(records["plan"]), record=merge)
        steps.append(
            task_step(f"export[mesh merge {j}]", merging, files, apps.export.merge_meshes, folder)
        )
    every = tuple(record for kind in records.values() for record in kind)
    files = FinishExport(**segmented, records=every, export=paths.precomputed)
    steps.append(
        task_step("export", {**base, "tasks": tasks}, files, apps.export.finish_export, folder)
    )
    return steps
