"""The split consensus of two stitched inference passes (pipeline.secondpass.agglomeration): per block core
the pairs of ids the two passes give its voxels, one table of them over the volume, a relabel
task per part of the layer writing each voxel's pair's row as its label, then a check that
every file is what its task wrote.

Each task's settings: {"blocks": BlockConfig, "shape": volume zyx, "layout": how the layer
written is stored (pipeline.export.layers.SegmentationLayout), "block": k (per-core tasks), "part": k
(per-part relabel tasks, pipeline.inference.stitching.layer_part)}; `first`, `second` are the folders
holding the two passes' layers, `folder` the one written."""

from parsl import python_app

from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL])
def consensus_pairs(settings: dict, first: str, second: str, inputs=(), outputs=()):
    """inputs: both passes' full resolutions; outputs[0]: core k's pairs of ids and their
    voxels (.npz)."""
    import numpy as np

    from apps.agglomerate import chunks_of, grid_of, layer_reader
    from pipeline.core.atomic import atomic_path
    from pipeline.core.stamps import digest_files, run_once
    from pipeline.inference.stitching import block_core
    from pipeline.secondpass.agglomeration import id_pairs

    output = outputs[0].filepath

    def work() -> str:
        core = block_core(settings["block"], grid_of(settings)[0], chunks_of(settings))
        with layer_reader(first) as read_first, layer_reader(second) as read_second:
            pairs, counts = id_pairs(read_first(core), read_second(core))
        with atomic_path(output) as tmp, open(tmp, "wb") as f:
            np.savez(f, pairs=pairs, counts=counts)
        return digest_files([output])

    return run_once(settings, [f.filepath for f in inputs], [output], work)


@python_app(executors=[CPU_LABEL])
def join_consensus_pairs(settings: dict, folder: str, inputs=(), outputs=()):
    """settings also: {"min_size": voxels}; inputs: the staged volume, then every core's
    pairs; outputs[0]: the table of pairs with at least `min_size` voxels (.npy). Also makes the
    new, empty segmentation layer in `folder` that the relabel tasks write into."""
    import numpy as np

    from apps.stitch import new_layer
    from pipeline.core.atomic import atomic_path
    from pipeline.core.stamps import run_once
    from pipeline.secondpass.agglomeration import join_id_pairs

    output = outputs[0].filepath

    def work() -> None:
        tables = []
        for f in inputs[1:]:
            with np.load(f.filepath) as found:
                tables.append((found["pairs"], found["counts"]))
        table = join_id_pairs(tables, settings["min_size"])
        with atomic_path(output) as tmp, open(tmp, "wb") as f:
            np.save(f, table)
        new_layer(settings, folder, inputs[0].filepath)
        # No content digest: a new (empty) volume must make every relabel task run again.

    return run_once(settings, [f.filepath for f in inputs], [output], work)


@python_app(executors=[CPU_LABEL])
def relabel_consensus_part(
    settings: dict, first: str, second: str, folder: str, inputs=(), outputs=()
):
    """inputs: the table, both passes' full resolutions; outputs[0]: part k's record (.json).
    Writes part k's consensus labels into the layer in `folder`."""
    import numpy as np

    from pipeline.core.stamps import digest, run_once
    from pipeline.inference.stitching import save_core_record

    table = inputs[0].filepath
    output = outputs[0].filepath

    def work() -> str:
        record = _write(settings["part"], settings, np.load(table), first, second, folder)
        save_core_record(output, record)
        return digest(record["chunks"])

    return run_once(settings, [f.filepath for f in inputs], [output], work)


@python_app(executors=[CPU_LABEL])
def finish_consensus(settings: dict, first: str, second: str, folder: str, inputs=(), outputs=()):
    """inputs: the staged volume, the table, both passes' full resolutions, then every core's
    part's record (in order); outputs: consensus.json and the folder of the layer's full
    resolution. Rewrites any part whose files changed after its task wrote them (all if the
    layer was lost)."""
    import json
    from pathlib import Path

    import numpy as np

    from apps.stitch import new_layer, writer_of
    from pipeline.core.atomic import atomic_path
    from pipeline.core.stamps import run_once
    from pipeline.export.layers import SEGMENTATION_LAYER
    from pipeline.inference.stitching import check_written_parts, load_core_record

    paths = [f.filepath for f in inputs]
    summary, full_resolution = (f.filepath for f in outputs)

    def work() -> str:
        if not (Path(folder) / SEGMENTATION_LAYER / "info").is_file():
            new_layer(settings, folder, paths[0])  # lost whole: every core is rewritten below
        table = np.load(paths[1])
        repaired, token = check_written_parts(
            (load_core_record(p) for p in paths[4:]),
            writer_of(settings, folder),
            lambda k: _write(k, settings, table, first, second, folder),
        )
        record = {"segments": len(table), "repaired_parts": repaired}
        with atomic_path(summary) as tmp:
            tmp.write_text(json.dumps(record, indent=2))
        return token

    return run_once(settings, paths, [summary, full_resolution], work)


def _write(k: int, settings: dict, table, first: str, second: str, folder: str) -> dict:
    """Part k's consensus labels written into the layer in `folder`; its record."""
    from apps.agglomerate import grid_of, layer_reader
    from apps.stitch import writer_of
    from pipeline.inference.stitching import layer_part, write_part_labels
    from pipeline.secondpass.agglomeration import consensus_labels

    blocks, _ = grid_of(settings)
    layer = writer_of(settings, folder)
    with layer_reader(first) as read_first, layer_reader(second) as read_second:
        return write_part_labels(
            k,
            layer_part(k, blocks, layer.layout),
            lambda part: consensus_labels(read_first(part), read_second(part), table),
            layer,
        )
