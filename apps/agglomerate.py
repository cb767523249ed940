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

from contextlib import contextmanager

from parsl import python_app

from site_configs import CPU_LABEL


@python_app(executors=[CPU_LABEL])
def pair_core(settings: dict, first_pass: str, inputs=(), outputs=()):
    """inputs: the first pass's full resolution; outputs[0]: core k's contacts (.npz)."""
    from pipeline.core.stamps import digest_files, run_once
    from pipeline.secondpass.agglomeration import core_contacts, save_contact_table

    output = outputs[0].filepath
    blocks, config = grid_of(settings)

    def work() -> str:
        with layer_reader(first_pass) as read:
            found = core_contacts(
                settings["block"],
                blocks,
                read,
                settings["shape"],
                chunks_of(settings),
                config.max_gap,
            )
        save_contact_table(output, found)
        return digest_files([output])

    return run_once(settings, [f.filepath for f in inputs], [output], work)


@python_app(executors=[CPU_LABEL])
def join_pairs(settings: dict, inputs=(), outputs=()):
    """inputs: every core's contacts; outputs[0]: the pairs to decide (.npz), those touching
    over at least `min_contact` in all."""
    from pipeline.core.stamps import digest_files, run_once
    from pipeline.secondpass.agglomeration import (
        load_contact_table,
        merge_contact_tables,
        save_contact_table,
    )

    output = outputs[0].filepath
    _, config = grid_of(settings)

    def work() -> str:
        tables = [load_contact_table(f.filepath) for f in inputs]
        save_contact_table(output, merge_contact_tables(tables, config.min_contact))
        return digest_files([output])

    return run_once(settings, [f.filepath for f in inputs], [output], work)


@python_app(executors=[CPU_LABEL])
def count_part(settings: dict, first_pass: str, inputs=(), outputs=()):
    """inputs: the first pass's full resolution; outputs[0]: the voxels of each object in part k
    of the layer (pipeline.inference.stitching.layer_part) (.npz)."""
    from pipeline.core.config_io import from_dict
    from pipeline.core.stamps import digest_files, run_once
    from pipeline.export.layers import SegmentationLayout
    from pipeline.inference.stitching import layer_part
    from pipeline.secondpass.agglomeration import save_sizes, segment_sizes

    output = outputs[0].filepath
    blocks, _ = grid_of(settings)

    def work() -> str:
        layout = from_dict(SegmentationLayout, settings["layout"])
        part = layer_part(settings["part"], blocks, layout)
        with layer_reader(first_pass) as read:
            save_sizes(output, *segment_sizes(read(part)))
        return digest_files([output])

    return run_once(settings, [f.filepath for f in inputs], [output], work)


@python_app(executors=[CPU_LABEL])
def sum_sizes(settings: dict, inputs=(), outputs=()):
    """inputs: every part's counts; outputs[0]: the whole volume's (.npz)."""
    from pipeline.core.stamps import digest_files, run_once
    from pipeline.secondpass.agglomeration import load_sizes, save_sizes, total_sizes

    output = outputs[0].filepath

    def work() -> str:
        save_sizes(output, *total_sizes(load_sizes(f.filepath) for f in inputs))
        return digest_files([output])

    return run_once(settings, [f.filepath for f in inputs], [output], work)


@python_app(executors=[CPU_LABEL])
def decide_core(settings: dict, first_pass: str, inputs=(), outputs=()):
    """settings also: {"inference": InferenceConfig}; inputs: the staged volume, the first
    pass's full resolution, the pairs, selection.json; outputs[0]: the decisions of the pairs
    whose contact point lies in core k (.npz)."""
    from pipeline.core.config_io import from_dict
    from pipeline.core.stamps import digest_files, run_once
    from pipeline.data.staging import read_staged
    from pipeline.data.volumes import open_volume
    from pipeline.inference.flood_fill import (
        InferenceConfig,
        checkpoint_model_config,
        predictor_from_checkpoint,
    )
    from pipeline.inference.stitching import block_core
    from pipeline.secondpass.agglomeration import (
        decide_pairs,
        load_contact_table,
        pairs_in,
        save_decisions,
    )
    from pipeline.selection.checkpoints import chosen_checkpoint

    volume, _, pairs, selection = (f.filepath for f in inputs)
    output = outputs[0].filepath
    blocks, config = grid_of(settings)

    def work() -> str:
        core = block_core(settings["block"], blocks, chunks_of(settings))
        table = pairs_in(load_contact_table(pairs), core)
        checkpoint = chosen_checkpoint(selection)
        model = checkpoint_model_config(checkpoint)
        inference = from_dict(InferenceConfig, settings["inference"])
        with open_volume(read_staged(volume).raw) as raw, layer_reader(first_pass) as read:
            decisions = decide_pairs(
                raw.__getitem__, read, settings["shape"], table,
                predictor_from_checkpoint(checkpoint, model), model, inference, config,
            )  # fmt: skip
        save_decisions(output, decisions)
        return digest_files([output])

    return run_once(settings, [f.filepath for f in inputs], [output], work)


@python_app(executors=[CPU_LABEL])
def merge_pairs(settings: dict, folder: str, inputs=(), outputs=()):
    """inputs: the staged volume, then every core's decisions; outputs[0]: the merge table
    (.npz: each merged id and the id it becomes). Also makes the new, empty segmentation layer
    in the export `folder` that the relabel tasks write into."""
    from apps.stitch import new_layer
    from pipeline.core.stamps import run_once
    from pipeline.secondpass.agglomeration import (
        load_decisions,
        merge_lookup,
        merged_pairs,
        save_merges,
    )

    output = outputs[0].filepath
    _, config = grid_of(settings)

    def work() -> None:
        decisions = [d for f in inputs[1:] for d in load_decisions(f.filepath)]
        save_merges(output, *merge_lookup(merged_pairs(decisions, config)))
        new_layer(settings, folder, inputs[0].filepath)
        # No content digest: a new (empty) volume must make every relabel task run again.

    return run_once(settings, [f.filepath for f in inputs], [output], work)


@python_app(executors=[CPU_LABEL])
def relabel_merged_part(settings: dict, first_pass: str, folder: str, inputs=(), outputs=()):
    """inputs: the merge table, the first pass's full resolution, with the fill the boundary forest
    and the staged volume (and with `fill_min_size` the objects' sizes);
    outputs[0]: part k's record (.json). Writes part k of the layer
    (pipeline.inference.stitching.layer_part), merged (and filled), into the export's segmentation layer."""
    from apps.stitch import writer_of
    from pipeline.core.stamps import digest, run_once
    from pipeline.inference.stitching import save_core_record
    from pipeline.secondpass.agglomeration import load_merges

    merges = inputs[0].filepath
    output = outputs[0].filepath
    blocks, config = grid_of(settings)

    def work() -> str:
        layer, k = writer_of(settings, folder), settings["part"]
        merged = load_merges(merges)
        fill = inputs[2:]
        with layer_reader(first_pass) as read, boundary_reader(config, settings, fill) as boundary:
            dropped = small_objects_of(config, fill, merged)
            record = _write_merged(k, blocks, layer, read, merged, boundary, config, dropped)
        save_core_record(output, record)
        return digest(record["chunks"])

    return run_once(settings, [f.filepath for f in inputs], [output], work)


@python_app(executors=[CPU_LABEL])
def finish_agglomeration(settings: dict, first_pass: str, folder: str, inputs=(), outputs=()):
    """inputs: the staged volume, the merge table, the first pass's full resolution, with the
    fill the boundary forest and the staged volume again (and with `fill_min_size` the objects'
    sizes), then every part's record
    (settings["parts"] of them), then every core's decisions (plan order);
    outputs: agglomerate.json and the folder of the export layer's full resolution. Rewrites
    any part whose files changed after its task wrote them (the whole layer if it was lost)."""
    import json
    from pathlib import Path

    from apps.stitch import new_layer, writer_of
    from pipeline.core.atomic import atomic_path
    from pipeline.core.stamps import run_once
    from pipeline.export.layers import SEGMENTATION_LAYER
    from pipeline.inference.stitching import check_written_parts, load_core_record
    from pipeline.secondpass.agglomeration import load_decisions, load_merges

    paths = [f.filepath for f in inputs]
    summary, full_resolution = (f.filepath for f in outputs)
    blocks, config = grid_of(settings)
    after = 3 + fill_input_count(config)
    fill, count = inputs[3:after], settings["parts"]
    records, decisions = paths[after : after + count], paths[after + count :]

    def work() -> str:
        if not (Path(folder) / SEGMENTATION_LAYER / "info").is_file():
            new_layer(settings, folder, paths[0])  # lost whole: every core is rewritten below
        layer = writer_of(settings, folder)
        merges = load_merges(paths[1])
        with layer_reader(first_pass) as read, boundary_reader(config, settings, fill) as boundary:
            dropped = small_objects_of(config, fill, merges)
            repaired, token = check_written_parts(
                (load_core_record(p) for p in records),
                layer,
                lambda k: _write_merged(k, blocks, layer, read, merges, boundary, config, dropped),
            )
        decided = [d for p in decisions for d in load_decisions(p)]
        record = {
            "pairs": len(decided),
            "merged_pairs": sum(config.merges(d) for d in decided),
            "unseeded_pairs": sum(not d.seeded for d in decided),
            "merged_segments": len(merges[0]),
            "merged_objects": len(set(merges[1].tolist())),  # what they became
            "fov_evaluations": sum(d.fov_evaluations for d in decided),
            "repaired_parts": repaired,
            "pairs_decided": config.enabled,
            "filled_unsegmented": config.fill_unsegmented,
            "dropped_objects": len(dropped),
            "fill_min_size": config.fill_min_size,
        }
        with atomic_path(summary) as tmp:
            tmp.write_text(json.dumps(record, indent=2))
        return token

    return run_once(settings, paths, [summary, full_resolution], work)


def _write_merged(k: int, blocks, layer, read, merges, boundary, config, dropped) -> dict:
    """Part k of `layer` (pipeline.inference.stitching.layer_part) written from the first pass (`read`)
    with `merges` applied, if `boundary` is given the `dropped` objects' voxels and the
    unsegmented ones filled over it; its record."""
    import fastremap

    from pipeline.inference.stitching import layer_part, write_part_labels
    from pipeline.secondpass.agglomeration import filled_part, relabel

    def merged(box):
        return relabel(read(box), *merges)

    def kept(box):
        return fastremap.mask(merged(box), dropped, in_place=True) if len(dropped) else merged(box)

    def labels_of(box):
        if boundary is None:
            return merged(box)
        return filled_part(box, blocks.volume_shape, config.fill_margin, kept, boundary)

    return write_part_labels(k, layer_part(k, blocks, layer.layout), labels_of, layer)


def grid_of(settings: dict):
    """The block grid and the agglomeration's settings."""
    from pipeline.core.config_io import from_dict
    from pipeline.inference.blocks import BlockConfig, plan_blocks
    from pipeline.secondpass.agglomeration import AgglomerationConfig

    blocks = plan_blocks(settings["shape"], from_dict(BlockConfig, settings["blocks"]))
    return blocks, from_dict(AgglomerationConfig, settings.get("agglomeration", {}))


def chunks_of(settings: dict) -> tuple[int, int, int]:
    """The layers' chunks, on which the cores are cut (as the stitching cuts them)."""
    from pipeline.core.config_io import from_dict
    from pipeline.inference.blocks import BlockConfig

    return from_dict(BlockConfig, settings["blocks"]).chunks


def fill_input_count(config) -> int:
    """The fill's inputs: the boundary forest and the staged volume, then the objects' sizes."""
    return (2 + bool(config.fill_min_size)) if config.fill_unsegmented else 0


def small_objects_of(config, inputs, merges):
    """The ids, after `merges`, of the objects the fill gives away (inputs[2]: their sizes)."""
    import numpy as np

    from pipeline.secondpass.agglomeration import load_sizes, small_objects

    if not config.fill_min_size:
        return np.zeros(0, np.uint64)
    return small_objects(load_sizes(inputs[2].filepath), merges, config.fill_min_size)


@contextmanager
def boundary_reader(config, settings: dict, inputs):
    """When the fill is on, a reader of the volume's boundary map (box -> P(boundary)), predicted
    box by box by the forest (inputs: the forest, the staged volume); else None. The forest is
    loaded at the first box: the last task reads none when no part needs rewriting."""
    from functools import cache

    from pipeline.data.staging import read_staged
    from pipeline.data.volumes import open_volume
    from pipeline.evaluation.evaluate import load_boundary_forest
    from pipeline.evaluation.learned_watershed import BoundaryForestConfig, box_boundary_probability

    if not config.fill_unsegmented:
        yield None
        return
    forest = cache(lambda: load_boundary_forest(inputs[0].filepath))
    with open_volume(read_staged(inputs[1].filepath).raw) as raw:
        yield lambda box: box_boundary_probability(
            forest(), raw.__getitem__, box, settings["shape"], BoundaryForestConfig()
        )


@contextmanager
def layer_reader(folder: str):
    """A reader of the segmentation layer in `folder`: box -> voxels."""
    from pipeline.data.volumes import open_volume
    from pipeline.export.layers import segmentation_spec

    with open_volume(segmentation_spec(folder)) as array:
        yield array.__getitem__
