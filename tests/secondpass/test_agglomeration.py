"""Agglomeration and split consensus (pipeline.secondpass.agglomeration) on the synthetic tissue, with the
shipped demo model deciding the pairs: a split planted into the ground truth is rejoined, true
neighbours stay apart."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from faults import zero_bytes
from test_inference import assert_same_segmentation

from apps.plan.dag import dag_steps
from apps.plan.describe import describe_dag
from apps.plan.resolved import resolve_plan
from pipeline.core.errors import ConfigError, VolumeShapeError
from pipeline.core.stamps import run_once, why_stale
from pipeline.data.synthetic import SyntheticConfig, generate
from pipeline.data.volumes import open_volume
from pipeline.export.layers import (
    SegmentationLayout,
    SegmentationWriter,
    new_segmentation,
    segmentation_spec,
)
from pipeline.inference.blocks import BlockConfig, plan_blocks
from pipeline.inference.flood_fill import (
    InferenceConfig,
    checkpoint_model_config,
    predictor_from_checkpoint,
)
from pipeline.inference.stitching import block_core, check_written_parts, write_part_labels
from pipeline.run.run_config import load_run_config
from pipeline.run.run_layout import RunPaths
from pipeline.secondpass.agglomeration import (
    AgglomerationConfig,
    PairDecision,
    candidate_pairs,
    consensus_labels,
    contact_boundary,
    core_contacts,
    decide_pairs,
    fill_unsegmented,
    filled_part,
    id_pairs,
    join_id_pairs,
    load_contact_table,
    load_decisions,
    merge_contact_tables,
    merge_lookup,
    merged_pairs,
    pair_measures,
    pairs_in,
    relabel,
    save_contact_table,
    save_decisions,
    segment_sizes,
    small_objects,
    split_consensus,
    total_sizes,
)

CHECKPOINT = Path(__file__).resolve().parents[2] / "models/demo-synthetic/checkpoints/ckpt-0"
CONFIG = AgglomerationConfig()
GAP = CONFIG.max_gap  # the ground truth leaves its 1-voxel membranes at 0, as the first pass
CROP = np.s_[:32, :64, :64]  # enough objects for the consensus tests, at a quarter of the cost


@pytest.fixture(scope="module")
def tissue() -> tuple[np.ndarray, np.ndarray]:
    """The selection volume (seed 2): neither trained on nor the demo's scored volume."""
    return generate(SyntheticConfig(seed=2))


@pytest.fixture(scope="module")
def network():
    model = checkpoint_model_config(CHECKPOINT)
    return predictor_from_checkpoint(CHECKPOINT, model), model


def largest_objects(labels: np.ndarray, count: int) -> list[int]:
    ids, sizes = np.unique(labels[labels > 0], return_counts=True)
    return [int(i) for i in ids[np.argsort(-sizes, kind="stable")][:count]]


def plant_split(labels: np.ndarray, obj: int, new_id: int) -> np.ndarray:
    """`labels` with the part of `obj` beyond the median plane across its longest extent (z
    counted twice: its voxels are twice as deep) relabelled `new_id`."""
    where = np.argwhere(labels == obj)
    axis = int(np.argmax(np.ptp(where, axis=0) * np.array([2, 1, 1])))
    upper = where[where[:, axis] >= int(np.median(where[:, axis]))]
    split = labels.copy()
    split[tuple(upper.T)] = new_id
    return split


def decide(raw, segmentation, table, network):
    predict, model = network
    return decide_pairs(
        lambda box: raw[box],
        lambda box: segmentation[box],
        segmentation.shape,
        table,
        predict,
        model,
        InferenceConfig(),
        CONFIG,
    )


def row(table, a: int, b: int) -> int:
    found = np.flatnonzero((table.ids[:, 0] == a) & (table.ids[:, 1] == b))
    assert len(found) == 1, f"({a}, {b}) is not a candidate pair"
    return int(found[0])


# ---------------------------------------------------------------------------------------------
# Agglomeration with the demo model


@pytest.mark.slow
def test_planted_split_is_rejoined(tissue, network):
    raw, labels = tissue
    segmentation = labels
    planted = []
    for obj in largest_objects(labels, 2):
        new_id = int(segmentation.max()) + 1
        segmentation = plant_split(segmentation, obj, new_id)
        planted.append((obj, new_id))
    table = candidate_pairs(segmentation, min_contact=CONFIG.min_contact, max_gap=GAP)
    rows = [row(table, a, b) for a, b in planted]
    for decision in decide(raw, segmentation, table.select(rows), network):
        assert CONFIG.merges(decision), decision
        assert decision.fov_evaluations <= 2 * CONFIG.max_fov_evaluations_per_fill
    ids, targets = merge_lookup(np.array(planted))
    assert_same_segmentation(relabel(segmentation, ids, targets), labels)


@pytest.mark.slow
def test_true_neighbours_stay_apart(tissue, network):
    """The 8 pairs of different objects that share the most membrane are kept apart (on seed 2,
    so are all of the 12 largest). Where a membrane is faint the model merges two objects: that
    is why `min_recovered` is high (bench/agglomerate.py)."""
    raw, labels = tissue
    table = candidate_pairs(labels, min_contact=CONFIG.min_contact, max_gap=GAP)
    largest = np.argsort(-table.contacts, kind="stable")[:8]
    for decision in decide(raw, labels, table.select(largest), network):
        assert decision.seeded and not CONFIG.merges(decision), decision


def test_measures_at_smaller_budgets_are_those_of_fills_stopped_there(tissue, network):
    """One flood seen at several budgets measures each pair as a flood with that budget does:
    budgets are chosen on the selection part without filling again."""
    raw, labels = tissue
    raw, labels = raw[CROP], labels[CROP]
    predict, model = network
    table = candidate_pairs(labels, min_contact=CONFIG.min_contact, max_gap=GAP)
    largest = np.argsort(-table.contacts, kind="stable")[:2]
    budgets = (1, 3, 8)
    for ids, point in zip(table.ids[largest], table.points[largest], strict=True):
        args = (lambda box: raw[box], lambda box: labels[box], labels.shape, tuple(ids), point,
                predict, model, InferenceConfig())  # fmt: skip
        seen = pair_measures(*args, CONFIG, budgets)
        for budget, measures in zip(budgets, seen, strict=True):
            alone = replace(CONFIG, max_fov_evaluations_per_fill=budget)
            assert measures == pair_measures(*args, alone, (budget,))[0], budget
            assert measures.fov_evaluations <= 2 * budget
        # Fills that stop early decide otherwise: the budgets are really different fills.
        assert seen[0] != seen[-1]


def test_skipping_the_second_fill_merges_the_same_pairs_for_fewer_fovs(tissue, network):
    """`skip_second_fill`: a pair whose fill from A covers too little of B is not filled from
    B. A planted split still merges with both fills' measures as before; of the true
    neighbours, those skipped are the pairs the full measures keep apart on A's fill alone."""
    raw, labels = tissue
    raw, labels = raw[CROP], labels[CROP]
    obj = largest_objects(labels, 1)[0]
    split = plant_split(labels, obj, int(labels.max()) + 1)
    table = candidate_pairs(split, min_contact=CONFIG.min_contact, max_gap=GAP)
    rows = [row(table, obj, int(labels.max()) + 1)]
    rows += [int(r) for r in np.argsort(-table.contacts, kind="stable")[:4] if r not in rows]
    skipping = replace(CONFIG, skip_second_fill=True)
    predict, model = network
    full, skipped = (
        decide_pairs(
            lambda box: raw[box],
            lambda box: split[box],
            split.shape,
            table.select(rows),
            predict,
            model,
            InferenceConfig(),
            config,
        )  # fmt: skip
        for config in (CONFIG, skipping)
    )
    assert CONFIG.merges(full[0]) and skipped[0] == full[0]
    assert [CONFIG.merges(d) for d in full] == [skipping.merges(d) for d in skipped]
    cut = [k for k, d in enumerate(skipped) if d != full[k]]
    assert cut, "no pair was decided on A's fill alone"
    for k in cut:
        assert skipped[k].recovered_b == full[k].recovered_b < CONFIG.min_recovered
        assert skipped[k].jaccard == skipped[k].recovered_a == 0
        assert skipped[k].fov_evaluations < full[k].fov_evaluations
    assert "min_recovered" in skipping.fill_settings()
    assert "min_recovered" not in CONFIG.fill_settings()


def test_pairs_whose_contact_the_boundary_map_calls_membrane_are_not_filled(tissue, network):
    """`max_contact_boundary`: a map that is 1 on membranes only. A planted split (no membrane
    between its halves) is filled and merged as without the screen; true neighbours touch across
    a membrane voxel (mean 1/3 across the contact) and are kept apart without a FOV."""
    raw, labels = tissue
    raw, labels = raw[CROP], labels[CROP]
    obj = largest_objects(labels, 1)[0]
    split = plant_split(labels, obj, int(labels.max()) + 1)
    membrane = (labels == 0).astype(np.float32)
    table = candidate_pairs(split, min_contact=CONFIG.min_contact, max_gap=GAP)
    rows = [row(table, obj, int(labels.max()) + 1)]
    rows += [int(r) for r in np.argsort(-table.contacts, kind="stable")[:3] if r not in rows]
    screening = replace(CONFIG, max_contact_boundary=0.2)
    predict, model = network

    def decisions(config, boundary=None):
        return decide_pairs(
            lambda box: raw[box], lambda box: split[box], split.shape, table.select(rows),
            predict, model, InferenceConfig(), config, boundary,
        )  # fmt: skip

    full = decisions(CONFIG)
    screened = decisions(screening, lambda box: membrane[box])
    assert screened[0].contact_boundary == 0
    assert replace(screened[0], contact_boundary=full[0].contact_boundary) == full[0]
    assert CONFIG.merges(full[0]) and screening.merges(screened[0])
    for before, after in zip(full[1:], screened[1:], strict=True):
        assert not CONFIG.merges(before) and before.fov_evaluations > 0
        assert after.contact_boundary == pytest.approx(1 / 3)
        assert not screening.merges(after) and after.fov_evaluations == 0
    with pytest.raises(ConfigError, match="boundary map: none given"):
        decisions(screening)


# ---------------------------------------------------------------------------------------------
# Candidate pairs


def test_candidate_pairs_of_touching_blocks():
    segmentation = np.zeros((4, 6, 6), np.uint64)
    segmentation[:, :, :3] = 1
    segmentation[:, :, 3:] = 2
    segmentation[:, 4:, 3:] = 3
    segmentation[0, 0, 0] = 0
    table = candidate_pairs(segmentation, offset_zyx=(10, 20, 30))
    np.testing.assert_array_equal(table.ids, [[1, 2], [1, 3], [2, 3]])
    # 1|2 along x: 4 z x 4 y faces; 1|3 along x: 4 x 2; 2|3 along y: 4 x 3.
    np.testing.assert_array_equal(table.contacts, [16, 8, 12])
    for (a, b), point in zip(table.ids, table.points - (10, 20, 30), strict=True):
        assert segmentation[tuple(point)] in (a, b)
    assert len(candidate_pairs(segmentation, min_contact=10)) == 2


def test_contacts_across_a_gap():
    segmentation = np.zeros((3, 3, 5), np.uint64)
    segmentation[..., :2] = 1
    segmentation[..., 3:] = 2
    assert len(candidate_pairs(segmentation)) == 0
    table = candidate_pairs(segmentation, max_gap=1)
    np.testing.assert_array_equal(table.ids, [[1, 2]])
    np.testing.assert_array_equal(table.contacts, [9])


def test_a_contacts_boundary_is_the_mean_across_it_gap_included():
    """One contact face to face, one across a background voxel: each the mean of its voxels from
    A's to B's; a third segment's contacts do not count; no contact, -1."""
    labels = np.array([[[1, 2, 0, 0], [1, 0, 2, 0], [3, 3, 3, 3]]], np.uint64)
    boundary = np.arange(12, dtype=np.float32).reshape(1, 3, 4) / 12
    face, across = (0 + 1) / 2 / 12, (4 + 5 + 6) / 3 / 12
    assert contact_boundary(labels, boundary, (1, 2), max_gap=1) == pytest.approx(
        (face + across) / 2
    )
    assert contact_boundary(labels, boundary, (1, 2), max_gap=0) == pytest.approx(face)
    assert contact_boundary(labels, boundary, (1, 4), max_gap=1) == -1


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_candidate_pairs_by_region_equal_the_whole(tissue, axis):
    """Two regions, each with GAP + 1 voxels of its neighbour: the same pairs and contacts; the
    point is the whole's wherever a contact lies in one region."""
    _, labels = tissue
    whole = candidate_pairs(labels, max_gap=GAP)
    cut = labels.shape[axis] // 2 + 3
    low, high = [slice(None)] * 3, [slice(None)] * 3
    low[axis], high[axis] = slice(0, cut + GAP + 1), slice(cut, None)
    own = list(labels.shape)
    own[axis] = cut
    offset = [0, 0, 0]
    offset[axis] = cut
    parts = [
        candidate_pairs(labels[tuple(low)], max_gap=GAP, own_shape_zyx=own),
        candidate_pairs(labels[tuple(high)], offset_zyx=offset, max_gap=GAP),
    ]
    merged = merge_contact_tables(parts, min_contact=CONFIG.min_contact)
    kept = whole.select(whole.contacts >= CONFIG.min_contact)
    np.testing.assert_array_equal(merged.ids, kept.ids)
    np.testing.assert_array_equal(merged.contacts, kept.contacts)
    for k, (a, b) in enumerate(merged.ids):
        assert labels[tuple(merged.points[k])] in (a, b)
    sides = [{tuple(p) for p in part.ids} for part in parts]
    alone = [
        k for k, pair in enumerate(map(tuple, merged.ids)) if sum(pair in s for s in sides) == 1
    ]
    assert alone
    np.testing.assert_array_equal(merged.points[alone], kept.points[alone])


# ---------------------------------------------------------------------------------------------
# Merging


def test_merge_lookup_joins_chains():
    ids, targets = merge_lookup(np.array([[7, 3], [9, 7], [20, 11]], np.uint64))
    np.testing.assert_array_equal(ids, [3, 7, 9, 11, 20])
    np.testing.assert_array_equal(targets, [3, 3, 3, 11, 11])
    segmentation = np.array([0, 3, 7, 9, 5, 20, 11], np.uint64)
    np.testing.assert_array_equal(relabel(segmentation, ids, targets), [0, 3, 3, 3, 5, 11, 11])
    np.testing.assert_array_equal(
        relabel(segmentation, *merge_lookup(np.zeros((0, 2)))), segmentation
    )


# ---------------------------------------------------------------------------------------------
# Split consensus


def test_consensus_with_itself_changes_nothing(tissue):
    labels = tissue[1][CROP]
    consensus, pairs = split_consensus(labels, labels)
    assert consensus.dtype == np.uint64
    assert_same_segmentation(consensus, labels)
    np.testing.assert_array_equal(pairs[:, 0], pairs[:, 1])


def test_consensus_undoes_a_merge_of_one_run(tissue):
    labels = tissue[1][CROP]
    a, b = largest_objects(labels, 2)
    merged = np.where(labels == b, a, labels)
    consensus, pairs = split_consensus(merged, labels)
    assert_same_segmentation(consensus, labels)
    assert len(pairs) == len(np.unique(labels)) - 1
    np.testing.assert_array_equal(split_consensus(merged, labels)[0], consensus)  # deterministic


def test_consensus_background_where_either_is():
    first = np.array([[1, 1, 0, 2]], np.uint64)
    second = np.array([[5, 0, 5, 5]], np.uint64)
    consensus, pairs = split_consensus(first, second)
    np.testing.assert_array_equal(consensus, [[1, 0, 0, 2]])
    np.testing.assert_array_equal(pairs, [[1, 5], [2, 5]])
    with pytest.raises(VolumeShapeError, match="must be equal"):
        split_consensus(first, second[:, :3])


# ---------------------------------------------------------------------------------------------
# The fill of unsegmented voxels


def test_unsegmented_voxels_go_to_the_side_of_the_boundary_they_lie_on():
    """A seam of 0s between two segments with a membrane (high P(boundary)) inside it, off its
    middle: each 0 voxel joins the segment on its side of the membrane, not the nearer one."""
    segmentation = np.zeros((4, 6, 12), np.uint64)
    segmentation[..., :2] = 2**40  # ids beyond int32 come back as they were
    segmentation[..., 9:] = 7
    boundary = np.full(segmentation.shape, 0.1, np.float32)
    boundary[..., 7] = 0.9  # the membrane, nearer to 7's side
    filled = fill_unsegmented(segmentation, boundary)
    assert filled.dtype == np.uint64 and filled.all()
    np.testing.assert_array_equal(filled[..., :7], 2**40)
    np.testing.assert_array_equal(filled[..., 8:], 7)
    np.testing.assert_array_equal(filled[segmentation > 0], segmentation[segmentation > 0])
    nothing = np.zeros_like(segmentation)
    assert not fill_unsegmented(nothing, boundary).any()  # no segment to flood from
    with pytest.raises(VolumeShapeError, match="differ in shape"):
        fill_unsegmented(segmentation, boundary[:2])


def test_a_part_filled_with_the_whole_as_context_is_the_whole_filled(tissue):
    """Part by part, as the relabel tasks write the layer: with the volume as context each part
    is that part of the whole's fill; with a narrow margin only voxels near its faces may differ."""
    first = tissue[1][CROP].astype(np.uint64)
    first[:, :, 20:26] = 0  # a slab the first pass left unsegmented across every object
    boundary = (tissue[1][CROP] == 0).astype(np.float32)  # the membranes
    whole = fill_unsegmented(first, boundary)
    assert whole.all()
    part = np.s_[8:24, 16:48, 16:48]
    read_first, read_boundary = first.__getitem__, boundary.__getitem__
    by_part = filled_part(part, first.shape, max(first.shape), read_first, read_boundary)
    np.testing.assert_array_equal(by_part, whole[part])
    narrow = filled_part(part, first.shape, 4, read_first, read_boundary)
    assert narrow.all() and (narrow == whole[part]).mean() > 0.9


def test_objects_too_small_in_the_whole_volume_are_filled_from_their_neighbours():
    """Sizes counted part by part and summed are the whole volume's; an object is small by its
    size after the merges (two small pieces merged are kept); a dropped object's voxels go to
    the neighbour on their side of the membrane."""
    segmentation = np.zeros((2, 4, 12), np.uint64)
    segmentation[..., :4] = 1  # 32 voxels
    segmentation[..., 4:5] = 2  # 8 voxels, alone: dropped
    segmentation[..., 6:7], segmentation[..., 7:8] = 3, 4  # 8 + 8, merged into one of 16: kept
    segmentation[..., 8:] = 5
    parts = [np.s_[:, :, :5], np.s_[:, :, 5:]]
    sizes = total_sizes(segment_sizes(segmentation[p]) for p in parts)
    assert [a.tolist() for a in sizes] == [[1, 2, 3, 4, 5], [32, 8, 8, 8, 32]]
    merges = merge_lookup(np.array([[3, 4]], np.uint64))
    assert small_objects(sizes, merges, 10).tolist() == [2]
    assert small_objects(sizes, merges, 17).tolist() == [2, 3]  # 3 and 4 became 3: 16 voxels
    kept = relabel(segmentation.copy(), *merges)
    kept[kept == 2] = 0
    boundary = np.full(segmentation.shape, 0.1, np.float32)
    boundary[..., 5] = 0.9  # the membrane between 2's voxels and 3's side
    filled = fill_unsegmented(kept, boundary)
    np.testing.assert_array_equal(filled[..., 4], 1)  # 2's voxels: 1's side of the membrane
    assert set(np.unique(filled).tolist()) == {1, 3, 5}
    assert total_sizes([])[0].size == 0  # a volume with no object


# ---------------------------------------------------------------------------------------------
# Settings


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"window_radius_fovs": 0.4}, "window_radius_fovs must be >= 0.5"),
        ({"analysis_radius_fovs": 0}, "analysis_radius_fovs must be in"),
        ({"analysis_radius_fovs": 2.0}, "analysis_radius_fovs must be in"),
        ({"min_contact": 0}, "min_contact must be >= 1"),
        ({"max_gap": -1}, "max_gap, fill_margin and fill_min_size must be >= 0"),
        ({"fill_margin": -1}, "max_gap, fill_margin and fill_min_size must be >= 0"),
        ({"fill_unsegmented": True, "fill_min_size": -1}, "fill_min_size must be >= 0"),
        ({"fill_min_size": 1000}, "it needs fill_unsegmented = true"),
        ({"max_fov_evaluations_per_fill": 0}, "max_fov_evaluations_per_fill must be >= 1"),
        ({"min_jaccard": 0}, "min_jaccard must be in"),
        ({"min_recovered": 1.5}, "min_recovered must be in"),
        ({"max_contact_boundary": 0}, "max_contact_boundary must be in"),
    ],
)
def test_config_errors(setting, message):
    with pytest.raises(ConfigError, match=message):
        AgglomerationConfig(**setting)


class TestAsTasks:
    """The pass as the workflow runs it (apps/agglomerate.py): block cores of the stitched
    volume, real files, a real segmentation layer."""

    SHAPE = (32, 64, 64)
    GRID = BlockConfig((32, 40, 40), (8, 16, 16))  # 1 x 2 x 2 blocks
    CHUNKS = (16, 16, 16)

    def test_contacts_found_core_by_core_are_those_of_the_whole_volume(self, tissue):
        labels = tissue[1][CROP]
        blocks = plan_blocks(self.SHAPE, self.GRID)
        tables = [
            core_contacts(k, blocks, labels.__getitem__, self.SHAPE, self.CHUNKS, GAP)
            for k in range(len(blocks))
        ]
        assert len(blocks) == 4 and all(len(t) for t in tables)
        by_cores = merge_contact_tables(tables, CONFIG.min_contact)
        whole = candidate_pairs(labels, min_contact=CONFIG.min_contact, max_gap=GAP)
        np.testing.assert_array_equal(by_cores.ids, whole.ids)
        np.testing.assert_array_equal(by_cores.contacts, whole.contacts)
        # Each pair is decided by the one core its point lies in.
        cores = [block_core(k, blocks, self.CHUNKS) for k in range(len(blocks))]
        assert sum(len(pairs_in(by_cores, core)) for core in cores) == len(by_cores)

    def test_decisions_and_tables_are_read_back_as_written(self, tmp_path):
        decisions = [
            PairDecision(3, 2**40 + 1, 0.75, 0.95, 1.0, 17, True),
            PairDecision(5, 9, 1.0, 1.0, 1.0, 0, False),  # unseeded: never merged
        ]
        save_decisions(tmp_path / "d.npz", decisions)
        assert load_decisions(tmp_path / "d.npz") == decisions
        save_decisions(tmp_path / "none.npz", [])
        assert load_decisions(tmp_path / "none.npz") == []
        assert merged_pairs(decisions, CONFIG).tolist() == [[3, 2**40 + 1]]
        table = candidate_pairs(np.array([[[1, 1, 2, 2]]]), min_contact=1)
        save_contact_table(tmp_path / "t.npz", table)
        back = load_contact_table(tmp_path / "t.npz")
        assert back.ids.tolist() == [[1, 2]] and back.points.tolist() == table.points.tolist()

    def test_a_core_rewritten_after_its_task_is_written_again(self, tissue, tmp_path):
        first = tissue[1][CROP].astype(np.uint64)
        blocks = plan_blocks(self.SHAPE, self.GRID)
        merges = merge_lookup(np.array([[int(first[0, 0, 0]), int(first[-1, -1, -1])]]))
        layout = SegmentationLayout(self.CHUNKS)
        new_segmentation(tmp_path, self.SHAPE, (20.0, 10.0, 10.0), layout)
        layer = SegmentationWriter(tmp_path)
        merged = lambda core: relabel(first[core], *merges)  # noqa: E731

        def write(k: int) -> dict:
            return write_part_labels(k, block_core(k, blocks, self.CHUNKS), merged, layer)

        records = [write(k) for k in range(len(blocks))]
        expected = relabel(first.copy(), *merges)
        assert (read_layer(tmp_path) == expected).all()
        name = next(iter(records[2]["chunks"]))
        chunk = layer.where + "/" + name
        zero_bytes(chunk, 0, 100)  # its size kept
        assert check_written_parts(records, layer, write)[0] == [2]
        assert (read_layer(tmp_path) == expected).all()
        assert check_written_parts(records, layer, write)[0] == []

    def test_consensus_core_by_core_is_that_of_the_whole_volume(self, tissue):
        """Each core's pairs of ids, their union, then each core's labels from it: the
        in-memory consensus, whatever core a pair first appears in."""
        labels = tissue[1][CROP].astype(np.uint64)
        other = plant_split(labels, largest_objects(labels, 1)[0], int(labels.max()) + 1)
        blocks = plan_blocks(self.SHAPE, self.GRID)
        cores = [block_core(k, blocks, self.CHUNKS) for k in range(len(blocks))]
        min_size = 100  # a pair has 73 voxels here; some are smaller in a core than in all
        table = join_id_pairs([id_pairs(labels[c], other[c]) for c in cores], min_size)
        by_cores = np.zeros(self.SHAPE, np.uint64)
        for core in cores:
            by_cores[core] = consensus_labels(labels[core], other[core], table)
        whole, pairs = split_consensus(labels, other, min_size)
        np.testing.assert_array_equal(by_cores, whole)
        np.testing.assert_array_equal(table, pairs)
        _, sizes = np.unique(whole[whole > 0], return_counts=True)
        assert len(sizes) == len(table) and sizes.min() >= min_size
        assert len(table) < len(join_id_pairs([id_pairs(labels, other)]))  # slivers dropped


def read_layer(folder) -> np.ndarray:
    with open_volume(segmentation_spec(folder)) as array:
        return array[...]


@pytest.mark.slow
def test_the_workflow_runs_consensus_and_agglomeration_after_stitching(tmp_path):
    """Inference only (the shipped demo model) on the tiny synthetic volume, with
    `[agglomeration] enabled`, `consensus`, `fill_unsegmented` and `fill_min_size`: both passes
    are stitched aside, their consensus beside them, and the agglomeration of the consensus is the
    merged layer (the consensus with the recorded merges applied, its small objects dropped, its
    0s filled), whose supervoxels, the same before the merges, are the export's segmentation;
    evaluation scores each step; a resume finds everything up to date."""
    from workflow_runs import ROOT, segmentation, tiny_variant, workflow

    config = tiny_variant(tmp_path, "agglomerate", {
        'name = "tiny"': f'name = "tiny-agglomerate"\npretrained_model = "{ROOT / "models" / "demo-synthetic"}"',
        "[export]": "[agglomeration]\nenabled = true\nconsensus = true\nfill_unsegmented = true\nfill_min_size = 100\n\n[export]",
    })  # fmt: skip
    run = tmp_path / "run"
    workflow("--config", str(config), "--run-dir", str(run))
    first, second, consensus = (
        read_layer(run / "agglomerate" / name)
        for name in ("first_pass", "second_pass", "consensus")
    )
    assert first.any() and second.any() and (first != second).any()  # the other seed order
    min_size = load_run_config(run / "config.json").inference.min_segment_size
    np.testing.assert_array_equal(consensus, split_consensus(first, second, min_size)[0])
    summary = json.loads((run / "agglomerate" / "agglomerate.json").read_text())
    assert summary["pairs"] > 0 and summary["fov_evaluations"] > 0
    with np.load(run / "agglomerate" / "merges.npz") as held:
        merges = held["ids"], held["targets"]
    merged = relabel(consensus.copy(), *merges)
    # Then objects under 100 voxels are dropped, and every voxel left 0 is filled from the
    # segments over the learned boundary map.
    ids, sizes = np.unique(merged[merged > 0], return_counts=True)
    dropped = ids[sizes < 100]
    assert len(dropped) and summary["dropped_objects"] == len(dropped)
    kept = (merged > 0) & ~np.isin(merged, dropped)
    exported = read_layer(run / "agglomerate" / "merged")
    assert (merged == 0).any() and exported.all()
    np.testing.assert_array_equal(exported[kept], merged[kept])
    assert set(np.unique(exported)) == set(ids[sizes >= 100])
    supervoxels = segmentation(run)
    np.testing.assert_array_equal(relabel(supervoxels.copy(), *merges), exported)
    assert (run / "baseline" / "boundary_forest.joblib").is_file()
    scores = json.loads((run / "evaluation.json").read_text())
    assert {"ffn", "ffn_first_pass", "ffn_consensus"} <= set(scores)
    report = (run / "report.md").read_text()
    assert "## Consensus" in report and "## Agglomeration" in report
    assert "| ffn + consensus + agglomeration + fill |" in report
    assert f"First, {len(dropped)} objects under 100 voxels were dropped" in report
    assert "| ffn, first pass only |" in report and "| ffn + consensus (before" in report
    assert (run / "precomputed" / "export.json").is_file()
    resumed = workflow("--run-dir", str(run), "--resume")
    assert "nothing to do" in resumed.stdout + resumed.stderr
    # A chunk of the layer rewritten after its part's task wrote it: the resume's last task
    # writes that part again (loading the forest for its fill), the layer as it was. Meshes and
    # skeletons are made from the layer, not part of it.
    full = run / "precomputed" / "segmentation"
    made_from = ("mesh", "skeleton")
    chunk = max((p for p in full.rglob("*") if p.is_file() and p.parent != full
                 and not any(name in p.parts[-2] for name in made_from)),
                key=lambda p: p.stat().st_size)  # fmt: skip
    written = chunk.read_bytes()
    zero_bytes(chunk, start=len(written) // 2)
    assert chunk.read_bytes() != written
    workflow("--run-dir", str(run), "--resume")
    repaired = json.loads((run / "agglomerate" / "agglomerate.json").read_text())["repaired_parts"]
    assert 0 < len(repaired) < len(list((run / "agglomerate" / "parts").glob("*.json")))
    assert chunk.read_bytes() == written
    np.testing.assert_array_equal(segmentation(run), supervoxels)


@pytest.mark.slow
def test_a_run_without_labels_to_learn_from_fills_over_another_runs_forest(tmp_path):
    """A pretrained model on a part with no training part (as on new tissue): `boundary_forest`
    is copied into the run and the fill floods its map; the same forest rewritten is copied
    again and nothing else runs; a new forest there is copied again and the fill redone; a file
    that is not a forest stops the run with its name."""
    import joblib
    from test_parts import LABELS, RAW
    from workflow_runs import ROOT, segmentation, tiny_variant, workflow

    from pipeline.data.volumes import read_labels, read_raw
    from pipeline.evaluation.learned_watershed import BoundaryForestConfig, train_boundary_forest

    raw, labels = read_raw(RAW)[0], read_labels(LABELS)[0]
    source = tmp_path / "another_run" / "boundary_forest.joblib"
    source.parent.mkdir()

    def learn(seed: int) -> None:  # the default features, few trees
        cheap = BoundaryForestConfig(samples_per_class=2000, trees=4, seed=seed)
        joblib.dump(train_boundary_forest(raw, labels, cheap), source)

    learn(seed=0)
    config = tiny_variant(tmp_path, "given-forest", {
        'name = "tiny"': f'name = "tiny-given-forest"\npretrained_model = "{ROOT / "models" / "demo-synthetic"}"\n'
                         f'boundary_forest = "{source}"',
        "synthetic_shape_zyx = [32, 64, 64]\n": f'eval_raw = "{RAW}"\neval_labels = "{LABELS}"\n',
        "[export]": "[agglomeration]\nfill_unsegmented = true\n\n[export]",
    })  # fmt: skip
    run = tmp_path / "run"
    done = workflow("--config", str(config), "--run-dir", str(run))
    assert "stage[train]" not in done.stdout + done.stderr  # nothing to learn a forest on
    copied = run / "baseline" / "boundary_forest.joblib"
    assert copied.read_bytes() == source.read_bytes()
    filled = segmentation(run)
    assert filled.all()  # every voxel the first pass left 0 given to a segment
    assert (run / "evaluation.json").is_file()
    assert (
        f"flooding a boundary map of the forest another run learned (`{source}`)"
        in (run / "report.md").read_text()
    )

    def stamped() -> dict:  # when each task after the copy last ran
        return {
            p: p.stat().st_mtime_ns for p in run.rglob("*.stamp.json") if "baseline" not in p.parts
        }

    before = stamped()
    source.write_bytes(source.read_bytes())  # rewritten as it was: copied again, nothing else
    resumed = workflow("--run-dir", str(run), "--resume")
    assert "evaluate[boundary forest] finished" in resumed.stdout + resumed.stderr
    assert stamped() == before

    learn(seed=1)  # the other run learned its forest again
    assert source.read_bytes() != copied.read_bytes()
    resumed = workflow("--run-dir", str(run), "--resume")
    assert copied.read_bytes() == source.read_bytes()
    assert "agglomerate[relabel 0]" in resumed.stdout + resumed.stderr  # filled again
    assert segmentation(run).all()

    joblib.dump({"trees": 4}, source)
    failed = workflow("--run-dir", str(run), "--resume", expect=1)
    assert f"{source}: a dict, not a random forest" in failed.stdout + failed.stderr


def test_a_given_forest_is_the_forest_task_s_only_input_and_no_training_part_is_staged(tmp_path):
    """With `boundary_forest` the run copies that file where it would learn one: the fill's
    tasks read the copy, nothing stages a training part, and --dry-run names both files."""
    from test_parts import LABELS, RAW

    from pipeline.data.staging import DataConfig
    from pipeline.run.run_config import RunConfig
    from site_configs import local

    given = tmp_path / "another_run" / "boundary_forest.joblib"
    config = RunConfig(
        data=DataConfig(eval_raw=RAW, eval_labels=LABELS),
        pretrained_model=str(CHECKPOINT.parents[1]),
        boundary_forest=str(given),
        agglomeration=AgglomerationConfig(fill_unsegmented=True),
    )
    paths = RunPaths(tmp_path / "run")
    steps = {s.task.name: s for s in dag_steps(resolve_plan(config, paths, local.SITE))}
    forest = steps["evaluate[boundary forest]"]
    assert forest.app_name == "evaluate.given_boundary_forest" and forest.task.inputs == (given,)
    assert forest.task.outputs == (paths.boundary_forest,)
    assert paths.boundary_forest in steps["agglomerate[relabel 0]"].task.inputs
    assert not [n for n in steps if n.startswith("stage[") and n != "stage[eval]"]
    plan = describe_dag(resolve_plan(config, paths, local.SITE))
    assert f"forest     {given} (given) -> {paths.boundary_forest}, the fill's map" in plan
    assert "  stitch, agglomerate, evaluate (with labels), export, report" in plan


def test_a_given_forest_that_is_missing_or_the_runs_own_copy_is_refused_before_the_run(tmp_path):
    from test_parts import LABELS, RAW
    from workflow_runs import ROOT, tiny_variant, workflow

    run = tmp_path / "run"
    for given, message in [
        (tmp_path / "none.joblib", ": no such file"),
        (run / "baseline" / "boundary_forest.joblib", " is this run's own copy"),
    ]:
        config = tiny_variant(tmp_path, "given", {
            'name = "tiny"': f'name = "given"\npretrained_model = "{ROOT / "models" / "demo-synthetic"}"\n'
                             f'boundary_forest = "{given}"',
            "synthetic_shape_zyx = [32, 64, 64]\n": f'eval_raw = "{RAW}"\neval_labels = "{LABELS}"\n',
            "[export]": "[agglomeration]\nfill_unsegmented = true\n\n[export]",
        })  # fmt: skip
        if "own copy" in message:
            given.parent.mkdir(parents=True)
            given.write_bytes(b"a copy")
        refused = workflow("--config", str(config), "--run-dir", str(run), expect=2)
        assert f"error: boundary_forest {given}{message}" in refused.stderr
        assert not (run / "config.json").exists()  # nothing of a run was begun


def test_dropping_small_objects_plans_a_count_per_part_summed_before_the_parts_are_filled(
    tmp_path,
):
    """`fill_min_size` adds a size count per part of the layer and their sum, an input of every
    relabel task; without it the plan has neither (finished runs stay done)."""
    from pipeline.run.run_config import RunConfig
    from site_configs import local

    def plan(**fill):
        config = replace(
            RunConfig(), agglomeration=AgglomerationConfig(fill_unsegmented=True, **fill)
        )
        return {
            s.task.name: s for s in dag_steps(resolve_plan(config, RunPaths(tmp_path), local.SITE))
        }

    steps = plan(fill_min_size=1000)
    counts = [n for n in steps if n.startswith("agglomerate[sizes ")]
    relabels = [n for n in steps if n.startswith("agglomerate[relabel ")]
    assert counts and len(counts) == len(relabels) and "agglomerate[sizes]" in steps
    names = list(steps)
    assert (
        max(map(names.index, counts)) < names.index("agglomerate[sizes]") < names.index(relabels[0])
    )
    sizes = tmp_path / "agglomerate" / "sizes.npz"
    assert all(sizes in steps[n].task.inputs for n in [*relabels, "agglomerate"])
    assert steps[relabels[0]].task.settings["agglomeration"]["fill_min_size"] == 1000
    unchanged = plan()
    assert not [n for n in unchanged if n.startswith("agglomerate[sizes")]
    # A part written before fill_min_size existed stays up to date at 0 (stamps.ADDED_SETTINGS).
    now = unchanged[relabels[0]].task.settings
    assert now["agglomeration"]["fill_min_size"] == 0
    fill = {k: v for k, v in now["agglomeration"].items() if k != "fill_min_size"}
    source, output = tmp_path / "in.txt", tmp_path / "part.json"
    source.write_text("layer")

    def write_part() -> None:
        output.write_text("part")

    run_once({**now, "agglomeration": fill}, [source], [output], write_part)
    assert why_stale(now, [source], [output]) is None
    dropping = steps[relabels[0]].task.settings
    assert why_stale(dropping, [source], [output]).startswith("settings changed:")


def test_the_fill_alone_plans_no_pair_and_the_learned_watersheds_forest(tmp_path):
    """`fill_unsegmented` without `enabled` (the demo's second pass): no pairs are found or
    decided, the layer's parts are filled over the map of the forest learned on the training
    part, the one forest that the learned watershed's map is made by too."""
    from pipeline.run.run_config import RunConfig
    from site_configs import local

    config = replace(RunConfig(), agglomeration=AgglomerationConfig(fill_unsegmented=True))
    steps = {
        s.task.name: s.task for s in dag_steps(resolve_plan(config, RunPaths(tmp_path), local.SITE))
    }
    names = list(steps)
    assert not [n for n in names if n.startswith(("agglomerate[pairs", "agglomerate[decide"))]
    assert [n for n in names if "forest" in n] == ["evaluate[boundary forest]"]
    forest = steps["evaluate[boundary forest]"].outputs[0]
    assert steps["evaluate[boundary forest]"].inputs == (tmp_path / "staged" / "train.h5",)
    assert names.index("stage[train]") < names.index("evaluate[boundary forest]")
    assert forest in steps["agglomerate[relabel 0]"].inputs
    assert forest == steps["evaluate[learned watershed]"].inputs[0]
    plan = describe_dag(
        resolve_plan(config, RunPaths(tmp_path), local.SITE)
    )  # what --dry-run prints
    assert f"-> {forest} (the fill floods its map too)" in plan
    # Without the fill or the learned baseline, no forest.
    neither = replace(RunConfig(), watershed=replace(RunConfig().watershed, learned=False))
    names = [s.task.name for s in dag_steps(resolve_plan(neither, RunPaths(tmp_path), local.SITE))]
    assert "evaluate[boundary forest]" not in names
