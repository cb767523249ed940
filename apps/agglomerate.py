"""FFN's second pass after stitching (pipeline.secondpass.agglomeration): the stitched first pass's touching
pairs found per block core, one table of them, a decision task per core (two flood fills per
pair around its contact), one table of merges, a relabel task per part of the export's
segmentation layer writing it (with the fill, its 0s filled over the boundary map that the
learned watershed's forest, apps/evaluate.py's `boundary_forest`, predicts part by part; with
`fill_min_size`, the objects' voxels counted per part and summed first, and the objects too
small in all filled alike), then a check that every file is what its task wrote.

Each task's settings: {"blocks": BlockConfig, "shape": volume zyx, "layout": how the layer
written is stored (pipeline.export.layers.SegmentationLayout), "block": k (per-core tasks), "part": k
(per-part relabel tasks, pipeline.inference.stitching.layer_part), "parts": how many (the last task),
"agglomeration": AgglomerationConfig (the tasks up to the decisions: only the settings the
fills depend on)}; `first_pass` is the folder holding the stitched first pass's layer, `folder`
the export's."""

from parsl import python_app

from apps.contracts import (
    CountPart,
    DecideCore,
    FinishAgglomeration,
    FinishGraph,
    JoinPairs,
    MergeGraph,
    MergePairs,
    PairCore,
    RelabelGraphPart,
    RelabelMergedPart,
    SumSizes,
)
from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL])
def pair_core(settings: dict, first_pass: str, io: PairCore, inputs=(), outputs=()):
    """Core k's contacts."""
    from pipeline.core.stamps import digest_files, run_once
    from pipeline.secondpass.agglomeration import core_contacts, save_contact_table
    from pipeline.secondpass.part_writing import chunks_of, grid_of, layer_reader

    def work() -> str:
        blocks, config = grid_of(settings)
        with layer_reader(first_pass) as read:
            found = core_contacts(settings["block"], blocks, read, settings["shape"],
                                  chunks_of(settings), config.max_gap)  # fmt: skip
        save_contact_table(io.contacts, found)
        return digest_files([io.contacts])

    return run_once(settings, io.inputs(), io.outputs(), work)


@python_app(executors=[CPU_LABEL])
def join_pairs(settings: dict, io: JoinPairs, inputs=(), outputs=()):
    """The pairs to decide: those touching over at least `min_contact` in all."""
    from pipeline.core.stamps import digest_files, run_once
    from pipeline.secondpass.agglomeration import (
        load_contact_table,
        merge_contact_tables,
        save_contact_table,
    )
    from pipeline.secondpass.part_writing import grid_of

    def work() -> str:
        tables = [load_contact_table(p) for p in io.contacts]
        save_contact_table(io.pairs, merge_contact_tables(tables, grid_of(settings)[1].min_contact))
        return digest_files([io.pairs])

    return run_once(settings, io.inputs(), io.outputs(), work)


@python_app(executors=[CPU_LABEL])
def count_part(settings: dict, first_pass: str, io: CountPart, inputs=(), outputs=()):
    """The voxels of each object in part k of the layer (pipeline.inference.stitching.layer_part)."""
    from pipeline.core.config_io import from_dict
    from pipeline.core.stamps import digest_files, run_once
    from pipeline.export.segmentation_layer import SegmentationLayout
    from pipeline.inference.stitching import layer_part
    from pipeline.secondpass.agglomeration import save_sizes, segment_sizes
    from pipeline.secondpass.part_writing import grid_of, layer_reader

    def work() -> str:
        layout = from_dict(SegmentationLayout, settings["layout"])
        part = layer_part(settings["part"], grid_of(settings)[0], layout)
        with layer_reader(first_pass) as read:
            save_sizes(io.sizes, *segment_sizes(read(part)))
        return digest_files([io.sizes])

    return run_once(settings, io.inputs(), io.outputs(), work)


@python_app(executors=[CPU_LABEL])
def sum_sizes(settings: dict, io: SumSizes, inputs=(), outputs=()):
    """The objects' sizes in the whole volume."""
    from pipeline.core.stamps import digest_files, run_once
    from pipeline.secondpass.agglomeration import load_sizes, save_sizes, total_sizes

    def work() -> str:
        save_sizes(io.sizes, *total_sizes(load_sizes(p) for p in io.counts))
        return digest_files([io.sizes])

    return run_once(settings, io.inputs(), io.outputs(), work)


@python_app(executors=[CPU_LABEL])
def decide_core(settings: dict, first_pass: str, io: DecideCore, inputs=(), outputs=()):
    """settings also: {"inference": InferenceConfig}; decides the pairs whose contact point lies
    in core k."""
    from pipeline.core.config_io import from_dict
    from pipeline.core.stamps import digest_files, run_once
    from pipeline.data.staging import read_staged
    from pipeline.data.volumes import open_volume
    from pipeline.evaluation.boundary_map import boundary_reader
    from pipeline.inference.flood_fill import InferenceConfig, inference_model
    from pipeline.inference.stitching import block_core
    from pipeline.secondpass.agglomeration import (
        decide_pairs,
        load_contact_table,
        pairs_in,
        save_decisions,
    )
    from pipeline.secondpass.part_writing import chunks_of, grid_of, layer_reader
    from pipeline.selection.checkpoints import chosen_checkpoint, chosen_predictor

    def work() -> str:
        blocks, config = grid_of(settings)
        core = block_core(settings["block"], blocks, chunks_of(settings))
        table = pairs_in(load_contact_table(io.pairs), core)
        inference = from_dict(InferenceConfig, settings["inference"])
        model = inference_model(chosen_checkpoint(io.selection), inference)
        with (
            open_volume(read_staged(io.volume).raw) as raw,
            layer_reader(first_pass) as read,
            boundary_reader(io.boundary, settings["shape"]) as boundary,
        ):
            decisions = decide_pairs(
                raw.__getitem__, read, settings["shape"], table,
                chosen_predictor(io.selection, model), model, inference, config, boundary,
            )  # fmt: skip
        save_decisions(io.decisions, decisions)
        return digest_files([io.decisions])

    return run_once(settings, io.inputs(), io.outputs(), work)


@python_app(executors=[CPU_LABEL])
def merge_pairs(settings: dict, folder: str, io: MergePairs, inputs=(), outputs=()):
    """The merge table (each merged id and the id it becomes). Also makes the new, empty
    segmentation layer in the export `folder` that the relabel tasks write into."""
    from pipeline.core.stamps import run_once
    from pipeline.inference.stitching import new_layer
    from pipeline.secondpass.agglomeration import (
        load_decisions,
        merge_lookup,
        merged_pairs,
        save_merges,
    )
    from pipeline.secondpass.part_writing import grid_of

    def work() -> None:
        decisions = [d for p in io.decisions for d in load_decisions(p)]
        save_merges(io.merges, *merge_lookup(merged_pairs(decisions, grid_of(settings)[1])))
        new_layer(settings, folder, io.volume)
        # No content digest: a new (empty) volume must make every relabel task run again.

    return run_once(settings, io.inputs(), io.outputs(), work)


@python_app(executors=[CPU_LABEL])
def relabel_merged_part(settings: dict, first_pass: str, folder: str, io: RelabelMergedPart, inputs=(), outputs=()):  # fmt: skip
    """Writes part k of the layer (pipeline.inference.stitching.layer_part), merged (and
    filled), into the export's segmentation layer."""
    from pipeline.core.stamps import digest, run_once
    from pipeline.evaluation.boundary_map import boundary_reader
    from pipeline.inference.stitching import save_core_record, writer_of
    from pipeline.secondpass.agglomeration import load_merges
    from pipeline.secondpass.part_writing import (
        grid_of,
        layer_reader,
        small_objects_of,
        write_merged_part,
    )

    def work() -> str:
        blocks, config = grid_of(settings)
        layer, k = writer_of(settings, folder), settings["part"]
        merges = load_merges(io.merges)
        with (
            layer_reader(first_pass) as read,
            boundary_reader(io.boundary, settings["shape"]) as boundary,
        ):
            dropped = small_objects_of(config, io.sizes, merges)
            record = write_merged_part(k, blocks, layer, read, merges, boundary, config, dropped,
                                       settings.get("supervoxels", False))  # fmt: skip
        save_core_record(io.record, record)
        return digest(record["chunks"])

    return run_once(settings, io.inputs(), io.outputs(), work)


@python_app(executors=[CPU_LABEL])
def finish_agglomeration(settings: dict, first_pass: str, folder: str, io: FinishAgglomeration, inputs=(), outputs=()):  # fmt: skip
    """Rewrites any part whose files changed after its task wrote them (the whole layer if it
    was lost); writes agglomerate.json: what was decided, merged and filled."""
    import json

    from pipeline.core.atomic import atomic_path
    from pipeline.core.stamps import run_once
    from pipeline.evaluation.boundary_map import boundary_reader
    from pipeline.inference.stitching import check_written_parts, layer_to_check, load_core_record
    from pipeline.secondpass.agglomeration import load_decisions, load_merges
    from pipeline.secondpass.part_writing import (
        grid_of,
        layer_reader,
        pass_summary,
        small_objects_of,
        write_merged_part,
    )

    def work() -> str:
        blocks, config = grid_of(settings)
        layer = layer_to_check(settings, folder, io.volume)
        merges = load_merges(io.merges)
        with (
            layer_reader(first_pass) as read,
            boundary_reader(io.boundary, settings["shape"]) as boundary,
        ):
            dropped = small_objects_of(config, io.sizes, merges)
            repaired, token = check_written_parts(
                (load_core_record(p) for p in io.records),
                layer,
                lambda k: write_merged_part(
                    k,
                    blocks,
                    layer,
                    read,
                    merges,
                    boundary,
                    config,
                    dropped,
                    settings.get("supervoxels", False),
                ),  # fmt: skip
            )
        decided = [d for p in io.decisions for d in load_decisions(p)]
        record = pass_summary(config, decided, merges, dropped, repaired)
        with atomic_path(io.summary) as tmp:
            tmp.write_text(json.dumps(record, indent=2))
        return token

    return run_once(settings, io.inputs(), io.outputs(), work)


# With pairs decided, the export's layer holds the supervoxels and the merges are a graph over
# them (pipeline.secondpass.merge_graph): the graph, a task per part of the merged layer, a check.


@python_app(executors=[CPU_LABEL])
def merge_graph(settings: dict, merged: str, io: MergeGraph, inputs=(), outputs=()):
    """Writes graph.csv, an edge per merge of supervoxels the layer holds, unless the file was
    edited by hand since this task made it from the same decisions and layer: then the edit is
    the graph (checked against the layer's ids). Made from other decisions, it keeps the hand
    edits (`remake_graph`). Also makes the merged layer, empty, in the
    folder `merged` unless it is there as it would make it."""
    import numpy as np

    from pipeline.core.stamps import made_from, run_once, save_cells
    from pipeline.inference.stitching import keep_layer, load_core_record
    from pipeline.secondpass.agglomeration import load_decisions
    from pipeline.secondpass.merge_graph import graph_cells, graph_edges, read_graph, remake_graph
    from pipeline.secondpass.part_writing import grid_of

    def work() -> str:
        part_ids = [np.array(load_core_record(p)["ids"], np.uint64) for p in io.supervoxels]
        present = np.unique(np.concatenate([np.zeros(0, np.uint64), *part_ids]))
        if not (io.graph.is_file() and made_from(settings, io.inputs(), io.graph, regions)):
            decided = [d for p in io.decisions for d in load_decisions(p)]
            remake_graph(io.graph, graph_edges(decided, grid_of(settings)[1], present), present)
        keep_layer(settings, merged, io.volume)
        # The token: per part, the merged ids of its supervoxels; a part of the merged layer
        # runs again only where they changed.
        return save_cells(io.graph, graph_cells(read_graph(io.graph, present), part_ids, settings))

    regions = io.parts(settings)
    return run_once(settings, io.inputs(), io.outputs(), work, regions)


@python_app(executors=[CPU_LABEL])
def relabel_graph_part(settings: dict, supervoxels: str, merged: str, io: RelabelGraphPart, inputs=(), outputs=()):  # fmt: skip
    """Writes part k of the merged layer: the export's layer in `supervoxels` with the graph's
    merges applied, into the layer in `merged`."""
    from pipeline.core.stamps import digest, run_once
    from pipeline.inference.stitching import save_core_record, writer_of
    from pipeline.secondpass.agglomeration import merge_lookup
    from pipeline.secondpass.merge_graph import read_graph
    from pipeline.secondpass.part_writing import grid_of, layer_reader, write_graph_part

    def work() -> str:
        blocks, _ = grid_of(settings)
        lookup = merge_lookup(read_graph(io.graph))
        with layer_reader(supervoxels) as read:
            record = write_graph_part(
                settings["part"], blocks, writer_of(settings, merged), read, lookup
            )
        save_core_record(io.record, record)
        return digest(record["chunks"])

    return run_once(settings, io.inputs(), io.outputs(), work, io.parts(settings))


@python_app(executors=[CPU_LABEL])
def finish_graph(settings: dict, supervoxels: str, merged: str, io: FinishGraph, inputs=(), outputs=()):  # fmt: skip
    """Rewrites any part of the merged layer whose files changed after its task wrote them (the
    whole layer if it was lost); writes merged.json: the graph's edges and objects."""
    import json

    from pipeline.core.atomic import atomic_path
    from pipeline.core.stamps import run_once, save_cells
    from pipeline.inference.stitching import (
        LayerCells,
        check_written_parts,
        layer_identity,
        layer_to_check,
        load_core_record,
    )
    from pipeline.secondpass.agglomeration import merge_lookup
    from pipeline.secondpass.merge_graph import read_graph
    from pipeline.secondpass.part_writing import grid_of, layer_reader, write_graph_part

    def work() -> str:
        blocks, _ = grid_of(settings)
        layer = layer_to_check(settings, merged, io.volume)
        edges = read_graph(io.graph)
        lookup = merge_lookup(edges)
        cells = LayerCells(
            settings["shape"], layer.layout.chunk_zyx, layer_identity(settings, io.volume)
        )

        def counted(paths):
            for path in paths:
                record = load_core_record(path)
                cells.add(record)
                yield record

        with layer_reader(supervoxels) as read:
            repaired, _ = check_written_parts(
                counted(io.records), layer,
                lambda k: write_graph_part(k, blocks, layer, read, lookup),
            )  # fmt: skip
        record = {
            "edges": len(edges),
            "merged_supervoxels": len(lookup[0]),
            "merged_objects": len(set(lookup[1].tolist())),
            "repaired_parts": repaired,
        }
        with atomic_path(io.summary) as tmp:
            tmp.write_text(json.dumps(record, indent=2))
        # The token: the parts' files per chunk, so an evaluation region runs again only where
        # a part of the merged layer changed.
        return save_cells(io.full_resolution, cells.cells())

    return run_once(settings, io.inputs(), io.outputs(), work, io.parts(settings))
