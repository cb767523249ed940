"""What the second pass's tasks share (apps/agglomerate.py, apps/consensus.py): the block grid
and settings of a task, the stitched layers read box by box, and a part of the layer written:
merged (and filled), or as the consensus of two passes.

A task's settings: {"blocks": BlockConfig, "shape": volume zyx, "layout": how the layer written
is stored (pipeline.export.segmentation_layer.SegmentationLayout), "block": k (per-core tasks),
"part": k (per-part tasks, pipeline.inference.stitching.layer_part), "agglomeration":
AgglomerationConfig (what the task depends on of it)}.
"""

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import fastremap
import numpy as np

from pipeline.core.atomic import atomic_path
from pipeline.core.config_io import from_dict
from pipeline.export.segmentation_layer import SegmentationWriter
from pipeline.inference.blocks import BlockConfig, BlockGrid, plan_blocks
from pipeline.inference.stitching import layer_part, write_part_labels, writer_of
from pipeline.secondpass.agglomeration import (
    AgglomerationConfig,
    PairDecision,
    consensus_labels,
    filled_part,
    load_sizes,
    members,
    relabel,
    small_objects,
)

Box = tuple[slice, ...]
Reader = Callable[[Box], np.ndarray]


def grid_of(settings: dict) -> tuple[BlockGrid, AgglomerationConfig]:
    """The block grid and the agglomeration's settings."""
    blocks = plan_blocks(settings["shape"], from_dict(BlockConfig, settings["blocks"]))
    return blocks, from_dict(AgglomerationConfig, settings.get("agglomeration", {}))


def chunks_of(settings: dict) -> tuple[int, int, int]:
    """The layers' chunks, on which the cores are cut (as the stitching cuts them)."""
    return from_dict(BlockConfig, settings["blocks"]).chunks


@contextmanager
def layer_reader(folder: str | Path) -> Iterator[Reader]:
    """A reader of the segmentation layer in `folder`: box -> voxels."""
    from pipeline.data.volumes import open_volume
    from pipeline.export.layers import segmentation_spec

    with open_volume(segmentation_spec(folder)) as array:
        yield array.__getitem__


def small_objects_of(
    config: AgglomerationConfig, sizes: Sequence[str | Path], merges: tuple[np.ndarray, np.ndarray]
) -> np.ndarray:
    """The ids, after `merges`, of the objects the fill gives away (`sizes`: the file of the
    objects' sizes, with `fill_min_size`)."""
    if not config.fill_min_size:
        return np.zeros(0, np.uint64)
    (path,) = sizes
    return small_objects(load_sizes(path), merges, config.fill_min_size)


def write_merged_part(
    k: int,
    blocks: BlockGrid,
    layer: SegmentationWriter,
    read: Reader,
    merges: tuple[np.ndarray, np.ndarray],
    boundary: Reader | None,
    config: AgglomerationConfig,
    dropped: np.ndarray,
    supervoxels: bool = False,
) -> dict:
    """Part k of `layer` (pipeline.inference.stitching.layer_part) written from the first pass
    (`read`) with `merges` applied, if `boundary` is given the `dropped` objects' voxels and the
    unsegmented ones filled over it; its record. With `supervoxels` the merges are not applied
    (the merge graph carries them, pipeline.secondpass.merge_graph): every segment of a dropped
    object goes, the rest are filled as they are, and the record lists the part's ids."""
    if supervoxels:
        dropped = members(dropped, merges)
        merges = (np.zeros(0, np.uint64), np.zeros(0, np.uint64))

    def merged(box):
        return relabel(read(box), *merges) if len(merges[0]) else read(box).astype(np.uint64)

    def kept(box):
        return fastremap.mask(merged(box), dropped, in_place=True) if len(dropped) else merged(box)

    def labels_of(box):
        if boundary is None:
            return kept(box)
        return filled_part(box, blocks.volume_shape, config.fill_margin, kept, boundary)

    part = layer_part(k, blocks, layer.layout)
    labels = labels_of(part)
    record = write_part_labels(k, part, lambda _: labels, layer)
    if supervoxels:
        record["ids"] = [int(i) for i in fastremap.unique(labels) if i]
    return record


def write_graph_part(
    k: int, blocks: BlockGrid, layer: SegmentationWriter, read: Reader, lookup: tuple
) -> dict:
    """Part k of the merged layer: the supervoxels' part (`read`, the export's layer) with the
    merge graph's `lookup` (`merge_lookup` of its edges) applied; its record."""
    return write_part_labels(
        k, layer_part(k, blocks, layer.layout), lambda box: relabel(read(box), *lookup), layer
    )


def pass_summary(
    config: AgglomerationConfig,
    decided: Sequence[PairDecision],
    merges: tuple[np.ndarray, np.ndarray],
    dropped: np.ndarray,
    repaired: list[int],
) -> dict:
    """What the second pass decided, merged and filled, and which parts its last task repaired
    (agglomerate.json)."""
    return {
        "pairs": len(decided),
        "merged_pairs": sum(config.merges(d) for d in decided),
        "unseeded_pairs": sum(not d.seeded for d in decided),
        # Not filled: membrane across the contact (`max_contact_boundary`).
        "screened_pairs": sum(d.contact_boundary > config.max_contact_boundary for d in decided),
        "merged_segments": len(merges[0]),
        "merged_objects": len(set(merges[1].tolist())),  # what they became
        "fov_evaluations": sum(d.fov_evaluations for d in decided),
        "repaired_parts": repaired,
        "pairs_decided": config.enabled,
        "filled_unsegmented": config.fill_unsegmented,
        "dropped_objects": len(dropped),
        "fill_min_size": config.fill_min_size,
    }


def write_consensus_part(
    k: int, settings: dict, table: np.ndarray, first: str | Path, second: str | Path, folder
) -> dict:
    """Part k's consensus labels of the passes' layers in `first` and `second` (by the `table`
    of their pairs of ids) written into the layer in `folder`; its record."""
    blocks, _ = grid_of(settings)
    layer = writer_of(settings, folder)
    with layer_reader(first) as read_first, layer_reader(second) as read_second:
        return write_part_labels(
            k,
            layer_part(k, blocks, layer.layout),
            lambda part: consensus_labels(read_first(part), read_second(part), table),
            layer,
        )


def save_id_pairs(path: str | Path, pairs: np.ndarray, counts: np.ndarray) -> None:
    """A core's pairs of ids of the two passes and their voxels (.npz)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, pairs=pairs, counts=counts)


def load_id_pairs(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    with np.load(path) as found:
        return found["pairs"], found["counts"]


def save_consensus_table(path: str | Path, table: np.ndarray) -> None:
    """The pairs of ids kept (.npy): a row per object of the consensus."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, table)
