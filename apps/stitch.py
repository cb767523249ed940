"""Join the block segmentations into one chunked volume with global ids, as small tasks
(pipeline.inference.stitching): pairs per block, one id table, a relabel task per part of the layer
writing its own files (a block's core, or a shard), then a check that every file is what its
task wrote. No task holds more than a block's neighbourhood or a shard, whatever the volume's
size. The volume is the full resolution of the export's segmentation layer
(pipeline.export.layers.new_segmentation), which the export then completes.

Each task's settings: {"blocks": BlockConfig, "shape": volume zyx, "layout": how the layer is
stored (pipeline.export.layers.SegmentationLayout), "block": k (per-block tasks), "part": k (per-part
tasks), "reads": which block's result each of its block results is, in order}; `folder` is the
export's folder."""

from parsl import python_app

from apps.contracts import FinishStitch, JoinBlocks, PairBlock, RelabelPart
from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL])
def pair_block(settings: dict, io: PairBlock, inputs=(), outputs=()):
    """Block k's pairs with the later blocks that overlap it."""
    from pipeline.core.stamps import digest_files, run_once
    from pipeline.inference.stitching import block_pairs, save_block_pairs, task_blocks

    def work() -> str:
        blocks, config, read = task_blocks(settings, io.results)
        save_block_pairs(io.pairs, block_pairs(settings["block"], blocks, read, config))
        return digest_files([io.pairs])

    return run_once(settings, io.inputs(), io.outputs(), work)


@python_app(executors=[CPU_LABEL])
def join_blocks(settings: dict, folder: str, io: JoinBlocks, inputs=(), outputs=()):
    """The id table of every block's pairs, each object's stitched id the name of its
    component (`stable_lookup`). Also makes the segmentation layer in `folder` that the
    relabel tasks write into, new and empty unless the one there is stored as asked
    (`keep_layer`)."""
    from pipeline.core.stamps import run_once, save_cells
    from pipeline.inference.stitching import (
        join_ids,
        keep_layer,
        layer_identity,
        load_block_pairs,
        save_id_table,
        stable_lookup,
        table_cells,
        task_blocks,
    )

    def work() -> str:
        found = [load_block_pairs(p) for p in io.pairs]
        offsets, components, merges = join_ids(found)
        lookup = stable_lookup(offsets, components, found)
        save_id_table(io.table, offsets, lookup, merges)
        keep_layer(settings, folder, io.volume)
        # The token: the ids per block, so a relabel task runs again only where its blocks'
        # ids changed (a layer made anew: its stamps say where they are, the check rewrites).
        blocks, _, _ = task_blocks(settings)
        identity = layer_identity(settings, io.volume)
        return save_cells(io.table, table_cells(blocks, offsets, lookup, identity))

    return run_once(settings, io.inputs(), io.outputs(), work, io.parts(settings))


@python_app(executors=[CPU_LABEL])
def relabel_part(settings: dict, folder: str, io: RelabelPart, inputs=(), outputs=()):
    """Writes part k (pipeline.inference.stitching.layer_part) into the segmentation layer; its
    record holds the inference stats of the blocks it owns (`owned_blocks`)."""
    from pipeline.core.stamps import digest, run_once
    from pipeline.inference.stitching import relabel_task_part, save_core_record

    def work() -> str:
        record = relabel_task_part(settings, folder, io.table, io.results)
        save_core_record(io.record, record)
        return digest(record["chunks"])

    # Keyed on its blocks' ids in the table: a table changed elsewhere keeps it.
    return run_once(settings, io.inputs(), io.outputs(), work, io.parts(settings))


@python_app(executors=[CPU_LABEL])
def finish_stitch(settings: dict, folder: str, io: FinishStitch, inputs=(), outputs=()):
    """Rewrites, from the block results, any part whose files changed after its task wrote them
    (lost or truncated files; the whole layer if it was lost); reads the records one at a time;
    writes stitch.json with the blocks' inference stats summed."""
    import dataclasses
    import json

    from pipeline.core.atomic import atomic_path
    from pipeline.core.stamps import run_once, save_cells
    from pipeline.inference.stitching import (
        LayerCells,
        check_cores,
        layer_identity,
        layer_to_check,
        load_core_record,
        load_id_table,
        task_blocks,
    )

    def work() -> str:
        blocks, _, read = task_blocks(settings, io.results)
        layer = layer_to_check(settings, folder, io.volume)
        records = (load_core_record(p) for p in io.records)
        identity = layer_identity(settings, io.volume)
        cells = LayerCells(settings["shape"], layer.layout.chunk_zyx, identity)
        checked = check_cores(records, layer, blocks, read, load_id_table(io.table), cells)
        record = {
            "stitch": dataclasses.asdict(checked.stitch),
            "repaired_parts": checked.repaired,
            "inference": checked.inference.to_dict(),  # the blocks' stats summed
        }
        with atomic_path(io.summary) as tmp:
            tmp.write_text(json.dumps(record, indent=2))
        # The token: the parts' files per chunk, so a task reading a region of the layer (an
        # export or evaluation region) runs again only where a part changed.
        return save_cells(io.full_resolution, cells.cells())

    return run_once(settings, io.inputs(), io.outputs(), work, io.parts(settings))
