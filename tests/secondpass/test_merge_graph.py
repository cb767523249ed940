"""The proofreading hand-off (pipeline.secondpass.merge_graph): with pairs decided, the exported
layer holds the second pass's segments before its merges (supervoxels), agglomerate/graph.csv
the merges with the evidence that decided them, and the merged objects the evaluation scores
are made from the two. A merge undone in graph.csv by hand changes only the object it joined,
and a resume writes again only what reads it."""

import json
import re

import numpy as np
import pytest
from workflow_runs import ROOT, segmentation, stamp_files, tasks_of, tiny_variant, workflow

from apps.plan.resolved import resolve_plan
from pipeline.core.errors import MergeGraphError
from pipeline.core.stamps import made_from, run_once
from pipeline.data.synthetic import SyntheticConfig, generate
from pipeline.data.volumes import open_volume
from pipeline.export.layers import (
    SegmentationLayout,
    SegmentationWriter,
    new_segmentation,
    segmentation_spec,
)
from pipeline.inference.blocks import BlockConfig, plan_blocks
from pipeline.run.run_config import load_run_config
from pipeline.run.run_layout import RunPaths
from pipeline.secondpass.agglomeration import (
    AgglomerationConfig,
    PairDecision,
    load_decisions,
    merge_lookup,
    relabel,
    segment_sizes,
    small_objects,
)
from pipeline.secondpass.merge_graph import (
    decided_path,
    graph_cells,
    graph_edges,
    read_graph,
    remake_graph,
    write_graph,
)
from pipeline.secondpass.part_writing import write_merged_part

SHAPE = (32, 64, 64)
GRID = BlockConfig((32, 40, 40), (8, 16, 16))  # 1 x 2 x 2 blocks: 4 parts of the layer
CHUNKS = (16, 16, 16)
HEADER = "a,b,jaccard,recovered_a,recovered_b,fov_evaluations\n"


def read_layer(folder) -> np.ndarray:
    with open_volume(segmentation_spec(folder)) as array:
        return array[...]


# ---------------------------------------------------------------------------------------------
# On arrays and files


def test_the_supervoxels_filled_then_merged_are_the_merged_objects_filled(tmp_path):
    """The selection tissue (seed 2) as a first pass with a slab left unsegmented, three merges
    (one joining two objects too small alone, so that they are kept) and small objects dropped:
    its parts written as supervoxels, then merged, are the parts written merged (what the layer
    held before the graph), voxel for voxel; a supervoxel part's record lists its ids."""
    labels = generate(SyntheticConfig(seed=2))[1][:32, :64, :64].astype(np.uint64)
    first = labels.copy()
    first[:, :, 20:26] = 0  # unsegmented across every object
    boundary = (labels == 0).astype(np.float32)  # the membranes
    ids, sizes = segment_sizes(first)
    by_size = np.argsort(-sizes, kind="stable")
    small = ids[by_size][sizes[by_size] < 500]  # the largest of them first
    large = ids[by_size[:4]]
    assert len(small) >= 3 and sizes[ids == small[0]] + sizes[ids == small[1]] >= 500
    pairs = np.array([[large[0], large[1]], [large[2], large[3]], [small[0], small[1]]])
    merges = merge_lookup(pairs.astype(np.uint64))
    config = AgglomerationConfig(enabled=True, fill_unsegmented=True, fill_min_size=500)
    dropped = small_objects((ids, sizes), merges, config.fill_min_size)
    assert min(small[:2]) not in dropped and small[2] in dropped  # merged: kept
    blocks = plan_blocks(SHAPE, GRID)
    written, records = {}, []
    for name, supervoxels in (("merged", False), ("supervoxels", True)):
        new_segmentation(tmp_path / name, SHAPE, (20.0, 10.0, 10.0), SegmentationLayout(CHUNKS))
        layer = SegmentationWriter(tmp_path / name)
        records = [write_merged_part(k, blocks, layer, first.__getitem__, merges,
                                     boundary.__getitem__, config, dropped, supervoxels)
                   for k in range(len(blocks))]  # fmt: skip
        written[name] = read_layer(tmp_path / name)
    assert written["merged"].all() and len(records) == 4
    merged_again = relabel(written["supervoxels"].copy(), *merges)
    np.testing.assert_array_equal(merged_again, written["merged"])
    assert set(np.unique(written["supervoxels"])) > set(np.unique(written["merged"]))
    for record in records:
        part = tuple(slice(*s) for s in record["core"])
        assert record["ids"] == np.unique(written["supervoxels"][part]).tolist()


def test_the_graph_holds_the_merges_of_supervoxels_the_layer_holds(tmp_path):
    config = AgglomerationConfig(enabled=True)
    decisions = [
        PairDecision(7, 3, 0.8, 0.95, 0.97, 32, True),  # merged
        PairDecision(3, 2**40, 0.9, 0.99, 0.91, 30, True),  # merged, ids beyond 32 bits
        PairDecision(4, 5, 0.8, 0.5, 0.97, 32, True),  # recovers too little: apart
        PairDecision(8, 9, 0.9, 0.99, 0.99, 32, True),  # merged, then dropped as too small
    ]
    present = np.array([3, 4, 5, 7, 2**40], np.uint64)
    edges = graph_edges(decisions, config, present)
    assert [(d.a, d.b) for d in edges] == [(3, 2**40), (7, 3)]
    path = tmp_path / "graph.csv"
    write_graph(path, edges)
    assert path.read_text().splitlines() == [
        HEADER.strip(), f"3,{2**40},0.9000,0.9900,0.9100,30", "7,3,0.8000,0.9500,0.9700,32",
    ]  # fmt: skip
    assert read_graph(path, present).tolist() == [[3, 2**40], [7, 3]]
    # A proofreader's edits: a line deleted, one added without evidence, a blank line.
    path.write_text(HEADER + "\n4,5,,,,\n7,3,0.8000,0.9500,0.9700,32\n")
    assert read_graph(path, present).tolist() == [[4, 5], [7, 3]]


def test_hand_edits_survive_decisions_made_again(tmp_path):
    """A proofreader undid 3-4 and added 7-8; the decisions, made again (a threshold changed),
    now merge 1-2, 3-4 and 9-10 but no longer 5-6: the graph is theirs with the edits kept.
    An added edge whose supervoxel the layer no longer holds goes. A task killed between
    writing graph.csv and the decisions' own graph finds the same edits the next time."""
    path, present = tmp_path / "graph.csv", np.arange(1, 11, dtype=np.uint64)

    def decided(*pairs):
        return [PairDecision(a, b, 0.8, 0.9, 0.9, 16, True) for a, b in pairs]

    remake_graph(path, decided((1, 2), (3, 4), (5, 6)), present)
    assert read_graph(path).tolist() == [[1, 2], [3, 4], [5, 6]]
    path.write_text(HEADER + "1,2,0.8000,0.9000,0.9000,16\n5,6,,,,\n8,7,,,,\n")  # the edits

    again = decided((1, 2), (3, 4), (9, 10))
    remake_graph(path, again, present)
    assert read_graph(path).tolist() == [[1, 2], [9, 10], [7, 8]]
    assert path.read_text().splitlines()[-1] == "7,8,,,,"  # no evidence: added by hand
    assert read_graph(decided_path(path)).tolist() == [[1, 2], [3, 4], [9, 10]]

    edited = path.read_text()
    decided_path(path).write_text(HEADER + "1,2\n3,4\n5,6\n")  # killed before it was written
    remake_graph(path, again, present)
    assert path.read_text() == edited

    remake_graph(path, again, present[present != 8])  # supervoxel 8 gone
    assert read_graph(path).tolist() == [[1, 2], [9, 10]]
    path.unlink()  # no graph: the decisions' own
    remake_graph(path, again, present)
    assert read_graph(path).tolist() == [[1, 2], [3, 4], [9, 10]]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("x,y\n3,7\n", "line 1 must be the header"),
        (HEADER + "3;7\n", r"line 2: '3;7' does not start with two segment ids"),
        (HEADER + "3,7\n3,3\n", "line 3: an edge joins two ids > 0, not 3, 3"),
        (HEADER + "3,7\n\n3,8\n", "line 4: the layer holds no segment 8"),
    ],
)
def test_a_graph_edited_wrongly_is_refused_naming_the_line(tmp_path, text, message):
    path = tmp_path / "graph.csv"
    path.write_text(text)
    with pytest.raises(MergeGraphError, match=message):
        read_graph(path, np.array([3, 7], np.uint64))


def test_an_edge_removed_changes_the_cells_of_the_parts_holding_what_it_joined_only():
    """The graph's cells, one per part of the layer: a part is keyed on the merged ids of its
    own supervoxels. 1-2-3 one object; 2-3 undone: 3 is an object of its own again, so only
    the parts holding 3 change (1 and 2 stay one object, named 1)."""
    settings = {"shape": list(SHAPE), "blocks": {"block_shape_zyx": [32, 40, 40],
                "overlap_zyx": [8, 16, 16]}, "layout": {"chunk_zyx": list(CHUNKS)}}  # fmt: skip
    part_ids = [np.array(ids, np.uint64) for ids in ([1, 4], [2, 4], [3], [1, 3, 5])]
    both = graph_cells(np.array([[1, 2], [2, 3]], np.uint64), part_ids, settings)
    one = graph_cells(np.array([[1, 2]], np.uint64), part_ids, settings)
    assert both.grid.shape == (1, 2, 2, 32)
    changed = [k for k in range(4) if (both.grid.reshape(4, 32)[k] != one.grid.reshape(4, 32)[k]).any()]  # fmt: skip
    assert changed == [2, 3]


def test_an_output_edited_by_hand_is_still_made_from_its_inputs(tmp_path):
    """`made_from`: what tells the graph's task a proofreader's edit (keep it) from a graph of
    other decisions (write it anew)."""
    source, graph = tmp_path / "decisions.txt", tmp_path / "graph.csv"
    source.write_text("3 7\n")
    run_once({"k": 1}, [source], [graph], lambda: graph.write_text(HEADER + "3,7\n") and None)
    assert made_from({"k": 1}, [source], graph)
    graph.write_text(HEADER)  # the merge undone by hand
    assert made_from({"k": 1}, [source], graph)
    assert not made_from({"k": 2}, [source], graph)
    source.write_text("3 7\n4 5\n")
    assert not made_from({"k": 1}, [source], graph)
    assert not made_from({"k": 1}, [source], tmp_path / "never.csv")


def test_a_graph_is_planned_only_where_pairs_are_decided(tmp_path):
    """The demo (the fill alone) plans no graph and scores its export, as before; with pairs
    decided, the graph's task follows the pass's check, a task per part of the merged layer
    reads its part's supervoxels, and the evaluation scores the merged layer. --dry-run says so."""
    from dataclasses import replace

    from apps.plan.dag import dag_steps
    from apps.plan.describe import describe_dag
    from pipeline.run.run_config import demo_config
    from site_configs import local

    demo, paths = demo_config(), RunPaths(tmp_path)
    names = [s.task.name for s in dag_steps(resolve_plan(demo, paths, local.SITE))]
    assert not [n for n in names if "graph" in n or "merged" in n]
    assert resolve_plan(demo, paths, local.SITE).scored_segmentations["ffn"] == paths.precomputed
    decided = replace(demo, agglomeration=replace(demo.agglomeration, enabled=True))
    plan = resolve_plan(decided, paths, local.SITE)
    steps = {s.task.name: s.task for s in dag_steps(plan)}
    names = list(steps)
    assert names.index("agglomerate") < names.index("agglomerate[graph]")
    assert names.index("agglomerate[merged]") < names.index("evaluate")
    parts = [n for n in names if n.startswith("agglomerate[merged ")]
    assert len(parts) == len([n for n in names if n.startswith("agglomerate[relabel ")])
    assert steps["agglomerate[merged 0]"].inputs == (
        paths.merge_graph, steps["agglomerate[relabel 0]"].outputs[0],
    )  # fmt: skip
    assert plan.scored_segmentations["ffn"] == paths.merged
    assert f"the merges -> {paths.merge_graph}" in describe_dag(plan)


# ---------------------------------------------------------------------------------------------
# In a run


def worked(out: str) -> set[str]:
    """The tasks whose app did the work (not found up to date), from the workflow's lines."""
    lines = r"^\[workflow [\d:]+\]\s+\d+ s (.+?) finished( \(found up to date\))?$"
    return {name for name, up_to_date in re.findall(lines, out, re.MULTILINE) if not up_to_date}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The tiny synthetic volume segmented with the shipped demo model, pairs decided, small
    objects dropped and the rest filled; the layer unsharded, so its 4 parts are the blocks'
    cores. In float32 on every CPU: the merges the tests count are the model's in one
    arithmetic (bf16, the default where the CPU has it, decides one merge fewer here)."""
    folder = tmp_path_factory.mktemp("graph")
    config = tiny_variant(folder, "graph", {
        'name = "tiny"': f'name = "tiny-graph"\npretrained_model = "{ROOT / "models" / "demo-synthetic"}"',
        "[inference]": '[inference]\nprecision = "float32"',
        "[export]": "[agglomeration]\nenabled = true\nfill_unsegmented = true\nfill_min_size = 100\n\n"
                    "[export]\nsharded = false",
    })  # fmt: skip
    run_dir = folder / "run"
    workflow("--config", str(config), "--run-dir", str(run_dir))
    return run_dir


def merged_layer(run_dir) -> np.ndarray:
    return read_layer(run_dir / "agglomerate" / "merged")


def part_records(run_dir) -> list[dict]:
    tasks = [t for t in tasks_of(run_dir) if t.name.startswith("agglomerate[relabel")]
    return [json.loads(t.outputs[0].read_text()) for t in tasks]


@pytest.mark.slow
def test_the_layer_holds_supervoxels_and_the_graph_the_merges(run):
    """graph.csv is every decided merge (by the run's thresholds) of two supervoxels the layer
    holds, with its fills' measures; the merged layer is the supervoxels with its components
    applied, and it is what the evaluation scores."""
    config = load_run_config(run / "config.json").agglomeration
    decided = [d for p in sorted((run / "agglomerate" / "decisions").glob("*.npz"))
               for d in load_decisions(p)]  # fmt: skip
    supervoxels = segmentation(run)
    edges = read_graph(run / "agglomerate" / "graph.csv")
    expected = graph_edges(decided, config, np.unique(supervoxels))
    assert len(edges) >= 2 and edges.tolist() == [[d.a, d.b] for d in expected]
    merged = merged_layer(run)
    np.testing.assert_array_equal(merged, relabel(supervoxels.copy(), *merge_lookup(edges)))
    assert len(np.unique(merged)) == len(np.unique(supervoxels)) - len(edges)
    summary = json.loads((run / "agglomerate" / "merged.json").read_text())
    assert summary["edges"] == len(edges) and summary["repaired_parts"] == []
    report = (run / "report.md").read_text()
    assert f"the graph `agglomerate/graph.csv` ({len(edges)} edges" in report
    plan = {t.name: t for t in tasks_of(run)}
    assert RunPaths(run).merged / "segmentation" in plan["evaluate[count 0]"].inputs[1].parents
    assert RunPaths(run).objects == RunPaths(run).merged  # what bench/ scripts read


@pytest.mark.slow
def test_a_merge_undone_in_the_graph_changes_only_the_object_it_joined(run):
    """The proofreader deletes an edge's line from graph.csv and resumes: the graph's task
    keeps the edit (it says why it runs), the merged layer is written again only in the parts
    that hold the supervoxel the merge had renamed, the evaluation counts only over those and
    scores again; the exported layer, its meshes and skeletons, and the second pass before the
    graph do not run. Only that supervoxel's voxels change, from the joined object's id back to
    its own. The graph file deleted, a resume writes it anew from the decisions."""
    graph = run / "agglomerate" / "graph.csv"
    written = graph.read_text()
    lines = written.splitlines()
    records = part_records(run)
    # The edge whose renamed supervoxel (the larger id: a component is named by its least) lies
    # in the fewest parts, so that some parts are left alone.
    edges = read_graph(graph)
    holding = [{r["part"] for r in records if int(max(e)) in r["ids"]} for e in edges]
    undone = min(range(len(edges)), key=lambda k: len(holding[k]))
    a, b = sorted(int(i) for i in edges[undone])
    assert len(np.unique(edges)) == edges.size  # each merge joined two supervoxels alone
    before = {"merged": merged_layer(run), "supervoxels": segmentation(run)}
    tasks = tasks_of(run)
    stamps = stamp_files(tasks)
    graph.write_text("\n".join(lines[: undone + 1] + lines[undone + 2 :]) + "\n")

    resumed = workflow("--run-dir", str(run), "--resume").stdout
    assert "agglomerate[graph]: output changed since it was made: agglomerate/graph.csv" in resumed
    ran = {name for name, state in stamp_files(tasks).items() if state != stamps[name]}
    assert worked(resumed) == ran
    merged_parts = {int(n.split()[1][:-1]) for n in ran if n.startswith("agglomerate[merged ")}
    assert merged_parts == holding[undone] and len(merged_parts) < len(records)
    assert {"agglomerate[graph]", "agglomerate[merged]", "evaluate"} <= ran
    assert not {
        n for n in ran if n.startswith(("export", "infer", "stitch", "agglomerate[relabel"))
    }
    assert graph.read_text().count("\n") == len(lines) - 1  # the edit kept
    after = merged_layer(run)
    changed = after != before["merged"]
    np.testing.assert_array_equal(changed, before["supervoxels"] == b)
    assert (before["merged"][changed] == a).all() and (after[changed] == b).all()
    np.testing.assert_array_equal(segmentation(run), before["supervoxels"])
    counted = [n for n in ran if n.startswith("evaluate[count ")]
    assert 0 < len(counted) < len([t for t in tasks if t.name.startswith("evaluate[count ")])

    graph.unlink()  # back to the second pass's own merges
    workflow("--run-dir", str(run), "--resume")
    assert graph.read_text() == written
    np.testing.assert_array_equal(merged_layer(run), before["merged"])
