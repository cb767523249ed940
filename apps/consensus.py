"""The split consensus of two stitched inference passes (pipeline.secondpass.agglomeration): per block core
the pairs of ids the two passes give its voxels, one table of them over the volume, a relabel
task per part of the layer writing each voxel's pair's row as its label, then a check that
every file is what its task wrote.

Each task's settings: {"blocks": BlockConfig, "shape": volume zyx, "layout": how the layer
written is stored (pipeline.export.layers.SegmentationLayout), "block": k (per-core tasks), "part": k
(per-part relabel tasks, pipeline.inference.stitching.layer_part)}; `first`, `second` are the folders
holding the two passes' layers, `folder` the one written."""

from parsl import python_app

from apps.contracts import (
    ConsensusPairs,
    FinishConsensus,
    JoinConsensusPairs,
    RelabelConsensusPart,
)
from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL])
def consensus_pairs(settings: dict, first: str, second: str, io: ConsensusPairs, inputs=(), outputs=()):  # fmt: skip
    """Core k's pairs of ids and their voxels."""
    from pipeline.core.stamps import digest_files, run_once
    from pipeline.inference.stitching import block_core
    from pipeline.secondpass.agglomeration import id_pairs
    from pipeline.secondpass.part_writing import chunks_of, grid_of, layer_reader, save_id_pairs

    def work() -> str:
        core = block_core(settings["block"], grid_of(settings)[0], chunks_of(settings))
        with layer_reader(first) as read_first, layer_reader(second) as read_second:
            save_id_pairs(io.pairs, *id_pairs(read_first(core), read_second(core)))
        return digest_files([io.pairs])

    return run_once(settings, io.inputs(), io.outputs(), work)


@python_app(executors=[CPU_LABEL])
def join_consensus_pairs(settings: dict, folder: str, io: JoinConsensusPairs, inputs=(), outputs=()):  # fmt: skip
    """settings also: {"min_size": voxels}; the table keeps the pairs with at least `min_size`
    voxels. Also makes the new, empty segmentation layer in `folder` that the relabel tasks
    write into."""
    from pipeline.core.stamps import run_once
    from pipeline.inference.stitching import new_layer
    from pipeline.secondpass.agglomeration import join_id_pairs
    from pipeline.secondpass.part_writing import load_id_pairs, save_consensus_table

    def work() -> None:
        tables = [load_id_pairs(p) for p in io.pairs]
        save_consensus_table(io.table, join_id_pairs(tables, settings["min_size"]))
        new_layer(settings, folder, io.volume)
        # No content digest: a new (empty) volume must make every relabel task run again.

    return run_once(settings, io.inputs(), io.outputs(), work)


@python_app(executors=[CPU_LABEL])
def relabel_consensus_part(
    settings: dict, first: str, second: str, folder: str, io: RelabelConsensusPart, inputs=(),
    outputs=(),
):  # fmt: skip
    """Writes part k's consensus labels into the layer in `folder`."""
    import numpy as np

    from pipeline.core.stamps import digest, run_once
    from pipeline.inference.stitching import save_core_record
    from pipeline.secondpass.part_writing import write_consensus_part

    def work() -> str:
        table = np.load(io.table)
        record = write_consensus_part(settings["part"], settings, table, first, second, folder)
        save_core_record(io.record, record)
        return digest(record["chunks"])

    return run_once(settings, io.inputs(), io.outputs(), work)


@python_app(executors=[CPU_LABEL])
def finish_consensus(
    settings: dict, first: str, second: str, folder: str, io: FinishConsensus, inputs=(),
    outputs=(),
):  # fmt: skip
    """Rewrites any part whose files changed after its task wrote them (all if the layer was
    lost); writes consensus.json."""
    import json

    import numpy as np

    from pipeline.core.atomic import atomic_path
    from pipeline.core.stamps import run_once
    from pipeline.inference.stitching import check_written_parts, layer_to_check, load_core_record
    from pipeline.secondpass.part_writing import write_consensus_part

    def work() -> str:
        layer = layer_to_check(settings, folder, io.volume)
        table = np.load(io.table)
        repaired, token = check_written_parts(
            (load_core_record(p) for p in io.records),
            layer,
            lambda k: write_consensus_part(k, settings, table, first, second, folder),
        )
        record = {"segments": len(table), "repaired_parts": repaired}
        with atomic_path(io.summary) as tmp:
            tmp.write_text(json.dumps(record, indent=2))
        return token

    return run_once(settings, io.inputs(), io.outputs(), work)
