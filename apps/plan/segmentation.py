"""The segmentation's steps after inference: the stitching of each pass's blocks, the split
consensus of two passes, and FFN's second pass (agglomeration and the fill)."""

from __future__ import annotations

import apps.agglomerate
import apps.consensus
import apps.stitch
from apps.contracts import (
    ConsensusPairs,
    CountPart,
    DecideCore,
    FinishAgglomeration,
    FinishConsensus,
    FinishGraph,
    FinishStitch,
    JoinBlocks,
    JoinConsensusPairs,
    JoinPairs,
    MergeGraph,
    MergePairs,
    PairBlock,
    PairCore,
    RelabelConsensusPart,
    RelabelGraphPart,
    RelabelMergedPart,
    RelabelPart,
    SumSizes,
)
from apps.plan.resolved import InferencePass, RunPlan
from apps.plan.step import Step, task_step
from pipeline.core import config_io


def stitch_steps(plan: RunPlan, one: InferencePass) -> list[Step]:
    """A pairs task per block, one join, a relabel task per part of the layer (a block's core,
    or a shard) writing it, then the check that writes stitch.json (apps/stitch.py), for pass
    `one`."""
    config, paths, blocks = plan.config, plan.paths, plan.blocks
    from pipeline.inference.blocks import block_path
    from pipeline.inference.stitching import later_neighbours, part_name, part_neighbours

    results = [block_path(one.blocks_dir, b) for b in blocks]
    pairs = [one.stitch_dir / "pairs" / f"{b.name}.npz" for b in blocks]
    parts = plan.layer_parts
    cores = [one.stitch_dir / "parts" / f"{part_name(p)}.json" for p in parts]
    table = one.stitch_dir / "ids.npy"
    # The folder is an argument, not a setting: a run moved elsewhere stays up to date.
    folder = str(one.folder)
    name = one.prefix
    base = {
        "blocks": config_io.to_dict(config.blocks),
        "shape": list(plan.eval_shape),
        "layout": plan.layout,
    }
    steps = []
    for k in range(len(blocks)):
        reads = [k, *later_neighbours(k, blocks)]
        files = PairBlock(results=tuple(results[i] for i in reads), pairs=pairs[k])
        steps.append(task_step(f"stitch[{name}pairs {k}]", {**base, "block": k, "reads": reads}, files,
                               apps.stitch.pair_block))  # fmt: skip
    files = JoinBlocks(volume=paths.eval_volume, pairs=tuple(pairs), table=table)
    steps.append(task_step(f"stitch[{name}join]", base, files, apps.stitch.join_blocks, folder))
    for k, part in enumerate(parts):
        reads = part_neighbours(part, blocks)
        files = RelabelPart(table=table, results=tuple(results[i] for i in reads), record=cores[k])
        steps.append(task_step(f"stitch[{name}relabel {k}]", {**base, "part": k, "reads": reads}, files,
                               apps.stitch.relabel_part, folder))  # fmt: skip
    every = {**base, "reads": list(range(len(blocks)))}
    files = FinishStitch(volume=paths.eval_volume, table=table, records=tuple(cores), results=tuple(results),
                         summary=one.stitch_summary, full_resolution=plan.full_resolution(one.folder))  # fmt: skip
    steps.append(task_step(f"stitch[{name.strip()}]" if name else "stitch", every, files,
                           apps.stitch.finish_stitch, folder))  # fmt: skip
    return steps


def consensus_steps(plan: RunPlan) -> list[Step]:
    """The split consensus of the two passes: a task per block core lists its pairs of ids, one
    joins them into a table, a relabel task per part of the layer (a block's core, or a shard)
    writes it, the last checks (apps/consensus.py)."""
    config, paths, blocks = plan.config, plan.paths, plan.blocks
    from pipeline.inference.stitching import part_name

    first, second = (
        str(one.folder) for one in plan.inference_passes
    )  # arguments: a moved run stays up to date
    first_layer, second_layer = (plan.full_resolution(one.folder) for one in plan.inference_passes)
    layers = {"first_layer": first_layer, "second_layer": second_layer}
    into = plan.consensus_into
    base = {
        "blocks": config_io.to_dict(config.blocks),
        "shape": list(plan.eval_shape),
        "layout": plan.layout,
    }
    cores = range(len(blocks))
    parts = plan.layer_parts
    pairs = [paths.consensus_dir / "pairs" / f"{b.name}.npz" for b in blocks]
    records = [paths.consensus_dir / "parts" / f"{part_name(p)}.json" for p in parts]
    table = paths.consensus_dir / "ids.npy"
    steps = [task_step(f"consensus[pairs {k}]", {**base, "block": k}, ConsensusPairs(**layers, pairs=pairs[k]),
                       apps.consensus.consensus_pairs, first, second) for k in cores]  # fmt: skip
    # Slivers where the passes disagree on a border go, as objects too small do in a pass.
    join = {**base, "min_size": config.inference.min_segment_size}
    files = JoinConsensusPairs(volume=paths.eval_volume, pairs=tuple(pairs), table=table)
    steps.append(
        task_step("consensus[join]", join, files, apps.consensus.join_consensus_pairs, str(into))
    )
    steps += [task_step(f"consensus[relabel {k}]", {**base, "part": k},
                        RelabelConsensusPart(table=table, **layers, record=records[k]),
                        apps.consensus.relabel_consensus_part, first, second, str(into))
              for k in range(len(parts))]  # fmt: skip
    files = FinishConsensus(volume=paths.eval_volume, table=table, **layers, records=tuple(records),
                            summary=paths.consensus_summary, full_resolution=plan.full_resolution(into))  # fmt: skip
    steps.append(task_step("consensus", base, files, apps.consensus.finish_consensus, first, second,
                           str(into)))  # fmt: skip
    return steps


def agglomerate_steps(plan: RunPlan) -> list[Step]:
    """FFN's second pass over the stitched first pass: a pairs task per block core, one join, a
    decision task per core (flood fills), one merge table, a relabel task per part of the layer
    (a block's core, or a shard) writing the export's segmentation layer, then the check that
    writes agglomerate.json (apps/agglomerate.py)."""
    config, paths, blocks = plan.config, plan.paths, plan.blocks
    from pipeline.inference.stitching import part_name
    from pipeline.secondpass.agglomeration import FILL_SETTINGS

    folder = paths.agglomerate_dir
    # What it agglomerates: the consensus if one is made, else the first pass.
    source = paths.consensus if config.agglomeration.consensus else paths.first_pass
    first_pass = str(source)  # arguments, not settings: a moved run stays up to date
    export = str(paths.precomputed)
    stitched = plan.full_resolution(source)
    base = {
        "blocks": config_io.to_dict(config.blocks),
        "shape": list(plan.eval_shape),
        "layout": plan.layout,
    }
    # The fills' measures do not depend on the merge thresholds: new thresholds re-run only the
    # merge and what follows it.
    second = config.agglomeration
    fills = {**base, "agglomeration": second.fill_settings()}
    # The merges do not depend on the fill: without it, every setting is as before it was added.
    merging = {k: v for k, v in config_io.to_dict(second).items() if k not in FILL_SETTINGS}
    thresholds = {**base, "agglomeration": merging}
    cores = range(len(blocks))
    parts = plan.layer_parts
    contacts = [folder / "contacts" / f"{b.name}.npz" for b in blocks]
    decisions = [folder / "decisions" / f"{b.name}.npz" for b in blocks]
    records = [folder / "parts" / f"{part_name(p)}.json" for p in parts]
    pairs, merges = folder / "pairs.npz", folder / "merges.npz"
    decide = {**fills, "inference": config_io.to_dict(config.inference)}
    steps = []
    boundary_map = (paths.boundary_forest, paths.eval_volume)
    screen = boundary_map if second.screens_contacts else ()
    if second.enabled:  # else no pair is merged: the pass only fills
        steps += [task_step(f"agglomerate[pairs {k}]", {**fills, "block": k},
                            PairCore(stitched=stitched, contacts=contacts[k]),
                            apps.agglomerate.pair_core, first_pass) for k in cores]  # fmt: skip
        files = JoinPairs(contacts=tuple(contacts), pairs=pairs)
        steps.append(task_step("agglomerate[join]", fills, files, apps.agglomerate.join_pairs))
        steps += [task_step(f"agglomerate[decide {k}]", {**decide, "block": k},
                            DecideCore(volume=paths.eval_volume, stitched=stitched, pairs=pairs,
                                       selection=paths.selection, boundary=screen,
                                       decisions=decisions[k]),
                            apps.agglomerate.decide_core, first_pass) for k in cores]  # fmt: skip
    else:
        decisions = []
    files = MergePairs(volume=paths.eval_volume, decisions=tuple(decisions), merges=merges)
    steps.append(
        task_step("agglomerate[merge]", thresholds, files, apps.agglomerate.merge_pairs, export)
    )
    # The fill of unsegmented voxels: the learned watershed's forest (dag_steps plans it), its
    # map predicted and flooded part by part. Without it, the parts' settings are as before it
    # was added (runs stay done).
    boundary, sizes, written = (), (), base
    if second.fill_unsegmented:
        boundary = boundary_map
        written = {**base, "agglomeration": second.part_settings()}
    if second.fill_min_size:  # the objects' sizes in the whole volume: a count per part, a sum
        counts = [folder / "sizes" / f"{part_name(p)}.npz" for p in parts]
        steps += [task_step(f"agglomerate[sizes {k}]", {**base, "part": k}, CountPart(stitched=stitched, sizes=counts[k]),
                            apps.agglomerate.count_part, first_pass) for k in range(len(parts))]  # fmt: skip
        sizes = (folder / "sizes.npz",)
        files = SumSizes(counts=tuple(counts), sizes=sizes[0])
        steps.append(task_step("agglomerate[sizes]", base, files, apps.agglomerate.sum_sizes))
    if second.enabled:  # the layer holds the supervoxels; the merges go into the graph
        written = {**written, "supervoxels": True}
    fill = {"stitched": stitched, "boundary": boundary, "sizes": sizes}
    steps += [task_step(f"agglomerate[relabel {k}]", {**written, "part": k},
                        RelabelMergedPart(merges=merges, **fill, record=records[k]),
                        apps.agglomerate.relabel_merged_part, first_pass, export)
              for k in range(len(parts))]  # fmt: skip
    filling = config_io.to_dict(second) if second.fill_unsegmented else merging
    finish = {**base, "agglomeration": filling, "parts": len(parts)}
    if second.enabled:
        finish["supervoxels"] = True
    files = FinishAgglomeration(volume=paths.eval_volume, merges=merges, **fill, records=tuple(records),
                                decisions=tuple(decisions), summary=paths.agglomerate_summary,
                                full_resolution=plan.full_resolution(paths.precomputed))  # fmt: skip
    steps.append(task_step("agglomerate", finish, files, apps.agglomerate.finish_agglomeration,
                           first_pass, export))  # fmt: skip
    if second.enabled:
        steps += merge_graph_steps(plan, thresholds, tuple(decisions), tuple(records))
    return steps


def merge_graph_steps(
    plan: RunPlan, thresholds: dict, decisions: tuple, supervoxels: tuple
) -> list[Step]:
    """The merges as a graph over the export's supervoxels (`supervoxels`: its parts' records),
    one task writing graph.csv, a task per part of the merged layer applying it, the check that
    writes merged.json (apps/agglomerate.py, pipeline/secondpass/merge_graph.py)."""
    paths = plan.paths
    from pipeline.inference.stitching import part_name

    base = {key: thresholds[key] for key in ("blocks", "shape", "layout")}
    graph, parts = paths.merge_graph, plan.layer_parts
    folders = (str(paths.precomputed), str(paths.merged))  # arguments: a moved run stays up to date
    records = [paths.agglomerate_dir / "merged_parts" / f"{part_name(p)}.json" for p in parts]
    files = MergeGraph(volume=paths.eval_volume, layer=plan.full_resolution(paths.precomputed),
                       decisions=decisions, supervoxels=supervoxels, graph=graph)  # fmt: skip
    steps = [task_step("agglomerate[graph]", thresholds, files, apps.agglomerate.merge_graph,
                       folders[1])]  # fmt: skip
    steps += [task_step(f"agglomerate[merged {k}]", {**base, "part": k},
                        RelabelGraphPart(graph=graph, supervoxels=supervoxels[k], record=records[k]),
                        apps.agglomerate.relabel_graph_part, *folders)
              for k in range(len(parts))]  # fmt: skip
    files = FinishGraph(volume=paths.eval_volume, graph=graph, supervoxels=supervoxels,
                        records=tuple(records), summary=paths.merged_summary,
                        full_resolution=plan.full_resolution(paths.merged))  # fmt: skip
    steps.append(task_step("agglomerate[merged]", {**base, "parts": len(parts)}, files,
                           apps.agglomerate.finish_graph, *folders))  # fmt: skip
    return steps
