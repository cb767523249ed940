"""Join the block segmentations into one chunked volume with global ids, as small tasks
(pipeline.inference.stitching): pairs per block, one id table, a relabel task per part of the layer
writing its own files (a block's core, or a shard), then a check that every file is what its
task wrote. No task holds more than a block's neighbourhood or a shard, whatever the volume's
size. The volume is the full resolution of the export's segmentation layer
(pipeline.export.layers.new_segmentation), which the export then completes.

Each task's settings: {"blocks": BlockConfig, "shape": volume zyx, "layout": how the layer is
stored (pipeline.export.layers.SegmentationLayout), "block": k (per-block tasks), "part": k (per-part
tasks), "reads": the indices of the block results among its inputs, in order}; `folder` is the
export's folder."""

from parsl import python_app

from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL])
def pair_block(settings: dict, inputs=(), outputs=()):
    """inputs: block k's result, then those of the later blocks that overlap it; outputs[0]:
    its pairs (.npz)."""
    from pipeline.core.stamps import digest_files, run_once
    from pipeline.inference.stitching import block_pairs, save_block_pairs

    blocks, config, read = _grid(settings, [f.filepath for f in inputs])
    output = outputs[0].filepath

    def work() -> str:
        save_block_pairs(output, block_pairs(settings["block"], blocks, read, config))
        return digest_files([output])

    return run_once(settings, [f.filepath for f in inputs], [output], work)


@python_app(executors=[CPU_LABEL])
def join_blocks(settings: dict, folder: str, inputs=(), outputs=()):
    """inputs: the staged volume, then every block's pairs in plan order; outputs[0]: the id
    table (.npz). Also makes the new, empty segmentation layer in `folder` that the relabel
    tasks write into."""
    from pipeline.core.stamps import run_once
    from pipeline.inference.stitching import join_ids, load_block_pairs, save_id_table

    output = outputs[0].filepath

    def work() -> None:
        save_id_table(output, *join_ids([load_block_pairs(f.filepath) for f in inputs[1:]]))
        new_layer(settings, folder, inputs[0].filepath)
        # No content digest: a new (empty) volume must make every relabel task run again.

    return run_once(settings, [f.filepath for f in inputs], [output], work)


@python_app(executors=[CPU_LABEL])
def relabel_part(settings: dict, folder: str, inputs=(), outputs=()):
    """inputs: the id table, then the results of the blocks that overlap part k of the layer
    (pipeline.inference.stitching.layer_part); outputs[0]: the part's record (.json), with the inference
    stats of the blocks it owns (`owned_blocks`). Writes part k into the segmentation layer."""
    from pipeline.core.stamps import digest, run_once
    from pipeline.inference.flood_fill import InferenceStats
    from pipeline.inference.stitching import (
        layer_part,
        load_id_table,
        owned_blocks,
        save_core_record,
        write_part,
    )

    table, results = inputs[0].filepath, [f.filepath for f in inputs[1:]]
    blocks, _, read = _grid(settings, results)
    output = outputs[0].filepath

    def work() -> str:
        offsets, lookup, _ = load_id_table(table)
        layer, k = writer_of(settings, folder), settings["part"]
        part = layer_part(k, blocks, layer.layout)
        record = write_part(k, part, blocks, read, offsets, lookup, layer)
        owned = owned_blocks(k, part, blocks, layer.layout)
        record["stats"] = sum((read.inference(i) for i in owned), InferenceStats()).to_dict()
        save_core_record(output, record)
        return digest(record["chunks"])

    return run_once(settings, [table, *results], [output], work)


@python_app(executors=[CPU_LABEL])
def finish_stitch(settings: dict, folder: str, inputs=(), outputs=()):
    """inputs: the staged volume, the id table, every block's record, then every block's
    result (plan order); outputs: stitch.json and the folder of the layer's full resolution.
    Rewrites, from the block results, any core whose chunks changed after its task wrote them
    (lost or truncated files); reads the records one at a time."""
    import dataclasses
    import json
    from pathlib import Path

    from pipeline.core.atomic import atomic_path
    from pipeline.core.stamps import run_once
    from pipeline.export.layers import SEGMENTATION_LAYER
    from pipeline.inference.stitching import check_cores, load_core_record, load_id_table

    paths = [f.filepath for f in inputs]
    count = len(paths) - 2 - len(settings["reads"])
    blocks, _, read = _grid(settings, paths[2 + count :])
    summary, full_resolution = (f.filepath for f in outputs)

    def work() -> str:
        if not (Path(folder) / SEGMENTATION_LAYER / "info").is_file():
            new_layer(settings, folder, paths[0])  # lost whole: every core is rewritten below
        layer = writer_of(settings, folder)
        records = (load_core_record(p) for p in paths[2 : 2 + count])
        checked = check_cores(records, layer, blocks, read, load_id_table(paths[1]))
        record = {
            "stitch": dataclasses.asdict(checked.stitch),
            "repaired_parts": checked.repaired,
            "inference": checked.inference.to_dict(),  # the blocks' stats summed
        }
        with atomic_path(summary) as tmp:
            tmp.write_text(json.dumps(record, indent=2))
        return checked.token

    return run_once(settings, paths, [summary, full_resolution], work)


def _grid(settings: dict, results: list[str]):
    """The block grid, the stitching settings and a reader of the task's block results by block
    index (`settings["reads"]` says which result each input path is)."""
    from pipeline.core.config_io import from_dict
    from pipeline.inference.blocks import BlockConfig, plan_blocks
    from pipeline.inference.stitching import BlockReader

    config = from_dict(BlockConfig, settings["blocks"])
    blocks = plan_blocks(settings["shape"], config)
    return blocks, config, BlockReader(blocks, dict(zip(settings["reads"], results, strict=True)))


def new_layer(settings: dict, folder: str, staged: str) -> None:
    """The empty segmentation layer in `folder`: the staged volume's shape and voxel size,
    stored as `settings["layout"]` says."""
    from pipeline.core.config_io import from_dict
    from pipeline.data.staging import read_staged
    from pipeline.export.layers import SegmentationLayout, new_segmentation

    layout = from_dict(SegmentationLayout, settings["layout"])
    new_segmentation(folder, settings["shape"], read_staged(staged).voxel_size_nm, layout)


def writer_of(settings: dict, folder: str):
    """The writer of the segmentation layer in `folder` (`new_layer`'s)."""
    from pipeline.export.layers import SegmentationWriter

    return SegmentationWriter(folder, settings["layout"]["gzip"])
