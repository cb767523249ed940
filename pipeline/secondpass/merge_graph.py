"""The second pass's merges as a graph over the exported layer's supervoxels: the proofreading
hand-off.

With pairs decided (`[agglomeration] enabled`), the export's segmentation layer holds the second
pass's segments before its merges, the supervoxels (small objects dropped, unsegmented voxels
filled), and `agglomerate/graph.csv` one edge per merge: the two supervoxel ids and the evidence
that decided it, the measures of the pair's two flood fills (`PairDecision`). google/ffn's
proofreading tools (`ffn/utils/proofreading.py`) work on such a graph over first-pass segments,
and Neuroglancer shows one as a segmentation layer's `equivalences` (`workflow.py view`).

The merged objects, which the evaluation scores, are the graph's connected components applied
to the supervoxels (`merge_lookup`), written part by part into a layer of their own. A line
deleted from graph.csv undoes that merge, a line added (`a,b`, the evidence left empty) makes
one; a resume then writes again only the parts of the merged layer that hold a supervoxel whose
object changed: each part's task is keyed on the merged ids of its own supervoxels
(`graph_cells`, `graph_part`). Decisions made again (a threshold changed, the first pass run
again) keep those edits: the graph the decisions last made is kept beside graph.csv
(`graph.decided.csv`), and what graph.csv differs from it by is applied to the new decisions'
graph (`remake_graph`).

A watershed's basins do not depend on its markers' ids (skimage floods in the order of the
image's values and of the markers' positions), so filling the supervoxels and then merging gives
what filling the merged objects gave: the merged objects are those of the pass before the graph.
"""

import csv
import hashlib
import io
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from pipeline.core.atomic import atomic_path
from pipeline.core.config_io import from_dict
from pipeline.core.errors import MergeGraphError
from pipeline.core.roi import Roi
from pipeline.core.stamps import Cells, Part, digest
from pipeline.export.segmentation_layer import SegmentationLayout
from pipeline.inference.blocks import BlockConfig, BlockGrid, plan_blocks
from pipeline.secondpass.agglomeration import (
    AgglomerationConfig,
    PairDecision,
    merge_lookup,
    relabel,
)

# graph.csv's columns: an edge's two supervoxel ids, then its evidence (empty for an edge added
# by hand). `seeded` is not one: a merged pair was seeded on both sides.
GRAPH_COLUMNS = ("a", "b", "jaccard", "recovered_a", "recovered_b", "fov_evaluations")


def graph_edges(
    decisions: Iterable[PairDecision], config: AgglomerationConfig, present: np.ndarray
) -> list[PairDecision]:
    """The decisions `config`'s thresholds merge whose two segments are both supervoxels of the
    layer (`present`, its ids): the merges of an object dropped as too small join nothing there.
    Sorted by (a, b)."""
    edges = [
        d for d in decisions if config.merges(d) and np.isin([d.a, d.b], present).all()
    ]  # fmt: skip
    return sorted(edges, key=lambda d: (d.a, d.b))


def write_graph(path: str | Path, edges: Sequence[PairDecision | tuple[int, int]]) -> None:
    """graph.csv: a header, then a line per edge (`GRAPH_COLUMNS`; an (a, b) pair alone, an
    edge added by hand, with its evidence empty), written whole or not at all."""
    text = io.StringIO()
    out = csv.writer(text, lineterminator="\n")
    out.writerow(GRAPH_COLUMNS)
    for d in edges:
        if isinstance(d, PairDecision):
            out.writerow([d.a, d.b, f"{d.jaccard:.4f}", f"{d.recovered_a:.4f}",
                          f"{d.recovered_b:.4f}", d.fov_evaluations])  # fmt: skip
        else:
            out.writerow([*d, *[""] * (len(GRAPH_COLUMNS) - 2)])
    with atomic_path(path) as tmp:
        tmp.write_text(text.getvalue())


def decided_path(path: str | Path) -> Path:
    """Beside graph.csv, the graph as the decisions last made it (`remake_graph`): what a hand
    edit of graph.csv is told from."""
    path = Path(path)
    return path.with_name(f"{path.stem}.decided{path.suffix}")


def _pair(a: int, b: int) -> tuple[int, int]:
    """An edge as (smaller id, larger id): a hand edit may write it either way."""
    return (int(min(a, b)), int(max(a, b)))


def _pairs(edges: np.ndarray) -> set[tuple[int, int]]:
    return {_pair(*e) for e in edges}


def remake_graph(path: str | Path, edges: Sequence[PairDecision], present: np.ndarray) -> None:
    """graph.csv made again from the decisions' `edges` (`graph_edges`) with the hand edits of
    the one there kept: an edge the decisions had made and the file no longer holds stays
    undone, an edge the file holds that they had not made stays (if the layer still holds both
    its supervoxels, `present`). The edits are told by the graph the decisions last made,
    kept beside it (`decided_path`; without it, as in runs before it, the file there is
    replaced). That graph is written after graph.csv, so a task killed between the two finds
    the same edits again."""
    path, kept = Path(path), decided_path(path)
    undone: set[tuple[int, int]] = set()
    added: set[tuple[int, int]] = set()
    if path.is_file() and kept.is_file():
        before, now = _pairs(read_graph(kept)), _pairs(read_graph(path))
        undone, added = before - now, now - before
    made = [d for d in edges if _pair(d.a, d.b) not in undone]
    made_pairs = {_pair(d.a, d.b) for d in made}
    by_hand = sorted(p for p in added - made_pairs if np.isin(p, present).all())
    write_graph(path, [*made, *by_hand])
    write_graph(kept, edges)


def read_graph(path: str | Path, present: np.ndarray | None = None) -> np.ndarray:
    """graph.csv's edges, (N, 2) uint64 in the file's order (a hand edit may leave any order;
    blank lines skipped). With `present` (the layer's supervoxel ids), an edge naming an id the
    layer does not hold is refused. Raises MergeGraphError naming the file and the line."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise MergeGraphError(f"{path}: cannot be read ({exc})") from exc
    rows = list(csv.reader(lines))
    if not rows or [c.strip() for c in rows[0][:2]] != list(GRAPH_COLUMNS[:2]):
        raise MergeGraphError(f"{path}: line 1 must be the header {','.join(GRAPH_COLUMNS)}")
    edges, numbers = [], []
    for number, row in enumerate(rows[1:], start=2):
        if not any(cell.strip() for cell in row):
            continue
        try:
            a, b = (int(cell) for cell in row[:2])
        except ValueError:
            raise MergeGraphError(
                f"{path}, line {number}: {','.join(row)!r} does not start with two segment ids"
            ) from None
        if a <= 0 or b <= 0 or a == b:
            raise MergeGraphError(f"{path}, line {number}: an edge joins two ids > 0, not {a}, {b}")
        edges.append((a, b))
        numbers.append(number)
    pairs = np.array(edges, np.uint64).reshape(-1, 2)
    if present is not None:
        unknown = ~np.isin(pairs, present)
        if unknown.any():
            row = int(np.flatnonzero(unknown.any(axis=1))[0])
            raise MergeGraphError(
                f"{path}, line {numbers[row]}: the layer holds no segment "
                f"{int(pairs[row][unknown[row]][0])} (an edge joins two of its supervoxels)"
            )
    return pairs


def equivalences(path: str | Path) -> list[list[int]]:
    """graph.csv's edges as Neuroglancer's equivalences of a segmentation layer."""
    return read_graph(path).tolist()


def part_grid(blocks: BlockGrid, layout: SegmentationLayout) -> tuple[int, ...]:
    """The parts of a layer (`stitching.layer_part`) as a grid: part k is its k-th cell in z, y,
    x order. Unsharded, the block grid (a part is a block's core); sharded, the shard regions'."""
    if layout.region_zyx is None:
        return tuple(len(s) for s in blocks.starts_zyx)
    return tuple(-(-n // r) for n, r in zip(blocks.volume_shape, layout.region_zyx, strict=True))


def _grid_of(settings: dict) -> tuple[int, ...]:
    blocks = plan_blocks(settings["shape"], from_dict(BlockConfig, settings["blocks"]))
    return part_grid(blocks, from_dict(SegmentationLayout, settings["layout"]))


def graph_identity(settings: dict) -> str:
    """What the cells of a graph are over: the layer's parts (its shape, blocks, layout)."""
    return digest({k: settings[k] for k in ("shape", "blocks", "layout")})


def graph_cells(pairs: np.ndarray, part_ids: Sequence[np.ndarray], settings: dict) -> Cells:
    """Per part of the layer (`part_ids[k]`: part k's supervoxel ids, sorted), on the parts'
    grid (`part_grid`), the sha256 of the merged ids of its supervoxels under the graph `pairs`:
    what a task writing a part of the merged layer reads of the graph, and alone keys it
    (`stamps.save_cells`, `graph_part`)."""
    grid_shape = _grid_of(settings)
    lookup = merge_lookup(pairs)
    grid = np.zeros([*grid_shape, 32], np.uint8)
    for k, ids in enumerate(part_ids):
        merged = relabel(np.asarray(ids, np.uint64).copy(), *lookup)
        sha = hashlib.sha256(np.ascontiguousarray(merged).tobytes()).digest()
        grid[np.unravel_index(k, grid_shape)] = np.frombuffer(sha, np.uint8)
    return Cells(graph_identity(settings), (0, 0, 0), (1, 1, 1), grid)


def graph_part(settings: dict) -> Part:
    """The part of the graph a task writing part `settings["part"]` of the merged layer reads
    (`graph_cells`): the merged ids of that part's supervoxels."""
    place = tuple(int(i) for i in np.unravel_index(settings["part"], _grid_of(settings)))
    return Part(Roi(place, tuple(i + 1 for i in place)))
