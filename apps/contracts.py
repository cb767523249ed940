"""A stage's contract, its named inputs and outputs, is here: one class per app, which the planner
(apps/plan/) builds and the app reads by name (`io.selection`), never by a place in a list.

Each field is a Path or a tuple of Paths, declared an input (`input_field`) or an output
(`output_field`). `inputs()` and `outputs()` flatten the fields of each kind in the order they are
declared: the task's inputs and outputs (pipeline.core.stamps.Task), which Parsl waits on and whose
tokens the task's stamp digests in that order. A field's place is part of the contract: moving
one would make every task of its kind in every run dir run again.

The app's other arguments (its settings, the folders it writes into) are not here: a folder is an
argument so that a run dir moved elsewhere stays up to date.
"""

import dataclasses
import typing
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from pipeline.core.roi import Roi
from pipeline.core.stamps import NO_VOXELS, Part, as_path

Paths = tuple[Path, ...]

_INPUT, _OUTPUT = "input", "output"


def input_field():
    """A field of what the stage reads: a Path, or a tuple of them (`Paths`)."""
    return dataclasses.field(metadata={"io": _INPUT})


def output_field():
    """A field of what the stage writes: a Path, or a tuple of them (`Paths`)."""
    return dataclasses.field(metadata={"io": _OUTPUT})


@cache
def _fields(cls: type) -> tuple[tuple[str, bool, bool], ...]:
    """`cls`'s fields in order, each as (name, whether it holds several paths, whether an input)."""
    found = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("io") not in (_INPUT, _OUTPUT):
            raise TypeError(f"{cls.__name__}.{f.name}: declare it with input_field or output_field")
        found.append((f.name, typing.get_origin(f.type) is tuple, f.metadata["io"] == _INPUT))
    return tuple(found)


@dataclass(frozen=True, kw_only=True)
class Contract:
    """The named inputs and outputs of a task; its fields' values are Paths (strings given are
    made Paths)."""

    def __post_init__(self) -> None:
        # Flattened once here, fields set in the instance's dict (it is frozen): a run of 10^12
        # voxels plans some 10^5 tasks.
        values, flat = self.__dict__, ([], [])
        for name, many, is_input in _fields(type(self)):
            value = values[name]
            if many:
                if isinstance(value, (str, Path)):
                    raise TypeError(
                        f"{type(self).__name__}.{name}: a tuple of paths, not {value!r}"
                    )
                # A path already a Path is kept, not parsed again (`as_path`): a block's result
                # is an input of its 26 neighbours' tasks; at 1024³ parsing them again doubled
                # the steps' building.
                value = values[name] = tuple(map(as_path, value))
                flat[not is_input].extend(value)
            elif not isinstance(value, Path):
                value = values[name] = Path(value)
                flat[not is_input].append(value)
            else:
                flat[not is_input].append(value)
        values["_flat"] = (tuple(flat[0]), tuple(flat[1]))

    def inputs(self) -> Paths:
        """Every input, in the order of the fields."""
        return self._flat[0]

    def outputs(self) -> Paths:
        """Every output, in the order of the fields."""
        return self._flat[1]

    def parts(self, settings: dict) -> tuple:
        """Per input, in the order of `inputs()`, the part of it the task reads, which alone
        keys it (`stamps.run_once`'s `regions`; None, or none given: all of it). The planner
        and the app both ask, so that they key the task alike."""
        return ()


def contract(cls):
    """A contract class: a frozen dataclass of keyword-only fields."""
    return dataclass(frozen=True, kw_only=True)(cls)


# -- stage, preprocess, train, select, study (apps/stage.py ... apps/study.py) --


@contract
class StageVolume(Contract):
    """Stage an input volume into the run dir: reads the user's files (none for synthetic data);
    writes the staged .h5 (raw and, if known, labels; or a record of where to read them)."""

    sources: Paths = input_field()
    staged: Path = output_field()


@contract
class Preprocess(Contract):
    """Partitions and seed coordinates: reads the staged training volume (its labels); writes
    partitions.h5 and coordinates.npz."""

    train_volume: Path = input_field()
    partitions: Path = output_field()
    coordinates: Path = output_field()


@contract
class Train(Contract):
    """A training: reads the staged training volume, the seed coordinates and, when it fine-tunes,
    the weights it starts from (none or one); writes train_summary.json (the checkpoints beside
    it)."""

    train_volume: Path = input_field()
    coordinates: Path = input_field()
    init_from: Paths = input_field()
    train_summary: Path = output_field()


@contract
class SelectCheckpoint(Contract):
    """The choice of a checkpoint: reads train_summary.json (its checkpoints beside it) and the
    labelled volume they are scored on; writes selection.json."""

    train_summary: Path = input_field()
    scored_on: Path = input_field()
    selection: Path = output_field()


@contract
class ReportStudy(Contract):
    """A study's report: reads each cell's train_summary.json; writes study/report.md (its
    figures and results.json beside it)."""

    train_summaries: Paths = input_field()
    report: Path = output_field()


# -- inference (apps/infer.py) --


@contract
class InferBlock(Contract):
    """A block's segmentation: reads the staged volume and selection.json; writes the block's
    result file."""

    volume: Path = input_field()
    selection: Path = input_field()
    result: Path = output_field()

    def parts(self, settings: dict) -> tuple:
        """Of the staged volume the block's box, which holds its context (the overlaps)."""
        from pipeline.inference.blocks import Block, infer_regions

        return infer_regions(Block(tuple(settings["start"]), tuple(settings["stop"])))


@contract
class GroundTruthBlock(Contract):
    """The stand-in of inference in benchmarks: reads the staged labelled volume; writes the
    block's result file (its ground truth)."""

    volume: Path = input_field()
    result: Path = output_field()

    def parts(self, settings: dict) -> tuple:
        """Of the staged volume the labels in the block's box."""
        return (Part(Roi(tuple(settings["start"]), tuple(settings["stop"])), "labels"),)


# -- stitching (apps/stitch.py) --


@contract
class PairBlock(Contract):
    """Block k's pairs: reads block k's result, then those of the later blocks that overlap it
    (the order of settings["reads"]); writes its pairs (.npz)."""

    results: Paths = input_field()
    pairs: Path = output_field()


@contract
class JoinBlocks(Contract):
    """The id table: reads the staged volume (its voxel size, for the new layer), then every
    block's pairs in plan order; writes the id table."""

    volume: Path = input_field()
    pairs: Paths = input_field()
    table: Path = output_field()

    def parts(self, settings: dict) -> tuple:
        """Of the staged volume no voxel: its shape and voxel size, for the new layer."""
        return (NO_VOXELS,)


@contract
class RelabelPart(Contract):
    """Part k of the layer: reads the id table, then the results of the blocks that overlap the
    part (the order of settings["reads"]); writes the part's record (.json)."""

    table: Path = input_field()
    results: Paths = input_field()
    record: Path = output_field()

    def parts(self, settings: dict) -> tuple:
        """Of the id table the ids of the blocks it reads."""
        from pipeline.inference.stitching import table_part

        return (table_part(settings),)


@contract
class FinishStitch(Contract):
    """The stitching's check: reads the staged volume, the id table, every part's record, then
    every block's result (plan order); writes stitch.json and the layer's full resolution."""

    volume: Path = input_field()
    table: Path = input_field()
    records: Paths = input_field()
    results: Paths = input_field()
    summary: Path = output_field()
    full_resolution: Path = output_field()

    def parts(self, settings: dict) -> tuple:
        """Of the staged volume no voxel: its shape and voxel size, for a layer lost whole."""
        return (NO_VOXELS,)


# -- the split consensus of two passes (apps/consensus.py) --


@contract
class ConsensusPairs(Contract):
    """Core k's pairs of ids: reads both passes' full resolutions; writes the pairs and their
    voxels (.npz)."""

    first_layer: Path = input_field()
    second_layer: Path = input_field()
    pairs: Path = output_field()


@contract
class JoinConsensusPairs(Contract):
    """The consensus table: reads the staged volume (for the new layer), then every core's
    pairs; writes the table of pairs kept (.npy)."""

    volume: Path = input_field()
    pairs: Paths = input_field()
    table: Path = output_field()


@contract
class RelabelConsensusPart(Contract):
    """Part k of the consensus layer: reads the table and both passes' full resolutions; writes
    the part's record (.json)."""

    table: Path = input_field()
    first_layer: Path = input_field()
    second_layer: Path = input_field()
    record: Path = output_field()


@contract
class FinishConsensus(Contract):
    """The consensus's check: reads the staged volume, the table, both passes' full resolutions,
    then every part's record; writes consensus.json and the layer's full resolution."""

    volume: Path = input_field()
    table: Path = input_field()
    first_layer: Path = input_field()
    second_layer: Path = input_field()
    records: Paths = input_field()
    summary: Path = output_field()
    full_resolution: Path = output_field()


# -- FFN's second pass (apps/agglomerate.py) --
# `stitched`: the full resolution of the layer agglomerated (the consensus, or the first pass).
# `boundary`: with the fill (or pairs screened), the boundary forest and the staged volume (its
# map's image); else none.
# `sizes`: with `fill_min_size`, the objects' sizes in the whole volume; else none.


@contract
class PairCore(Contract):
    """Core k's touching pairs: reads the stitched layer; writes its contacts (.npz)."""

    stitched: Path = input_field()
    contacts: Path = output_field()


@contract
class JoinPairs(Contract):
    """The pairs to decide: reads every core's contacts; writes those touching enough (.npz)."""

    contacts: Paths = input_field()
    pairs: Path = output_field()


@contract
class DecideCore(Contract):
    """The decisions of core k's pairs: reads the staged volume, the stitched layer, the pairs,
    selection.json and, where pairs are screened, the boundary forest and volume; writes the
    decisions (.npz)."""

    volume: Path = input_field()
    stitched: Path = input_field()
    pairs: Path = input_field()
    selection: Path = input_field()
    boundary: Paths = input_field()
    decisions: Path = output_field()


@contract
class MergePairs(Contract):
    """The merge table: reads the staged volume (for the new layer), then every core's decisions
    (none without pair merges); writes the merge table (.npz)."""

    volume: Path = input_field()
    decisions: Paths = input_field()
    merges: Path = output_field()


@contract
class CountPart(Contract):
    """The objects' voxels in part k of the layer: reads the stitched layer; writes the counts
    (.npz)."""

    stitched: Path = input_field()
    sizes: Path = output_field()


@contract
class SumSizes(Contract):
    """The objects' sizes in the whole volume: reads every part's counts; writes their sum
    (.npz)."""

    counts: Paths = input_field()
    sizes: Path = output_field()


@contract
class RelabelMergedPart(Contract):
    """Part k of the export's layer, merged (and filled): reads the merge table, the stitched
    layer, the fill's boundary forest and volume and the objects' sizes (where the run fills);
    writes the part's record (.json)."""

    merges: Path = input_field()
    stitched: Path = input_field()
    boundary: Paths = input_field()
    sizes: Paths = input_field()
    record: Path = output_field()


@contract
class FinishAgglomeration(Contract):
    """The second pass's check: reads the staged volume, the merge table, the stitched layer,
    the fill's inputs (as `RelabelMergedPart`), every part's record, then every core's decisions
    (plan order); writes agglomerate.json and the export layer's full resolution."""

    volume: Path = input_field()
    merges: Path = input_field()
    stitched: Path = input_field()
    boundary: Paths = input_field()
    sizes: Paths = input_field()
    records: Paths = input_field()
    decisions: Paths = input_field()
    summary: Path = output_field()
    full_resolution: Path = output_field()


# With pairs decided, the export's layer holds the supervoxels (`RelabelMergedPart` applies no
# merge) and the merges are a graph over them, which makes the merged layer the evaluation scores
# (pipeline.secondpass.merge_graph).


@contract
class MergeGraph(Contract):
    """The merge graph: reads the staged volume (its voxel size, for the merged layer), the
    export's layer's full resolution (once checked), every core's decisions (plan order), then
    every part's record of that layer (the supervoxel ids it holds); writes graph.csv (a hand
    edit since is kept while these are as they were)."""

    volume: Path = input_field()
    layer: Path = input_field()
    decisions: Paths = input_field()
    supervoxels: Paths = input_field()
    graph: Path = output_field()

    def parts(self, settings: dict) -> tuple:
        """Of the staged volume no voxel: its shape and voxel size."""
        return (NO_VOXELS,)


@contract
class RelabelGraphPart(Contract):
    """Part k of the merged layer: reads the merge graph (the merged ids of the part's
    supervoxels only) and part k's record of the export's layer; writes the part's record."""

    graph: Path = input_field()
    supervoxels: Path = input_field()
    record: Path = output_field()

    def parts(self, settings: dict) -> tuple:
        from pipeline.secondpass.merge_graph import graph_part

        return graph_part(settings), None


@contract
class FinishGraph(Contract):
    """The merged layer's check: reads the staged volume (its voxel size, for a layer lost
    whole), the merge graph, every part's record of the export's layer, then every part's
    record of the merged layer; writes merged.json and the merged layer's full resolution."""

    volume: Path = input_field()
    graph: Path = input_field()
    supervoxels: Paths = input_field()
    records: Paths = input_field()
    summary: Path = output_field()
    full_resolution: Path = output_field()

    def parts(self, settings: dict) -> tuple:
        """Of the staged volume no voxel: its shape and voxel size."""
        return (NO_VOXELS,)


# -- evaluation (apps/evaluate.py) --


@contract
class CountRegion(Contract):
    """A region's overlap counts: reads the staged labelled volume and the segmentation's full
    resolution; writes the counts (.npz)."""

    volume: Path = input_field()
    segmentation: Path = input_field()
    counts: Path = output_field()

    def parts(self, settings: dict) -> tuple:
        """The region's labels and segmentation."""
        region = Roi.parse(settings["region"])
        return Part(region, "labels"), Part(region)


@contract
class BoundaryForest(Contract):
    """The boundary forest: reads the staged training part; writes the forest (joblib)."""

    train_volume: Path = input_field()
    forest: Path = output_field()


@contract
class GivenBoundaryForest(Contract):
    """Another run's boundary forest: reads it; writes its checked copy in this run."""

    source: Path = input_field()
    forest: Path = output_field()


@contract
class LearnedBaseline(Contract):
    """The learned watershed: reads the boundary forest, the staged volume it is tuned on and
    the staged volume it segments; writes the segmentation (HDF5) and its record (.json)."""

    forest: Path = input_field()
    tuned_on: Path = input_field()
    volume: Path = input_field()
    segmentation: Path = output_field()
    record: Path = output_field()


@contract
class Evaluate(Contract):
    """The scores: reads the staged labelled volume, every region's counts (then those of each
    of settings["also"] in turn), the full resolution of each segmentation they count (for ERL
    along the ground truth's skeletons) and the learned baseline's segmentation (none or one);
    writes evaluation.json."""

    volume: Path = input_field()
    counts: Paths = input_field()
    segmentations: Paths = input_field()
    learned: Paths = input_field()
    evaluation: Path = output_field()


# -- export (apps/export.py) --


@contract
class BeginExport(Contract):
    """The export begun: reads the staged volume and the segmentation's full resolution; writes
    the record of the voxel size it was begun with."""

    volume: Path = input_field()
    segmentation: Path = input_field()
    begun: Path = output_field()

    def parts(self, settings: dict) -> tuple:
        """No voxel of either: their shapes, voxel sizes and how the layer is stored."""
        return NO_VOXELS, NO_VOXELS


@contract
class ExportRegion(Contract):
    """A region of the export: reads the begun export's record, the staged volume and the
    segmentation's full resolution; writes the region task's record."""

    begun: Path = input_field()
    volume: Path = input_field()
    segmentation: Path = input_field()
    record: Path = output_field()

    def parts(self, settings: dict) -> tuple:
        """The region's image and segmentation."""
        region = Roi.parse(settings["region"])
        return None, Part(region), Part(region)


@contract
class ExportMeshes(Contract):
    """An unsharded export's meshing task: reads the begun export's record and the
    segmentation's full resolution; writes the record of the fragments it wrote."""

    begun: Path = input_field()
    segmentation: Path = input_field()
    record: Path = output_field()


@contract
class PlanMeshes(Contract):
    """The mesh shards' plan: reads every region task's record; writes the plan's record."""

    regions: Paths = input_field()
    plan: Path = output_field()


@contract
class MergeMeshes(Contract):
    """A mesh shards' merge: reads the plan's record; writes the record of the shards it
    wrote."""

    plan: Paths = input_field()
    record: Path = output_field()


@contract
class ExportSkeletons(Contract):
    """A region's skeleton task: reads the begun export's record and the segmentation's full
    resolution; writes the record of the skeletons' pieces it wrote."""

    begun: Path = input_field()
    segmentation: Path = input_field()
    record: Path = output_field()

    def parts(self, settings: dict) -> tuple:
        """The region and a voxel past its high faces (igneous's overlap)."""
        from pipeline.export.skeletons import skeleton_read

        return None, Part(skeleton_read(Roi.parse(settings["region"]), settings["shape"]))


@contract
class PlanSkeletons(Contract):
    """The skeleton shards' plan: reads every skeleton task's record; writes the plan's record."""

    skeletons: Paths = input_field()
    plan: Path = output_field()


@contract
class MergeSkeletons(Contract):
    """A skeleton shards' merge: reads the plan's record; writes the record of the shards (or,
    unsharded, the segments' files) it wrote."""

    plan: Paths = input_field()
    record: Path = output_field()


@contract
class FinishExport(Contract):
    """The export's check and summary: reads the staged volume, the segmentation's full
    resolution, then every export task's record; writes the export's folder."""

    volume: Path = input_field()
    segmentation: Path = input_field()
    records: Paths = input_field()
    export: Path = output_field()
